"""`eval_batches` (`fa.eval_batches`): a user's evaluation `DataLoader`, split for exact metrics.

Evaluation reads the dataset in its own order (a ``shuffle=True`` loader is
read in order too), split by `fnaccel.data.sharding.shard_batch`, the rule
training uses: step ``s`` gives rank ``r`` the samples
``[s*B*W + r*B, (s*B*W + (r+1)*B)``, padded to ``B`` by wrapping around to the
start. Every rank runs the same number of steps, so no rank waits in a
collective for a batch that never comes, and each step yields how many of its
leading samples are real: concatenating the ranks' real samples in rank order
gives the dataset order, for any length and world size (fewer samples than
ranks included). That is what `gather_for_metrics` needs to be exact. One
process pads nothing (there is no rank to keep in step), as Accelerate: a port
that gathers and truncates only when distributed counts every sample once.
"""

from __future__ import annotations

from collections.abc import Sized

import torch
from torch.utils.data import DataLoader, IterableDataset

from fnaccel.data.fetch import IndexFetch, batch_fetch
from fnaccel.data.iterable import shard_iterable
from fnaccel.data.loader import Collate, CollateSteps, loader_plan
from fnaccel.data.prepared import Batches, Collated
from fnaccel.data.sharding import eval_shards, num_steps
from fnaccel.data.skip import ReaderSettings
from fnaccel.dist import DistLike, as_dist, data_parallel_context
from fnaccel.ops.tree import send_to_device, tree_leaves

__all__ = ["eval_batches"]


def _reader(loader: DataLoader[object]) -> ReaderSettings:
    """How the user's loader reads; its workers are seeded without drawing from the process."""
    kwargs: ReaderSettings = {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": torch.Generator().manual_seed(0),
    }
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def eval_batches(state: DistLike, loader: DataLoader[object]) -> Batches:
    """Reads ``state`` (a `RunState` or its `DistContext`, not consumed): this rank's share
    of ``loader``'s dataset as ``(batch, num_valid)`` pairs, on the device.

    For hand-written evaluation loops; `fa.evaluate` is the loop written once.

    Args:
        state: the run's state, or its ``dist``.
        loader: a `DataLoader` with a ``batch_size`` (samples per rank per step)
            over a map-style or iterable dataset; its dataset, collate_fn,
            workers and pinning are kept, its sampler's order is not.

    Returns:
        An iterator of ``(batch, num_valid)``: the batch on ``state.dist.device`` and
        how many of its leading samples are real; pass ``num_valid`` to
        ``fa.ops.gather_for_metrics(state, outputs, num_valid=num_valid)``. On
        one process nothing is padded (the last batch is short, ``num_valid`` is
        every batch's length), as Accelerate; on several, every rank's batch has
        ``batch_size`` samples, the padding wrapping around to the dataset's start.
        Its ``len()`` is the batches this rank yields (the same on every rank), as
        Accelerate's prepared loader's, so a ported loop's truncation at
        ``step == len(batches) - 1`` is exact; it raises `TypeError` for a stream
        without a length.

    Raises:
        TypeError: ``loader`` is not a `DataLoader`.
        ValueError: the loader does not batch, uses a custom batch sampler
            across several processes, or its dataset is empty.

    >>> import torch, fnaccel as fa
    >>> state = fa.init(cpu=True)
    >>> data = torch.utils.data.DataLoader(torch.arange(5), batch_size=2, shuffle=True)
    >>> batches = fa.eval_batches(state, data)
    >>> len(batches), [(batch.tolist(), n) for batch, n in batches]
    (3, [([0, 1], 2), ([2, 3], 2), ([4], 1)])
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"fa.eval_batches takes a torch.utils.data.DataLoader, got {type(loader).__name__}")
    ctx = data_parallel_context(as_dist(state))  # ranks of one tp/pp group evaluate the same batches
    rank, num_processes = ctx.rank, ctx.num_processes
    plan = loader_plan(loader)
    if plan.kind == "custom" and plan.batch_sampler is not None:
        if num_processes > 1:
            raise ValueError(
                f"fa.eval_batches: the DataLoader's custom {type(plan.batch_sampler).__name__} cannot be "
                "split exactly across processes; evaluate with a DataLoader(dataset, batch_size=...)"
            )
        return Batches(
            ((send_to_device(b, ctx.device), _num_samples(b)) for b in loader), _length(loader), _UNKNOWN
        )
    if plan.batch_size is None:
        raise ValueError(
            "fa.eval_batches needs a DataLoader with a batch_size (samples per rank per step), "
            "got batch_size=None"
        )
    collate = Collate(loader.collate_fn, unbatched=False)
    even_batches = num_processes > 1  # one process has nobody to wait for: no padding, as Accelerate
    if isinstance(loader.dataset, IterableDataset):
        stream = shard_iterable(
            loader.dataset,
            batch_size=plan.batch_size,
            num_processes=num_processes,
            rank=rank,
            drop_last=False,
            even_batches=even_batches,
        )
        steps = DataLoader(
            stream,
            batch_size=None,
            collate_fn=CollateSteps(collate),  # type: ignore[arg-type]
            **_reader(loader),
        )
        num_samples = _length(loader.dataset)  # a stream may know its length
        length = None if num_samples is None else num_steps(num_samples, plan.batch_size, num_processes)
        return Batches(
            ((send_to_device(c.batch, ctx.device), c.num_valid) for c in steps if isinstance(c, Collated)),
            length,
            _UNKNOWN,
        )
    num_samples = len(loader.dataset)  # type: ignore[arg-type]
    if num_samples == 0:
        raise ValueError("fa.eval_batches: the evaluation dataset is empty")
    shards = eval_shards(num_samples, plan.batch_size, num_processes, rank, even_batches)
    fetch = batch_fetch(loader, collate, ctx.device)
    if isinstance(fetch, IndexFetch):  # a TensorDataset: one indexing per tensor, as fa.batches reads it
        return Batches(
            ((fetch(torch.tensor(s.indices, dtype=torch.long)), s.num_valid) for s in shards), len(shards)
        )
    reader = DataLoader(
        loader.dataset, batch_sampler=[list(s.indices) for s in shards], collate_fn=collate, **_reader(loader)
    )
    return Batches(
        ((send_to_device(b, ctx.device), s.num_valid) for b, s in zip(reader, shards, strict=False)),
        len(shards),
    )


_UNKNOWN = (
    "fa.eval_batches: the evaluation data has no length (an IterableDataset without __len__, or a "
    "batch sampler without one), so what fa.eval_batches returns has no len(); count the batches as "
    "they come, or give the dataset a __len__"
)


def _length(sized: object) -> int | None:
    """``len(sized)``, or None for an object without a length."""
    if not isinstance(sized, Sized):
        return None
    try:  # a __len__ may raise TypeError itself
        return len(sized)
    except TypeError:
        return None


def _num_samples(batch: object) -> int:
    """A batch's sample count (dim 0 of its first tensor), for loaders fnaccel does not split."""
    leaves = tree_leaves(batch)
    return int(leaves[0].shape[0]) if leaves and leaves[0].ndim else 1
