"""`init_empty_weights` / `init_on_device`: meta parameters, real buffers, exact restoration."""

from __future__ import annotations

import resource
from contextlib import ExitStack

import pytest
import torch
from torch import nn

from fnaccel.modeling.empty import init_empty_weights, init_on_device

ORIGINAL_REGISTER_PARAMETER = vars(nn.Module)["register_parameter"]
ORIGINAL_REGISTER_BUFFER = vars(nn.Module)["register_buffer"]


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.frozen = nn.Parameter(torch.ones(2), requires_grad=False)
        self.register_buffer("positions", torch.arange(5))
        self.register_buffer("table", torch.full((2,), 7.0, device="cpu"), persistent=False)


def assert_restored() -> None:
    assert vars(nn.Module)["register_parameter"] is ORIGINAL_REGISTER_PARAMETER
    assert vars(nn.Module)["register_buffer"] is ORIGINAL_REGISTER_BUFFER


def test_a_four_billion_parameter_stack_costs_no_memory() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(64)])
    assert sum(p.numel() for p in model.parameters()) == 64 * (8192 * 8192 + 8192) > 4e9
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"building on meta took {grown_mib:.0f} MiB"
    assert_restored()


def test_buffers_keep_their_values_on_the_cpu_by_default() -> None:
    with init_empty_weights():
        model = WithBuffers()
    assert model.fc.weight.device.type == "meta" and model.frozen.device.type == "meta"
    assert model.frozen.requires_grad is False
    assert torch.equal(model.positions, torch.arange(5))
    assert torch.equal(model.table, torch.full((2,), 7.0))
    with init_empty_weights():
        bn = nn.BatchNorm1d(4)
    assert bn.weight.is_meta and torch.equal(bn.running_var, torch.ones(4))


def test_include_buffers_puts_everything_on_the_device() -> None:
    with init_empty_weights(include_buffers=True):
        model = WithBuffers()
        made_inside = torch.zeros(3)
    assert {t.device.type for t in [*model.parameters(), *model.buffers(), made_inside]} == {"meta"}
    assert torch.zeros(1).device.type == "cpu"
    assert_restored()


def test_include_buffers_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        model = WithBuffers()
    assert model.positions.is_meta
    with init_empty_weights(include_buffers=False):
        model = WithBuffers()
    assert not model.positions.is_meta


def test_init_on_device_cpu() -> None:
    with init_on_device(torch.device("cpu")):
        model = nn.Linear(2, 2)
    assert model.weight.device.type == "cpu" and model.weight.requires_grad


def test_restored_when_the_block_raises() -> None:
    with pytest.raises(ZeroDivisionError), init_empty_weights(include_buffers=True):
        nn.Linear(2, 2)
        _ = 1 / 0
    assert_restored()
    assert nn.Linear(2, 2).weight.device.type == "cpu" and torch.empty(1).device.type == "cpu"


def test_nested_blocks_the_inner_one_wins_then_the_outer_one_again() -> None:
    with init_empty_weights():
        with init_on_device("cpu"):
            inner = nn.Linear(2, 2)
        after_inner = nn.Linear(2, 2)
    assert inner.weight.device.type == "cpu"
    assert after_inner.weight.is_meta
    assert_restored()


def test_blocks_may_exit_out_of_order() -> None:
    outer, inner = init_empty_weights(), init_on_device("cpu")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)  # the wrong order: the inner block is still open
    still_inner = nn.Linear(2, 2)
    inner.__exit__(None, None, None)
    assert still_inner.weight.device.type == "cpu"
    assert_restored()
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_many_interleaved_blocks_restore_exactly() -> None:
    with ExitStack() as stack:
        for _ in range(5):
            stack.enter_context(init_empty_weights(include_buffers=True))
            stack.enter_context(init_on_device("cpu"))
        assert nn.Linear(1, 1).weight.device.type == "cpu"
    assert_restored()


def test_parameter_subclasses_keep_their_class_and_attributes() -> None:
    class Tagged(nn.Parameter):
        tag: str

        def __new__(cls, data: torch.Tensor, requires_grad: bool = True, tag: str = "") -> Tagged:
            param = super().__new__(cls, data, requires_grad)
            param.tag = tag
            return param

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = Tagged(torch.ones(3), requires_grad=False, tag="q4")

    with init_empty_weights():
        holder = Holder()
    assert type(holder.weight) is Tagged and holder.weight.tag == "q4"
    assert holder.weight.is_meta and not holder.weight.requires_grad


def test_plain_parameters_keep_their_attributes() -> None:
    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            param = nn.Parameter(torch.ones(2))
            param.marker = "kept"  # type: ignore[attr-defined]  # an attribute torch does not declare
            self.weight = param

    with init_empty_weights():
        module = Marked()
    assert module.weight.is_meta and getattr(module.weight, "marker") == "kept"
