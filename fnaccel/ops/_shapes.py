"""Every rank's tree signature in one small collective, and mismatch reports.

gloo aborts the whole process (it does not raise) when ranks enter a
collective with different sizes, hangs one rank, or (broadcast) returns a
partly filled buffer, so a mismatch has to be found *before* the data moves.
`exchange_shapes` sends a fixed-size int64 header (`MARK`, then 64 slots) holding a
fingerprint of the call (operation, its arguments, the tree's paths, dtypes
and ranks), a hash of every leaf's shape and, when they fit, the shapes
themselves: one tiny collective gives each rank the whole table, and every
rank decides from the same rows, so either all ranks go on or all raise.

A repeated call need not wait for that round trip: its flag travels in the
data, `fnaccel.ops._flags`.
"""

from __future__ import annotations

import sys
import zlib
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fnaccel._errors import CollectiveCallError, CollectiveMismatchError, CollectiveTimeoutError
from fnaccel.calls import calls_of, failure_of
from fnaccel.dist import DistContext
from fnaccel.ops.tree import tree_paths

__all__ = [
    "MARK",
    "ShapeTable",
    "Signature",
    "all_gather_rows",
    "all_gather_single",
    "exchange_shapes",
    "naming_timeouts",
    "require_same_shapes",
]

_SLOTS = 64
_FIXED = 5  # leaf count, total rank (ndim), fingerprint, shape hash, extras count

# 16 random bytes, chosen once: what a rank whose call differs from the agreed
# gather writes at the start of one leaf's bytes (the rest zeros), and what
# every header exchange begins with, so that a rank in a repeated gather which
# meets another rank's header exchange (ranks out of step) sees a false alarm,
# never a result.
MARK = bytes.fromhex("5deb2d5c40f5936da873ce1aa552114b")
_MARK_WORDS = tuple(int.from_bytes(MARK[i : i + 8], sys.byteorder, signed=True) for i in (0, 8))


@contextmanager
def naming_timeouts(ctx: DistContext, op: str) -> Iterator[None]:
    """Around ``fa.ops``' collectives: record the call for the other ranks (`fnaccel.calls`)
    when it is not part of another fnaccel call, and turn torch's errors into ours:
    a collective broken because a rank named a mismatch of calls raises that
    `CollectiveCallError`; one that waited past the group's timeout a
    `CollectiveTimeoutError` naming ``op`` and the fix (torch's own message, which
    names the missing ranks where the backend knows them, is kept in it)."""
    owner = ctx.group_owner
    calls = calls_of(owner)
    if calls is not None and calls.call is not None:
        calls = None  # part of another fnaccel call, which stays the one recorded
    if calls is not None:
        calls.call = f"fa.ops.{op}"
    try:
        yield
    except CollectiveCallError:
        raise
    except RuntimeError as exc:
        failure = failure_of(owner, exc)
        if failure is not None:
            raise failure from None  # the cause, named; torch's text is its symptom
        text = str(exc)
        if "timed out" not in text.lower() and "timeout" not in text.lower():
            raise
        raise CollectiveTimeoutError(
            f"{op}: timed out waiting for the other ranks (torch: {text.strip().splitlines()[0]}). "
            "A rank that never reaches this collective (it failed, or calls collectives in another "
            "order) is waited for up to the process group's timeout: 10 minutes in fnaccel unless "
            "fa.init(kwargs_handlers=[InitProcessGroupKwargs(timeout=...)]) sets another. gloo does not "
            "say which rank is missing: the first error in the other ranks' output names it."
        ) from exc
    finally:
        if calls is not None:
            calls.done()


# torch 2.13 renamed all_gather_into_tensor; older releases only have the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    all_gather_single(out, wire, group=ctx.process_group)
    return out if wire.dtype == tensor.dtype else out.view(tensor.dtype)


def _all_gather_ints(ctx: DistContext, values: list[int], op: str) -> list[list[int]]:
    """Every rank's list of ints (all of one length): one int64 all-gather of `MARK`
    and the values. A rank whose row lacks the mark is in another collective (its
    data met this exchange): `CollectiveMismatchError` names it.

    Built through `array` and `frombuffer`, which costs a few microseconds
    where `torch.tensor` on a 64-item list costs about 17.
    """
    local = torch.frombuffer(array("q", [*_MARK_WORDS, *values]), dtype=torch.int64).to(ctx.device)
    rows = all_gather_rows(ctx, local).view(ctx.num_processes, len(values) + 2).tolist()
    strays = [rank for rank, row in enumerate(rows) if tuple(row[:2]) != _MARK_WORDS]
    if strays:
        raise CollectiveMismatchError(
            f"{op}: rank {strays[0]} is in another collective (its data met this call's header "
            "exchange): every rank must make the same collectives in the same order"
        )
    return [row[2:] for row in rows]


@dataclass(frozen=True, slots=True)
class ShapeTable:
    """Every rank's leaf shapes and extra integers, as `exchange_shapes` returns them."""

    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # [rank][leaf] -> shape
    extras: tuple[tuple[int, ...], ...]  # [rank] -> extras


@dataclass(frozen=True, slots=True)
class Signature:
    """What every rank must agree on before a collective: the call and its tree.

    Attributes:
        op: the operation, named in messages (``"gather"``).
        key: the call's arguments that must match too (``"reduction=sum"``).
        paths: each tensor leaf's path in the tree (``"['x'][0]"``), which
            carries the dict keys, list lengths and field names.
        leaves: the tensor leaves, in the same order.
    """

    op: str
    key: str
    paths: tuple[str, ...]
    leaves: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, op: str, tree: object, leaves: Sequence[torch.Tensor], key: str = "") -> Signature:
        """The signature of ``tree`` whose tensor leaves are ``leaves``: none, and so no paths,
        where this rank refused its tree (the refusal travels beside the signature)."""
        if not leaves:
            paths: tuple[str, ...] = ()
        else:
            paths = ("",) if isinstance(tree, torch.Tensor) else tuple(tree_paths(tree))
        return cls(op=op, key=key, paths=paths, leaves=tuple(leaves))

    def shape(self, i: int) -> tuple[int, ...]:
        """Leaf ``i``'s shape; a nested tensor (ragged, no single shape) counts as ()."""
        t = self.leaves[i]
        return () if t.is_nested else tuple(t.shape)

    def fingerprint(self) -> int:
        """A hash of everything but the sizes: operation, arguments, paths, dtypes, ranks."""
        parts = [
            f"{p}:{t.dtype}/{'nested' if t.is_nested else t.ndim}"
            for p, t in zip(self.paths, self.leaves, strict=True)
        ]
        return zlib.crc32(f"{self.op}|{self.key}|{';'.join(parts)}".encode())

    def layout(self) -> tuple[tuple[torch.dtype, tuple[int, ...]], ...]:
        """Each leaf's dtype and shape: what the data collectives' sizes follow."""
        return tuple((t.dtype, self.shape(i)) for i, t in enumerate(self.leaves))

    def describe(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(path, shape, dtype)`` of each leaf, for the error message."""
        return [
            (p, self.shape(i), str(t.dtype).replace("torch.", "") + (" nested" if t.is_nested else ""))
            for i, (p, t) in enumerate(zip(self.paths, self.leaves, strict=True))
        ]


def _describe(op_key: str, leaves: Sequence[tuple[str, tuple[int, ...], str]]) -> str:
    body = ", ".join(f"{p + ': ' if p else ''}{tuple(s)} {d}" for p, s, d in leaves)
    return f"{op_key}[{body}]"


def _differences(everyone: Sequence[tuple[str, list[tuple[str, tuple[int, ...], str]]]]) -> list[str]:
    """What differs between the ranks' signatures, in the words of the guarantee."""
    found = []
    calls = {call for call, _ in everyone}
    if len(calls) > 1:
        found.append("the operation or its arguments")
    sigs = [sig for _, sig in everyone]
    if len({tuple(p for p, _, _ in sig) for sig in sigs}) > 1:
        found.append("tree structure (keys, lengths or fields)")
    for what, pick in (("dtype", lambda e: e[2]), ("ndim", lambda e: len(e[1])), ("shape", lambda e: e[1])):
        if len({tuple(pick(e) for e in sig) for sig in sigs}) > 1:
            found.append(what)
    return found or ["nothing visible (a hash collision?)"]


def _raise_mismatch(ctx: DistContext, signature: Signature, hint: str) -> None:
    """Collect every rank's signature (all ranks are here together) and raise."""
    mine = (f"{signature.op}({signature.key}) ", signature.describe())
    # every rank's `mine`; all_gather_object fills each slot
    everyone: list[tuple[str, list[tuple[str, tuple[int, ...], str]]]] = [("", [])] * ctx.num_processes
    dist.all_gather_object(everyone, mine, group=ctx.process_group)
    same_call = len({call for call, _ in everyone}) == 1
    lines = [
        f"rank {rank}: {_describe('' if same_call else call, sig)}"
        for rank, (call, sig) in enumerate(everyone)
    ]
    raise CollectiveMismatchError(
        f"{signature.op}: the ranks passed different tensors; they differ in "
        f"{', '.join(_differences(everyone))} ({'; '.join(lines)}). {hint}"
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


def _header(
    signature: Signature, extras: Sequence[int], problem: BaseException | None
) -> tuple[list[int], list[int]]:
    """This rank's header (slot 0: its input is bad; then the fixed part, the extras)
    and the flat list of its dims."""
    dims = [d for i in range(len(signature.leaves)) for d in signature.shape(i)]
    shape_hash = zlib.crc32(array("q", dims).tobytes()) if dims else 0
    header = [
        int(problem is not None),
        len(signature.leaves),
        len(dims),
        signature.fingerprint(),
        shape_hash,
        len(extras),
        *extras,
    ]
    if len(header) > _SLOTS:
        raise ValueError(f"{signature.op}: at most {_SLOTS - _FIXED - 1} extra integers fit the header")
    return header, dims


def exchange_shapes(
    ctx: DistContext,
    signature: Signature,
    extras: Sequence[int] = (),
    hint: str = "Every rank must pass the same structure and dtypes.",
    problem: BaseException | None = None,
) -> ShapeTable:
    """All ranks' shapes of the signature's leaves (plus a few integers each) in one collective.

    Args:
        signature: this rank's call and tree.
        extras: integers to hand to every rank beside the shapes.
        hint: the fix, appended to a mismatch message.
        problem: the error this rank found in its own input, if any. It is
            raised after the exchange, and every other rank raises too, so
            no rank is left waiting in a collective.

    Raises:
        CollectiveMismatchError: the ranks' calls differ in operation,
            arguments, tree structure, dtype or number of dimensions (the
            message names each rank's tree), or another rank rejected its input.
    """
    header, dims = _header(signature, extras, problem)
    inline = len(header) + len(dims) <= _SLOTS
    row = header + (dims if inline else [])
    row += [0] * (_SLOTS - len(row))
    with naming_timeouts(ctx, signature.op):
        rows = _all_gather_ints(ctx, row, signature.op)
    if any(r[0] for r in rows):
        _raise_problem(ctx, signature.op, problem)
    # everything but the shape hash (slot 4) must agree: the sizes may differ here
    if any(r[1:4] + r[5:6] != rows[0][1:4] + rows[0][5:6] for r in rows):
        _raise_mismatch(ctx, signature, hint)
    start = len(header)
    if inline:  # the same on every rank: the fixed header part agreed
        per_rank_dims = [r[start : start + len(dims)] for r in rows]
    else:  # a tree too large for the header: its dims travel in a second message
        with naming_timeouts(ctx, signature.op):
            per_rank_dims = _all_gather_ints(ctx, dims, signature.op)
    shapes = []
    for flat in per_rank_dims:
        it = iter(flat)
        shapes.append(
            tuple(tuple(next(it) for _ in signature.shape(i)) for i in range(len(signature.leaves)))
        )
    return ShapeTable(shapes=tuple(shapes), extras=tuple(tuple(r[1 + _FIXED : start]) for r in rows))


def require_same_shapes(
    ctx: DistContext, signature: Signature, hint: str, problem: BaseException | None = None
) -> None:
    """The full check, in one small collective whatever the tree's size: every rank
    makes the same call with the same tree paths, dtypes and shapes, and none
    rejected its own input; otherwise every rank raises."""
    header, _ = _header(signature, (), problem)
    rows = _all_gather_ints(ctx, header + [0] * (_SLOTS - len(header)), signature.op)
    if any(r[0] for r in rows):
        _raise_problem(ctx, signature.op, problem)
    if any(r[1:] != rows[0][1:] for r in rows):
        _raise_mismatch(ctx, signature, hint)
