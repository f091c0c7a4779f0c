"""The scheduler passed to `fa.prepare` advances as Accelerate's `AcceleratedScheduler` does.

A schedule sized as Accelerate's examples size it (``len(train_dataloader) *
num_epochs``, from the loader before `prepare`) ends with the run on any number
of processes: each update advances it once per process the batches are cut
across (once under ``split_batches``), only at accumulation boundaries. Compared
with Accelerate itself, on 1 and 2 real processes; a resume mid-run stays exact;
`SchedulerConfiguration(step_per_process=False)` gives one step per update.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.testing import World

EPOCHS, WARMUP, BATCH_SIZE = 2, 3, 2

# name -> (scheduler, samples, accumulation steps, split_batches)
CASES: dict[str, tuple[str, int, int, bool]] = {
    "linear": ("linear", 22, 1, False),  # 11 batches: the 2 ranks pad the last one
    "accumulate": ("linear", 24, 2, False),
    "split_batches": ("linear", 22, 1, True),
    "one_cycle": ("one_cycle", 22, 1, False),  # stops at its total_steps rather than raising
}


def _objects(case: str) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader[Any], Any]:
    """The script's objects, built as Accelerate's examples build them: the schedule's
    length is the loader's before prepare, times the epochs."""
    kind, samples, _, _ = CASES[case]
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # the same weights in every call
        torch.manual_seed(0)
        model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(TensorDataset(torch.randn(samples, 3, generator=g), torch.randn(samples, generator=g)),
                        batch_size=BATCH_SIZE)
    total = len(loader) * EPOCHS
    if kind == "one_cycle":
        scheduler: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=total)
    else:  # transformers' get_linear_schedule_with_warmup(optimizer, WARMUP, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(
            (s / WARMUP) if s < WARMUP else 1.0, max(0.0, (total - s) / (total - WARMUP))))
    return model, optimizer, loader, scheduler


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def fnaccel_rates(state: fa.RunState, case: str, handlers: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The rate of every update of the fnaccel port, and where the scheduler ends."""
    _, _, num_steps, split = CASES[case]
    model, optimizer, loader, scheduler = _objects(case)
    kwargs_handlers = {type(h).__name__: h for h in (fa.DataLoaderConfiguration(split_batches=split), *handlers)}
    state = state.replace(kwargs_handlers=MappingProxyType(kwargs_handlers))
    state = fa.prepare(state, model, optimizer, loader, scheduler, loss_fn=_loss,
                       pipeline=fa.compose(fa.ddp(), fa.accumulate(num_steps)))
    rates = []
    for batch in fa.batches(state, epochs=EPOCHS):
        state, metrics = fa.step(state, batch)
        if "lr" in metrics:
            rates.append(float(metrics["lr"]))
    return {"rates": rates, "last_epoch": scheduler.last_epoch}


def accelerate_rates(_: fa.RunState, case: str) -> dict[str, Any]:
    """The same script written for Accelerate, run by Accelerate on this world's processes."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration

    AcceleratorState._reset_state(True)  # a fresh Accelerator per case in these workers
    GradientState._reset_state()
    _, _, num_steps, split = CASES[case]
    model, optimizer, loader, scheduler = _objects(case)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=num_steps,
                              dataloader_config=DataLoaderConfiguration(split_batches=split))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    rates = []
    for _epoch in range(EPOCHS):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(_loss(model, batch))
                if accelerator.sync_gradients:
                    rates.append(optimizer.param_groups[0]["lr"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    return {"rates": rates, "last_epoch": scheduler.scheduler.last_epoch}


def both(state: fa.RunState, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return fnaccel_rates(state, case), accelerate_rates(state, case)


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_processes", [1, 2])
def test_a_schedule_sized_from_the_loader_follows_accelerate(num_processes: int) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")
    with World(num_processes, timeout=90) as world:
        for case in CASES:
            for ours, theirs in world.run(both, case):
                assert ours == theirs, f"{case} on {num_processes} process(es)"
    if num_processes == 2:  # the decay reaches its end with the run, not half-way
        assert ours["rates"][-1] < ours["rates"][0] and ours["last_epoch"] >= 22


def one_step_per_update(state: fa.RunState) -> dict[str, Any]:
    return fnaccel_rates(state, "linear", (fa.SchedulerConfiguration(step_per_process=False),))


def test_step_per_process_false_steps_once_per_update(world2: World) -> None:
    """For a schedule sized in updates: one step per update on any number of processes."""
    results = world2.run(one_step_per_update)
    assert all(r == results[0] for r in results)
    assert results[0]["last_epoch"] == len(results[0]["rates"]) == 12  # 6 updates per epoch on each rank


def _prepared(state: fa.RunState) -> tuple[fa.RunState, Any]:
    model, optimizer, loader, scheduler = _objects("linear")
    return fa.prepare(state, model, optimizer, loader, scheduler, loss_fn=_loss,
                      pipeline=fa.compose(fa.ddp())), scheduler


def _run_on(state: fa.RunState, scheduler: Any, rates: list[float], stop_at: int | None = None) -> dict[str, Any]:
    for batch in fa.batches(state, epochs=EPOCHS):
        state, metrics = fa.step(state, batch)
        rates.append(float(metrics["lr"]))
        if len(rates) == stop_at:
            break
    return {"state": state, "rates": rates, "last_epoch": scheduler.last_epoch,
            "weights": [p.detach().tolist() for p in state.model.parameters()]}


def uninterrupted(state: fa.RunState) -> dict[str, Any]:
    result = _run_on(*_prepared(state), [])
    del result["state"]
    return result


def until_saved(state: fa.RunState, directory: str, stop_at: int) -> list[float]:
    result = _run_on(*_prepared(state), [], stop_at)
    fa.save(result["state"], directory)
    return result["rates"]


def from_saved(state: fa.RunState, directory: str, rates: list[float]) -> dict[str, Any]:
    """A restarted script: new objects, a new state, the checkpoint loaded, the run finished."""
    state, scheduler = _prepared(state)
    result = _run_on(fa.load(state, directory), scheduler, rates)
    del result["state"]
    return result


def test_a_resume_mid_run_continues_the_schedule_exactly(world2: World, tmp_path: Path) -> None:
    whole = world2.run(uninterrupted)
    before = world2.run(until_saved, str(tmp_path / "ckpt"), 5)
    again = world2.run(from_saved, str(tmp_path / "ckpt"), before[0])
    assert again == whole
    assert whole[0]["last_epoch"] == 24  # 12 updates, 2 steps each
