"""Save and load pre-hooks: a user's state-dict transform on the way to and from the files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fnaccel as fa
from fnaccel.checkpoint.storage.parts import (
    CheckpointHooks,
    register_load_state_pre_hook,
    register_save_state_pre_hook,
)


def _prepared(seed: int) -> fa.RunState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    return fa.prepare(fa.init(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1))


def to_other_layout(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"backbone.{k}": v.to(torch.float16) for k, v in sd.items()}


def from_other_layout(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("backbone."): v.float() for k, v in sd.items()}


def test_hooks_transform_what_is_written_and_what_is_loaded(tmp_path: Path) -> None:
    state = register_save_state_pre_hook(_prepared(0), to_other_layout)
    fa.save(state, tmp_path / "ckpt")
    written = load_file(tmp_path / "ckpt" / "model.safetensors")
    expected = {f"backbone.{k}": v.half() for k, v in state.model.state_dict().items()}  # type: ignore[union-attr]
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)

    other = register_load_state_pre_hook(_prepared(1), from_other_layout)
    other = fa.load(other, tmp_path / "ckpt")
    for key, value in other.model.state_dict().items():  # type: ignore[union-attr]
        assert torch.equal(value, expected[f"backbone.{key}"].float())


def test_hooks_run_in_order_and_may_edit_in_place(tmp_path: Path) -> None:
    calls = []

    def first(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
        calls.append(("first", sorted(sd)))
        sd["0.bias"] = torch.zeros(4)  # in place, returning None

    def second(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
        calls.append(("second", float(sd["0.bias"].abs().sum())))

    base = _prepared(0)
    state = register_save_state_pre_hook(register_save_state_pre_hook(base, first), second)
    fa.save(state, tmp_path / "ckpt")
    assert calls == [("first", ["0.bias", "0.weight", "1.bias", "1.weight"]), ("second", 0.0)]
    assert torch.equal(load_file(tmp_path / "ckpt" / "model.safetensors")["0.bias"], torch.zeros(4))
    assert not torch.equal(base.model[0].bias, torch.zeros(4))  # type: ignore[index]  # the model is untouched
    # the state from before registering has no hooks: that is how a hook is removed
    assert "CheckpointHooks" not in base.kwargs_handlers


def test_a_checkpoint_written_through_a_hook_needs_its_inverse(tmp_path: Path) -> None:
    fa.save(register_save_state_pre_hook(_prepared(0), to_other_layout), tmp_path / "ckpt")
    with pytest.raises(fa.FnaccelError, match="missing keys \\['0.bias'"):
        fa.load(_prepared(1), tmp_path / "ckpt")


def test_bad_hooks_are_reported(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="takes a callable hook"):
        register_save_state_pre_hook(_prepared(0), "not a hook")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a tuple of callables"):
        CheckpointHooks(load_state_pre=[from_other_layout])  # type: ignore[arg-type]
    state = register_save_state_pre_hook(_prepared(0), lambda model, sd: list(sd.values()))  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="returned list; return a dict of tensors"):
        fa.save(state, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_hooks_can_be_given_to_init() -> None:
    hooks = CheckpointHooks(save_state_pre=(to_other_layout,))
    state = fa.init(cpu=True, kwargs_handlers=[hooks])
    assert register_load_state_pre_hook(state, from_other_layout).kwargs_handlers["CheckpointHooks"] == (
        CheckpointHooks(save_state_pre=(to_other_layout,), load_state_pre=(from_other_layout,))
    )
