"""BnbQuantizationConfig validation and load_and_quantize_model (real quantization where bitsandbytes is)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from fnaccel.config.environment import is_bnb_available
from fnaccel.modeling import quantization
from fnaccel.modeling.empty import init_empty_weights
from fnaccel.modeling.quantization import BnbQuantizationConfig, load_and_quantize_model

CAN_QUANTIZE = is_bnb_available() and torch.cuda.is_available()
NEEDS_BNB = "needs bitsandbytes (pip install bitsandbytes) and a CUDA GPU"


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8)))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(ids))))


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


# -- the config ---------------------------------------------------------------------------


def test_config_defaults_follow_accelerate() -> None:
    eight = BnbQuantizationConfig(load_in_8bit=True)
    assert (eight.llm_int8_threshold, eight.bnb_4bit_quant_type, eight.bnb_4bit_use_double_quant) == (
        6.0,
        "fp4",
        False,
    )
    assert eight.bnb_4bit_compute_dtype is torch.float16 and eight.torch_dtype is torch.float16
    assert (
        eight.target_dtype is torch.int8 and eight.skip_modules is None and eight.keep_in_fp32_modules is None
    )
    four = BnbQuantizationConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype="bf16",
        skip_modules=["head"],
        keep_in_fp32_modules=("norm",),
    )
    assert four.torch_dtype is torch.bfloat16 and four.target_dtype == "int4"  # the compute dtype by default
    assert four.skip_modules == ("head",) and four.keep_in_fp32_modules == ("norm",)
    explicit = BnbQuantizationConfig(
        load_in_8bit=True, torch_dtype=torch.float32, bnb_4bit_compute_dtype="float32"
    )
    assert explicit.torch_dtype is torch.float32 and explicit.bnb_4bit_compute_dtype is torch.float32
    assert explicit == BnbQuantizationConfig(
        load_in_8bit=True, torch_dtype="fp32", bnb_4bit_compute_dtype="fp32"
    )
    # dtype names are read as everywhere in fnaccel.modeling: torch's names too
    assert explicit == BnbQuantizationConfig(
        load_in_8bit=True, torch_dtype="torch.float32", bnb_4bit_compute_dtype="float"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        eight.load_in_4bit = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        BnbQuantizationConfig(True)  # type: ignore[call-arg]  # keyword-only
    assert not hasattr(eight, "__dict__")  # slotted


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"load_in_8bit": True, "load_in_4bit": True}, ValueError, "both True; pick one"),
        ({}, ValueError, "set load_in_8bit=True or load_in_4bit=True"),
        ({"load_in_8bit": 1}, TypeError, "load_in_8bit must be True or False"),
        ({"load_in_4bit": True, "bnb_4bit_use_double_quant": "yes"}, TypeError, "bnb_4bit_use_double_quant"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, ValueError, "'fp4' or 'nf4', got 'int4'"),
        (
            {"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp8"},
            ValueError,
            "bnb_4bit_compute_dtype must be",
        ),
        ({"load_in_8bit": True, "torch_dtype": torch.int8}, ValueError, "torch_dtype must be one of"),
        ({"load_in_8bit": True, "torch_dtype": "int8"}, ValueError, "torch_dtype must be one of"),
        ({"load_in_8bit": True, "torch_dtype": "float17"}, ValueError, "torch_dtype must be one of"),
        ({"load_in_8bit": True, "llm_int8_threshold": "6"}, TypeError, "llm_int8_threshold must be a number"),
        (
            {"load_in_8bit": True, "llm_int8_threshold": True},
            TypeError,
            "llm_int8_threshold must be a number",
        ),
        ({"load_in_8bit": True, "llm_int8_threshold": -1.0}, ValueError, "must be >= 0"),
        ({"load_in_8bit": True, "skip_modules": "lm_head"}, TypeError, "skip_modules must be a list"),
        (
            {"load_in_8bit": True, "keep_in_fp32_modules": [1]},
            TypeError,
            "keep_in_fp32_modules must be a list",
        ),
    ],
)
def test_config_refuses_bad_values(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        BnbQuantizationConfig(**kwargs)


def test_an_8bit_threshold_with_4bit_is_a_warning() -> None:
    with pytest.warns(UserWarning, match="only applies to 8-bit"):
        BnbQuantizationConfig(load_in_4bit=True, llm_int8_threshold=3.0)
    assert BnbQuantizationConfig(load_in_8bit=True, llm_int8_threshold=3).llm_int8_threshold == 3.0


# -- load_and_quantize_model: what is checked before bitsandbytes is needed ------------


@pytest.fixture
def no_bnb(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantization, "is_bnb_available", lambda min_version=None: False)


@pytest.mark.skipif(is_bnb_available(), reason="bitsandbytes is installed here")
def test_without_bitsandbytes_a_clear_import_error() -> None:
    with pytest.raises(ImportError, match=r"^bitsandbytes is not installed: pip install bitsandbytes$"):
        load_and_quantize_model(_mlp(), BnbQuantizationConfig(load_in_8bit=True))


def test_arguments_are_checked_first(no_bnb: None) -> None:
    config = BnbQuantizationConfig(load_in_4bit=True)
    with pytest.raises(TypeError, match="must be a BnbQuantizationConfig, got dict"):
        load_and_quantize_model(_mlp(), {"load_in_4bit": True})  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="disk offload"):
        load_and_quantize_model(_mlp(), config, offload_folder="offload")
    with pytest.raises(NotImplementedError, match="disk offload"):
        load_and_quantize_model(_mlp(), config, offload_state_dict=True)
    with init_empty_weights():
        empty = _mlp()
    with pytest.raises(ValueError, match="meta device .* give weights_location"):
        load_and_quantize_model(empty, config)
    with pytest.raises(
        ValueError, match="a string must be one of auto, balanced, balanced_low_0, sequential"
    ):
        load_and_quantize_model(_mlp(), config, device_map="everywhere")
    with pytest.raises(TypeError, match="device_map must be a dict"):
        load_and_quantize_model(_mlp(), config, device_map=0)  # type: ignore[arg-type]
    for device_map in ({"0": 0, "2": 1, "4": 0}, {"": "cpu"}, {"0": 0, "2": "disk", "4": 0}):
        with pytest.raises(NotImplementedError, match="does not put the whole model on one GPU"):
            load_and_quantize_model(_mlp(), config, device_map=device_map)
    # planned from sizes alone: fits one GPU, then bitsandbytes is missing; overflows, not built
    with pytest.raises(ImportError, match="bitsandbytes is not installed"):
        load_and_quantize_model(_mlp(), config, device_map="auto", max_memory={0: "1GiB", "cpu": "1GiB"})
    with pytest.raises(ImportError, match="bitsandbytes is not installed"):
        load_and_quantize_model(_mlp(), config, device_map={"": 0})
    with pytest.raises(NotImplementedError, match="does not put the whole model on one GPU"):
        load_and_quantize_model(
            _mlp(),
            config,
            device_map="sequential",
            max_memory={0: 400, "cpu": "1GiB"},
            no_split_module_classes=["Linear"],
        )


def test_without_a_gpu_a_clear_runtime_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantization, "is_bnb_available", lambda min_version=None: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bitsandbytes quantizes on a CUDA GPU, and none is available"):
        load_and_quantize_model(_mlp(), BnbQuantizationConfig(load_in_8bit=True))


# -- the pieces of the quantizing path that need no GPU ----------------------------------


def test_default_skip_modules_are_the_output_layer_and_tied_layers() -> None:
    assert quantization._default_skip_modules(TiedLM()) == ["embed", "head"]
    assert quantization._default_skip_modules(_mlp()) == ["4"]


class _Fake8bit(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, **options: Any) -> None:
        super().__init__(in_features, out_features, bias)
        self.options = options


class _Fake4bit(nn.Linear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool, compute_dtype: torch.dtype, **options: Any
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.options = {"compute_dtype": compute_dtype, **options}


def test_linear_layers_are_swapped_outside_the_kept_modules() -> None:
    fake = SimpleNamespace(Linear8bitLt=_Fake8bit, Linear4bit=_Fake4bit)
    model = TiedLM()
    inner = model.blocks[2][0]
    weight = inner.weight
    config = BnbQuantizationConfig(load_in_8bit=True, llm_int8_threshold=4.0)
    assert quantization._replace_linear_layers(model, config, ["embed", "head"], fake) == 2
    assert type(model.blocks[0]) is _Fake8bit and type(model.blocks[2][0]) is _Fake8bit
    assert type(model.head) is nn.Linear  # kept
    assert model.blocks[2][0].options == {"has_fp16_weights": False, "threshold": 4.0}
    assert model.blocks[2][0].weight.data is weight.data or torch.equal(model.blocks[2][0].weight, weight)
    assert not any(p.requires_grad for p in model.blocks.parameters())

    mlp = _mlp()
    config = BnbQuantizationConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True
    )
    assert quantization._replace_linear_layers(mlp, config, ["2"], fake) == 2
    assert [type(m).__name__ for m in mlp] == ["_Fake4bit", "ReLU", "Linear", "ReLU", "_Fake4bit"]
    assert mlp[0].options == {
        "compute_dtype": torch.float16,
        "compress_statistics": True,
        "quant_type": "nf4",
    }


def test_kept_module_names_match_at_any_depth() -> None:
    assert quantization._matches("blocks.2.0", ["2"]) and quantization._matches("blocks.2.0", ["blocks"])
    assert quantization._matches("model.lm_head", ["lm_head"])
    assert not quantization._matches("blocks.20", ["2"]) and not quantization._matches("head2", ["head"])


def test_meta_weights_are_materialised_with_their_ties() -> None:
    with init_empty_weights(include_buffers=True):
        model = TiedLM()
    quantization._materialize(model)
    assert not any(t.is_meta for t in model.state_dict().values())
    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, nn.Parameter)


# -- real quantization -------------------------------------------------------------------


@pytest.mark.skipif(not CAN_QUANTIZE, reason=NEEDS_BNB)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantizes_for_real(bits: int, tmp_path: Any) -> None:
    import bitsandbytes as bnb
    from safetensors.torch import save_file

    reference = _mlp().half().cuda()
    x = torch.randn(8, 16, dtype=torch.float16, device="cuda")
    config = BnbQuantizationConfig(load_in_8bit=bits == 8, load_in_4bit=bits == 4, bnb_4bit_quant_type="nf4")
    model = load_and_quantize_model(_mlp(), config)
    wanted = bnb.nn.Linear8bitLt if bits == 8 else bnb.nn.Linear4bit
    assert [type(m) for m in model] == [wanted, nn.ReLU, wanted, nn.ReLU, nn.Linear]  # the output layer kept
    assert model[4].weight.dtype == torch.float16 and getattr(model, f"is_loaded_in_{bits}bit")
    with torch.no_grad():
        assert torch.allclose(model(x).float(), reference(x).float(), atol=0.1, rtol=0.1)

    save_file({k: v.contiguous() for k, v in _mlp().state_dict().items()}, tmp_path / "model.safetensors")
    with init_empty_weights():
        empty = _mlp()
    loaded = load_and_quantize_model(empty, config, weights_location=tmp_path, device_map="auto")
    with torch.no_grad():
        assert torch.allclose(loaded(x).float(), reference(x).float(), atol=0.1, rtol=0.1)
