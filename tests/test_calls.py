"""Ranks in different collective fnaccel calls end on every rank, naming what each was doing.

The case users meet (issue 37 point 1): nanoGPT-style code saves under ``if
master_process:``, so ``fa.save`` runs on rank 0 while rank 1 goes on into
``fa.step`` and waits in its gradients' all-reduce. Before, both waited for the
process group's timeout (10 minutes) and ended with gloo's raw text.

The detecting rank ends its process as an uncaught error would (``os._exit``
after writing what it raised to a file): that closes its connections, which
releases the rank blocked in the all-reduce, as in a launched run. The world
is then rebuilt for the next test (conftest).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.calls import DEFAULT_COLLECTIVE_TIMEOUT, RELEASE_SECONDS, collective_timeout
from fnaccel.testing import DistributedTestError, World


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def _prepared(state: fa.RunState) -> tuple[fa.RunState, torch.Tensor]:
    """A DDP run three steps in (the default pipeline on 2 ranks is ddp())."""
    model = torch.nn.Linear(4, 2)
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    batch = torch.ones(8, 4)
    for _ in range(3):
        state, _ = fa.step(state, batch)
    return state, batch


def _end_process(report: str, error: BaseException, start: float) -> None:
    Path(report).write_text(json.dumps([type(error).__name__, str(error), time.monotonic() - start]))
    os._exit(0)  # as the uncaught error would: the process's connections close


def _shutdown_on_rank0_rank1_exits(state: fa.RunState) -> str:
    if state.dist.rank == 0:
        fa.shutdown(state)
        return "shut down"
    # what interpreter exit runs on a rank that ends its script without fa.shutdown
    state.dist.group_owner.calls._exiting()
    return "exited"


def test_an_exit_without_shutdown_counts_as_it(world2: World) -> None:
    """A clean end with fa.shutdown on rank 0 only: rank 1's exit enters the agreement.
    (First: it leaves the world whole, and each test after it ends one of its ranks.)"""
    start = time.monotonic()
    assert world2.run(_shutdown_on_rank0_rank1_exits) == ["shut down", "exited"]
    assert time.monotonic() - start < DEFAULT_COLLECTIVE_TIMEOUT


def _save_on_rank0_only(state: fa.RunState, path: str, report: str, timeout: float) -> Any:
    state, batch = _prepared(state)
    calls = state.dist.group_owner.calls
    default = calls.timeout  # what fa.init set from an environment without FNACCEL_COLLECTIVE_TIMEOUT
    calls.timeout = timeout
    start = time.monotonic()
    if state.dist.rank == 0:  # `if master_process:` around the save
        try:
            fa.save(state, path)
        except fa.FnaccelError as error:
            Path(report).with_suffix(".default").write_text(repr(default))
            _end_process(report, error, start)
        raise AssertionError("fa.save returned on rank 0 alone")
    while True:
        state, _ = fa.step(state, batch)


def _shutdown_against_gather(state: fa.RunState, report: str, timeout: float) -> Any:
    state.dist.group_owner.calls.timeout = timeout  # what FNACCEL_COLLECTIVE_TIMEOUT sets at fa.init
    start = time.monotonic()
    if state.dist.rank == 0:
        try:
            fa.shutdown(state)
        except fa.FnaccelError as error:
            _end_process(report, error, start)
        raise AssertionError("fa.shutdown returned on rank 0 alone")
    return fa.ops.gather(state, torch.ones(2))


def _run_until_one_ends(world: World, function: Any, *args: Any) -> tuple[BaseException, float]:
    start = time.monotonic()
    with pytest.raises(fa.FnaccelError) as info:
        world.run(function, *args)
    return info.value, time.monotonic() - start


def test_save_on_one_rank_ends_both_naming_fa_save_and_the_step(world2: World, tmp_path: Path) -> None:
    """Rank 0 in fa.save, rank 1 in fa.step's all-reduce. The run's timeout is the default
    (fa.init's, checked below) and is then set short: the mismatch is found once it has passed,
    and waiting the default's 30 s would show nothing more (how it is read: the last test)."""
    report = tmp_path / "rank0.json"
    error, elapsed = _run_until_one_ends(
        world2, _save_on_rank0_only, str(tmp_path / "ckpt"), str(report), 2.0
    )
    expected = (
        "fa.save was called on rank 0 only (rank 1 is in fa.step at step 3): fa.save is "
        "collective; call it on every rank, and guard only your own files with "
        "state.dist.is_main_process"
    )
    # rank 1's error, raised by its fa.step instead of gloo's "Connection closed by peer"
    assert isinstance(error, fa.CollectiveCallError), error
    assert str(error) == expected
    name, message, detected = json.loads(report.read_text())
    assert (name, message) == ("CollectiveCallError", expected)  # rank 0's, the same cause
    assert float(report.with_suffix(".default").read_text()) == DEFAULT_COLLECTIVE_TIMEOUT
    assert 2.0 <= detected < 2.0 + 30  # the margin the default's bound had (30 <= detected < 60)
    assert elapsed < 2.0 + 30
    assert not (tmp_path / "ckpt").exists()


def test_shutdown_against_a_gather_ends_both(world2: World, tmp_path: Path) -> None:
    """rank 0 in fa.shutdown, rank 1 in fa.ops.gather."""
    report = tmp_path / "rank0.json"
    error, elapsed = _run_until_one_ends(world2, _shutdown_against_gather, str(report), 1.0)
    expected = (
        "fa.shutdown was called on rank 0 only (rank 1 is in fa.ops.gather at step 0): "
        "fa.shutdown is collective on a clean end; call it on every rank after its last "
        "collective call"
    )
    assert isinstance(error, fa.CollectiveCallError), error
    assert str(error) == expected
    assert json.loads(report.read_text())[:2] == ["CollectiveCallError", expected]
    assert elapsed < 30


def _evaluate_against_step_and_live_on(state: fa.RunState, report: str, timeout: float) -> Any:
    state, batch = _prepared(state)
    state.dist.group_owner.calls.timeout = timeout
    start = time.monotonic()
    if state.dist.rank == 0:
        try:
            fa.evaluate(state, torch.utils.data.DataLoader(torch.ones(4, 4), batch_size=2), _loss_per_sample)
        except fa.FnaccelError as error:  # caught, and the process lives on: nothing releases rank 1
            Path(report).write_text(json.dumps([type(error).__name__, str(error), time.monotonic() - start]))
            return "caught"
        raise AssertionError("fa.evaluate returned on rank 0 alone")
    while True:
        state, _ = fa.step(state, batch)


def _loss_per_sample(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean(dim=1)


def test_a_rank_nothing_releases_ends_its_process(world2: World, tmp_path: Path) -> None:
    """rank 0 in fa.evaluate catches the error and lives on, so rank 1's all-reduce is never
    released: its watcher prints the message and ends the process (calls.RELEASE_SECONDS)."""
    report = tmp_path / "rank0.json"
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"rank 1 died \(exit code 1\)"):
        world2.run(_evaluate_against_step_and_live_on, str(report), 1.0)
    assert time.monotonic() - start < 1.0 * 2 + RELEASE_SECONDS + 15
    name, message, _ = json.loads(report.read_text())
    assert name == "CollectiveCallError"
    assert message.startswith(
        "fa.evaluate was called on rank 0 only (rank 1 is in fa.step at step 3): fa.evaluate is collective"
    )


def test_collective_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert collective_timeout() == DEFAULT_COLLECTIVE_TIMEOUT
    monkeypatch.setenv("FNACCEL_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout() == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv("FNACCEL_COLLECTIVE_TIMEOUT", bad)
        with pytest.raises(fa.ConfigError, match="FNACCEL_COLLECTIVE_TIMEOUT=.*positive number of seconds"):
            collective_timeout()
