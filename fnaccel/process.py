"""Process helpers that take the run's context: barriers, main-process-first
blocks, functions that run on one process, splitting inputs between processes.

Each takes a `RunState` or its `DistContext` first; in a world of one they
are no-ops (or run the function), so the same script runs everywhere.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fnaccel.dist import DistContext, DistLike, as_dist

__all__ = [
    "local_main_process_first",
    "main_process_first",
    "on_local_main_process",
    "on_main_process",
    "on_process",
    "print_on_main",
    "split_between_processes",
    "wait_for_everyone",
]

R = TypeVar("R")
# what split_between_processes yields: a share of the same kind as the whole
T = TypeVar("T")


def wait_for_everyone(ctx: DistLike) -> None:
    """Block until every process of the run reaches this point (a barrier)."""
    ctx = as_dist(ctx)
    if ctx.num_processes > 1:
        dist.barrier(group=ctx.process_group)


@contextmanager
def _goes_first(ctx: DistContext, first: bool) -> Iterator[None]:
    if not first:
        wait_for_everyone(ctx)
    yield
    if first:
        wait_for_everyone(ctx)


def main_process_first(ctx: DistLike) -> AbstractContextManager[None]:
    """A block the main process runs before the others (e.g. to download or
    preprocess a dataset once, which the others then read from its cache).

    >>> import fnaccel as fa
    >>> with fa.utils.main_process_first(fa.init(cpu=True)):
    ...     pass
    """
    ctx = as_dist(ctx)
    return _goes_first(ctx, ctx.is_main_process)


def local_main_process_first(ctx: DistLike) -> AbstractContextManager[None]:
    """A block each machine's local main process runs before the machine's others."""
    ctx = as_dist(ctx)
    return _goes_first(ctx, ctx.is_local_main_process)


def _only_where(run_here: bool, function: Callable[..., R]) -> Callable[..., R | None]:
    @functools.wraps(function)
    def wrapper(*args: object, **kwargs: object) -> R | None:
        return function(*args, **kwargs) if run_here else None

    return wrapper


def on_process(ctx: DistLike, function: Callable[..., R], process_index: int) -> Callable[..., R | None]:
    """``function`` wrapped to run only on global rank ``process_index`` (None elsewhere)."""
    ctx = as_dist(ctx)
    if not 0 <= process_index < ctx.num_processes:
        raise ValueError(
            f"on_process: process_index={process_index} is not a rank of this {ctx.num_processes}-process run"
        )
    return _only_where(ctx.rank == process_index, function)


def on_main_process(ctx: DistLike, function: Callable[..., R]) -> Callable[..., R | None]:
    """``function`` wrapped to run only on the main process (None elsewhere).

    >>> import fnaccel as fa
    >>> fa.utils.on_main_process(fa.init(cpu=True), lambda: "ran")()
    'ran'
    """
    return on_process(ctx, function, 0)


def on_local_main_process(ctx: DistLike, function: Callable[..., R]) -> Callable[..., R | None]:
    """``function`` wrapped to run only on each machine's local main process."""
    return _only_where(as_dist(ctx).is_local_main_process, function)


def print_on_main(ctx: DistLike, *args: object, **kwargs: Any) -> None:
    """`print` on the main process only: once per run (Accelerate's
    ``accelerator.print`` prints once per machine, on each local main process)."""
    if as_dist(ctx).is_main_process:
        builtins.print(*args, **kwargs)


def _split(
    inputs: Any, num_processes: int, rank: int, apply_padding: bool
) -> Any:  # a list, tuple, tensor or dict
    if isinstance(inputs, Mapping):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(
                f"split_between_processes: the dict's values have different lengths {sorted(lengths)}"
            )
        rebuild: Any = type(inputs)
        return rebuild({k: _split(v, num_processes, rank, apply_padding) for k, v in inputs.items()})
    length = len(inputs)
    base, extra = divmod(length, num_processes)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    part = inputs[start:end]
    if apply_padding and extra and rank >= extra and length:
        # Every rank gets ceil(length / num_processes) items: repeat the last input.
        last = inputs[length - 1 : length]
        part = torch.cat([part, last]) if isinstance(part, torch.Tensor) else part + type(part)(last)
    return part


@contextmanager
def split_between_processes(ctx: DistLike, inputs: T, apply_padding: bool = False) -> Iterator[T]:
    """Yield this process's contiguous share of ``inputs`` (a list, tuple, tensor
    or a dict of them); the first ``len % num_processes`` ranks get one more.

    Args:
        ctx: a `RunState` or its `DistContext`.
        inputs: what to split, along its first dimension.
        apply_padding: repeat the last input so every rank gets
            ``ceil(len(inputs) / num_processes)`` items (for a later gather).

    >>> import fnaccel as fa
    >>> with fa.utils.split_between_processes(fa.init(cpu=True), ["a", "b"]) as mine:
    ...     mine
    ['a', 'b']
    """
    ctx = as_dist(ctx)
    if ctx.num_processes == 1:
        yield inputs
        return
    yield _split(inputs, ctx.num_processes, ctx.rank, apply_padding)
