"""The kinds of training transform: each hook on the kind that has it, and the engine, `EngineTransform`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.transforms import EngineTransform, StepTransform, Transform
from fnaccel.transforms.contract import EngineRequest, PipelineView
from fnaccel.transforms.declared import Capability
from fnaccel.transforms.phases import Phase


def test_only_an_engine_transform_takes_engine_hooks() -> None:
    for engine_only in ("prepare_engine", "backward", "takes_over", "micro_steps"):
        with pytest.raises(TypeError, match=engine_only):
            Transform(name="mine", **{engine_only: None})
    with pytest.raises(TypeError, match="prepare_engine"):
        EngineTransform(name="engine")  # type: ignore[call-arg]  # an engine is built by its hook


def test_deepspeed_is_the_pipelines_engine_and_prints_as_its_factory_call() -> None:
    engine = fa.deepspeed(zero_stage=3, gradient_accumulation_steps=4)
    assert isinstance(engine, EngineTransform)
    assert repr(engine) == "deepspeed(gradient_accumulation_steps=4, zero_stage=3)"
    assert engine.micro_steps == 4 and engine.takes_over == {Capability.CLIPS_GRADIENTS}
    assert fa.compose(fa.autocast(fa.bf16), engine, fa.clip_grad_norm(1.0)).engine is engine
    assert fa.compose(fa.autocast(fa.bf16), fa.ddp()).engine is None
    assert engine == fa.deepspeed(zero_stage=3, gradient_accumulation_steps=4)
    assert engine != fa.deepspeed(zero_stage=3, gradient_accumulation_steps=2)


class _Marked(nn.Module):
    """What a prepare_model hook wraps the model in (the engine must receive it)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def test_an_engine_of_ones_own_is_built_by_prepare_and_steps_as_it_declares() -> None:
    """`fa.prepare` hands the engine the model after every prepare_model hook; `fa.step` runs the
    engine's backward, its own accumulation (no `fa.accumulate`), and skips the before_update of a
    transform declaring a capability the engine takes over; the update equals a hand-written loop."""
    seen: dict[str, Any] = {"backwards": 0, "clipped": 0}

    def prepare_engine(request: EngineRequest) -> tuple[nn.Module, torch.optim.Optimizer]:
        seen["model"], seen["state"] = request.model, request.state
        assert request.optimizer is not None
        return request.model, request.optimizer

    def backward(loss: torch.Tensor, state: Any) -> None:
        seen["backwards"] += 1
        loss.backward()

    def step(optimizer: torch.optim.Optimizer, state: Any) -> dict[str, torch.Tensor]:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # an engine with its own backward owns the gradients
        return {}

    def clip(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> dict[str, torch.Tensor]:
        seen["clipped"] += 1
        return {}

    engine = EngineTransform(
        name="engine",
        phase=Phase.DATA_PARALLEL,
        init=lambda ctx: "engine state",
        optimizer_step=step,
        prepare_engine=prepare_engine,
        backward=backward,
        micro_steps=2,
        takes_over=frozenset({Capability.CLIPS_GRADIENTS}),
    )
    wrap = Transform(
        name="wrap",
        phase=Phase.CHECKPOINT_ACTIVATIONS,
        prepare_model=lambda ctx, model, state: _Marked(model),
    )
    clipper = StepTransform(
        name="clipper",
        phase=Phase.CLIP,
        before_update=clip,
        capabilities=frozenset({Capability.CLIPS_GRADIENTS}),
    )
    torch.manual_seed(0)
    model, reference = nn.Linear(3, 1), nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline=fa.compose(wrap, engine, clipper),
        loss_fn=_loss,
    )
    assert isinstance(seen["model"], _Marked) and seen["model"].inner is model
    assert seen["state"] == "engine state" and state.model is seen["model"]

    batches = [torch.randn(4, 3) for _ in range(4)]
    steps = []
    for batch in batches:
        state, _ = fa.step(state, batch)
        steps.append(state.step)
    assert steps == [0, 1, 1, 2] and seen["backwards"] == 4 and seen["clipped"] == 0

    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        (_loss(reference, batch) / 2).backward()
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    assert torch.equal(model.weight, reference.weight) and torch.equal(model.bias, reference.bias)


def test_a_pipeline_holds_one_engine() -> None:
    def prepare_engine(request: EngineRequest) -> tuple[nn.Module, torch.optim.Optimizer]:
        raise AssertionError("not built")

    mine = EngineTransform(name="mine", phase=Phase.DATA_PARALLEL, prepare_engine=prepare_engine)
    with pytest.raises(
        ValueError,
        match=r"compose: deepspeed\(\) and mine\(\) each hand the model and "
        r"optimizer to an engine of their own; keep one",
    ):
        fa.compose(fa.deepspeed(), mine)


def test_the_pipelines_accumulation_wins_over_the_engines_default() -> None:
    def prepare_engine(request: EngineRequest) -> tuple[nn.Module, torch.optim.Optimizer]:
        assert request.optimizer is not None
        return request.model, request.optimizer

    engine = EngineTransform(name="engine", phase=Phase.DATA_PARALLEL, prepare_engine=prepare_engine)
    model = nn.Linear(3, 1)
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        pipeline=fa.compose(engine, fa.accumulate(3)),
        loss_fn=_loss,
    )
    assert state.plan is not None and state.plan.micro_steps == 3


def test_a_transforms_check_gets_what_each_prepare_call_passes() -> None:
    """The check hook receives one `PrepareRequest` (it saw only the pipeline and the context),
    so a transform can own its whole contract: the loss function, the loader's sharding, the
    optimizer's parameters and the models are there."""
    seen: list[fa.PrepareRequest] = []

    def check(request: fa.PrepareRequest) -> PipelineView:
        seen.append(request)
        return request.pipeline

    mine = Transform(name="mine", check=check)
    model = nn.Linear(2, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 2)), batch_size=2)
    state = fa.prepare(fa.init(seed=0, cpu=True), model, pipeline=fa.compose(mine), loss_fn=_loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = fa.prepare(state, optimizer=optimizer, loader=loader)
    first, second = seen
    assert first.pipeline == fa.compose(mine) and first.ctx.num_processes == 1
    assert first.loss_fn_given and first.model is model and first.prepared_model is None
    assert first.optimizer_params is None and first.loader_shards is None
    assert not second.loss_fn_given and second.model is None and second.prepared_model is state.model
    assert second.optimizer_params == tuple(model.parameters()) and second.loader_shards == 1


PACKAGE = Path(fa.__file__).parent
# each rule of fa.pp and fa.fsdp, by a piece of its message, and the one module that holds it
RULES = {
    "drop fa.prepare's loss_fn": "transforms/pipelining.py",
    "every stage of fa.pp must read the same batches": "transforms/pipelining.py",
    "is not supported under fa.pp": "transforms/pipelining.py",
    "data-parallel replicas is not built": "transforms/pipelining.py",
    "the optimizer holds parameters that are not the prepared model's": "transforms/parallel.py",
}


@pytest.mark.parametrize("message", sorted(RULES))
def test_pp_and_fsdp_rules_live_in_their_own_transform_only(message: str) -> None:
    """fa.prepare's module held pp's loss, loader and optimizer rules and fsdp's optimizer rule
    (and the first fa.step pp's accumulation rule); each is now in one place, its transform."""
    holders = sorted(
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if message in path.read_text()
    )
    assert holders == [RULES[message]], holders
