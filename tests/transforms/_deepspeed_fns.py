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


def _data() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_SAMPLES, 8, generator=gen)
    y = torch.randn(NUM_SAMPLES, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def _parts(pipeline: fa.Pipeline) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any, fa.Pipeline]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, _data(), pipeline


def pipeline_of(engine: str, precision: str | None, accumulate: int, clip: float | None,
                **settings: Any) -> fa.Pipeline:
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
        return {k: v.detach().float().clone() for k, v in fa.utils.extract_model_from_parallel(
            state.model).state_dict().items()}
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p)  # None where the engine steps the parameter itself (stage 0)
        out[name] = (p.detach().float() if master is None else master).clone()
    return out


def train(state: fa.RunState, engine: str, precision: str | None, accumulate: int, clip: float | None,
          epochs: int = 1, explicit: bool = False, **settings: Any) -> dict[str, Any]:
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
    out = {"weights": full_weights(state), "losses": losses, "norms": norms, "step": state.step,
           "lr": opt.param_groups[0]["lr"]}
    fa.shutdown(state)
    return out


def resume(state: fa.RunState, path: str, stop: int, precision: str | None, **settings: Any) -> dict[str, Any]:
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
            for j in ([0, 1] if i is None else [i]):
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
