"""compose: one transform record for collectives (and, later, training transforms)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.transforms import CallInfo, Collective, Pipeline, Transform


def test_pipelines_print_as_the_code_that_built_them_and_compare_by_value() -> None:
    collect = fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    assert repr(collect) == "compose(pad_across_processes(dim=1, pad_index=-100), gather())"
    assert collect == fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    assert collect != fa.compose(fa.pad_across_processes(dim=0, pad_index=-100), fa.gather())
    assert repr(fa.reduce("sum", scale=0.5)) == "reduce(reduction='sum', scale=0.5)"
    assert collect.names == ("pad_across_processes", "gather")


def test_nested_pipelines_are_flattened() -> None:
    inner = fa.compose(fa.pad_across_processes(dim=1))
    assert fa.compose(inner, fa.gather()).transforms == (fa.pad_across_processes(dim=1), fa.gather())


def test_a_nested_pipeline_is_merged_where_the_order_rules_put_each_transform() -> None:
    """compose(fa.default_pipeline(state), fa.accumulate(4)) adds one transform to what the
    launch asked for, even where the launch's pipeline holds a later one (compile)."""
    launch = fa.compose(fa.autocast(fa.bf16), fa.ddp(), fa.compile())
    merged = fa.compose(launch, fa.accumulate(4), fa.clip_grad_norm(1.0))
    assert merged.names == ("autocast", "ddp", "accumulate", "clip_grad_norm", "compile")
    assert fa.compose(fa.accumulate(4), launch).names == ("autocast", "ddp", "accumulate", "compile")
    assert fa.compose(launch) == launch
    # the transforms written out are still checked in the order written
    with pytest.raises(ValueError, match=r"accumulate\(num_steps=4\) must come before clip_grad_norm"):
        fa.compose(launch, fa.clip_grad_norm(1.0), fa.accumulate(4))
    # and the merged result is validated whole: duplicates and conflicts across the nesting
    with pytest.raises(
        ValueError, match=r"ddp\(\) and ddp\(find_unused_parameters=True\) both appear; keep one ddp"
    ):
        fa.compose(launch, fa.ddp(find_unused=True))
    with pytest.raises(ValueError, match=r"ddp\(\) and fsdp\(\) cannot be combined"):
        fa.compose(launch, fa.fsdp())


def test_duplicates_are_rejected_naming_both() -> None:
    with pytest.raises(ValueError, match=r"gather\(\) and gather\(\) both appear; keep one gather"):
        fa.compose(fa.gather(), fa.gather())


def test_conflicting_collectives_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"gather\(\) and reduce\(reduction='mean'\) cannot be combined"):
        fa.compose(fa.gather(), fa.reduce())


def test_wrong_order_names_the_fix() -> None:
    with pytest.raises(ValueError) as info:
        fa.compose(fa.gather(), fa.pad_across_processes(dim=1))
    assert "pad_across_processes(dim=1) must come before gather()" in str(info.value)
    assert "write compose(pad_across_processes(dim=1), gather())" in str(info.value)


def test_a_factory_passed_uncalled_is_explained() -> None:
    with pytest.raises(TypeError, match="forget to call the factory"):
        fa.compose(fa.gather)  # type: ignore[arg-type]


def test_bad_factory_arguments() -> None:
    with pytest.raises(ValueError, match="unknown reduction 'median'"):
        fa.reduce("median")  # type: ignore[arg-type]
    assert fa.reduce("max")(fa.init(cpu=True), torch.tensor(2.0)) == 2.0


def test_states_are_keyed_by_name() -> None:
    counter = Transform(name="counter", phase=5, init=lambda ctx: {"count": ctx.num_processes})
    pipeline = fa.compose(counter, fa.clip_grad_norm(1.0))
    assert dict(pipeline.init(fa.init(cpu=True))) == {"counter": {"count": 1}}


def test_a_pipeline_without_collective_steps_cannot_be_applied() -> None:
    stateful_only = Pipeline((Transform(name="noop"),))
    with pytest.raises(TypeError, match="no collective steps"):
        stateful_only(fa.init(cpu=True), torch.ones(1))


def test_calls_pass_information_down_the_chain() -> None:
    seen: list[CallInfo] = []

    def record(ctx: fa.DistContext, tree: object, call: CallInfo) -> tuple[object, CallInfo]:
        seen.append(call)
        return tree, call

    spy = Collective(name="spy", phase=15, apply=record)
    out = fa.compose(fa.pad_across_processes(dim=0), spy, fa.gather_for_metrics())(
        fa.init(cpu=True), torch.arange(3), num_valid=2
    )
    assert torch.equal(out, torch.arange(2))
    assert seen[0].num_valid == 2


def test_a_single_transform_is_callable() -> None:
    state = fa.init(cpu=True)
    assert torch.equal(fa.gather()(state, torch.tensor(2.0)), torch.tensor([2.0]))
    assert torch.equal(fa.reduce("sum", scale=3.0)(state, torch.tensor(2.0)), torch.tensor(6.0))
    assert fa.broadcast_object_list(0)(state, ["a"]) == ["a"]
    assert fa.gather_object()(state, ["a", "b"]) == ["a", "b"]


def test_training_transforms_and_collectives_do_not_mix() -> None:
    with pytest.raises(ValueError, match="autocast.* is a training transform and gather\\(\\) a collective"):
        fa.compose(fa.autocast(fa.bf16), fa.gather())


def _linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(2, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean() * 100  # large enough for clip_grad_norm(1.0) to clip


@pytest.mark.parametrize(
    "bare",
    [fa.ddp, lambda: fa.clip_grad_norm(1.0), lambda: fa.accumulate(2)],
    ids=["ddp", "clip_grad_norm", "accumulate"],
)
def test_a_bare_transform_is_a_pipeline_of_one(bare: Any) -> None:
    model, opt = _linear()
    state = fa.prepare(fa.init(seed=0, cpu=True), model, opt, pipeline=bare(), loss_fn=_loss)
    assert state.pipeline == fa.compose(bare())
    state, _ = fa.step(state, torch.ones(4, 2))
    assert state.micro_step == 1


@pytest.mark.parametrize(
    "value",
    [[fa.ddp()], (fa.ddp(), fa.accumulate(2)), fa.ddp, "ddp"],
    ids=["list", "tuple", "function", "string"],
)
def test_a_pipeline_that_is_not_one_names_compose(value: Any) -> None:
    model, opt = _linear()
    with pytest.raises(
        TypeError,
        match=r"pipeline must be a transform or fa\.compose\(\.\.\.\) of transforms, "
        f"got {type(value).__name__} .*write pipeline=fa.compose",
    ):
        fa.prepare(fa.init(seed=0, cpu=True), model, opt, pipeline=value, loss_fn=_loss)
