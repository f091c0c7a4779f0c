"""A world's ranks end promptly, whatever they went through, and no rank waits for
another where the others are not.

Both tests share one 2-rank `World` whose task timeout (45 s) is below
`fnaccel.resources.SETTLE_SECONDS` (60 s), so a rank left waiting in a settle
shows as a world torn down, not as a slow pass; the last test closes it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.testing import World

pytestmark = pytest.mark.multiprocess

_TASK_SECONDS = 45.0


class _World:
    """This file's world, started at its first use and again if a test broke it."""

    world: World | None = None

    def __init__(self, preload: tuple[str, ...]) -> None:
        self.preload = preload

    def get(self) -> World:
        if self.world is None or not self.world.alive:
            self.world = World(2, timeout=_TASK_SECONDS, preload=self.preload)
        return self.world


@pytest.fixture(scope="module")
def shared(preload: tuple[str, ...]) -> Iterator[_World]:
    holder = _World(preload)
    yield holder
    if holder.world is not None:
        holder.world.close()


def _drop_a_run_then_collect_on_rank1(state: fa.RunState) -> float:
    """A run of its own over the world's processes, dropped without fa.shutdown inside
    a reference cycle (as an exception's traceback holds a frame that holds it), so
    that only the collector frees its `GroupOwner`: rank 1 collects, rank 0 does not."""
    run = fa.init(cpu=True, seed=0)
    cycle: list[Any] = [run]
    cycle.append(cycle)
    del run, cycle
    if state.dist.rank == 1:
        gc.collect()
    # the world still works on both ranks, and neither waited
    return float(fa.ops.reduce(state, torch.tensor(1.0), "sum").item())


def test_a_run_the_collector_frees_on_one_rank_waits_for_no_other(shared: _World) -> None:
    """Before: rank 1's collection ran the owner's finalizer, whose settle (a monitored
    barrier of up to 60 s) waited for rank 0, which was not in it: the world timed out."""
    assert shared.get().run(_drop_a_run_then_collect_on_rank1) == [2.0, 2.0]


def _shutdown_on_rank0_rank1_exits(state: fa.RunState) -> str:
    """tests/test_calls.py's last task: fa.shutdown on rank 0; rank 1 runs what
    interpreter exit runs for a script that ends without fa.shutdown."""
    if state.dist.rank == 0:
        fa.shutdown(state)
        return "shut down"
    state.dist.group_owner.calls._exiting()
    return "exited"


def test_a_world_whose_ranks_agreed_apart_ends_cleanly(shared: _World) -> None:
    """After a task that left the ranks' call records apart (rank 0 agreed on one more
    call than rank 1), the world's own fa.shutdown still ends both ranks cleanly.
    Before: rank 1 matched rank 0's old entry and went on into the settle, while rank 0
    waited for rank 1's entry until its question went unanswered (over 30 s); the
    close killed it (exit code -9) and rank 1 tore down alone. The group the previous
    test abandoned is ended here too, at the workers' exit, on both ranks."""
    world = shared.get()
    assert world.run(_shutdown_on_rank0_rank1_exits) == ["shut down", "exited"]
    assert world.close() == [0, 0]
