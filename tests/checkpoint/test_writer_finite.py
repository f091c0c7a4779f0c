"""No checkpoint with NaN or inf replaces a finite one: `fa.save` refuses non-finite
parameters and optimizer moments (on every rank, agreed before anyone writes) unless
``allow_nonfinite=True``, whose checkpoint is marked so that `fa.latest_checkpoint`
prefers any finite one to it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.writer import first_nonfinite

NAN, INF = float("nan"), float("inf")


def _run(state: fa.RunState | None = None, pipeline: fa.Pipeline | None = None) -> fa.RunState:
    """A small model after one AdamW update (its moments exist)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    state = fa.prepare(
        state or fa.init(seed=0, cpu=True),
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        pipeline=pipeline or fa.compose(),
        loss_fn=lambda m, b: m(b).pow(2).mean(),
    )
    state, _ = fa.step(state, torch.randn(4, 4, generator=torch.Generator().manual_seed(state.dist.rank)))
    return state


def _linear(state: fa.RunState, index: int) -> nn.Linear:
    """Layer ``index`` of the run's model, as built in `_run`."""
    assert isinstance(state.model, nn.Sequential)
    layer = state.model[index]
    assert isinstance(layer, nn.Linear)
    return layer


def _finite(checkpoint: Path) -> bool:
    value = json.loads((checkpoint / "fnaccel.json").read_text())["finite"]
    assert isinstance(value, bool)
    return value


def test_a_nan_parameter_or_an_inf_moment_is_refused_naming_it_and_the_escape(tmp_path: Path) -> None:
    state = _run()
    fa.save(state, tmp_path / "good")
    assert _finite(tmp_path / "good")
    optimizer = state.optimizer
    assert optimizer is not None
    with torch.no_grad():
        _linear(state, 2).bias[1] = NAN
    with pytest.raises(
        fa.CheckpointError,
        match=r"fa\.save: parameter '2\.bias' holds NaN or inf values; "
        r"nothing was written.*allow_nonfinite=True",
    ):
        fa.save(state, tmp_path / "good")
    assert _finite(tmp_path / "good")  # the finite checkpoint is still there, untouched
    with pytest.raises(fa.CheckpointError, match="parameter '2.bias'"):
        fa.save(state, tmp_path / "new")
    assert not (tmp_path / "new").exists()
    with torch.no_grad():
        _linear(state, 2).bias[1] = 0.0
        optimizer.state[_linear(state, 0).weight]["exp_avg_sq"][3, 1] = INF
    with pytest.raises(
        fa.CheckpointError, match=r"optimizer state 'exp_avg_sq' of '0\.weight' holds NaN or inf"
    ):
        fa.save(state, tmp_path / "new", blocking=False)
    assert not (tmp_path / "new").exists()
    with pytest.raises(TypeError, match="allow_nonfinite must be True or False, got 1"):
        fa.save(state, tmp_path / "new", allow_nonfinite=1)  # type: ignore[arg-type]


def test_large_finite_values_are_not_mistaken_for_overflow(tmp_path: Path) -> None:
    """The fast check's sum of squares overflows float32 here; the exact check lets it through."""
    state = _run()
    with torch.no_grad():
        _linear(state, 0).weight.fill_(3e38)
    assert not torch.isfinite(torch.stack(torch._foreach_norm([_linear(state, 0).weight], 2))).all()
    assert first_nonfinite(state) is None
    fa.save(state, tmp_path / "large")
    assert _finite(tmp_path / "large")


def test_allow_nonfinite_writes_a_marked_checkpoint_that_latest_passes_over(tmp_path: Path) -> None:
    state = _run()
    fa.save(state, tmp_path / "ckpt" / "step_1")
    state, _ = fa.step(state, torch.ones(4, 4))
    with torch.no_grad():
        _linear(state, 0).weight[0, 0] = NAN
    fa.save(state, tmp_path / "ckpt" / "step_2", allow_nonfinite=True)
    assert not _finite(tmp_path / "ckpt" / "step_2")
    with pytest.warns(
        fa.SkippedCheckpointWarning,
        match=r"step_2 \(step 2\): it was saved with NaN or inf values "
        r".*the newest finite checkpoint, .*step_1, comes first",
    ):
        assert fa.latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_1"
    # a finite one that does not verify: the non-finite one is all there is, and it says so
    (tmp_path / "ckpt" / "step_1" / "model.safetensors").write_bytes(b"broken")
    with pytest.warns(fa.SkippedCheckpointWarning) as caught:
        assert fa.latest_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "step_2"
    messages = [str(w.message) for w in caught]
    assert any("step_1" in m and "model.safetensors" in m for m in messages), messages
    assert any(
        m.startswith("fa.latest_checkpoint: no finite checkpoint holds; ") and "step_2 is saved with NaN" in m
        for m in messages
    ), messages
    # the non-finite checkpoint loads (to inspect the run), NaN included
    loaded = fa.load(_run(), tmp_path / "ckpt" / "step_2")
    assert torch.isnan(_linear(loaded, 0).weight[0, 0])
    # the mark records what the values are, not the flag: a finite state saved with it is finite
    fa.save(_run(), tmp_path / "finite", allow_nonfinite=True)
    assert _finite(tmp_path / "finite")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fa.latest_checkpoint(tmp_path / "finite") == tmp_path / "finite"


def plant_nan_on_rank_1(state: fa.RunState, root: str, sharded: bool) -> str:
    """Runs on each rank: a NaN in rank 1's copy (ddp) or shard (fsdp) of one parameter only."""
    run = _run(state, fa.compose(fa.fsdp() if sharded else fa.ddp()))
    if run.dist.rank == 1:
        assert run.optimizer is not None
        param = run.optimizer.param_groups[0]["params"][2]  # "2.weight"
        with torch.no_grad():
            local = param.to_local() if sharded else param
            local.view(-1)[0] = NAN
    try:
        fa.save(run, f"{root}/{'fsdp' if sharded else 'ddp'}")
    except fa.CheckpointError as exc:
        return str(exc)
    return "saved"


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_every_rank_refuses_a_nan_only_one_rank_holds(world2: Any, tmp_path: Path, sharded: bool) -> None:
    outcomes = world2.run(plant_nan_on_rank_1, str(tmp_path), sharded)
    assert outcomes[0] == outcomes[1], outcomes  # agreed in the save's one exchange: nobody wrote
    assert outcomes[0].startswith("fa.save: parameter '2.weight' holds NaN or inf values on rank 1; "), (
        outcomes[0]
    )
    assert not list(tmp_path.iterdir())
