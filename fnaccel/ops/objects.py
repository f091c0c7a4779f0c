"""Collectives over lists of picklable objects: `gather_object`, `broadcast_object_list`.

Both are built on the header exchange of `fnaccel.ops._shapes` plus one data
collective: the two collectives torch's own versions make, with every rank
learning whether another refused its input (or, for a broadcast, passed a
list of another length), so that all raise together and none waits.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from fnaccel._errors import CollectiveMismatchError
from fnaccel.dist import DistContext, DistLike, as_dist
from fnaccel.ops._shapes import Signature, all_gather_rows, exchange_shapes, naming_timeouts

__all__ = ["broadcast_object_list", "gather_object"]

# the objects of every rank: what each rank passed, unpickled
T = TypeVar("T")


def _not_a_list(op: str, objects: object) -> TypeError | None:
    if isinstance(objects, (list, tuple)):
        return None
    return TypeError(
        f"{op} takes a list of objects, got {type(objects).__name__}; "
        f"wrap a single object: {op}(state, [obj])"
    )


def _alone(op: str, objects: Sequence[T]) -> list[T]:
    """A world of one: the list itself, once checked."""
    problem = _not_a_list(op, objects)
    if problem is not None:
        raise problem
    return list(objects)


def _pickle(op: str, objects: Sequence[object]) -> tuple[bytes, TypeError | None]:
    """``objects`` as one pickled list, or why it cannot travel."""
    problem = _not_a_list(op, objects)
    if problem is not None:
        return b"", problem
    try:
        return pickle.dumps(list(objects)), None
    except Exception as exc:
        return b"", TypeError(f"{op}: cannot pickle the objects: {exc}")


def _byte_buffer(ctx: DistContext, payload: bytes, size: int) -> torch.Tensor:
    """``payload`` zero-padded to ``size`` bytes, as a uint8 tensor on the run's device."""
    buffer = torch.zeros(size, dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buffer.to(ctx.device)


def broadcast_object_list(ctx: DistLike, object_list: Sequence[T], from_process: int = 0) -> list[T]:
    """``from_process``'s list of picklable objects, on every rank.

    Unlike `torch.distributed.broadcast_object_list` the argument is not
    modified; a new list is returned. Each rank passes a list of the same
    length (checked on every rank, in the collective that also agrees on the
    message size: the same two collectives torch's version makes). Objects
    travel pickled between the run's own processes.

    Raises:
        CollectiveMismatchError: the ranks' list lengths or ``from_process``
            differ, or another rank's input was refused.
        TypeError: ``object_list`` is not a list, or (on ``from_process``)
            cannot be pickled.

    >>> import fnaccel as fa
    >>> fa.ops.broadcast_object_list(fa.init(cpu=True), ["a", 1])
    ['a', 1]
    """
    ctx = as_dist(ctx)
    op = "broadcast_object_list"
    if ctx.num_processes == 1:
        return _alone(op, object_list)
    if not 0 <= from_process < ctx.num_processes:
        raise ValueError(
            f"{op}: from_process={from_process} is not a rank of this {ctx.num_processes}-process run"
        )
    if ctx.rank == from_process:
        payload, problem = _pickle(op, object_list)
    else:
        payload, problem = b"", _not_a_list(op, object_list)
    length = len(object_list) if problem is None else -1
    signature = Signature.of(op, [], [], key=f"from_process={from_process}")
    table = exchange_shapes(ctx, signature, extras=[length, len(payload)], problem=problem)
    lengths = [extras[0] for extras in table.extras]
    if len(set(lengths)) > 1:
        raise CollectiveMismatchError(
            f"{op}: list lengths differ by rank ("
            + "; ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
            + f"); every rank passes a list as long as rank {from_process}'s"
        )
    buffer = _byte_buffer(ctx, payload, table.extras[from_process][1])
    with naming_timeouts(ctx, op):
        dist.broadcast(buffer, group=ctx.process_group, group_src=from_process)
    if ctx.rank == from_process:
        return list(object_list)
    received: list[T] = pickle.loads(_as_bytes(buffer))
    return received


def _as_bytes(buffer: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy."""
    host = buffer.cpu().reshape(-1)
    out = bytearray(host.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(host)
    return bytes(out)


def gather_object(ctx: DistLike, object: Sequence[T]) -> list[T]:
    """Gather a list of picklable objects from every rank into one list, in rank order.

    Ranks may pass lists of different lengths (that is what it is for). Two
    collectives, as torch's `all_gather_object`: the first agrees on the
    message sizes and tells every rank whether another rank's input was
    refused, so that all raise together instead of some waiting.

    Raises:
        TypeError: ``object`` is not a list, or cannot be pickled.
        CollectiveMismatchError: another rank's input was refused.

    >>> import fnaccel as fa
    >>> fa.ops.gather_object(fa.init(cpu=True), ["a", "b"])
    ['a', 'b']
    """
    ctx = as_dist(ctx)
    op = "gather_object"
    if ctx.num_processes == 1:
        return _alone(op, object)
    payload, problem = _pickle(op, object)
    table = exchange_shapes(ctx, Signature.of(op, [], []), extras=[len(payload)], problem=problem)
    sizes = [extras[0] for extras in table.extras]
    most = max(sizes)
    with naming_timeouts(ctx, op):
        rows = all_gather_rows(ctx, _byte_buffer(ctx, payload, most)).view(ctx.num_processes, most)
    host = _as_bytes(rows)
    parts = [pickle.loads(host[r * most : r * most + size]) for r, size in enumerate(sizes)]
    return [item for part in parts for item in part]
