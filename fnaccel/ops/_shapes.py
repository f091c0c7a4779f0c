"""Every rank's tensor shapes in one small collective, and mismatch reports.

gloo aborts the whole process (it does not raise) when ranks enter a
collective with different sizes, and nccl may hang, so a mismatch has to be
found *before* the data moves. `exchange_shapes` sends a fixed-size int64
header (64 slots) holding a fingerprint of the tree (leaf count, dtypes,
ranks) and, when they fit, every leaf's shape: one tiny collective gives each
rank the whole table. Operations that need sizes anyway (padding, gathering
for metrics) get the full check for free; plain gather, reduce and broadcast
pay for it only under ``FNACCEL_DEBUG_MODE=1``.
"""

from __future__ import annotations

import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fnaccel._errors import CollectiveMismatchError
from fnaccel.dist import DistContext

__all__ = ["ShapeTable", "all_gather_rows", "exchange_shapes", "require_same_shapes"]

_SLOTS = 64
_FIXED = 4  # leaf count, total rank (ndim), fingerprint, extras count


# torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# dtypes every backend moves as they are; anything else travels as raw bytes
_NATIVE = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8}
)


def as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous view of ``tensor`` that any backend can move (0-d becomes 1-d).

    gloo refuses bool and some low-precision dtypes, but bytes always move;
    native dtypes are left as they are, so the call is the one a hand-written
    gather would make.
    """
    flat = tensor.reshape(1) if tensor.ndim == 0 else tensor.contiguous()
    if flat.dtype in _NATIVE or not flat.numel():
        return flat
    return flat.view(torch.uint8)


def all_gather_rows(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    """All-gather ``tensor`` along dim 0 whatever its dtype; 0-d tensors become 1-d.

    Returns ``num_processes`` times as many rows, in rank order.
    """
    wire = as_wire(tensor)
    out = wire.new_empty((ctx.num_processes * wire.shape[0], *wire.shape[1:]))
    _all_gather_single(out, wire, group=ctx.process_group)
    return out if wire.dtype == tensor.dtype else out.view(tensor.dtype)


def _all_gather_ints(ctx: DistContext, values: list[int]) -> list[list[int]]:
    """Every rank's list of ints (all of one length): one int64 all-gather.

    Built through `array` and `frombuffer`, which costs a few microseconds
    where `torch.tensor` on a 64-item list costs about 17.
    """
    local = torch.frombuffer(array("q", values), dtype=torch.int64).to(ctx.device)
    return all_gather_rows(ctx, local).view(ctx.num_processes, len(values)).tolist()


@dataclass(frozen=True, slots=True)
class ShapeTable:
    """Every rank's leaf shapes and extra integers, as `exchange_shapes` returns them."""

    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # [rank][leaf] -> shape
    extras: tuple[tuple[int, ...], ...]  # [rank] -> extras


def _fingerprint(leaves: Sequence[torch.Tensor]) -> int:
    text = ";".join(f"{t.dtype}/{t.ndim}" for t in leaves)
    return zlib.crc32(text.encode())


def _describe(signature: Sequence[tuple[tuple[int, ...], str]]) -> str:
    return "[" + ", ".join(f"{tuple(s)} {d.replace('torch.', '')}" for s, d in signature) + "]"


def _raise_mismatch(ctx: DistContext, op: str, leaves: Sequence[torch.Tensor], hint: str) -> None:
    """Collect every rank's signature (all ranks are here together) and raise."""
    signature = [(tuple(t.shape), str(t.dtype)) for t in leaves]
    everyone: list[object] = [None] * ctx.num_processes
    dist.all_gather_object(everyone, signature, group=ctx.process_group)
    lines = [f"rank {rank}: {_describe(sig)}" for rank, sig in enumerate(everyone)]  # type: ignore[arg-type]
    raise CollectiveMismatchError(
        f"{op}: the ranks passed different tensors ({'; '.join(lines)}). {hint}"
    )


def _raise_problem(ctx: DistContext, op: str, problem: BaseException | None) -> None:
    """Some rank rejected its own input: every rank raises, together, instead of
    the healthy ranks waiting in a collective the failing one never enters."""
    everyone: list[object] = [None] * ctx.num_processes
    dist.all_gather_object(everyone, None if problem is None else str(problem), group=ctx.process_group)
    if problem is not None:
        raise problem
    rank, message = next((r, m) for r, m in enumerate(everyone) if m is not None)
    raise CollectiveMismatchError(f"{op}: rank {rank} rejected its input: {message}")


def exchange_shapes(
    ctx: DistContext,
    op: str,
    leaves: Sequence[torch.Tensor],
    extras: Sequence[int] = (),
    hint: str = "Every rank must pass the same structure and dtypes.",
    problem: BaseException | None = None,
) -> ShapeTable:
    """All ranks' shapes of ``leaves`` (plus a few integers each) in one collective.

    Args:
        problem: the error this rank found in its own input, if any. It is
            raised after the exchange, and every other rank raises too, so
            no rank is left waiting in a collective.

    Raises:
        CollectiveMismatchError: the ranks' trees differ in leaf count, dtype
            or number of dimensions (the message names each rank's shapes),
            or another rank rejected its input.
    """
    dims = [d for t in leaves for d in t.shape]
    # slot 0: this rank's input is bad; then the fixed part, the extras, the dims
    header = [int(problem is not None), len(leaves), len(dims), _fingerprint(leaves), len(extras), *extras]
    fixed = slice(1, 1 + _FIXED)
    inline = len(header) + len(dims) <= _SLOTS
    if len(header) > _SLOTS:
        raise ValueError(f"{op}: at most {_SLOTS - _FIXED - 1} extra integers fit the header")
    row = header + (dims if inline else [])
    row += [0] * (_SLOTS - len(row))
    rows = _all_gather_ints(ctx, row)
    if any(r[0] for r in rows):
        _raise_problem(ctx, op, problem)
    if any(r[fixed] != rows[0][fixed] for r in rows):
        _raise_mismatch(ctx, op, leaves, hint)
    start = len(header)
    if inline:  # the same on every rank: the fixed header part agreed
        per_rank_dims = [r[start : start + len(dims)] for r in rows]
    else:  # a tree too large for the header: its dims travel in a second message
        per_rank_dims = _all_gather_ints(ctx, dims)
    shapes = []
    for flat in per_rank_dims:
        it = iter(flat)
        shapes.append(tuple(tuple(next(it) for _ in range(t.ndim)) for t in leaves))
    return ShapeTable(
        shapes=tuple(shapes), extras=tuple(tuple(r[1 + _FIXED : start]) for r in rows)
    )


def require_same_shapes(
    ctx: DistContext, op: str, leaves: Sequence[torch.Tensor], hint: str
) -> None:
    """The full check: every rank passes exactly the same shapes and dtypes."""
    table = exchange_shapes(ctx, op, leaves, hint=hint)
    if any(shapes != table.shapes[0] for shapes in table.shapes):
        _raise_mismatch(ctx, op, leaves, hint)
