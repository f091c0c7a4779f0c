"""get_grad_scaler and get_mixed_precision_context_manager against torch's own objects."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import fnaccel as fa
from fnaccel.utils import (
    AutocastKwargs,
    DistributedType,
    get_grad_scaler,
    get_mixed_precision_context_manager,
)


def test_grad_scaler_takes_gradscalerkwargs_fields_on_this_machines_device() -> None:
    scaler = get_grad_scaler(init_scale=256.0, growth_interval=7)
    assert type(scaler) is torch.amp.GradScaler
    assert scaler._device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert scaler.get_scale() == 256.0 and scaler.get_growth_interval() == 7


def test_grad_scaler_scales_and_steps_like_torchs() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    ours, theirs = get_grad_scaler(init_scale=8.0), torch.amp.GradScaler("cpu", init_scale=8.0)
    for m, opt, scaler in ((model, optimizer, ours), (reference, ref_optimizer, theirs)):
        scaler.scale(m(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
    torch.testing.assert_close(model.weight, reference.weight, rtol=0, atol=0)


def test_fsdp_gets_the_sharded_scaler() -> None:
    assert isinstance(get_grad_scaler(DistributedType.FSDP), ShardedGradScaler)
    assert isinstance(get_grad_scaler("FSDP"), ShardedGradScaler)
    assert not isinstance(get_grad_scaler(DistributedType.MULTI_GPU), ShardedGradScaler)


def test_grad_scaler_refuses_unknown_options() -> None:
    with pytest.raises(TypeError, match="init_scal"):
        get_grad_scaler(init_scal=2.0)


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_context_autocasts_to_the_runs_precision(precision: str, dtype: torch.dtype) -> None:
    state = fa.init(cpu=True, mixed_precision=precision)
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    with get_mixed_precision_context_manager(state, native_amp=True):
        out = a @ b
    assert out.dtype == dtype
    with torch.autocast("cpu", dtype=dtype):
        expected = a @ b
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_context_without_native_amp_does_nothing_and_kwargs_are_applied() -> None:
    state = fa.init(cpu=True, mixed_precision="bf16")
    with get_mixed_precision_context_manager(state):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with get_mixed_precision_context_manager(state, True, AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with pytest.raises(TypeError, match="AutocastKwargs"):
        get_mixed_precision_context_manager(state, True, {"enabled": False})  # type: ignore[arg-type]
