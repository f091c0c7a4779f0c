"""Functions the 2-rank World runs for tests/transforms/test_deepspeed.py (importable by the workers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fnaccel as fa

NUM_SAMPLES, BATCH = 48, 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float().squeeze(-1), y)


def _data(num_samples: int = NUM_SAMPLES) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_samples, 8, generator=gen)
    y = torch.randn(num_samples, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def _parts(pipeline: fa.Pipeline) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any, fa.Pipeline]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, _data(), pipeline


def pipeline_of(
    engine: str, precision: str | None, accumulate: int, clip: float | None, **settings: Any
) -> fa.Pipeline:
    parts: list[Any] = []
    if precision is not None:
        parts.append(fa.autocast(precision))
    parts.append(fa.ddp() if engine == "ddp" else fa.deepspeed(**settings))
    if accumulate > 1:
        parts.append(fa.accumulate(accumulate))
    if clip is not None:
        parts.append(fa.clip_grad_norm(clip))
    return fa.compose(*parts)


def full_weights(state: fa.RunState) -> dict[str, torch.Tensor]:
    """Every parameter in fp32, gathered under ZeRO-3 (the fp32 masters where DeepSpeed keeps them)."""
    from fnaccel.transforms.deepspeed import deepspeed_engine

    engine = deepspeed_engine(state.model)
    if engine is None:
        return {
            k: v.detach().float().clone()
            for k, v in fa.utils.extract_model_from_parallel(state.model).state_dict().items()
        }
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)  # None where the engine steps the parameter itself (stage 0)
        out[name] = (p.detach().float() if master is None else master).clone()
    return out


def train(
    state: fa.RunState,
    engine: str,
    precision: str | None,
    accumulate: int,
    clip: float | None,
    epochs: int = 1,
    explicit: bool = False,
    **settings: Any,
) -> dict[str, Any]:
    """Train one epoch; return the fp32 weights, the losses and the metrics' keys."""
    model, opt, sched, loader, pipeline = _parts(pipeline_of(engine, precision, accumulate, clip, **settings))
    state = fa.prepare(state, model, opt, loader, sched, pipeline=pipeline, loss_fn=loss_fn)
    losses, norms = [], []
    for batch in fa.batches(state, epochs=epochs):
        if explicit:  # the two halves of fa.step, as a hand-written research step calls them
            state, loss = fa.with_rng(state, loss_fn, state.model, batch)
            state = fa.backward(state, loss)
            state, metrics = fa.apply_gradients(state)
            metrics["loss"] = loss.detach()
        else:
            state, metrics = fa.step(state, batch)
        losses.append(float(metrics["loss"]))
        if "grad_norm" in metrics:
            norms.append(float(metrics["grad_norm"]))
    out = {
        "weights": full_weights(state),
        "losses": losses,
        "norms": norms,
        "step": state.step,
        "lr": opt.param_groups[0]["lr"],
    }
    fa.shutdown(state)
    return out


def resume(
    state: fa.RunState, path: str, stop: int, precision: str | None, **settings: Any
) -> dict[str, Any]:
    """Train 2 epochs straight; then again, saving after ``stop`` batches, and continue a fresh
    state and engine loaded from the checkpoint. Returns both runs' weights and losses."""
    pipeline = pipeline_of("deepspeed", precision, 2, 0.5, **settings)

    def fresh(state: fa.RunState) -> fa.RunState:
        model, opt, sched, loader, _ = _parts(pipeline)
        return fa.prepare(state, model, opt, loader, sched, pipeline=pipeline, loss_fn=loss_fn)

    import dataclasses

    from fnaccel.resources import Resources
    from fnaccel.rng import RNGState
    from fnaccel.state import Lease

    def again(state: fa.RunState) -> fa.RunState:  # another run in this process: its own state and engine
        return dataclasses.replace(state, _lease=Lease(), resources=Resources(), rng=RNGState.seeded(0))

    base = state
    straight, losses = fresh(again(base)), []
    for batch in fa.batches(straight, epochs=2):
        straight, metrics = fa.step(straight, batch)
        losses.append(float(metrics["loss"]))
    expected = full_weights(straight)
    fa.shutdown(straight)

    first, resumed_losses = fresh(again(base)), []
    for i, batch in enumerate(fa.batches(first, epochs=2)):
        if i == stop:
            break
        first, metrics = fa.step(first, batch)
        resumed_losses.append(float(metrics["loss"]))
    fa.save(first, path)
    fa.shutdown(first)
    second = fa.load(fresh(again(base)), path)
    for batch in fa.batches(second, epochs=2):
        second, metrics = fa.step(second, batch)
        resumed_losses.append(float(metrics["loss"]))
    got = full_weights(second)
    fa.save_model(second, path + "-model")
    fa.shutdown(second)
    return {"expected": expected, "got": got, "losses": losses, "resumed": resumed_losses}


def prepare_only(state: fa.RunState, case: str) -> None:
    """Prepare a pipeline the engine cannot run (built here: pipelines do not cross the pipe)."""
    pipeline = {
        "items": lambda: fa.compose(fa.deepspeed(), fa.accumulate(2, normalize="items")),
        "fp16": lambda: fa.compose(fa.autocast(fa.fp16), fa.deepspeed()),
        "no optimizer": lambda: fa.compose(fa.deepspeed()),
        "accumulation": lambda: fa.compose(fa.deepspeed(gradient_accumulation_steps=4), fa.accumulate(2)),
    }[case]()
    with_optimizer = case != "no optimizer"
    model, opt, _, loader, _ = _parts(pipeline)
    fa.prepare(state, model, opt if with_optimizer else None, loader, pipeline=pipeline, loss_fn=loss_fn)


def two_engines(state: fa.RunState, interleaved: bool) -> list[list[float]]:
    """Two models, each with its own pipeline, engine and state (as a GAN's two halves), stepped
    in turn (``interleaved``) or one after the other; their losses."""
    import dataclasses

    from fnaccel.resources import Resources
    from fnaccel.state import Lease

    def start(stage: int) -> fa.RunState:
        model, opt, _, loader, pipeline = _parts(fa.compose(fa.deepspeed(zero_stage=stage)))
        own = dataclasses.replace(state, _lease=Lease(), resources=Resources())
        return fa.prepare(own, model, opt, loader, pipeline=pipeline, loss_fn=loss_fn)

    losses: list[list[float]] = [[], []]
    states = [start(1), start(3)] if interleaved else [start(1)]
    batches = list(fa.batches(states[0], epochs=1))
    for i in range(2) if not interleaved else [None]:
        if i == 1:
            states.append(start(3))
        for batch in batches:
            for j in [0, 1] if i is None else [i]:
                states[j], metrics = fa.step(states[j], batch)
                losses[j].append(float(metrics["loss"]))
    for s in states:
        fa.shutdown(s)
    return losses


def zero3_init(state: fa.RunState) -> dict[str, Any]:
    """A model built under zero.Init (partitioned from the start) trains like one built whole."""
    from fnaccel.transforms.plugins.deepspeed import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True)
    with plugin.zero3_init_context_manager(state):
        torch.manual_seed(0)
        model = Net()
    local = {name: p.numel() for name, p in model.named_parameters()}  # partitioned: empty here
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pipeline = fa.compose(plugin.transform())
    state = fa.prepare(state, model, opt, _data(), sched, pipeline=pipeline, loss_fn=loss_fn)
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
    out = {"local": local, "weights": full_weights(state)}
    fa.shutdown(state)
    return out


class NoBiasNet(nn.Module):
    """Net without biases: Accelerate's weight-decay split leaves its no-decay group empty."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16, bias=False)
        self.second = nn.Linear(16, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _scheduler_first() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Model, optimizer and schedule as Accelerate's DeepSpeed example builds them, before fa.prepare:
    a weight-decay split (one group empty here) and a linear warmup and decay sized from the loader."""
    torch.manual_seed(0)
    model = NoBiasNet()
    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {
            "params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
            "weight_decay": 0.0,
        },
    ]
    optimizer = torch.optim.AdamW(groups, lr=0.05)
    total = len(_data()) * 2  # transformers' get_linear_schedule_with_warmup(optimizer, 2, total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: s / 2 if s < 2 else max(0.0, (total - s) / (total - 2))
    )
    return model, optimizer, scheduler


def literal_port(state: fa.RunState, engine: str) -> dict[str, Any]:
    """Accelerate's DeepSpeed example ported literally (scheduler first) through fa.deepspeed (ZeRO-2) or fa.ddp()."""
    model, optimizer, scheduler = _scheduler_first()
    pipeline = pipeline_of(engine, None, 2, 0.5, zero_stage=2)
    state = fa.prepare(state, model, optimizer, _data(), scheduler, pipeline=pipeline, loss_fn=loss_fn)
    losses, rates = [], []
    for batch in fa.batches(state, epochs=2):
        state, metrics = fa.step(state, batch)
        losses.append(float(metrics["loss"]))
        if "lr" in metrics:  # an update
            rates.append(float(metrics["lr"]))
    out = {
        "weights": full_weights(state),
        "losses": losses,
        "rates": rates,
        "groups": len(optimizer.param_groups),
        "step": state.step,
    }
    fa.shutdown(state)
    return out


def doc_example(state: fa.RunState, code: str, directory: str) -> dict[str, Any]:
    """Run docs/deepspeed.md's example as written, at tiny size: the names it leaves to the reader
    bound to small real ones (the scheduler built before fa.prepare), its files written in
    ``directory``; ``fa.init`` gives this world's state."""
    import os
    import types

    model, optimizer, scheduler = _scheduler_first()
    fa_here = types.SimpleNamespace(**{name: getattr(fa, name) for name in fa.__all__})
    fa_here.init = lambda **_: state
    # 8 batches per rank and epoch: the example's save after 3 epochs falls on an update of its accumulation(4)
    names = {
        "fa": fa_here,
        "model": model,
        "optimizer": optimizer,
        "loader": _data(64),
        "scheduler": scheduler,
        "loss_fn": loss_fn,
    }
    here = os.getcwd()
    os.chdir(directory)
    try:
        exec(code, names)
    finally:
        os.chdir(here)
    out = {"step": names["state"].step, "groups": len(optimizer.param_groups)}
    fa.shutdown(names["state"])
    return out


def bf16_overflow(state: fa.RunState) -> dict[str, Any]:
    """bf16 ZeRO-2 (DeepSpeed 0.19.8 checks bf16 gradients by default), the second update's inputs inf:
    what fa.step reported, where the scheduler stood after each update, and whether the
    skipped update moved a weight."""
    model, opt, sched, loader, pipeline = _parts(pipeline_of("deepspeed", "bf16", 1, None, zero_stage=2))
    state = fa.prepare(state, model, opt, loader, sched, pipeline=pipeline, loss_fn=loss_fn)
    skipped, scheduler_epochs, moved = [], [], False
    for index, batch in enumerate(fa.batches(state)):
        if index == 1:
            batch = (torch.full_like(batch[0], float("inf")), batch[1])
        before = full_weights(state)
        state, metrics = fa.step(state, batch)
        skipped.append(bool(metrics.get("skipped", False)))
        scheduler_epochs.append(sched.last_epoch)
        if index == 1:
            after = full_weights(state)
            moved = any(not torch.equal(after[name], weight) for name, weight in before.items())
        if index == 2:
            break
    out = {"skipped": skipped, "moved": moved, "scheduler_epochs": scheduler_epochs}
    fa.shutdown(state)
    return out
