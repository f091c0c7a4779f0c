"""Registered objects (fa.utils.register_for_checkpointing) come back as they went in."""

from __future__ import annotations

import enum
import json
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.checkpoint.manifest import manifest_hash
from fnaccel.checkpoint.storage.files import Checksum


def _gan(seed_state: fa.RunState) -> tuple[fa.RunState, nn.Module, nn.Module, torch.optim.Optimizer]:
    """A GAN: the generator and its Adam prepared as the run, the discriminator and its
    Adam registered with it."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6))
    disc = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    gen_opt = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    disc_opt = torch.optim.Adam(disc.parameters(), lr=2e-2, betas=(0.5, 0.99))
    real = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)) + 2.0
    loader = DataLoader(TensorDataset(real), batch_size=4, shuffle=True)

    def gen_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        noise = torch.randn(batch[0].shape[0], 4)
        return nn.functional.softplus(-disc(model(noise))).mean()

    state = fa.prepare(seed_state, gen, gen_opt, loader, pipeline=fa.compose(), loss_fn=gen_loss)
    return fa.utils.register_for_checkpointing(state, disc=disc, disc_opt=disc_opt), gen, disc, disc_opt


def _train(
    state: fa.RunState, disc: nn.Module, disc_opt: torch.optim.Optimizer, stop_after: int | None = None
) -> fa.RunState:
    gen = state.model
    assert gen is not None
    for (real,) in fa.batches(state, epochs=2):
        # the discriminator's noise from its own generator: the process's is not the run's (fa.load
        # restores the run's generators, which fa.step draws gen_loss's noise from)
        noise = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(state.micro_step))
        fake = gen(noise).detach()
        disc_loss = nn.functional.softplus(-disc(real)).mean() + nn.functional.softplus(disc(fake)).mean()
        disc_opt.zero_grad()
        disc_loss.backward()
        disc_opt.step()
        state, _ = fa.step(state, [real])
        if state.micro_step == stop_after:
            break
    return state


def _weights(*modules: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_a_resumed_gan_steps_like_the_uninterrupted_run(tmp_path: Path) -> None:
    whole, gen, disc, disc_opt = _gan(fa.init(seed=0, cpu=True))
    _train(whole, disc, disc_opt)
    expected = _weights(gen, disc)

    first, _, disc1, disc_opt1 = _gan(fa.init(seed=0, cpu=True))
    first = _train(first, disc1, disc_opt1, stop_after=5)
    fa.save(first, tmp_path / "ckpt")
    saved_state = disc_opt1.state_dict()

    second, gen2, disc2, disc_opt2 = _gan(fa.init(seed=0, cpu=True))
    second = fa.load(second, tmp_path / "ckpt")
    loaded = disc_opt2.state_dict()
    assert list(loaded["state"]) == list(saved_state["state"]) == [0, 1, 2, 3]  # int keys, as saved
    assert loaded["param_groups"][0]["betas"] == (0.5, 0.99)  # a tuple, as saved
    assert all(
        torch.equal(loaded["state"][i][k], v) for i, s in saved_state["state"].items() for k, v in s.items()
    )
    _train(second, disc2, disc_opt2)
    assert all(torch.equal(a, b) for a, b in zip(_weights(gen2, disc2), expected, strict=True))


class Holder:
    """A registered object whose state_dict is whatever the test sets."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> Any:
        return self.value

    def load_state_dict(self, value: Any) -> None:
        self.value = value


def _round_trip(tmp_path: Path, value: Any, like: Any) -> Any:
    state = fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=Holder(value))
    fa.save(state, tmp_path / "ckpt")
    fresh = Holder(like)
    fa.load(fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=fresh), tmp_path / "ckpt")
    return fresh.value


def _same(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (tensors: same dtype, shape, values)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            list(map(type, a)) == list(map(type, b))
            and list(a) == list(b)
            and all(_same(a[k], b[k]) for k in a)
            and getattr(a, "_metadata", None) == getattr(b, "_metadata", None)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, float) and a != a:
        return b != b
    return bool(a == b)


def test_keys_scalars_containers_and_tensors_come_back_with_their_types(tmp_path: Path) -> None:
    module_state = nn.BatchNorm1d(3).state_dict()  # an OrderedDict with torch's _metadata
    value = {
        0: {"step": torch.tensor(3.0), "exp_avg": torch.arange(4, dtype=torch.float64)},
        "0": "a string key beside the int key 0",
        (1, "b"): [1, 2.5, True, None, "x", float("nan"), float("-inf"), -0.0, 2**70],
        "betas": (0.9, 0.999),
        "nested": [(1, [2, (3,)]), {"t": torch.ones(2, dtype=torch.int8)}],
        "module": module_state,
        "empty": ({}, [], ()),
        1.5: False,
        None: "a None key",
        True: 1,
    }
    back = _round_trip(tmp_path, value, {})
    assert _same(back, value), back


class Color(enum.IntEnum):
    RED = 1


class Meters(float):
    pass


@pytest.mark.parametrize(
    "value, key, what",
    [
        ({"when": object()}, "when", "a object"),
        ({"a": {"b": Color.RED}}, "a/b", "Color"),
        (
            {"f": Meters(1.0)},
            "f",
            "Meters",
        ),  # a float subclass (as NumPy's float64 is) would come back a float
        ({"d": defaultdict(list)}, "d", "collections.defaultdict"),
        ({frozenset({1}): 1}, "frozenset({1})", "its key is a frozenset"),
        ({"size": torch.Size([2])}, "size", "torch.Size"),
    ],
)
def test_what_cannot_come_back_as_it_went_in_is_refused_naming_the_object_and_key(
    tmp_path: Path, value: Any, key: str, what: str
) -> None:
    state = fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=Holder(value))
    with pytest.raises(fa.CheckpointError) as raised:
        fa.save(state, tmp_path / "ckpt")
    message = str(raised.value)
    assert message.startswith(f"registered object 'obj': key {key!r}: "), message
    assert what in message, message
    assert not (tmp_path / "ckpt").exists()


def _rewrite(checkpoint: Path, name: str, value: Any) -> None:
    """Replace ``name`` with ``value`` (JSON text when bytes) and reseal the manifest (as a
    stranger would)."""
    data = value if isinstance(value, bytes) else json.dumps(value).encode()
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "fnaccel.json").read_text())
    digest = Checksum()
    digest.update(memoryview(data))
    manifest["files"][name] = {"blocksum": digest.hexdigest(), "size": len(data)}
    manifest["manifest_sha256"] = manifest_hash(manifest)
    (checkpoint / "fnaccel.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "tree, match",
    [
        ({"set": [1]}, r"key '': \{'set': \[1\]\} is not one of the stored forms"),
        ({"dict": [[1, 2, 3]]}, r"an entry \[1, 2, 3\] is not a \[key, value\] pair"),
        ({"dict": [[[1], 2]]}, r"a key \[1\] is not hashable"),
        ({"dict": [["a", 1], ["a", 2]]}, r"the key 'a' is given twice"),
        ({"dict": [["w", {"tensor": "nope"}]]}, r"key 'w': tensor 'nope' is not in extras.safetensors"),
        ({"tuple": "abc"}, r"is not one of the stored forms"),
        ({"dict": [["a", {"tuple": [1]}], ["b", {"odict": [], "extra": 1}]]}, r"key 'b': .* is not one of"),
    ],
)
def test_a_hostile_registered_tree_is_refused_naming_the_key(tmp_path: Path, tree: Any, match: str) -> None:
    state = fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=Holder({"w": torch.ones(1)}))
    fa.save(state, tmp_path / "ckpt")
    _rewrite(tmp_path / "ckpt", "extras.json", {"obj": tree})
    fresh = Holder({})
    with pytest.raises(fa.CheckpointError, match=match):
        fa.load(fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=fresh), tmp_path / "ckpt")
    assert fresh.value == {}


def test_a_registered_tree_nested_too_deeply_is_refused(tmp_path: Path) -> None:
    state = fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=Holder({}))
    fa.save(state, tmp_path / "ckpt")
    levels = 490  # JSON reads it (980 levels, its limit is about 1000); the decoder must not crash
    _rewrite(
        tmp_path / "ckpt", "extras.json", b'{"obj": ' + b'{"tuple": [' * levels + b"1" + b"]}" * levels + b"}"
    )
    try:
        fa.load(
            fa.utils.register_for_checkpointing(fa.init(seed=0, cpu=True), obj=Holder({})), tmp_path / "ckpt"
        )
    except fa.CheckpointError as exc:
        assert "nested too deeply" in str(exc)


def test_an_ordered_dict_keeps_its_order_and_metadata(tmp_path: Path) -> None:
    value = OrderedDict([("b", 1), ("a", 2)])
    value._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    back = _round_trip(tmp_path, value, {})
    assert type(back) is OrderedDict and list(back) == ["b", "a"]
    assert getattr(back, "_metadata") == {"": {"version": 2}}
