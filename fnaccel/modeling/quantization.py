"""bitsandbytes quantization: `BnbQuantizationConfig` and `load_and_quantize_model`.

The config is validated on its own, with or without bitsandbytes. Quantizing
replaces the model's ``nn.Linear`` layers by bitsandbytes' ``Linear8bitLt``
(LLM.int8()) or ``Linear4bit`` (FP4 / NF4) layers, which quantize their
weights when they move to the GPU; bitsandbytes quantizes on CUDA only.
Modules named in ``skip_modules`` (by default the output layer and tied
layers, as Accelerate) and in ``keep_in_fp32_modules`` stay unquantized.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

import torch
from torch import nn

from fnaccel.checks import is_number
from fnaccel.config.environment import is_bnb_available
from fnaccel.modeling.sizes import as_torch_dtype
from fnaccel.modeling.tensors import ModuleT

__all__ = ["BnbQuantizationConfig", "load_and_quantize_model"]

# Short names Accelerate's configs use, beside torch's own.
_SHORT_DTYPE_NAMES = MappingProxyType({"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"})
_QUANT_TYPES = ("fp4", "nf4")
_DEFAULT_THRESHOLD = 6.0
MISSING_BNB = "bitsandbytes is not installed: pip install bitsandbytes"


def _as_dtype(value: object, field_name: str) -> torch.dtype:
    dtype = as_torch_dtype(_SHORT_DTYPE_NAMES.get(value, value) if isinstance(value, str) else value)
    if dtype is not None and dtype.is_floating_point:
        return dtype
    raise ValueError(
        f"BnbQuantizationConfig: {field_name} must be one of {', '.join(map(repr, _SHORT_DTYPE_NAMES))}, "
        f"a floating-point torch.dtype or its name ('bfloat16'), got {value!r}"
    )


def _as_names(value: object, field_name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if (
        isinstance(value, str)
        or not isinstance(value, Sequence)
        or not all(isinstance(v, str) for v in value)
    ):
        raise TypeError(f"BnbQuantizationConfig: {field_name} must be a list of module names, got {value!r}")
    return tuple(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class BnbQuantizationConfig:
    """How `load_and_quantize_model` quantizes: LLM.int8() (8-bit) or FP4/NF4 (4-bit).

    Exactly one of ``load_in_8bit`` and ``load_in_4bit`` must be True. Dtype
    fields take ``"fp32"``, ``"fp16"``, ``"bf16"`` (or ``"float32"``...) or a
    ``torch.dtype`` and hold the ``torch.dtype`` after construction.

    Args:
        load_in_8bit: quantize linear layers to int8 (``bnb.nn.Linear8bitLt``).
        llm_int8_threshold: LLM.int8()'s outlier threshold (8-bit only).
        load_in_4bit: quantize linear layers to 4 bits (``bnb.nn.Linear4bit``).
        bnb_4bit_quant_type: ``"fp4"`` or ``"nf4"``.
        bnb_4bit_use_double_quant: quantize the quantization constants too.
        bnb_4bit_compute_dtype: the dtype 4-bit layers compute in.
        torch_dtype: the dtype of the layers left unquantized; default
            float16 for 8-bit, ``bnb_4bit_compute_dtype`` for 4-bit.
        skip_modules: module names never quantized (kept in ``torch_dtype``);
            None: the output layer and tied layers, as Accelerate.
        keep_in_fp32_modules: module names never quantized and kept in float32.

    Raises:
        ValueError: both or neither of 8 and 4 bits, an unknown quant type
            or dtype, a negative threshold.
        TypeError: a field of the wrong type.

    >>> config = BnbQuantizationConfig(load_in_4bit=True, bnb_4bit_compute_dtype="bf16")
    >>> config.torch_dtype, config.target_dtype
    (torch.bfloat16, 'int4')
    """

    load_in_8bit: bool = False
    llm_int8_threshold: float = _DEFAULT_THRESHOLD
    load_in_4bit: bool = False
    bnb_4bit_quant_type: str = "fp4"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_compute_dtype: str | torch.dtype = "fp16"
    torch_dtype: str | torch.dtype | None = None
    skip_modules: Sequence[str] | None = None
    keep_in_fp32_modules: Sequence[str] | None = None

    def __post_init__(self) -> None:
        for name in ("load_in_8bit", "load_in_4bit", "bnb_4bit_use_double_quant"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"BnbQuantizationConfig: {name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("BnbQuantizationConfig: load_in_8bit and load_in_4bit are both True; pick one")
        if not (self.load_in_8bit or self.load_in_4bit):
            raise ValueError(
                "BnbQuantizationConfig: set load_in_8bit=True or load_in_4bit=True "
                "(quantizing to neither is not quantizing)"
            )
        threshold = self.llm_int8_threshold
        if not is_number(threshold):
            raise TypeError(f"BnbQuantizationConfig: llm_int8_threshold must be a number, got {threshold!r}")
        if threshold < 0:
            raise ValueError(f"BnbQuantizationConfig: llm_int8_threshold must be >= 0, got {threshold}")
        if self.load_in_4bit and threshold != _DEFAULT_THRESHOLD:
            warnings.warn(
                "BnbQuantizationConfig: llm_int8_threshold only applies to 8-bit quantization; "
                "it is ignored with load_in_4bit",
                stacklevel=3,
            )
        if self.bnb_4bit_quant_type not in _QUANT_TYPES:
            raise ValueError(
                f"BnbQuantizationConfig: bnb_4bit_quant_type must be 'fp4' or 'nf4', "
                f"got {self.bnb_4bit_quant_type!r}"
            )
        compute = _as_dtype(self.bnb_4bit_compute_dtype, "bnb_4bit_compute_dtype")
        if self.torch_dtype is None:
            rest = torch.float16 if self.load_in_8bit else compute
        else:
            rest = _as_dtype(self.torch_dtype, "torch_dtype")
        object.__setattr__(self, "llm_int8_threshold", float(threshold))
        object.__setattr__(self, "bnb_4bit_compute_dtype", compute)
        object.__setattr__(self, "torch_dtype", rest)
        object.__setattr__(self, "skip_modules", _as_names(self.skip_modules, "skip_modules"))
        object.__setattr__(
            self, "keep_in_fp32_modules", _as_names(self.keep_in_fp32_modules, "keep_in_fp32_modules")
        )

    @property
    def target_dtype(self) -> torch.dtype | str:
        """What quantized weights become: ``torch.int8`` or ``"int4"`` (Accelerate's ``CustomDtype.INT4``)."""
        return torch.int8 if self.load_in_8bit else "int4"


def _matches(name: str, keys: Sequence[str]) -> bool:
    """Whether module ``name`` is, or is inside, a module named by one of ``keys`` (at any depth)."""
    return any(f".{key}." in f".{name}." for key in keys)


def _default_skip_modules(model: nn.Module) -> list[str]:
    """The output layer (the owner of the last parameter) and every module holding a tied parameter."""
    from fnaccel.modeling.tied import find_tied_parameters

    names = [name for group in find_tied_parameters(model) for name in group]
    last = [name for name, _ in model.named_parameters(remove_duplicate=False)][-1:]
    return sorted({name.rpartition(".")[0] for name in names + last} - {""})


def _target_device(
    model: nn.Module,
    config: BnbQuantizationConfig,
    keep: Sequence[str],
    device_map: Mapping[str, int | str | torch.device] | str | None,
    no_split_module_classes: Sequence[str] | None,
    max_memory: Mapping[int | str, int | str] | None,
) -> int | None:
    """The GPU index the whole quantized model goes to (None: the current one)."""
    if device_map is None:
        return None
    if isinstance(device_map, str):
        from fnaccel.modeling.device_map import resolve_device_map

        unquantized = config.torch_dtype
        assert isinstance(unquantized, torch.dtype)  # __post_init__ resolved it
        special = {
            name: torch.float32
            if _matches(name.rpartition(".")[0], config.keep_in_fp32_modules or ())
            else unquantized
            for name, _ in model.named_parameters()
            if _matches(name.rpartition(".")[0], keep)
        }
        device_map = resolve_device_map(
            model,
            device_map,
            max_memory,
            no_split_module_classes,
            dtype=config.target_dtype,
            special_dtypes=special,
        )
    if not isinstance(device_map, Mapping):
        raise TypeError(
            f"load_and_quantize_model: device_map must be a dict, a string or None, got {device_map!r}"
        )
    places = {
        None if d == "disk" else torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        for d in device_map.values()
    }
    place = next(iter(places)) if len(places) == 1 else None
    if place is None or place.type != "cuda":
        raise NotImplementedError(
            f"load_and_quantize_model: the device map {dict(device_map)} does not put the whole model "
            "on one GPU; bitsandbytes quantizes on a GPU, and dispatching a quantized model over "
            "several devices or offloading part of it to the CPU or disk is not built yet "
            "(use device_map=None, or a budget that fits one GPU)"
        )
    return place.index


def _materialize(model: nn.Module) -> None:
    """Give the meta-device tensors of ``model`` real (uninitialised) CPU storage, ties kept."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None or not tensor.is_meta:
                continue
            real = done.get(id(tensor))
            if real is None:
                real = torch.empty_like(tensor, device="cpu")
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                done[id(tensor)] = real
            if name in module._parameters:
                module._parameters[name] = real  # type: ignore[assignment]
            else:
                module._buffers[name] = real


def _load_weights(model: nn.Module, weights_location: str | os.PathLike[str]) -> None:
    """Materialize ``model`` (it may have been built under `init_empty_weights`) and load its weights."""
    from fnaccel.modeling.loading import load_checkpoint_in_model  # loads the checkpoint layer: on first use

    _materialize(model)
    load_checkpoint_in_model(model, weights_location, strict=True)


def _replace_linear_layers(
    model: nn.Module, config: BnbQuantizationConfig, keep: Sequence[str], bnb_nn: ModuleType
) -> int:
    """Swap every ``nn.Linear`` outside ``keep`` for its bitsandbytes layer; return how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear or _matches(full, keep):
                continue
            has_bias = child.bias is not None
            if config.load_in_8bit:
                layer = bnb_nn.Linear8bitLt(
                    child.in_features,
                    child.out_features,
                    has_bias,
                    has_fp16_weights=False,
                    threshold=config.llm_int8_threshold,
                )
            else:
                layer = bnb_nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    has_bias,
                    config.bnb_4bit_compute_dtype,
                    compress_statistics=config.bnb_4bit_use_double_quant,
                    quant_type=config.bnb_4bit_quant_type,
                )
            layer.weight.data = child.weight.data  # quantized when the layer moves to the GPU
            if has_bias:
                layer.bias.data = child.bias.data
            layer.requires_grad_(False)
            setattr(module, child_name, layer)
            swapped += 1
    return swapped


def load_and_quantize_model(
    model: ModuleT,
    bnb_quantization_config: BnbQuantizationConfig,
    weights_location: str | os.PathLike[str] | None = None,
    device_map: Mapping[str, int | str | torch.device] | str | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    max_memory: Mapping[int | str, int | str] | None = None,
    offload_folder: str | os.PathLike[str] | None = None,
    offload_state_dict: bool = False,
) -> ModuleT:
    """Quantize ``model``'s linear layers with bitsandbytes, in place, on one GPU.

    Loads the weights first when ``weights_location`` is given (then the
    model may have been built under `init_empty_weights`), casts the layers
    left unquantized to ``torch_dtype`` (``keep_in_fp32_modules`` to
    float32), replaces every other ``nn.Linear`` by ``bnb.nn.Linear8bitLt`` or
    ``bnb.nn.Linear4bit`` and moves the model to the GPU, which quantizes.

    Args:
        model: the model, materialised or on the meta device.
        bnb_quantization_config: how to quantize.
        weights_location: a safetensors file, index or directory
            (`fnaccel.utils.load_checkpoint_in_model`) to load first.
        device_map: None (the current GPU), a dict, or ``"auto"``,
            ``"balanced"``, ``"balanced_low_0"``, ``"sequential"``; it must
            place the whole model on one GPU.
        no_split_module_classes: with a string ``device_map``: classes never split.
        max_memory: with a string ``device_map``: the budget per device.
        offload_folder, offload_state_dict: disk offload, not built yet:
            only their defaults are accepted.

    Returns:
        ``model``, quantized on the GPU (``model.is_loaded_in_8bit`` /
        ``is_loaded_in_4bit`` set, as Accelerate and PEFT expect).

    Raises:
        ImportError: bitsandbytes is not installed.
        RuntimeError: no CUDA GPU.
        ValueError: a meta-device model without ``weights_location``, a bad ``device_map``.
        NotImplementedError: a device map over several devices, or offload.

    >>> config = BnbQuantizationConfig(load_in_8bit=True)
    >>> try:
    ...     model = load_and_quantize_model(torch.nn.Linear(4, 4), config)
    ... except (ImportError, RuntimeError):  # where bitsandbytes or a GPU is missing
    ...     model = None
    """
    if not isinstance(bnb_quantization_config, BnbQuantizationConfig):
        raise TypeError(
            "load_and_quantize_model: bnb_quantization_config must be a BnbQuantizationConfig, "
            f"got {type(bnb_quantization_config).__name__}"
        )
    config = bnb_quantization_config
    if offload_folder is not None or offload_state_dict:
        raise NotImplementedError(
            "load_and_quantize_model: disk offload (offload_folder, "
            "offload_state_dict) is not built yet; leave them at their defaults"
        )
    fp32 = list(config.keep_in_fp32_modules or ())
    keep = list(_default_skip_modules(model) if config.skip_modules is None else config.skip_modules) + fp32
    device = _target_device(model, config, keep, device_map, no_split_module_classes, max_memory)
    if weights_location is None and any(t.is_meta for t in model.state_dict().values()):
        raise ValueError(
            "load_and_quantize_model: the model is on the meta device (init_empty_weights); "
            "give weights_location, the checkpoint to load its weights from"
        )
    if not is_bnb_available():
        raise ImportError(MISSING_BNB)
    if not torch.cuda.is_available():
        raise RuntimeError(
            "load_and_quantize_model: bitsandbytes quantizes on a CUDA GPU, and none is available"
        )
    import bitsandbytes as bnb

    if weights_location is not None:
        _load_weights(model, weights_location)
    dtype = config.torch_dtype
    assert isinstance(dtype, torch.dtype)  # __post_init__ resolved it
    model.to(dtype)
    for name, module in model.named_modules():
        if name and _matches(name, fp32):
            module.float()
    _replace_linear_layers(model, config, keep, bnb.nn)
    model.cuda(device)  # bitsandbytes' parameters quantize on the way
    for bits in ("8bit", "4bit"):  # the flags Accelerate and PEFT read
        setattr(model, f"is_loaded_in_{bits}", getattr(config, f"load_in_{bits}"))
    return model
