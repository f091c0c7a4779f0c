"""Functions the pipeline-parallel tests run on every rank of a World."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa
from fnaccel.dist import data_parallel

BATCH = 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Linear(16, 4),
    )


def batches(num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(num)
    ]


def reference(num: int, *, clip: float | None = None, accumulate: int = 1) -> dict[str, Any]:
    """The unsplit model in one process, by hand, on the same batches."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, norms = [], []
    data = batches(num)
    for i in range(0, num, accumulate):
        for x, y in data[i : i + accumulate]:
            loss = F.cross_entropy(model(x), y)
            (loss / accumulate).backward()
            losses.append(loss.detach())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach() for k, v in model.named_parameters()}, "losses": losses, "norms": norms}


def train(
    state: fa.RunState,
    num: int,
    schedule: str,
    num_microbatches: int = 4,
    *,
    clip: float | None = None,
    accumulate: int = 1,
    **split: Any,
) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    parts = [fa.pp(loss_fn=F.cross_entropy, num_microbatches=num_microbatches, schedule=schedule, **split)]
    if accumulate > 1:
        parts.append(fa.accumulate(accumulate))
    if clip is not None:
        parts.append(fa.clip_grad_norm(clip))
    state = fa.prepare(state, model, opt, pipeline=fa.compose(*parts))
    losses, norms = [], []
    for batch in batches(num):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"])
        if "grad_norm" in metrics:
            norms.append(metrics["grad_norm"])
    held = {
        name
        for group in opt.param_groups
        for name, p in state.model.named_parameters()
        if any(p is q for q in group["params"])
    }
    return {
        "params": {k: v.detach() for k, v in state.model.named_parameters()},
        "losses": losses,
        "norms": norms,
        "optimizer_holds": sorted(held),
        "step": state.step,
    }


def _prepared(state: fa.RunState, schedule: str) -> tuple[fa.RunState, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    pipeline = fa.compose(
        fa.pp(loss_fn=F.cross_entropy, num_microbatches=2, schedule=schedule), fa.clip_grad_norm(0.5)
    )
    return fa.prepare(state, model, opt, pipeline=pipeline), opt


def save_and_continue(state: fa.RunState, path: str, schedule: str) -> dict[str, Any]:
    """Four steps, saving after two; the parameters and losses of the last two."""
    state, _ = _prepared(state, schedule)
    data = batches(4)
    for batch in data[:2]:
        state, _ = fa.step(state, batch)
    fa.save(state, path)
    fa.save(state, f"{path}-async", blocking=False).wait()  # a background save over its own group
    losses = []
    for batch in data[2:]:
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"])
    fa.save_model(state, f"{path}-model")
    return {"params": {k: v.detach().clone() for k, v in state.model.named_parameters()}, "losses": losses}


def resume(state: fa.RunState, path: str, schedule: str) -> dict[str, Any]:
    """A fresh run of the same layout, loaded from the checkpoint, for the last two steps."""
    state, _ = _prepared(state, schedule)
    state = fa.load(state, path)
    losses = []
    for batch in batches(4)[2:]:
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"])
    return {
        "params": {k: v.detach().clone() for k, v in state.model.named_parameters()},
        "losses": losses,
        "step": state.step,
    }


def refused(state: fa.RunState, case: str) -> str:
    """The error a bad pipeline-parallel setup gets (the same on every rank)."""
    model: Any = make_model()
    pp = {"loss_fn": F.cross_entropy, "num_microbatches": 4}
    if case == "too_many_stages":
        pp["num_stages"] = 10
        pp["schedule"] = "Interleaved1F1B"
    elif case == "stages_per_rank":
        pp["num_stages"] = 3
    elif case == "bad_split_point":
        pp["split_points"] = ("5", "2")
        pp["schedule"] = "Interleaved1F1B"
    elif case == "not_sequential":
        model = nn.ModuleList(list(model))
    elif case == "tied":
        model[2] = model[6]  # stage 0 holds children 0-3, stage 1 children 4-7
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = batches(1)[0]
    if case == "no_pp":  # a mesh of 2 stages and a pipeline without fa.pp: each rank would train it all
        run = fa.init(cpu=True, parallelism=fa.ParallelismConfig(pp_size=2))
        try:
            fa.prepare(run, model, opt)
        except ValueError as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            fa.shutdown(run)
        return "accepted"
    try:
        if case == "microbatches":
            batch = (batch[0][:6], batch[1][:6])
        if case == "loader":
            data = torch.utils.data.TensorDataset(*batch)
            fa.prepare(
                state,
                model,
                opt,
                torch.utils.data.DataLoader(data, batch_size=4),
                pipeline=fa.compose(fa.pp(**pp)),
            )
        elif case == "late_optimizer":
            state = fa.prepare(state, model, pipeline=fa.compose(fa.pp(**pp)))
            fa.prepare(state, optimizer=opt)
        elif case == "prepare_loss_fn":
            fa.prepare(state, model, opt, pipeline=fa.compose(fa.pp(**pp)), loss_fn=lambda m, b: m(b))
        else:
            state = fa.prepare(state, model, opt, pipeline=fa.compose(fa.pp(**pp)))
            fa.step(state, batch)
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def reference_bf16(num: int) -> dict[str, Any]:
    """The unsplit model by hand, each half (fa.pp's two stages) under bf16 autocast, its output in fp32."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(num):
        h = x
        for part in (model[:4], model[4:]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = part(h)
            h = h.float()
        loss = F.cross_entropy(h, y)
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach() for k, v in model.named_parameters()}, "losses": losses}


def train_bf16(state: fa.RunState, num: int) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    pipeline = fa.compose(fa.autocast(fa.bf16), fa.pp(loss_fn=F.cross_entropy, num_microbatches=2))
    state = fa.prepare(state, model, opt, pipeline=pipeline)
    losses = []
    for batch in batches(num):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"])
    return {"params": {k: v.detach() for k, v in state.model.named_parameters()}, "losses": losses}


def train_from_loader(state: fa.RunState, num: int, mesh: bool = False) -> dict[str, Any]:
    """fa.batches over a loader every stage reads whole: shard=False, or a mesh whose
    only dimension is pp (the data-parallel size is then 1)."""
    from dataclasses import replace

    if mesh:
        state = fa.init(cpu=True, parallelism=fa.ParallelismConfig(pp_size=state.dist.num_processes))
        try:
            assert data_parallel(state.dist) == (0, 1)
            return _train_from_loader(state, num)
        finally:
            fa.shutdown(state)
    handlers = {**state.kwargs_handlers, "DataLoaderConfiguration": fa.DataLoaderConfiguration(shard=False)}
    return _train_from_loader(replace(state, kwargs_handlers=handlers), num)


def _train_from_loader(state: fa.RunState, num: int) -> dict[str, Any]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = batches(num)
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH)
    pp = fa.pp(loss_fn=F.cross_entropy, num_microbatches=4, schedule="GPipe")
    state = fa.prepare(state, model, opt, loader, pipeline=fa.compose(pp))
    losses = []
    for batch in fa.batches(state, epochs=1):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"])
    return {"params": {k: v.detach() for k, v in state.model.named_parameters()}, "losses": losses}
