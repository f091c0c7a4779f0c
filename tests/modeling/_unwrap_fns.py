"""Worker functions for tests/modeling/test_unwrap.py (importable by World's processes)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import fnaccel as fa
from fnaccel.modeling.unwrap import extract_model_from_parallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def unwrap_ddp(state: fa.RunState, compiled: bool) -> dict[str, Any]:
    """ddp() (and compile()) around a model: the user's module comes back, the prepared one is untouched."""
    model = _model()
    parts = [fa.ddp()] + ([fa.compile(backend="eager")] if compiled else [])
    state = fa.prepare(state, model, pipeline=fa.compose(*parts))
    prepared = state.model
    x = torch.randn(3, 4)
    kept = extract_model_from_parallel(prepared)
    plain = extract_model_from_parallel(prepared, keep_torch_compile=False)
    inner = getattr(prepared, "_orig_mod", prepared)
    with torch.no_grad():
        kept_output_equal = torch.equal(kept(x), model(x))
    return {
        "prepared_is_ddp": isinstance(inner, DistributedDataParallel) and inner.module is model,
        "kept_type": type(kept).__name__,
        "kept_wraps_model": getattr(kept, "_orig_mod", kept) is model,
        "kept_output_equal": kept_output_equal,
        "plain_is_model": plain is model,
    }


def unwrap_ddp_autocast(state: fa.RunState) -> dict[str, Any]:
    model = _model()
    state = fa.prepare(state, model, pipeline=fa.compose(fa.autocast(fa.bf16), fa.ddp()))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda m, args, out: dtypes.append(out.dtype))
    x = torch.randn(3, 4)
    with torch.no_grad():
        state.model(x)  # type: ignore[misc]
        kept = extract_model_from_parallel(state.model)  # type: ignore[arg-type]
        kept(x)
        wrapped_before = "forward" in vars(model)
        removed = extract_model_from_parallel(state.model, keep_fp32_wrapper=False)  # type: ignore[arg-type]
        removed(x)
    return {
        "same": kept is model and removed is model,
        "wrapped_before": wrapped_before,
        "wrapped_after": "forward" in vars(model),
        "dtypes": [str(d) for d in dtypes],
    }


def unwrap_fsdp(state: fa.RunState) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    model = _model()
    state = fa.prepare(state, model, pipeline=fa.compose(fa.autocast(fa.bf16), fa.fsdp()))
    out = extract_model_from_parallel(state.model, keep_fp32_wrapper=False)  # type: ignore[arg-type]
    return {
        "same": out is model and state.model is model,
        "sharded": isinstance(out, FSDPModule),
        "dtensor": type(next(out.parameters())).__name__,
    }


def unwrap_recursive_ddp_child(state: fa.RunState) -> dict[str, Any]:
    child = nn.Linear(4, 4)
    model = nn.Sequential(DistributedDataParallel(child, process_group=state.dist.process_group), nn.ReLU())
    shallow = extract_model_from_parallel(model)
    still_wrapped = isinstance(model[0], DistributedDataParallel)
    deep = extract_model_from_parallel(model, recursive=True)
    return {
        "shallow_keeps_child": shallow is model and still_wrapped,
        "deep_child_is_module": deep is model and model[0] is child,
    }
