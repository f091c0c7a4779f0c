"""Repeated collective calls: the flag "my call differs" travels in the data.

A repeated call need not wait for the header round trip of
`fnaccel.ops._shapes` (`require_same_shapes`). The group's owner keeps
the last call every rank agreed on (`Agreed`: operation, arguments, leaf
paths, dtypes and shapes, the same on every rank). When it is set, every rank
sends the flag "my call differs from the agreed one" (for instance in a
one-element all-reduce, `PendingFlag`, not waited for) and at once runs the
data collectives *shaped as the agreed call* (a rank whose own call differs sends zeros of
those shapes), so no size can differ inside gloo; then it reads the flag.
No rank raised it: the data is the answer. Any did: every rank throws the
data away and runs that full check (a mismatch raises on every rank;
a layout every rank changed alike is recorded and its data sent again).
Only a changed layout pays the round trip.

The flag need not be a collective of its own (on gloo its latency adds a
quarter to a 1 MB gather); `flag_carrier` picks how it travels in the data. A
reduce with a floating-point leaf carries it as an infinity in that leaf's
first element (`NonFinite`). In a gather, a rank whose call differs writes
`MARK` at the start of one leaf of its agreed-shaped zeros (`Marked`: no
copy), or, when every leaf is under 16 bytes, the flag follows one leaf's
bytes through kept buffers (`Staging`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist

from fnaccel.dist import DistContext
from fnaccel.ops._shapes import MARK, Signature, all_gather_rows, all_gather_single

__all__ = [
    "Agreed",
    "Marked",
    "NonFinite",
    "PendingFlag",
    "Staging",
    "call_of",
    "flag_carrier",
]

# An agreed call: operation, arguments, leaf paths, and each leaf's dtype and shape.
Call: TypeAlias = tuple[str, str, tuple[str, ...], tuple[tuple[torch.dtype, tuple[int, ...]], ...]]


@dataclass(frozen=True, slots=True)
class Marked:
    """A repeated gather whose flag is a mark in one leaf's data: no copy, no extra collective.

    A rank whose call differs sends the agreed layout's zeros with `MARK` at the
    start of leaf ``leaf`` (the smallest of at least 16 bytes, the same on every
    rank); every rank looks for the mark in each rank's part of the gathered leaf.
    Data that happens to begin with the mark is only a false alarm: the full
    check finds the calls agree, and the data is sent again.

    Attributes:
        leaf: the leaf that carries the mark.
        mark: `MARK` as a uint8 tensor on the run's device.
    """

    leaf: int
    mark: torch.Tensor

    def run(
        self, ctx: DistContext, leaves: Sequence[torch.Tensor], differs: bool
    ) -> list[torch.Tensor] | None:
        """Every leaf gathered as `all_gather_rows` does, or None if any rank's part
        of the carrying leaf begins with the mark (then no other leaf is sent)."""
        carrier = leaves[self.leaf]
        if differs:  # the agreed layout's fresh zeros
            carrier.reshape(-1).view(torch.uint8)[: len(MARK)].copy_(self.mark)
        carried = all_gather_rows(ctx, carrier)
        starts = carried.reshape(-1).view(torch.uint8).view(ctx.num_processes, -1)[:, : len(MARK)]
        if starts.eq(self.mark).all(dim=1).any().item():
            return None
        return [carried if i == self.leaf else all_gather_rows(ctx, t) for i, t in enumerate(leaves)]


@dataclass(frozen=True, slots=True)
class Staging:
    """A repeated gather of leaves too small for a mark (under 16 bytes each): the
    flag travels after the smallest leaf's bytes, through kept buffers.

    Attributes:
        leaf: which leaf carries it (the smallest, the same on every rank).
        row: bytes each rank sends: the leaf's bytes, padded to 8, then the int64 flag.
        send: this rank's row.
        received: every rank's row, in rank order.
    """

    leaf: int
    row: int
    send: torch.Tensor
    received: torch.Tensor

    def run(
        self, ctx: DistContext, leaves: Sequence[torch.Tensor], differs: bool
    ) -> list[torch.Tensor] | None:
        """Every leaf gathered as `all_gather_rows` does, or None if any rank's flag
        says its call differs (then no other leaf is sent). The carrying leaf is
        copied into ``send`` with the flag after it, every rank's row is gathered at
        once, and the rows are copied out into a fresh tensor."""
        carrier = leaves[self.leaf]
        flat = carrier.reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        flag_at = self.row - 8
        if nbytes:
            self.send[:nbytes].copy_(flat.view(torch.uint8))
        self.send[flag_at:].view(torch.int64).fill_(int(differs))
        all_gather_single(self.received, self.send, group=ctx.process_group)
        rows = self.received.view(ctx.num_processes, self.row)
        if rows[:, flag_at:].view(torch.int64).any().item():
            return None
        n = ctx.num_processes
        shape = (n * carrier.shape[0], *carrier.shape[1:]) if carrier.ndim else (n,)
        carried = torch.empty(shape, dtype=carrier.dtype, device=carrier.device)
        if nbytes:
            carried.view(-1).view(torch.uint8).view(n, nbytes).copy_(rows[:, :nbytes])
        return [carried if i == self.leaf else all_gather_rows(ctx, t) for i, t in enumerate(leaves)]


@dataclass(frozen=True, slots=True)
class NonFinite:
    """A repeated reduce whose flag is an infinity in the first element of one
    floating-point leaf: no copy beyond the reduce's own clone, no extra collective.

    A rank whose call differs sends the agreed layout's zeros with ``value``
    (+inf; -inf under ``min``) there, which makes that element of the result
    infinite or NaN on every rank. A result whose first element is not finite
    for another reason (an inf or NaN in the data) is only a false alarm: the
    full check finds the calls agree, and the data is reduced again.

    Attributes:
        leaf: the leaf that carries the flag.
        op: the reduction's `torch.distributed.ReduceOp`.
        value: what a rank whose call differs writes.
    """

    leaf: int
    op: dist.ReduceOp.RedOpType
    value: float

    def run(
        self, ctx: DistContext, leaves: Sequence[torch.Tensor], differs: bool
    ) -> list[torch.Tensor] | None:
        """Every leaf reduced (a clone of each), or None if the carrying leaf's first
        element came back not finite (then no other leaf is reduced)."""
        out = [t.clone() for t in leaves]
        carrier = out[self.leaf]
        first = (0,) * carrier.ndim
        if differs:
            carrier[first] = self.value
        dist.all_reduce(carrier, op=self.op, group=ctx.process_group)
        if not math.isfinite(carrier[first].item()):
            return None
        for i, value in enumerate(out):
            if i != self.leaf:
                dist.all_reduce(value, op=self.op, group=ctx.process_group)
        return out


def flag_carrier(
    call: Call, ctx: DistContext, reduce_op: dist.ReduceOp.RedOpType | None = None
) -> Marked | Staging | NonFinite | None:
    """How the agreed call ``call`` carries its flag in its data: a gather with a leaf
    of at least 16 bytes by `Marked`, one with smaller leaves only by `Staging`, a
    reduce (by ``reduce_op``) with a non-empty floating-point leaf by `NonFinite`;
    None for anything else (the flag then needs its own collective)."""
    if call[0] == "reduce":
        floating = [
            i for i, (dtype, shape) in enumerate(call[3]) if dtype.is_floating_point and math.prod(shape) > 0
        ]
        if not floating:
            return None
        assert reduce_op is not None, "a reduce is agreed with its operation"
        value = -math.inf if reduce_op == dist.ReduceOp.MIN else math.inf
        return NonFinite(leaf=floating[0], op=reduce_op, value=value)
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in call[3]]
    if call[0] != "gather" or not sizes:
        return None
    device = ctx.device
    big = [size for size in sizes if size >= len(MARK)]
    if big:
        mark = torch.frombuffer(bytearray(MARK), dtype=torch.uint8).to(device)
        return Marked(leaf=sizes.index(min(big)), mark=mark)
    leaf = sizes.index(min(sizes))
    row = -(-sizes[leaf] // 8) * 8 + 8
    return Staging(
        leaf=leaf,
        row=row,
        send=torch.empty(row, dtype=torch.uint8, device=device),
        received=torch.empty(ctx.num_processes * row, dtype=torch.uint8, device=device),
    )


@dataclass(frozen=True, slots=True)
class Agreed:
    """A collective call every rank agreed on (kept by the group's owner).

    Attributes:
        call: what identifies it: operation, arguments, leaf paths, dtypes, shapes.
        param: the argument its data collective needs (the reduction, the source rank).
        carrier: how a gather's flag travels in its data (`flag_carrier`), or None.
    """

    call: Call
    param: str | int | None
    carrier: Marked | Staging | NonFinite | None = None

    @property
    def op(self) -> str:
        return str(self.call[0])

    def zeros(self, device: torch.device) -> list[torch.Tensor]:
        """Leaves of the agreed layout, for a rank whose own call differs."""
        return [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in self.call[3]]


def call_of(signature: Signature) -> Call:
    """The `Agreed.call` of ``signature``: equal on two ranks exactly when their
    collectives move the same sizes and their checks would agree."""
    return (signature.op, signature.key, signature.paths, signature.layout())


class PendingFlag:
    """Whether any rank raised its flag: a one-element MAX all-reduce, started
    when built, read by `raised` (which waits for it)."""

    __slots__ = ("_flag", "_work")

    def __init__(self, ctx: DistContext, mine: bool) -> None:
        self._flag = torch.full((1,), int(mine), dtype=torch.int64, device=ctx.device)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=ctx.process_group, async_op=True)

    def raised(self) -> bool:
        self._work.wait()
        return bool(self._flag.item())
