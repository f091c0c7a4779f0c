"""`sp()`: Ulysses sequence parallelism over the mesh's ``sp`` dimension.

The ranks of one sequence-parallel group are one data-parallel rank: they read
the same batch (`fnaccel.dist.data_parallel` counts them once), and each keeps
its own contiguous part of the sequence (``split_batch``: every tensor of the
batch that has the sequence dimension is cut along it). Position ids stay
global: a batch without ``position_ids`` gets this part's (its offset into the
sequence onwards), one that has them (packed documents) keeps its values.

Around the model's attention, ``torch.nn.functional.scaled_dot_product_attention``
(or a user's function decorated with `ulysses_attention`), an all-to-all turns
the sequence parts into head parts: each rank attends over the whole sequence
for ``heads / sp_size`` heads, and a second all-to-all turns the result back.
The calls are found by a torch function mode entered for the model's forward
in `fa.step` only (evaluation runs the whole sequence on every rank).

The loss is correct by construction: ``loss_fn`` returns the mean over this
part's real tokens (labels other than ``ignore_index``; ``cross_entropy``'s
default), and each rank's loss is weighted by its share of the batch's real
tokens (counted on the whole batch, which every rank holds: no communication).
The gradients of the group's ranks are summed at the update, so they equal one
process's on the whole sequence, whatever the split of the padding. `fa.step`'s
``loss`` is the whole batch's mean (one scalar all-reduce over the group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function

from fnaccel.checks import is_int
from fnaccel.dist import DistContext, mesh_dim
from fnaccel.transforms.contract import PipelineView, PrepareRequest
from fnaccel.transforms.declared import Accumulation
from fnaccel.transforms.kinds import ParallelismTransform, options
from fnaccel.transforms.phases import Phase

__all__ = ["SequenceShard", "sp", "ulysses_attention"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
AttentionFn = Callable[..., torch.Tensor]


def ulysses_attention(fn: AttentionFn) -> AttentionFn:
    """Mark a user's attention function ``fn(query, key, value, **kwargs)`` as one `fa.sp` splits.

    The tensors are ``(batch, heads, sequence, head_dim)``, as for torch's
    ``scaled_dot_product_attention``. Outside an `fa.sp` step the function is
    ``fn`` itself; inside one, ``fn`` gets the whole sequence for this rank's
    share of the heads, and its result is turned back into this rank's part of
    the sequence. ``fn`` must attend causally or fully over the sequence (no
    mask built from the local part).

    >>> import torch
    >>> @ulysses_attention
    ... def attend(q, k, v):
    ...     return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
    >>> attend(*[torch.ones(1, 2, 3, 4)] * 3).shape
    torch.Size([1, 2, 3, 4])
    """

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if has_torch_function((query, key, value)):  # an sp step's mode (or a tensor subclass) handles it
            return handle_torch_function(attention, (query, key, value), query, key, value, **kwargs)
        return fn(query, key, value, **kwargs)

    attention._fnaccel_sp_attention = fn  # type: ignore[attr-defined]  # what _UlyssesMode runs
    attention.__name__ = getattr(fn, "__name__", "attention")
    attention.__doc__ = fn.__doc__
    return attention


class SequenceShard:
    """`sp`'s state: the group, and this step's share of the batch's real tokens."""

    __slots__ = ("armed", "ctx", "num_local", "num_total", "rank", "size", "weight")

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx  # the group is read through the run's owner each time, never held
        mesh = mesh_dim(ctx, "sp")
        self.size = 1 if mesh is None else mesh.size()
        self.rank = 0 if mesh is None else mesh.get_local_rank()
        self.armed = False
        self.num_local: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.num_total: torch.Tensor | None = None

    @property
    def group(self) -> dist.ProcessGroup:
        mesh = mesh_dim(self.ctx, "sp")
        assert mesh is not None, "sp_size > 1 without an sp mesh dimension"
        return mesh.get_group()


def _leaves(tree: object, fn: Callable[[torch.Tensor], object]) -> object:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return type(tree)({key: _leaves(value, fn) for key, value in tree.items()})  # type: ignore[call-arg]
    if isinstance(tree, (tuple, list)):
        out = [_leaves(value, fn) for value in tree]
        return tree._make(out) if hasattr(tree, "_make") else type(tree)(out)  # a namedtuple: its _make
    return tree


def _with_positions(batch: object, seq_dim: int, position_ids: str | None) -> object:
    """``batch`` with the global position ids under ``position_ids`` when it is a mapping without them."""
    if position_ids is None or not isinstance(batch, Mapping) or position_ids in batch:
        return batch
    shaped = next((t for t in batch.values() if isinstance(t, torch.Tensor) and t.dim() > seq_dim), None)
    if shaped is None:
        return batch
    length = shaped.shape[seq_dim]
    return {
        **batch,
        position_ids: torch.arange(length, device=shaped.device).expand(*shaped.shape[:seq_dim], length),
    }


def _split(
    batch: Any,
    shard: SequenceShard,
    seq_dim: int,
    labels: str | int,
    ignore_index: int,
    position_ids: str | None,
) -> Any:
    lengths: set[int] = set()
    _leaves(batch, lambda t: lengths.add(t.shape[seq_dim]) if t.dim() > seq_dim else None)
    if len(lengths) != 1:
        raise ValueError(
            f"fa.sp: the batch's tensors must share one sequence length along dim {seq_dim}, found "
            f"{sorted(lengths) or 'no tensor with that many dims'}; give fa.sp(seq_dim=...) the sequence "
            "dimension, or pad the batch's tensors to one length"
        )
    (length,) = lengths
    if length % shard.size:
        raise ValueError(
            f"fa.sp: the sequence length {length} is not divisible by sp_size={shard.size}; pad the batch "
            f"to a multiple of {shard.size} (labels {ignore_index} on the padding: it does not count in the "
            "loss), e.g. in the DataLoader's collate_fn"
        )
    try:
        target = batch[labels]
    except (KeyError, IndexError, TypeError):
        raise ValueError(
            f"fa.sp: the batch has no labels under {labels!r}; fa.sp weights each rank's loss by its share "
            "of the real tokens, so it needs them: give fa.sp(labels=...) the key (or the index in a tuple "
            "batch) of the per-token labels"
        ) from None
    if not isinstance(target, torch.Tensor) or target.dim() <= seq_dim:
        raise ValueError(
            f"fa.sp: the labels under {labels!r} must be a tensor with the sequence along dim "
            f"{seq_dim}, got {type(target).__name__}"
        )
    part = length // shard.size
    start = part * shard.rank
    batch = _with_positions(batch, seq_dim, position_ids)
    local = _leaves(batch, lambda t: t.narrow(seq_dim, start, part) if t.dim() > seq_dim else t)
    real = target != ignore_index
    num_total = real.sum()
    shard.num_local = real.narrow(seq_dim, start, part).sum()
    shard.num_total = num_total
    shard.weight = shard.num_local / num_total.clamp(min=1)
    shard.armed = True
    return local


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` in equal chunks along dim 0, with its gradient: the same
    exchange run backwards (chunk ``j`` of rank ``i`` went to rank ``j`` as its chunk ``i``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # autograd may hand a strided gradient; gloo reads and writes flat memory
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _to_heads(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``(B, H, L/P, D)`` -> ``(B, H/P, L, D)``: this rank's heads over the whole sequence."""
    b, h, part, d = x.shape
    p = shard.size
    send = x.reshape(b, p, h // p, part, d).transpose(0, 1).contiguous()
    got: torch.Tensor = _AllToAll.apply(send, shard.group)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * part, d)


def _to_sequence(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """``(B, H/P, L, D)`` -> ``(B, H, L/P, D)``: every head over this rank's part of the sequence."""
    b, h_part, length, d = x.shape
    p = shard.size
    send = x.reshape(b, h_part, p, length // p, d).permute(2, 0, 1, 3, 4).contiguous()
    got: torch.Tensor = _AllToAll.apply(send, shard.group)  # type: ignore[no-untyped-call]  # torch's Function.apply
    return got.transpose(0, 1).reshape(b, p * h_part, length // p, d)


class _UlyssesMode(TorchFunctionMode):
    """Runs the attention calls of one forward across the group (see the module docstring)."""

    def __init__(self, shard: SequenceShard) -> None:
        super().__init__()
        self.shard = shard
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inner = getattr(func, "_fnaccel_sp_attention", None)
        if func is not _SDPA and inner is None:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        attend = _SDPA if inner is None else inner
        if func is _SDPA:
            names = ("attn_mask", "dropout_p", "is_causal", "scale")
            kwargs = {**dict(zip(names, rest, strict=False)), **kwargs}
            if kwargs.get("attn_mask") is not None:
                raise ValueError(
                    "fa.sp: the model calls scaled_dot_product_attention with an attn_mask; a mask over "
                    "one rank's part of the sequence (sliding window, document or padding masks) cannot be "
                    "split across the sp ranks. Use is_causal=True (right-pad and label the padding -100), "
                    "or set sp_size=1"
                )
            rest = []
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if tensor.dim() != 4 or tensor.shape[1] % self.shard.size:
                raise ValueError(
                    f"fa.sp: attention's {name} has shape {tuple(tensor.shape)}; fa.sp needs (batch, heads, "
                    f"sequence, head_dim) with heads divisible by sp_size={self.shard.size}; choose an "
                    "sp_size that divides the number of heads (and of key/value heads)"
                )
        self.calls += 1
        heads = [_to_heads(t, self.shard) for t in (query, key, value)]
        out = attend(heads[0], heads[1], heads[2], *rest, **kwargs)
        return _to_sequence(out, self.shard)


class SequenceParallelForward:
    """A model's own ``forward`` run with its attention across the sp group, in an `fa.step`."""

    __slots__ = ("inner", "shard")

    def __init__(self, inner: Callable[..., Any], shard: SequenceShard) -> None:
        self.inner = inner
        self.shard = shard

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.shard.armed:  # not a split batch (evaluation, a forward of the user's own)
            return self.inner(*args, **kwargs)
        mode = _UlyssesMode(self.shard)
        with mode:
            out = self.inner(*args, **kwargs)
        if not mode.calls:
            raise ValueError(
                "fa.sp: the model's forward called no torch.nn.functional.scaled_dot_product_attention; "
                "each rank attended only over its own part of the sequence. Use torch's "
                "scaled_dot_product_attention, or decorate your attention function with "
                "fnaccel.transforms.sequence.ulysses_attention (linear or sliding-window attention cannot "
                "be split this way: set sp_size=1)"
            )
        return out


def _sum_gradients(optimizer: torch.optim.Optimizer, shard: SequenceShard) -> None:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    for dtype in {t.dtype for t in local}:
        same = [t for t in local if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=shard.group)
        torch._foreach_copy_(
            same,
            [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in same]), same, strict=True)],
        )


def sp(
    *,
    seq_dim: int = 1,
    labels: str | int = "labels",
    ignore_index: int = -100,
    position_ids: str | None = "position_ids",
) -> ParallelismTransform:
    """Split each batch's sequence over the mesh's ``sp`` dimension (Ulysses; see the module docstring).

    Args:
        seq_dim: the sequence dimension of the batch's tensors (1: ``(batch, sequence, ...)``).
        labels: the batch's key (or a tuple batch's index) of the per-token
            labels, aligned with the inputs (shift them before the batch,
            as the loss of position ``i`` must be with position ``i``).
        ignore_index: the label of tokens that do not count (padding).
        position_ids: the key under which a mapping batch without position
            ids gets the global ones, on one process too (None: add none).

    Raises:
        ValueError: a bad argument (at once); at `fa.step`, a sequence length
            or a head count that ``sp_size`` does not divide, an attention
            mask, no attention call to split, a batch without labels.

    >>> import fnaccel as fa
    >>> fa.sp()
    sp()
    """
    if not is_int(seq_dim) or seq_dim < 0:
        raise ValueError(f"sp: seq_dim must be a non-negative int, got {seq_dim!r}")
    if not isinstance(labels, str) and not is_int(labels):
        raise TypeError(
            f"sp: labels must be the batch's key (a str) or a tuple batch's index, got {labels!r}"
        )
    if not is_int(ignore_index):
        raise TypeError(f"sp: ignore_index must be an int, got {ignore_index!r}")
    if position_ids is not None and not isinstance(position_ids, str):
        raise TypeError(f"sp: position_ids must be a key (str) or None, got {position_ids!r}")

    def prepare_model(ctx: DistContext, model: nn.Module, shard: SequenceShard) -> nn.Module:
        if shard.size > 1:
            # transformers' gradient_checkpointing_enable() sets this flag on the modules it recomputes
            if any(getattr(module, "gradient_checkpointing", False) is True for module in model.modules()):
                raise ValueError(
                    "fa.prepare: the model has activation checkpointing of its own (transformers' "
                    "gradient_checkpointing_enable()); its recomputation in backward would attend over one "
                    "rank's part of the sequence only. Call model.gradient_checkpointing_disable() with fa.sp(), "
                    "or set sp_size=1"
                )
            from fnaccel.transforms.parallel import broadcast_from_first_rank

            broadcast_from_first_rank(model, shard.group)  # the group's ranks must start alike
            model.forward = SequenceParallelForward(model.forward, shard)
        return model

    def split_batch(batch: object, shard: SequenceShard) -> object:
        if shard.size == 1:  # the same batch keys as on sp ranks: a script runs unchanged on one process
            return _with_positions(batch, seq_dim, position_ids)
        return _split(batch, shard, seq_dim, labels, ignore_index, position_ids)

    def scale_loss(loss: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        if shard.size == 1:
            return loss
        if shard.weight is None or shard.num_local is None:
            raise ValueError(
                "fa.sp: this loss was computed on a batch fa.sp did not split (fa.backward after a forward of "
                "your own): every rank of the sp group computed the whole sequence, and their summed gradients "
                "would count it sp_size times. Use fa.step(state, batch), which splits the batch"
            )
        # a part with no real token has a NaN mean (0 / 0): it counts zero, its gradient too
        kept = torch.where(shard.num_local > 0, loss, torch.zeros_like(loss))
        return kept * shard.weight.to(loss.dtype)

    def after_backward(
        loss: torch.Tensor, aux: object, shard: SequenceShard
    ) -> dict[str, torch.Tensor] | None:
        shard.armed = False  # the step's forwards are done: a later one (evaluation) sees whole sequences
        if shard.size == 1 or shard.num_local is None or shard.num_total is None:
            return None
        summed = torch.where(shard.num_local > 0, loss.detach().double() * shard.num_local, 0.0)
        dist.all_reduce(summed, group=shard.group)
        mean = (summed / shard.num_total.clamp(min=1)).to(loss.dtype)
        shard.num_local = shard.weight = shard.num_total = None  # used: the next loss needs its own split
        return {"loss": mean}

    def before_update(
        model: nn.Module, optimizer: torch.optim.Optimizer, shard: SequenceShard
    ) -> dict[str, torch.Tensor]:
        if shard.size > 1:
            _sum_gradients(optimizer, shard)
        return {}

    def check(request: PrepareRequest) -> PipelineView:
        pipeline = request.pipeline
        accumulation = pipeline.settings(Accumulation)
        if accumulation is not None and accumulation.sums_items:
            raise ValueError(
                "fa.prepare: fa.sp() weights each rank's mean loss by its share of the real tokens, and "
                "accumulate(normalize='items') expects summed losses; use accumulate(k) (normalize='mean') "
                "with fa.sp()"
            )
        if pipeline.forward_backward is not None:
            raise ValueError(
                "fa.prepare: fa.sp() splits the batch before the loss function, which a transform "
                "running its own forward and backward (fa.pp) does not call; set sp_size=1 or "
                "pp_size=1"
            )
        return pipeline

    opts = (
        (options(seq_dim=seq_dim) if seq_dim != 1 else ())
        + (options(labels=labels) if labels != "labels" else ())
        + (options(ignore_index=ignore_index) if ignore_index != -100 else ())
        + (options(position_ids=position_ids) if position_ids != "position_ids" else ())
    )
    return ParallelismTransform(
        name="sp",
        options=opts,
        phase=Phase.SEQUENCE_PARALLEL,
        mesh_dims=frozenset({"sp"}),
        conflicts=frozenset({"checkpoint_activations"}),
        conflict_fix="a recomputed block would attend over one rank's part of the sequence only; "
        "drop fa.checkpoint_activations() or set sp_size=1",
        check=check,
        init=SequenceShard,
        prepare_model=prepare_model,
        split_batch=split_batch,
        scale_loss=scale_loss,
        after_backward=after_backward,
        before_update=before_update,
    )
