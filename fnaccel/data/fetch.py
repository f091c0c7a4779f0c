"""How a prepared loader reads a batch itself, without the DataLoader's iterator.

A loader without workers whose order fnaccel owns (a `ShardedBatchSampler`)
is read by a `BatchFetch` from each batch of sample indices: `ItemFetch` does
what torch's map-style fetcher does (the dataset's ``__getitems__``, or one
``__getitem__`` per index, then the collate_fn); `IndexFetch` reads a
`TensorDataset` or a tensor under ``default_collate`` in one indexing per
tensor, which is element for element what stacking the samples gives. Either
way the batches are the ones the user's `DataLoader` would yield.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from fnaccel.ops.tree import send_to_device

__all__ = ["BatchFetch", "IndexFetch", "ItemFetch", "batch_fetch"]


class BatchFetch(Protocol):
    """Reads one rank's batch from its sample indices (an int64 tensor,
    `ShardedBatchSampler.index_batches`), exactly as the loader's DataLoader
    would. ``placed``: the batch comes back on the device already."""

    placed: bool

    def __call__(self, indices: torch.Tensor) -> object: ...


class ItemFetch:
    """One rank's batch of a step, read in this process as torch's map-style
    fetcher reads it (the dataset's ``__getitems__`` when it has one, else one
    ``__getitem__`` per index; then the collate_fn), without the DataLoader
    iterator around it. Used when the loader has no workers. ``batched``: the loader
    batches; without batching torch reads ``dataset[i]`` alone, never ``__getitems__``."""

    placed = False  # the reader places the batch on the device

    def __init__(
        self, dataset: Dataset[object], collate: Callable[[list[object]], object], *, batched: bool
    ) -> None:
        self.dataset = dataset
        self.collate = collate
        getitems = getattr(dataset, "__getitems__", None)
        # torch's rule: present and truthy, and only when batching
        self._getitems = getitems if getitems and batched else None

    def __call__(self, indices: torch.Tensor) -> object:
        batch = indices.tolist()  # what torch's fetcher gets from a batch sampler: a list of ints
        if self._getitems is not None:
            samples = self._getitems(batch)
            if type(samples) is list and len(samples) != len(batch):
                raise ValueError(
                    f"{type(self.dataset).__name__}.__getitems__ returned {len(samples)} sample(s) for "
                    f"{len(batch)} indices ({batch[:8]}{'...' if len(batch) > 8 else ''}); it must return "
                    "one sample per index, in order (a list of samples), or the batch would silently "
                    "hold other samples"
                )
            return self.collate(samples)
        dataset = self.dataset
        return self.collate([dataset[i] for i in batch])


class IndexFetch:
    """``default_collate`` of a `TensorDataset`'s (or a tensor's) samples, as one
    indexing operation per tensor, placed on the device: ``[t[indices] for t in
    tensors]`` is what stacking ``dataset[i]`` for each index gives (a list, as
    default_collate makes of tuples), element for element."""

    placed = True

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        *,
        single: bool,
        device: torch.device,
        non_blocking: bool,
        pin: bool,
        fallback: ItemFetch,
    ) -> None:
        self.tensors = tensors
        self.single = single
        self.fallback = fallback  # an empty batch: the collate_fn's own answer (or error)
        self._device = device
        self._non_blocking = non_blocking
        self._pin = pin
        # Tensors already on the device are indexed there: no copy beyond the batch's own.
        self._move = any(t.device != device for t in tensors)

    def __call__(self, indices: torch.Tensor) -> object:
        if not len(indices):
            return send_to_device(self.fallback(indices), self._device, non_blocking=self._non_blocking)
        out = self.index(indices)
        if self._move:
            out = [self._to_device(t) for t in out]
        return out[0] if self.single else out

    def index(self, indices: torch.Tensor) -> list[torch.Tensor]:
        """Each tensor's rows ``indices``, where the tensor is."""
        return [t[indices] for t in self.tensors]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._pin and tensor.device.type == "cpu":
            tensor = tensor.pin_memory()
        return tensor.to(self._device, non_blocking=self._non_blocking)


def _indexable(dataset: object) -> tuple[tuple[torch.Tensor, ...], bool] | None:
    """The tensors of a dataset whose samples default_collate stacks exactly as
    indexing them would: a `TensorDataset` or a tensor, of plain dense tensors
    (no subclass, view bits, autograd history or sparse/nested/quantized layout)."""
    if type(dataset) is TensorDataset:
        tensors, single = tuple(dataset.tensors), False
    elif type(dataset) is torch.Tensor:
        tensors, single = (dataset,), True
    else:
        return None
    for t in tensors:
        if (
            type(t) is not torch.Tensor
            or t.layout != torch.strided
            or t.is_nested
            or t.is_quantized
            or t.requires_grad
            or t.is_conj()
            or t.is_neg()
            or t.dim() == 0
            or not t.is_contiguous()
        ):
            return None
    return tensors, single


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same(a: object, b: object) -> bool:
    """Bit for bit, so that NaN compares equal to itself and a dtype without ``torch.equal``
    (complex32) is compared at all. The probe's tensors are contiguous, so the views are free."""
    if isinstance(a, torch.Tensor):
        return (
            type(b) is torch.Tensor
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.device == b.device
            and a.is_contiguous()
            and b.is_contiguous()
            and torch.equal(_bits(a), _bits(b))
        )
    if type(a) is not type(b) or not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b):
        return False
    return all(_same(x, y) for x, y in zip(a, b, strict=False))


def batch_fetch(
    loader: DataLoader[object],
    collate: Callable[[list[object]], object],
    device: torch.device | str,
    *,
    non_blocking: bool = False,
) -> BatchFetch | None:
    """How a `PreparedLoader` reads a batch itself, or None to read through the DataLoader.

    Args:
        loader: the user's loader (its dataset, collate_fn, workers, pinning).
        collate: what turns a list of samples into the batch (the loader's
            collate_fn, or fnaccel's wrapper of it).
        device: where batches go.
        non_blocking: copy to ``device`` without blocking.

    Only without workers (workers fetch in their own processes), and without
    pinning for the generic fetch (the DataLoader pins what it collates). The
    one-indexing fetch needs the loader's collate_fn to be ``default_collate``
    and a probe batch to come out identical to it (a changed
    ``default_collate_fn_map`` falls back to the generic fetch).

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> data = DataLoader(TensorDataset(torch.arange(6.0), torch.arange(6)), batch_size=2)
    >>> fetch = batch_fetch(data, data.collate_fn, "cpu")
    >>> type(fetch).__name__, fetch(torch.tensor([4, 1]))
    ('IndexFetch', [tensor([4., 1.]), tensor([4, 1])])
    """
    if loader.num_workers > 0:
        return None
    batched = loader.batch_size is not None or loader.batch_sampler is not None
    generic = ItemFetch(loader.dataset, collate, batched=batched)
    pins = loader.pin_memory and torch.cuda.is_available()
    user_collate = getattr(collate, "collate_fn", collate)  # fnaccel's wrapper holds the user's
    source = _indexable(loader.dataset) if user_collate is default_collate and batched else None
    if source is not None:
        tensors, single = source
        fast = IndexFetch(
            tensors,
            single=single,
            device=torch.device(device),
            non_blocking=non_blocking,
            pin=pins,
            fallback=generic,
        )
        probe = [len(tensors[0]) - 1, 0]
        indexed = fast.index(torch.tensor(probe))
        if _same(default_collate([loader.dataset[i] for i in probe]), indexed[0] if single else indexed):
            return fast
    return None if pins else generic
