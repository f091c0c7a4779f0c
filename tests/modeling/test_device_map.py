"""Device maps: budgets, `infer_auto_device_map` against hand-computed maps and its invariants.

The transformer-like `TinyLM` (d=4, vocabulary 16, float32) has, in bytes:
embed 256 (its weight is tied to lm_head's, which counts 0); each Block 976 =
ln1 32 + attn 320 (q, k, v, o: 80 each) + ln2 32 + mlp 592 (up 320, down 272);
norm 32. Three blocks: 3216 in all.
"""

from __future__ import annotations

import random
import warnings
from collections import defaultdict

import pytest
import torch
from torch import nn

from fnaccel.modeling.device_map import (
    check_device_map,
    clean_device_map,
    infer_auto_device_map,
    resolve_device_map,
)
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.memory_budget import convert_file_size_to_int, get_balanced_memory, get_max_memory
from fnaccel.modeling.sizes import compute_module_sizes
from fnaccel.modeling.tied import find_tied_parameters


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)


class TinyLM(nn.Module):
    def __init__(self, num_layers: int = 3, d: int = 4, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(num_layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.embed.weight


def test_the_hand_counted_sizes() -> None:
    sizes = compute_module_sizes(TinyLM())
    assert (sizes["embed"], sizes["blocks.0"], sizes["blocks.0.attn"], sizes["blocks.0.mlp"]) == (
        256,
        976,
        320,
        592,
    )
    assert (sizes["norm"], sizes["lm_head"], sizes[""]) == (32, 0, 3216)


# --- budgets -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("10GiB", 10 * 2**30),
        ("256MB", 256 * 10**6),
        ("1.5KiB", 1536),
        ("2kb", 250),
        ("3GB", 3 * 10**9),
        ("1TiB", 2**40),
        (" 7 MiB ", 7 * 2**20),
        ("8Gb", 10**9),
        (123, 123),
        (0, 0),
        ("1TB", 10**12),
        ("0GB", 0),
        (" 1 kib ", 1024),  # bits only for decimal units, as Accelerate
    ],
)
def test_convert_file_size_to_int(text: str | int, size: int) -> None:
    assert convert_file_size_to_int(text) == size


@pytest.mark.parametrize("bad", ["10", "ten GB", "-1GB", "5PB", "", -3, True, 1.5])
def test_convert_file_size_to_int_rejects_non_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        convert_file_size_to_int(bad)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default lists the GPUs too")
def test_default_max_memory_is_the_available_ram() -> None:
    memory = get_max_memory()
    assert list(memory) == ["cpu"] and memory["cpu"] > 0


def test_max_memory_is_converted_and_ordered_gpus_first_without_touching_the_input() -> None:
    given: dict[int | str, int | str] = {"disk": "1GB", "cpu": "2GiB", 1: 100, 0: "1KB"}
    assert list(get_max_memory(given).items()) == [(0, 1000), (1, 100), ("cpu", 2**31), ("disk", 10**9)]
    assert given["cpu"] == "2GiB"


@pytest.mark.parametrize("key", ["gpu", "cuda:0", -1, 1.0])
def test_max_memory_rejects_unknown_devices(key: object) -> None:
    with pytest.raises(ValueError, match="not a device: use integers for GPUs"):
        get_max_memory({key: 10})  # type: ignore[dict-item]


def test_balanced_memory_by_hand() -> None:
    model = TinyLM()
    budget: dict[int | str, int] = {0: 10_000, 1: 10_000, "cpu": 10_000}
    # 3216 // 2 GPUs, plus 1.25 x the larger of a Block (976) and the mean leaf (3216 / 26 leaves = 123)
    assert get_balanced_memory(model, budget, ["Block"]) == {0: 1608 + 1220, 1: 10_000, "cpu": 10_000}
    assert get_balanced_memory(model, budget) == {0: 1608 + 153, 1: 10_000, "cpu": 10_000}
    three: dict[int | str, int] = {0: 10_000, 1: 10_000, 2: 10_000}
    # low_zero: GPUs 1 and 2 share the model (3216 // 2 + 1220); GPU 0 gets what they leave, nothing
    assert get_balanced_memory(model, three, ["Block"], low_zero=True) == {0: 0, 1: 2828, 2: 10_000}
    assert get_balanced_memory(model, {0: 5000, "cpu": 10}) == {0: 5000, "cpu": 10}
    assert get_balanced_memory(model, {"cpu": 10}) == {"cpu": 10}


def test_balanced_memory_is_a_good_max_memory() -> None:
    model = TinyLM(num_layers=8)
    budget = get_balanced_memory(model, {0: 100_000, 1: 100_000, 2: 100_000}, ["Block"])
    device_map = infer_auto_device_map(model, budget, ["Block"])
    assert set(device_map.values()) == {0, 1, 2}


def test_strategy_names_resolve_to_balanced_or_sequential_maps() -> None:
    model = TinyLM(num_layers=8)
    budget: dict[int | str, int] = {0: 100_000, 1: 100_000, 2: 100_000}
    assert resolve_device_map(model, "sequential", budget, ["Block"]) == {"": 0}
    for strategy in ("auto", "balanced"):
        balanced = get_balanced_memory(model, budget, ["Block"])
        assert resolve_device_map(model, strategy, budget, ["Block"]) == infer_auto_device_map(
            model, balanced, ["Block"]
        )
    low_0 = resolve_device_map(model, "balanced_low_0", budget, ["Block"], dtype="float16")
    assert low_0 == infer_auto_device_map(
        model,
        get_balanced_memory(model, budget, ["Block"], dtype="float16", low_zero=True),
        ["Block"],
        dtype="float16",
    )
    assert 0 not in low_0.values()
    with pytest.raises(ValueError, match="'everywhere': a string must be one of auto, balanced"):
        resolve_device_map(model, "everywhere", budget)


# --- infer_auto_device_map: hand-computed maps ----------------------------------------------------------


def test_everything_fits_on_the_cpu() -> None:
    assert infer_auto_device_map(TinyLM(), {"cpu": 10_000}, ["Block"]) == {"": "cpu"}


def test_one_gpu_cpu_and_disk_keep_room_for_the_largest_layer() -> None:
    # GPU 0: 2000 - 976 reserved for a Block = 1024: embed (+ its tied lm_head) 256, no room for a Block.
    # CPU: 2000 - 976 = 1024: blocks.0; blocks.1 does not fit beside it, so blocks.1 and the rest go to disk.
    expected = {
        "embed": 0,
        "lm_head": 0,
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "disk",
        "norm": "disk",
    }
    assert infer_auto_device_map(TinyLM(), {0: 2000, "cpu": 2000}, ["Block"]) == expected


def test_two_gpus_only_gpu_zero_keeps_a_reserve() -> None:
    # GPU 0: 1500 - 976 = 524: embed 256 only. GPU 1: 2500, no reserve: two Blocks (1952).
    # CPU: the last Block and the norm (the reserve shrinks to 32, then 0, as the layers run out).
    expected = {"embed": 0, "lm_head": 0, "blocks.0": 1, "blocks.1": 1, "blocks.2": "cpu", "norm": "cpu"}
    assert infer_auto_device_map(TinyLM(), {0: 1500, 1: 2500, "cpu": 10_000}, ["Block"]) == expected


def test_without_no_split_classes_a_block_is_split() -> None:
    # The largest layer is an mlp.up (320): GPU 0 has 1200 - 320 = 880 for embed 256, ln1 32, attn 320,
    # ln2 32 (640 in all); mlp (592) is split and mlp.up does not fit in what is left (240).
    expected = {
        "embed": 0,
        "lm_head": 0,
        "blocks.0.ln1": 0,
        "blocks.0.attn": 0,
        "blocks.0.ln2": 0,
        "blocks.0.mlp": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "cpu",
        "norm": "cpu",
    }
    assert infer_auto_device_map(TinyLM(), {0: 1200, "cpu": 100_000}) == expected
    # Kept whole, a Block (976) is the largest layer: 1200 - 976 leaves GPU 0 no room even for embed.
    assert infer_auto_device_map(TinyLM(), {0: 1200, "cpu": 100_000}, ["Block"]) == {"": "cpu"}


def test_clean_result_false_gives_the_placed_units() -> None:
    raw = infer_auto_device_map(TinyLM(), {0: 1200, "cpu": 100_000}, clean_result=False)
    assert raw == {
        "embed": 0,
        "lm_head": 0,
        "blocks.0.ln1": 0,
        "blocks.0.attn": 0,
        "blocks.0.ln2": 0,
        "blocks.0.mlp.up": "cpu",
        "blocks.0.mlp.down": "cpu",
        "blocks.1": "cpu",
        "blocks.2": "cpu",
        "norm": "cpu",
    }
    assert clean_device_map(raw) == infer_auto_device_map(TinyLM(), {0: 1200, "cpu": 100_000})


def test_dtype_halves_the_sizes() -> None:
    # In float16 every size halves: GPU 0's 1000 - 488 = 512 takes embed (128) but no Block (488 beside it).
    expected = {
        "embed": 0,
        "lm_head": 0,
        "blocks.0": "cpu",
        "blocks.1": "disk",
        "blocks.2": "disk",
        "norm": "disk",
    }
    assert infer_auto_device_map(TinyLM(), {0: 1000, "cpu": 1000}, ["Block"], dtype="float16") == expected


class TiedPair(nn.Module):
    """a 80 B, embed 256 B, mid 80 B, head: Sequential(proj 64 B of bias, its weight tied to embed's;
    extra 80 B), or with ``split_head=False`` just the proj."""

    def __init__(self, split_head: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.embed = nn.Embedding(16, 4)
        self.mid = nn.Linear(4, 4)
        proj = nn.Linear(4, 16)
        proj.weight = self.embed.weight
        self.head = nn.Sequential(proj, nn.Linear(4, 4)) if split_head else proj


def test_tied_modules_go_together_even_when_the_embedding_alone_would_fit() -> None:
    model = TiedPair(split_head=False)
    # GPU 0: 450 - 80 (reserve: mid) - 80 (a) = 290 fits embed (256) but not embed + head (320): both move on.
    assert infer_auto_device_map(model, {0: 450, "cpu": 10_000}) == {
        "a": 0,
        "embed": "cpu",
        "mid": "cpu",
        "head": "cpu",
    }


def test_a_tied_module_is_split_so_that_only_the_tied_part_comes_along() -> None:
    # GPU 0: 480 - 80 reserved - 80 (a) = 320: embed + head (400) does not fit, head is split,
    # and embed + head.0 (320) does; mid and head.1 go to the CPU.
    assert infer_auto_device_map(TiedPair(), {0: 480, "cpu": 10_000}) == {
        "a": 0,
        "embed": 0,
        "head.0": 0,
        "mid": "cpu",
        "head.1": "cpu",
    }


def test_top_level_parameters_and_buffers_are_placed() -> None:
    model = nn.Module()
    model.scale = nn.Parameter(torch.ones(100))  # 400 B
    model.fc = nn.Linear(10, 10)  # 440 B
    model.register_buffer("table", torch.zeros(25))  # 100 B
    # CPU: 900 - 440 (fc) kept = 460 for scale; then 900 - 100 (table) - 400 = 400: no room for fc.
    assert infer_auto_device_map(model, {"cpu": 900}) == {"scale": "cpu", "fc": "disk", "table": "disk"}
    # With 940, fc fits beside scale (940 - 100 - 400 = 440), and table once nothing is left to reserve for.
    assert infer_auto_device_map(model, {"cpu": 940}) == {"": "cpu"}


def test_the_buffers_of_a_split_module_are_placed_too() -> None:
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    model.register_buffer("steps", torch.zeros(10))
    outer = nn.ModuleDict({"body": model})
    # body (920) does not fit in 900 - 440: split; body.0 fits, body.1 not beside it (900 - 40 - 440 = 420).
    device_map = infer_auto_device_map(outer, {"cpu": 900})
    assert device_map == {"body.0": "cpu", "body.1": "disk", "body.steps": "disk"}
    check_device_map(outer, device_map)


def test_verbose_prints_the_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    infer_auto_device_map(TinyLM(), {0: 2000, "cpu": 2000}, ["Block"], verbose=True)
    out = capsys.readouterr().out
    assert "Treating module embed." in out and "Splitting blocks." in out
    assert "is tied to ['lm_head']" in out and "going to the next device" in out


def test_buffers_left_on_the_main_device_must_fit_a_gpu() -> None:
    model = nn.Sequential(*[nn.BatchNorm1d(100) for _ in range(3)])  # 1608 B each, 808 of them buffers
    # GPU 0 holds "0" and keeps 1608 for the next layer: the 1616 B of offloaded buffers do not fit too.
    with pytest.warns(UserWarning, match="offload_buffers=True"):
        assert infer_auto_device_map(model, {0: 4000, "cpu": 10_000}) == {"0": 0, "1": "cpu", "2": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infer_auto_device_map(model, {0: 4000, "cpu": 10_000}, offload_buffers=True)
        # GPU 1 holds "1" (1608) and has room for the 808 B of buffers of "2", on the CPU
        assert infer_auto_device_map(model, {0: 4000, 1: 2500, "cpu": 10_000}) == {"0": 0, "1": 1, "2": "cpu"}


def test_meta_models_and_gpu_ids_need_no_gpu() -> None:
    with init_empty_weights():
        model = TinyLM(num_layers=4, d=512, vocab=32_000)
    device_map = infer_auto_device_map(model, {0: "80MB", 1: "80MB", "cpu": "100MB"}, ["Block"])
    assert set(device_map.values()) <= {0, 1, "cpu", "disk"}
    check_device_map(model, device_map)


# --- check_device_map ----------------------------------------------------------------------------------


def test_check_device_map() -> None:
    model = TinyLM()
    check_device_map(model, {"": "cpu"})
    check_device_map(model, {"embed": 0, "blocks": 1, "norm": "cpu", "lm_head": torch.device("cpu")})
    with pytest.raises(ValueError, match="no device to 'lm_head.weight'"):
        check_device_map(model, {"embed": 0, "blocks": 1, "norm": "cpu"})
    with pytest.raises(ValueError, match="no device to 'blocks.2.ln1.weight', .* and 6 more"):
        check_device_map(model, {"embed": 0, "blocks.0": 1, "blocks.1": 1, "norm": "cpu", "lm_head": 0})
    with pytest.raises(ValueError, match="names 'blocks.9', which is not a module"):
        check_device_map(model, {"": "cpu", "blocks.9": 0})
    with pytest.raises(ValueError, match="puts '' on 'gpu0', which is not a device"):
        check_device_map(model, {"": "gpu0"})


def test_non_persistent_buffers_need_no_device() -> None:
    model = nn.Linear(2, 2)
    model.register_buffer("cache", torch.zeros(2), persistent=False)
    check_device_map(model, {"weight": "cpu", "bias": "disk"})


def test_clean_device_map() -> None:
    assert clean_device_map({"a.0": 0, "a.1": 0, "b.0": 1, "b.1": "cpu"}) == {"a": 0, "b.0": 1, "b.1": "cpu"}
    assert clean_device_map({"a.x.0": 0, "a.x.1": 0, "a.y": 0, "b": 1}) == {"a": 0, "b": 1}
    assert clean_device_map({"a": 0}) == {"a": 0}
    assert list(clean_device_map({"z": 1, "a.0": 0, "a.1": 0})) == ["z", "a"]


# --- invariants over many random budgets ---------------------------------------------------------------


def _device_of(name: str, device_map: dict[str, int | str]) -> int | str:
    owner = max(
        (key for key in device_map if key == "" or name == key or name.startswith(key + ".")), key=len
    )
    return device_map[owner]


def _check_invariants(
    model: nn.Module, budget: dict[int | str, int], no_split: list[str], dtype: str | None
) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the buffers of the offloaded modules", UserWarning)
        device_map = infer_auto_device_map(model, budget, no_split, dtype=dtype)
    check_device_map(model, device_map)
    sizes = compute_module_sizes(model, dtype=dtype)
    tensors = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    used: dict[int | str, int] = defaultdict(int)
    for name in tensors:
        used[_device_of(name, device_map)] += sizes[name]
    for device, total in used.items():
        assert device == "disk" or total <= budget[device], (device, total, budget, device_map)
    for name, module in model.named_modules():
        if type(module).__name__ in no_split:
            inside = {_device_of(t, device_map) for t in tensors if t.startswith(name + ".")}
            assert len(inside) == 1, (name, device_map)
    for group in find_tied_parameters(model):
        assert len({_device_of(name, device_map) for name in group}) == 1, (group, device_map)


class Ends(nn.Module):
    def __init__(self, embed: nn.Embedding | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4) if embed is None else embed
        self.block = Block(4)


class Sandwich(nn.Module):
    """Two no-split candidates (``Ends``) tied to each other through an embedding, Blocks between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = Ends()
        self.middle = nn.Sequential(Block(4), Block(4))
        self.last = Ends(self.first.embed)
        self.register_buffer("steps", torch.zeros(8))


@pytest.mark.parametrize("seed", range(4))
def test_invariants_hold_for_random_budgets(seed: int) -> None:
    rng = random.Random(seed)
    models = [TinyLM(num_layers=3), TinyLM(num_layers=5, d=8), TiedPair(), Sandwich()]
    for _ in range(80):
        model = rng.choice(models)
        budget: dict[int | str, int] = {gpu: rng.randrange(0, 4000) for gpu in range(rng.randrange(0, 4))}
        if rng.random() < 0.8:
            budget["cpu"] = rng.randrange(0, 6000)
        no_split = rng.choice(
            [[], ["Block"], ["MLP", "Attention"], ["Block", "MLP"], ["Ends"], ["Ends", "Block"]]
        )
        _check_invariants(model, budget, no_split, rng.choice([None, "float16"]))


def test_fallback_allocation_puts_a_later_module_that_fits_on_a_device_left_empty() -> None:
    # 0 (30400 B) does not fit beside the room kept for 1 (40400 B): without the fallback, GPU 0 stays empty
    model = nn.Sequential(nn.Linear(75, 100), nn.Linear(100, 100), nn.Linear(10, 10))
    budget: dict[int | str, int] = {0: 60000, "cpu": 10**6}
    assert infer_auto_device_map(model, budget) == {"": "cpu"}
    placed = infer_auto_device_map(model, budget, fallback_allocation=True)
    assert placed == {"2": 0, "0": "cpu", "1": "cpu"}


def test_fallback_allocation_searches_inside_modules_breadth_first() -> None:
    model = nn.Sequential(
        nn.Linear(75, 100), nn.Linear(100, 100), nn.Sequential(nn.Linear(100, 50), nn.Linear(10, 10))
    )
    placed = infer_auto_device_map(
        model,
        {0: 60000, "cpu": 10**6},
        no_split_module_classes=["Linear"],
        fallback_allocation=True,
        clean_result=False,
    )
    assert placed["2.1"] == 0 and placed["2.0"] == "cpu" and placed["0"] == "cpu"


def test_fallback_allocation_changes_nothing_when_regular_allocation_succeeds() -> None:
    model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])
    budget: dict[int | str, int] = {0: 1000, "cpu": 1000}
    assert infer_auto_device_map(model, budget, fallback_allocation=True) == infer_auto_device_map(
        model, budget
    )
