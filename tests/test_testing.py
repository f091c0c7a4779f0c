"""fa.testing: the harness reports failures by rank and never hangs."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.testing import DistributedTestError, World, run_distributed


def _rank_times(state: fa.RunState, factor: int) -> int:
    return state.dist.rank * factor


def _fail_on_last(state: fa.RunState) -> int:
    if state.dist.is_last_process:
        raise KeyError("only the last rank fails")
    return state.dist.rank


def _hang_on_rank_one(state: fa.RunState) -> None:
    if state.dist.rank == 1:
        time.sleep(60)


def _die_on_rank_one(state: fa.RunState) -> None:
    if state.dist.rank == 1:
        os._exit(3)


def test_results_come_back_in_rank_order(world: Any) -> None:
    assert world.run(_rank_times, 10) == [10 * r for r in range(world.num_processes)]


def test_an_exception_is_reraised_with_its_rank(world: Any) -> None:
    with pytest.raises(KeyError, match="only the last rank fails") as info:
        world.run(_fail_on_last)
    last = world.num_processes - 1
    assert any(note.startswith(f"rank {last} raised KeyError") for note in info.value.__notes__)
    assert world.alive  # the other ranks finished: the world is still usable
    assert world.run(_rank_times, 1) == list(range(world.num_processes))


@pytest.mark.multiprocess
def test_a_hung_rank_and_a_dead_rank_tear_the_world_down(preload: tuple[str, ...]) -> None:
    """Forked ranks (a preload) hang and die here; run_distributed's are spawned."""
    with World(2, timeout=4, preload=preload) as world:
        started = time.monotonic()
        with pytest.raises(DistributedTestError, match=r"rank\(s\) \[1\] did not finish"):
            world.run(_hang_on_rank_one)
        assert time.monotonic() - started < 30
        assert not world.alive
        with pytest.raises(DistributedTestError, match="closed or broke"):
            world.run(_rank_times, 1)
    results = run_distributed(_rank_times, 2, 5)
    assert results == [0, 5]
    with (
        World(2, timeout=30, preload=preload) as world,
        pytest.raises(DistributedTestError, match=r"rank 1 died \(exit code 3\)"),
    ):
        world.run(_die_on_rank_one)


def _shut_down(state: fa.RunState) -> int:
    fa.shutdown(state)  # the world lent its group: this must not end it
    return state.dist.rank


def test_a_task_shutting_down_its_state_leaves_the_world_usable(world2: Any) -> None:
    assert world2.run(_shut_down) == [0, 1]
    assert world2.run(_rank_times, 2) == [0, 2]


def _started_with(state: fa.RunState) -> dict[str, Any]:
    return {
        "preloaded": "torch._dynamo" in sys.modules,  # nothing this module or fa.init imports
        "parent": os.getppid(),
        "mark": os.environ.get("FNACCEL_WORLD_MARK"),
        "gone": os.environ.get("FNACCEL_WORLD_GONE"),
        "threads": torch.get_num_threads(),
    }


@pytest.mark.multiprocess
def test_a_preloaded_world_forks_its_ranks_with_the_callers_environment_of_the_moment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A preload forks the ranks from a server that imported the modules once (spawned ranks
    import torch each: about 3 s of CPU a rank); what the caller's environment is when each
    world starts, the thread count included, reaches its ranks as it reaches spawned ones,
    though the server was started under another."""
    monkeypatch.setenv("FNACCEL_WORLD_MARK", "first")
    monkeypatch.setenv("FNACCEL_WORLD_GONE", "set")
    with World(2, preload=("torch._dynamo",)) as first:
        seen = first.run(_started_with)
    assert [rank["mark"] for rank in seen] == ["first", "first"]
    monkeypatch.setenv("FNACCEL_WORLD_MARK", "second")
    monkeypatch.delenv("FNACCEL_WORLD_GONE")
    with World(2, preload=("torch._dynamo",), env={"OMP_NUM_THREADS": "3"}) as second:
        seen = second.run(_started_with)
    for rank in seen:
        assert rank["preloaded"] and rank["parent"] != os.getpid(), rank  # forked by the server
        assert rank["mark"] == "second" and rank["gone"] is None and rank["threads"] == 3, rank
