"""autocast_context(state): the run's precision for code outside the prepared forward."""

from __future__ import annotations

import pytest
import torch

import fnaccel as fa
from fnaccel.kwargs import AutocastKwargs
from fnaccel.precision import autocast_context


def _matmul() -> torch.Tensor:
    return torch.ones(2, 3) @ torch.ones(3, 2)


def test_the_run_precision_applies_inside_and_only_inside() -> None:
    state = fa.init(cpu=True, mixed_precision="bf16")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    with autocast_context(state):
        y = x @ w
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, x.bfloat16() @ w.bfloat16())  # what a hand cast computes
    assert _matmul().dtype == torch.float32


def test_the_pipeline_autocast_wins_over_the_launch_precision() -> None:
    model = torch.nn.Linear(3, 3)
    state = fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.autocast(fa.bf16)))
    assert state.mixed_precision is fa.utils.PrecisionType.NO
    with autocast_context(state):
        assert _matmul().dtype == torch.bfloat16


def test_full_precision_runs_and_disabled_handlers_do_not_cast() -> None:
    with autocast_context(fa.init(cpu=True)):
        assert _matmul().dtype == torch.float32
    state = fa.init(cpu=True, mixed_precision="bf16")
    with autocast_context(state, AutocastKwargs(enabled=False)):
        assert _matmul().dtype == torch.float32
    handled = fa.init(cpu=True, mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    with autocast_context(handled):
        assert _matmul().dtype == torch.float32


def test_fp8_runs_compute_the_rest_in_bf16() -> None:
    with autocast_context(fa.init(cpu=True, mixed_precision="fp8")):
        assert _matmul().dtype == torch.bfloat16


def test_a_pipeline_training_in_fp8_computes_the_rest_in_bf16() -> None:
    """The pipeline's precision is read from autocast's typed settings; its printed dtype
    ('fp8', not a torch dtype) once reached torch.autocast and failed."""
    pytest.importorskip("torchao", reason="fa.autocast(fa.fp8) needs torchao")
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))  # the middle one in float8
    state = fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.autocast(fa.fp8)))
    with autocast_context(state):
        assert _matmul().dtype == torch.bfloat16


def test_a_wrong_handler_is_refused() -> None:
    with pytest.raises(TypeError, match="must be an AutocastKwargs, got dict"):
        autocast_context(fa.init(cpu=True), {"enabled": False})  # type: ignore[arg-type]
