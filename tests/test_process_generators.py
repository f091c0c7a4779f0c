"""No fnaccel call moves the process's generators (DESIGN principle 2).

Python's `random`, torch's CPU generator (and each CUDA device's) and NumPy's
global generator are exactly where the user's code left them after every call,
while the run's own draws (dropout in the step) still come from the run's
states. One test per call; then the patterns that depend on it: code between
steps draws its seeded values, a cross-validation loop builds each fold's
model from the process generator, two interleaved runs equal each alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def _snapshot() -> tuple[Any, ...]:
    cuda = tuple(s.tolist() for s in torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
    return random.getstate(), torch.get_rng_state().tolist(), np.random.get_state()[1].tolist(), cuda


def _seed_process(seed: int = 123) -> None:
    random.seed(seed), np.random.seed(seed + 1), torch.manual_seed(seed + 2)


def _model_from_process() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 1))


def _model() -> nn.Module:
    """The same weights every time, without moving the process generator (the test's own draws
    would otherwise hide fnaccel's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _model_from_process()


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def _loader(num_workers: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, generator=g))
    return DataLoader(data, batch_size=4, shuffle=True, num_workers=num_workers)


def _prepared(seed: int | None = 0, **kw: Any) -> fa.RunState:
    model = _model()
    return fa.prepare(
        fa.init(seed=seed, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _loader(**kw),
        loss_fn=_loss,
        pipeline=fa.compose(),
    )


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 4, generator=g), torch.randn(4, generator=g)


def _evaluate_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return nn.functional.dropout(model(batch[0]), 0.5, training=True)  # draws, under the run's copy


def _hand_backward(state: fa.RunState) -> fa.RunState:
    state, loss = fa.with_rng(state, _loss, state.model, _batch())
    _seed_process()
    before = _snapshot()
    state = fa.backward(state, loss)
    assert _snapshot() == before
    return state


def _call_apply_gradients(state: fa.RunState, _: Path) -> None:
    state = _hand_backward(state.replace(step_rng_types=("torch", "cuda", "python", "numpy")))
    _seed_process()
    before = _snapshot()
    fa.apply_gradients(state)
    assert _snapshot() == before


def _call_step_all_kinds(state: fa.RunState, _: Path) -> None:
    fa.step(state.replace(step_rng_types=("torch", "cuda", "python", "numpy")), _batch())


def _call_load(state: fa.RunState, tmp: Path) -> None:
    state, _ = fa.step(state, _batch())
    fa.save(state, tmp / "ckpt")
    _seed_process()
    before = _snapshot()
    fa.load(_prepared(), tmp / "ckpt")
    assert _snapshot() == before


def _call_prepare_piecewise(_: fa.RunState, __: Path) -> None:
    model = _model()
    state = fa.prepare(fa.init(seed=0, cpu=True), model, pipeline=fa.compose())
    state = fa.prepare(state, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    fa.prepare(state, loader=_loader())


def _call_batches(state: fa.RunState, _: Path) -> None:
    """Two epochs read (each builds its order and its iterator), no step taken."""
    assert len(list(fa.batches(state, epochs=1))) == 6
    assert len(list(fa.batches(state.replace(data_position=fa.DataPosition(epoch=1))))) == 6


def _call_batches_with_workers(_: fa.RunState, tmp: Path) -> None:
    state = _prepared(num_workers=1)
    _seed_process()
    before = _snapshot()
    _call_batches(state, tmp)
    assert _snapshot() == before


# Each call runs on a prepared state (seed 0, a dropout model, a shuffled loader) between two
# snapshots of the process generators; a call that needs setting up first checks its own window.
CALLS: dict[str, Callable[[fa.RunState, Path], Any]] = {
    "init": lambda s, _: fa.init(seed=5, cpu=True),
    "init_without_seed": lambda s, _: fa.init(cpu=True),
    "prepare": lambda s, _: _prepared(),
    "prepare_with_workers": lambda s, _: _prepared(num_workers=1),
    "prepare_in_three_calls": _call_prepare_piecewise,
    "step": lambda s, _: fa.step(s, _batch()),
    "step_all_generators": _call_step_all_kinds,
    "backward": lambda s, _: _hand_backward(s),
    "apply_gradients": _call_apply_gradients,
    "with_rng": lambda s, _: fa.with_rng(s, torch.rand, 3),
    "evaluate": lambda s, _: fa.evaluate(s, _loader(), _evaluate_fn),
    "eval_batches": lambda s, _: list(fa.eval_batches(s, _loader(num_workers=1))),
    "batches": _call_batches,
    "batches_with_workers": _call_batches_with_workers,
    "save": lambda s, tmp: fa.save(s, tmp / "ckpt"),
    "load": _call_load,
    "save_model": lambda s, tmp: fa.save_model(s, tmp / "model"),
    "set_seed_of_a_state": lambda s, _: fa.set_seed(s, 7, device_specific=True),
    "synchronize_rng_states": lambda s, _: fa.synchronize_rng_states(s),
    "shutdown": lambda s, _: fa.shutdown(s),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_leaves_the_process_generators_where_they_were(call: str, tmp_path: Path) -> None:
    state = _prepared()
    _seed_process()
    before = _snapshot()
    CALLS[call](state, tmp_path)
    assert _snapshot() == before, f"fa.{call} moved the process's generators"


@pytest.mark.parametrize("kinds", [None, ("torch", "cuda", "python", "numpy")], ids=["default", "all"])
def test_a_step_that_raises_gives_the_process_its_generators_back(kinds: tuple[str, ...] | None) -> None:
    def failing(model: nn.Module, batch: Any) -> torch.Tensor:
        torch.rand(5)  # the run's generator, then the error
        raise RuntimeError("boom")

    model = _model()
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=failing,
        pipeline=fa.compose(),
    )
    if kinds is not None:
        state = state.replace(step_rng_types=kinds)
    _seed_process()
    before = _snapshot()
    with pytest.raises(RuntimeError, match="boom"):
        fa.step(state, _batch())
    assert _snapshot() == before


def test_code_between_steps_draws_what_it_would_draw_without_fnaccel() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    state = _prepared()
    torch.manual_seed(123)
    state, _ = fa.step(state, _batch())
    assert torch.equal(torch.rand(3), expected)


def test_the_step_still_draws_dropout_from_the_run() -> None:
    """The run's draws are the run's: a step's dropout mask depends on the run's seed,
    not on the process generator, and the state's generator moves past it."""

    def masks(run_seed: int, process_seed: int) -> tuple[list[float], bool]:
        state = _prepared(seed=run_seed)
        torch.manual_seed(process_seed)
        state, metrics = fa.step(state, _batch())
        return [metrics["loss"].item()], not torch.equal(state.rng.torch, fa.RNGState.seeded(run_seed).torch)

    loss_a, moved = masks(0, 1)
    assert moved
    assert masks(0, 2)[0] == loss_a
    assert masks(3, 1)[0] != loss_a


def _fold_run(fold: int) -> list[float]:
    state = fa.init(seed=0, cpu=True)
    model = _model_from_process()  # as a user's script builds it
    weights = model[0].weight.detach().flatten().tolist()
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _loader(),
        loss_fn=_loss,
        pipeline=fa.compose(),
    )
    for batch, _ in zip(fa.batches(state), range(3), strict=False):
        state, _ = fa.step(state, batch)
    fa.shutdown(state)
    return weights


def test_cross_validation_folds_build_different_models_from_the_process_generator() -> None:
    torch.manual_seed(0)
    folds = [_fold_run(k) for k in range(3)]
    assert len({tuple(w) for w in folds}) == 3
    # the models are exactly what the process generator gives without fnaccel
    torch.manual_seed(0)
    assert folds == [_model_from_process()[0].weight.detach().flatten().tolist() for _ in range(3)]


def test_two_interleaved_runs_each_equal_the_run_alone() -> None:
    def alone(seed: int) -> list[float]:
        state, losses = _prepared(seed=seed), []
        for batch, _ in zip(fa.batches(state, epochs=2), range(8), strict=False):
            state, metrics = fa.step(state, batch)
            losses.append(metrics["loss"].item())
        return losses

    expected_a, expected_b = alone(1), alone(2)
    a, b = _prepared(seed=1), _prepared(seed=2)
    got_a: list[float] = []
    got_b: list[float] = []
    for (batch_a, batch_b), _ in zip(
        zip(fa.batches(a, epochs=2), fa.batches(b, epochs=2), strict=False), range(8), strict=False
    ):
        a, metrics = fa.step(a, batch_a)
        got_a.append(metrics["loss"].item())
        torch.rand(7), random.random(), np.random.rand()  # the user's own draws in between
        b, metrics = fa.step(b, batch_b)
        got_b.append(metrics["loss"].item())
    assert got_a == expected_a and got_b == expected_b and expected_a != expected_b


def _draws() -> tuple[Any, ...]:
    return random.random(), np.random.rand(2).tolist(), torch.rand(2).tolist()


def test_set_seed_with_a_seed_seeds_the_process_generators_as_accelerates_does() -> None:
    fa.set_seed(11)
    ours = _draws()
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    assert ours == _draws()
    accelerate_utils = pytest.importorskip("accelerate.utils", reason="accelerate is not installed")
    accelerate_utils.set_seed(11)
    assert ours == _draws()


def test_set_seed_device_specific_adds_the_launchers_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    fa.utils.set_seed(5, device_specific=True)
    ours = _draws()
    fa.utils.set_seed(7)
    assert ours == _draws()
    monkeypatch.setenv("RANK", "two")
    with pytest.raises(ValueError, match="RANK='two'"):
        fa.set_seed(5, device_specific=True)


def test_set_seed_deterministic_turns_on_deterministic_algorithms() -> None:
    try:
        fa.set_seed(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_literal_port_seeds_the_process_then_a_seedless_run_starts_from_it() -> None:
    """Accelerate's order (seed, then build): ``set_seed(s)`` then ``fa.init()`` without a seed
    gives the run a copy of the seeded generators, so the run is reproducible too."""
    fa.set_seed(21)
    state = fa.init(cpu=True)
    assert (
        torch.equal(state.rng.torch, fa.RNGState.seeded(21).torch) and state.rng.python == random.getstate()
    )
    model = _model_from_process()  # draws from the process, not from the run
    assert torch.equal(state.rng.torch, fa.RNGState.seeded(21).torch)
    assert model is not None


def test_set_seed_says_which_two_calls_exist_when_given_neither() -> None:
    with pytest.raises(
        TypeError,
        match=r"set_seed\(seed\) seeds the process's generators .* set_seed\(state, seed\) the run's",
    ):
        fa.set_seed("42")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="seed must be an int"):
        fa.set_seed(fa.init(cpu=True), 4.5)  # type: ignore[call-overload]
