"""The scheduler passed to `fa.prepare` advances as Accelerate's `AcceleratedScheduler` does.

A schedule sized as Accelerate's examples size it (``len(train_dataloader) *
num_epochs``, from the loader before `prepare`) ends with the run on any number
of processes: each update advances it once per process the batches are cut
across (once under ``split_batches``), only at accumulation boundaries. Compared
with Accelerate itself, on 1 and 2 real processes; a resume mid-run stays exact;
`SchedulerConfiguration(step_per_process=False)` gives one step per update.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.testing import World
from fnaccel.transforms.contract import EngineRequest
from fnaccel.transforms.kinds import EngineTransform
from fnaccel.transforms.phases import Phase

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
    loader = DataLoader(
        TensorDataset(torch.randn(samples, 3, generator=g), torch.randn(samples, generator=g)),
        batch_size=BATCH_SIZE,
    )
    total = len(loader) * EPOCHS
    if kind == "one_cycle":
        scheduler: Any = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.5, total_steps=total)
    else:  # transformers' get_linear_schedule_with_warmup(optimizer, WARMUP, total)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda s: min((s / WARMUP) if s < WARMUP else 1.0, max(0.0, (total - s) / (total - WARMUP))),
        )
    return model, optimizer, loader, scheduler


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def fnaccel_rates(state: fa.RunState, case: str, handlers: tuple[Any, ...] = ()) -> dict[str, Any]:
    """The rate of every update of the fnaccel port, and where the scheduler ends."""
    _kind, _num_samples, num_steps, split = CASES[case]
    model, optimizer, loader, scheduler = _objects(case)
    kwargs_handlers = {
        type(h).__name__: h for h in (fa.DataLoaderConfiguration(split_batches=split), *handlers)
    }
    state = state.replace(kwargs_handlers=MappingProxyType(kwargs_handlers))
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        scheduler,
        loss_fn=_loss,
        pipeline=fa.compose(fa.ddp(), fa.accumulate(num_steps)),
    )
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
    _kind, _num_samples, num_steps, split = CASES[case]
    model, optimizer, loader, scheduler = _objects(case)
    accelerator = Accelerator(
        cpu=True,
        gradient_accumulation_steps=num_steps,
        dataloader_config=DataLoaderConfiguration(split_batches=split),
    )
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
def test_a_schedule_sized_from_the_loader_follows_accelerate(
    num_processes: int, preload: tuple[str, ...]
) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[test]')")
    with World(num_processes, timeout=90, preload=preload) as world:
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
    return fa.prepare(
        state, model, optimizer, loader, scheduler, loss_fn=_loss, pipeline=fa.compose(fa.ddp())
    ), scheduler


def _run_on(
    state: fa.RunState, scheduler: Any, rates: list[float], stop_at: int | None = None
) -> dict[str, Any]:
    for batch in fa.batches(state, epochs=EPOCHS):
        state, metrics = fa.step(state, batch)
        rates.append(float(metrics["lr"]))
        if len(rates) == stop_at:
            break
    return {
        "state": state,
        "rates": rates,
        "last_epoch": scheduler.last_epoch,
        "weights": [p.detach().tolist() for p in state.model.parameters()],
    }


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


def _drop_empty_groups(request: EngineRequest) -> tuple[nn.Module, torch.optim.Optimizer]:
    """What DeepSpeed's initialize does to the optimizer it is given: empty groups dropped in place."""
    assert request.optimizer is not None
    request.optimizer.param_groups[:] = [g for g in request.optimizer.param_groups if g["params"]]
    return request.model, request.optimizer


def _split_by_decay(model: nn.Module) -> torch.optim.Optimizer:
    """Accelerate's examples' weight-decay split; on a model without biases the second group is empty."""
    no_decay = ("bias", "LayerNorm.weight")
    named = list(model.named_parameters())
    return torch.optim.AdamW(
        [
            {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.01},
            {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
        ],
        lr=0.05,
    )


class _OwnSchedule(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler class of the user's: it may keep per-group lists fnaccel cannot know."""


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "linear_warmup": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 3, 1.0)),
    "cyclic": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, 0.01, 0.05, step_size_up=2, cycle_momentum=False
    ),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, 0.9),
        ],
        milestones=[2],
    ),
    "own": lambda opt: _OwnSchedule(opt, lambda s: 1.0),
}


def _scheduler_first(schedule: str, engine: bool, later: bool = False) -> dict[str, Any]:
    """The literal port: optimizer (one group empty) and scheduler built before fa.prepare."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Tanh(), nn.Linear(4, 1, bias=False))
    optimizer = _split_by_decay(model)
    scheduler = SCHEDULES[schedule](optimizer)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(16, 3, generator=g), torch.randn(16, generator=g)), batch_size=2
    )
    parts = [
        EngineTransform(name="drops_groups", phase=Phase.DATA_PARALLEL, prepare_engine=_drop_empty_groups)
    ]
    state = fa.init(seed=0, cpu=True)
    if later:  # the scheduler built first but passed in a second fa.prepare
        state = fa.prepare(state, model, optimizer, loader, loss_fn=_loss, pipeline=fa.compose(*parts))
        state = fa.prepare(state, scheduler=scheduler)
    else:
        state = fa.prepare(
            state,
            model,
            optimizer,
            loader,
            scheduler,
            loss_fn=_loss,
            pipeline=fa.compose(*parts) if engine else fa.compose(),
        )
    rates = []
    for batch in fa.batches(state, epochs=1):
        state, metrics = fa.step(state, batch)
        rates.append(float(metrics["lr"]))
    return {
        "rates": rates,
        "weights": [p.detach().clone() for p in model.parameters()],
        "groups": len(optimizer.param_groups),
    }


@pytest.mark.parametrize("schedule", ["linear_warmup", "cyclic", "sequential"])
def test_a_scheduler_built_before_an_engine_drops_an_empty_group_follows_it(schedule: str) -> None:
    # Before: the first update raised torch's "zip() argument 2 is longer than argument 1"
    ours = _scheduler_first(schedule, engine=True)
    plain = _scheduler_first(
        schedule, engine=False
    )  # the same script without an engine: the empty group kept
    assert ours["groups"] == 1 and plain["groups"] == 2
    assert ours["rates"] == plain["rates"] and len(set(ours["rates"])) > 1
    assert all(torch.equal(a, b) for a, b in zip(ours["weights"], plain["weights"], strict=True))


def test_a_scheduler_that_cannot_be_realigned_is_refused_with_the_fix() -> None:
    with pytest.raises(
        ValueError,
        match=r"engine changed the optimizer's parameter groups \(2 -> 1\) and the "
        r"scheduler _OwnSchedule.*build the scheduler after fa.prepare",
    ):
        _scheduler_first("own", engine=True)
    with pytest.raises(
        ValueError,
        match="the scheduler has 2 learning rates but the optimizer has 1 parameter "
        "groups.*build the scheduler after fa.prepare",
    ):
        _scheduler_first("linear_warmup", engine=True, later=True)


def warned_when_given_later(state: fa.RunState, handlers: tuple[Any, ...], later: bool) -> list[str]:
    """The scheduler passed after the loader (``later``) or with it; the warnings fa.prepare gave."""
    model, optimizer, loader, scheduler = _objects("linear")
    state = state.replace(kwargs_handlers={type(h).__name__: h for h in handlers})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if later:
            state = fa.prepare(state, model, optimizer, loader, loss_fn=_loss, pipeline=fa.compose(fa.ddp()))
            state = fa.prepare(state, scheduler=scheduler)
        else:
            state = fa.prepare(
                state, model, optimizer, loader, scheduler, loss_fn=_loss, pipeline=fa.compose(fa.ddp())
            )
    fa.shutdown(state)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


def test_a_scheduler_given_after_the_loader_is_warned_of_the_rule(world2: World) -> None:
    # Code written before the rule sized its schedule from len(state.loader), in updates, and passed it in a
    # second fa.prepare: on 2 processes it now ends half-way, which nothing said before
    later = world2.run(warned_when_given_later, (), True)
    assert len(later[0]) == 1 and later[1] == []  # once, by the main process
    assert later[0][0].startswith(
        "SchedulerRuleWarning: fa.prepare: the scheduler given after the loader "
        "advances 2 steps per optimizer update"
    )
    assert "fa.init(kwargs_handlers=[fa.SchedulerConfiguration(step_per_process=False)])" in later[0][0]
    # a rule chosen, or the scheduler given with the loader (sized from it, as Accelerate's examples): silent
    chosen = (fa.SchedulerConfiguration(step_per_process=False),)
    assert world2.run(warned_when_given_later, chosen, True) == [[], []]
    assert world2.run(warned_when_given_later, (), False) == [[], []]
