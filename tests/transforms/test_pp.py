"""fa.pp on 2 gloo processes: each schedule against the unsplit model by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

import fnaccel as fa
from tests.transforms import _pp_jobs as jobs


def _assert_matches(result: dict[str, Any], expected: dict[str, Any]) -> None:
    assert result["params"], "every rank holds a stage"
    for name, value in result["params"].items():
        torch.testing.assert_close(value, expected["params"][name], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        torch.stack(result["losses"]), torch.stack(expected["losses"]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_each_schedule_equals_the_unsplit_model(world2: Any, schedule: str) -> None:
    expected = jobs.reference(4)
    results = world2.run(jobs.train, 4, schedule)
    held = [sorted(r["params"]) for r in results]
    assert sorted(held[0] + held[1]) == sorted(expected["params"]), "the stages cover the model once"
    for result, names in zip(results, held, strict=False):
        assert result["optimizer_holds"] == names and result["step"] == 4
        _assert_matches(result, expected)


def test_clipping_takes_the_norm_over_every_stage_and_accumulation_adds_micro_batches(world2: Any) -> None:
    expected = jobs.reference(4, clip=0.5, accumulate=2)
    for result in world2.run(jobs.train, 4, "1F1B", 2, clip=0.5, accumulate=2, split_points=("5",)):
        assert result["step"] == 2
        _assert_matches(result, expected)
        torch.testing.assert_close(torch.stack(result["norms"]), torch.stack(expected["norms"]))


def test_a_saved_pipeline_resumes_bit_for_bit(world2: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    straight = world2.run(jobs.save_and_continue, path, "Interleaved1F1B")
    resumed = world2.run(jobs.resume, path, "Interleaved1F1B")
    resumed_async = world2.run(jobs.resume, f"{path}-async", "Interleaved1F1B")
    for a, b in zip(straight * 2, resumed + resumed_async, strict=False):
        assert b["step"] == 4 and a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=False))
    assert sorted(p.name for p in (tmp_path / "ckpt" / "sharded").iterdir()) == [
        "metadata.json",
        "rank0.safetensors",
        "rank1.safetensors",
        "state.json",
    ]
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "ckpt-model" / "model.safetensors")
    joined = {**straight[0]["params"], **straight[1]["params"]}
    assert weights.keys() == joined.keys() == dict(jobs.make_model().named_parameters()).keys()
    assert all(torch.equal(weights[k], joined[k]) for k in weights)


def test_another_stage_layout_is_refused_on_resume(world2: Any, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    world2.run(jobs.save_and_continue, path, "Interleaved1F1B")
    with pytest.raises(fa.CheckpointError, match="parameter groups do not match"):
        world2.run(jobs.resume, path, "1F1B")


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("too_many_stages", "10 stages cannot be made from a model of 8 children"),
        ("stages_per_rank", "needs exactly 2 stages, got 3"),
        ("bad_split_point", "must name children after the first, in increasing order"),
        ("not_sequential", "splits an nn.Sequential into stages, got a ModuleList"),
        ("tied", "tied weights across stages"),
        ("microbatches", "divides into num_microbatches=4 equal micro-batches"),
        ("loader", "DataLoaderConfiguration(shard=False)"),
        ("prepare_loss_fn", "drop fa.prepare's loss_fn"),
        ("late_optimizer", "build it from state.model.parameters()"),
        ("no_pp", "pp_size=2 but compose(ddp()) has no transform over its pp dimension; add fa.pp(loss_fn="),
    ],
)
def test_invalid_setups_are_refused_with_the_fix(world2: Any, case: str, message: str) -> None:
    for result in world2.run(jobs.refused, case):
        assert message in result


def test_compose_refuses_data_parallel_beside_pp_with_the_reason() -> None:
    with pytest.raises(ValueError, match="no data-parallel dimension"):
        fa.compose(fa.pp(loss_fn=F.cross_entropy, num_microbatches=2), fa.ddp())
    with pytest.raises(ValueError, match="fa.pp: schedule must be one of"):
        fa.pp(loss_fn=F.cross_entropy, num_microbatches=2, schedule="ZeroBubble")
    with pytest.raises(ValueError, match="num_stages or split_points, not both"):
        fa.pp(loss_fn=F.cross_entropy, num_microbatches=2, num_stages=2, split_points=("3",))
    with pytest.raises(ValueError, match="num_microbatches must be a positive int"):
        fa.pp(loss_fn=F.cross_entropy, num_microbatches=0)


def test_autocast_runs_each_stage_under_it(world2: Any) -> None:
    expected, full_precision = jobs.reference_bf16(3), jobs.reference(3)
    for result in world2.run(jobs.train_bf16, 3):
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected["params"][name], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(
            torch.stack(result["losses"]), torch.stack(expected["losses"]), rtol=1e-3, atol=1e-3
        )
        assert not torch.allclose(
            torch.stack(result["losses"]), torch.stack(full_precision["losses"][:3]), rtol=1e-4, atol=1e-4
        ), "bf16 changed the losses"


@pytest.mark.parametrize("mesh", [False, True], ids=["shard=False", "pp-mesh"])
def test_a_loader_every_stage_reads_whole_trains_like_the_batches(world2: Any, mesh: bool) -> None:
    expected = jobs.reference(3)
    for result in world2.run(jobs.train_from_loader, 3, mesh):
        _assert_matches(result, expected)


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B"])
def test_in_a_world_of_one_the_micro_batches_run_in_order(schedule: str) -> None:
    expected = jobs.reference(4, clip=0.5, accumulate=2)
    result = jobs.train(fa.init(seed=0, cpu=True), 4, schedule, clip=0.5, accumulate=2)
    assert sorted(result["params"]) == sorted(expected["params"]) == result["optimizer_holds"]
    _assert_matches(result, expected)
    torch.testing.assert_close(torch.stack(result["norms"]), torch.stack(expected["norms"]))


def test_in_a_world_of_one_a_pp_checkpoint_is_a_plain_one(tmp_path: Path) -> None:
    straight = jobs.save_and_continue(fa.init(seed=0, cpu=True), str(tmp_path / "ckpt"), "GPipe")
    resumed = jobs.resume(fa.init(seed=0, cpu=True), str(tmp_path / "ckpt"), "GPipe")
    assert all(torch.equal(straight["params"][k], resumed["params"][k]) for k in straight["params"])
    assert (tmp_path / "ckpt" / "model.safetensors").is_file()  # loads into the unsplit model too
    assert not (tmp_path / "ckpt" / "sharded").exists()


def test_pp_refuses_what_its_schedule_cannot_do() -> None:
    pp = fa.pp(loss_fn=F.cross_entropy, num_microbatches=2)
    for other, reason in (
        (fa.ddp(), "no data-parallel dimension"),
        (fa.compile(), "no compile"),
        (fa.grad_scaler(), "no fp16 loss scaling"),
        (fa.local_sgd(4), "local_sgd"),
    ):
        with pytest.raises(ValueError, match=reason):
            fa.compose(pp, other)
    model = jobs.make_model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=fa.compose(pp)
    )
    x, _ = jobs.batches(1)[0]
    with pytest.raises(ValueError, match="call fa.step"):
        fa.backward(state, x.sum())
    assert state.model is not None
    with pytest.raises(TypeError, match="train it with fa.step"):
        state.model(x)
    with pytest.raises(TypeError, match=r"takes a batch \(inputs, target\)"):
        fa.step(state, x)
    model = jobs.make_model()
    items = fa.compose(pp, fa.accumulate(2, normalize="items"))
    with pytest.raises(ValueError, match="normalize='items'"):  # at fa.prepare, by pp's own check
        fa.prepare(
            fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=items
        )
