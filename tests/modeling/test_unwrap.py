"""extract_model_from_parallel: DDP, FSDP2, torch.compile and autocast wrappers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

import fnaccel as fa
from fnaccel.modeling.unwrap import extract_model_from_parallel
from tests.modeling import _unwrap_fns as fns


def test_a_plain_module_is_its_own_model() -> None:
    model = nn.Linear(2, 2)
    assert extract_model_from_parallel(model) is model
    assert extract_model_from_parallel(model, False, False, True) is model


def test_compiled_kept_or_removed() -> None:
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    assert isinstance(compiled, OptimizedModule)
    assert extract_model_from_parallel(compiled) is compiled
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


def test_a_compiled_container_is_rewrapped_without_touching_the_original() -> None:
    model = nn.Linear(2, 2)
    container = nn.DataParallel(model)  # on a CPU-only machine: a plain container
    compiled = torch.compile(container, backend="eager")
    assert isinstance(compiled, OptimizedModule)
    out = extract_model_from_parallel(compiled)
    assert isinstance(out, OptimizedModule) and out is not compiled
    assert out._orig_mod is model and compiled._orig_mod is container  # the prepared one is intact
    assert out.dynamo_ctx is compiled.dynamo_ctx  # same compiler settings
    x = torch.randn(3, 2)
    assert torch.equal(out(x), model(x))
    assert extract_model_from_parallel(compiled, keep_torch_compile=False) is model


def test_recursive_unwraps_wrapped_submodules_in_place() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    holder = nn.Module()
    holder.module = nn.Linear(2, 2)  # a submodule that happens to be called "module": not a wrapper
    compiled = torch.compile(second, backend="eager")
    assert isinstance(compiled, OptimizedModule)
    model = nn.Sequential(nn.DataParallel(first), compiled, holder)
    assert extract_model_from_parallel(model) is model and isinstance(model[0], nn.DataParallel)
    assert extract_model_from_parallel(model, recursive=True) is model
    inner = list(model)
    assert inner[0] is first and isinstance(inner[1], OptimizedModule) and inner[2] is holder
    extract_model_from_parallel(model, keep_torch_compile=False, recursive=True)
    inner = list(model)
    assert inner[1] is second and inner[2] is holder


def _hooked(model: nn.Sequential) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    return dtypes


def test_keep_fp32_wrapper_false_removes_autocast_in_place() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    state = fa.prepare(
        fa.init(cpu=True), model, pipeline=fa.compose(fa.autocast(fa.bf16), fa.compile(backend="eager"))
    )
    dtypes = _hooked(model)
    x = torch.randn(3, 2)
    assert extract_model_from_parallel(state.model) is state.model  # type: ignore[arg-type]
    state.model(x)
    out = extract_model_from_parallel(state.model, keep_fp32_wrapper=False)
    assert out is state.model and "forward" not in vars(model)
    out(x)
    assert extract_model_from_parallel(out, keep_fp32_wrapper=False, keep_torch_compile=False) is model
    assert dtypes == [torch.bfloat16, torch.float32]


def test_a_forward_set_by_the_user_survives_the_removal() -> None:
    model = nn.Linear(2, 2)
    calls: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return nn.Linear.forward(model, x)

    model.forward = forward  # type: ignore[assignment]
    fa.prepare(fa.init(cpu=True), model, pipeline=fa.compose(fa.autocast(fa.bf16)))
    assert model.forward is not forward
    extract_model_from_parallel(model, keep_fp32_wrapper=False)
    assert model.forward is forward
    model(torch.ones(1, 2))
    assert calls == [1]


def test_ddp_across_two_processes(world2: Any) -> None:
    for compiled in (False, True):
        for result in world2.run(fns.unwrap_ddp, compiled):
            assert result["prepared_is_ddp"] and result["plain_is_model"], result
            assert result["kept_wraps_model"] and result["kept_output_equal"], result
            assert result["kept_type"] == ("OptimizedModule" if compiled else "Sequential")


def test_ddp_with_autocast_across_two_processes(world2: Any) -> None:
    for result in world2.run(fns.unwrap_ddp_autocast):
        assert result["same"] and result["wrapped_before"] and not result["wrapped_after"], result
        assert result["dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32"]


def test_fsdp2_is_its_own_model_across_two_processes(world2: Any) -> None:
    for result in world2.run(fns.unwrap_fsdp):
        assert result == {"same": True, "sharded": True, "dtensor": "DTensor"}


def test_recursive_ddp_child_across_two_processes(world2: Any) -> None:
    for result in world2.run(fns.unwrap_recursive_ddp_child):
        assert result == {"shallow_keeps_child": True, "deep_child_is_module": True}
