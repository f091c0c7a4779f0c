"""fp8 training through torchao's float8 linear layers (``fa.autocast(fa.fp8)``).

`autocast(fa.fp8)` (fnaccel.transforms.mixed_precision) calls `convert_to_fp8` at
`fa.prepare`: the model's ``nn.Linear`` layers become torchao ``Float8Linear``
layers (`convert_to_float8_training`), whose matmuls cast their inputs,
weights and output gradients to float8 with dynamic per-tensor scales, and
everything else runs under bf16 autocast. Under `fa.fsdp()` the bf16 part
becomes FSDP2's mixed-precision policy, and with
``FP8RecipeKwargs(enable_fsdp_float8_all_gather=True)`` the shards are
all-gathered in float8 (a quarter of fp32's traffic).

The layers that stay in high precision are those Accelerate and torchtitan
leave out: the model's first and last ``nn.Linear`` (for stability: the
embedding-side projection and the output head) and every linear whose input
or output features are not multiples of 16 (the float8 matmul kernels need
them). ``FP8RecipeKwargs(module_filter_func=fn)`` replaces that choice with
torchao's own filter signature, ``fn(module, fqn) -> bool`` (True: convert).

`FP8RecipeKwargs` maps onto torchao's ``Float8LinearConfig``: ``fp8_format``
picks the float8 types (HYBRID, torchao's default: E4M3 forward, E5M2 output
gradients; E4M3 or E5M2 everywhere) and
``override_linear_precision`` keeps the forward, input-gradient or
weight-gradient matmul in high precision. Delayed-scaling options
(``margin``, ``interval``, ``amax_history_len``, ``amax_compute_algo``) and
MS-AMP's ``opt_level`` have no torchao counterpart (torchao scales each
tensor from its current amax) and are refused rather than ignored.
TransformerEngine ("TE") and MS-AMP ("MSAMP") run fp8 on CUDA GPUs only and
are not driven by this build: asking for them is refused with the reason.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fnaccel.config.environment import is_torchao_available
from fnaccel.kwargs import FP8RecipeKwargs

if TYPE_CHECKING:
    from torchao.float8 import CastConfig, Float8LinearConfig

__all__ = [
    "check_fp8_recipe",
    "convert_to_fp8",
    "float8_linear_config",
    "keep_first_and_last_linear",
    "recipe_from_config",
]

_MULTIPLE = 16  # float8 matmul kernels need both feature dims divisible by 16
_DELAYED_SCALING = ("margin", "interval", "amax_history_len", "amax_compute_algo")
_CUDA_ONLY = MappingProxyType(
    {"TE": ("TransformerEngine", "transformer_engine"), "MSAMP": ("MS-AMP", "msamp")}
)
_INSTALL = "pip install 'fnaccel[fp8]' (torchao)"


def check_fp8_recipe(recipe: FP8RecipeKwargs) -> None:
    """Refuse, with the reason, an fp8 recipe this build cannot run.

    Raises:
        ValueError: the backend is TransformerEngine or MS-AMP, or an option
            has no torchao counterpart.
        ImportError: torchao is not installed.

    >>> check_fp8_recipe(FP8RecipeKwargs(backend="AO", fp8_format="HYBRID"))
    >>> check_fp8_recipe(FP8RecipeKwargs(margin=1))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    ValueError: fp8: FP8RecipeKwargs(margin=1) configures delayed scaling, which torchao does not have
    (it scales each tensor from its current amax); drop the option
    """
    if recipe.backend is not None and recipe.backend in _CUDA_ONLY:
        package, module = _CUDA_ONLY[recipe.backend]
        missing = [] if torch.cuda.is_available() else ["this machine has no CUDA device"]
        if importlib.util.find_spec(module) is None:
            missing.append(f"{package} is not installed")
        why = " and ".join(missing) if missing else "this build of fnaccel does not drive it"
        raise ValueError(
            f"fp8: backend {recipe.backend!r} ({package}) runs fp8 on CUDA GPUs only; {why}. "
            f"Use FP8RecipeKwargs(backend='AO'): torchao's float8 layers ({_INSTALL})"
        )
    for name in _DELAYED_SCALING:
        if getattr(recipe, name) is not None:
            raise ValueError(
                f"fp8: FP8RecipeKwargs({name}={getattr(recipe, name)!r}) configures delayed scaling, "
                "which torchao does not have (it scales each tensor from its current amax); drop the option"
            )
    if recipe.opt_level is not None:
        raise ValueError(
            f"fp8: opt_level={recipe.opt_level!r} is MS-AMP's, which needs CUDA; "
            "drop it (torchao has no optimisation levels)"
        )
    if recipe.use_autocast_during_eval:
        raise ValueError(
            "fp8: use_autocast_during_eval is TransformerEngine's switch; torchao's float8 "
            "layers compute in float8 in eval mode too; drop the option"
        )
    if not is_torchao_available():
        raise ImportError(
            f"fa.autocast(fa.fp8) trains with torchao's float8 layers, which are not installed: {_INSTALL}"
        )


def recipe_from_config(section: Mapping[str, Any], source: str = "fp8_config") -> FP8RecipeKwargs | None:
    """The `FP8RecipeKwargs` a launch config's ``fp8_config`` section (or the ``--fp8_*``
    flags) describes, Accelerate's keys; values may be the text the launch carries. None
    when the section is empty.

    >>> recipe_from_config({"backend": "AO", "fp8_format": "E4M3", "amax_history_len": "16"})
    FP8RecipeKwargs(backend='AO', fp8_format='E4M3', amax_history_len=16)
    """
    from fnaccel._errors import ConfigError

    known = {
        "backend",
        "use_autocast_during_eval",
        "margin",
        "interval",
        "fp8_format",
        "amax_history_len",
        "amax_compute_algo",
        "override_linear_precision",
        "opt_level",
    }
    values = {key: value for key, value in section.items() if value not in (None, "")}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{source}: unknown key '{unknown[0]}'; known keys are {', '.join(sorted(known))}")

    def flag(key: str, text: object) -> bool:
        if isinstance(text, bool):
            return text
        lowered = str(text).strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{source}: {key} must be true or false, got {text!r}")
        return lowered in ("true", "1", "yes")

    try:
        for key in ("margin", "interval", "amax_history_len"):
            if key in values:
                values[key] = int(values[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {key} must be an integer, got {values[key]!r}") from None
    if "use_autocast_during_eval" in values:
        values["use_autocast_during_eval"] = flag(
            "use_autocast_during_eval", values["use_autocast_during_eval"]
        )
    precision = values.get("override_linear_precision")
    if isinstance(precision, str):
        values["override_linear_precision"] = tuple(
            flag("override_linear_precision", part) for part in precision.strip("()[] ").split(",")
        )
    if values.get("backend") is not None and str(values["backend"]).upper() == "TORCHAO":
        values["backend"] = "AO"
    if not values:
        return None
    try:
        return FP8RecipeKwargs(**values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def float8_linear_config(recipe: FP8RecipeKwargs) -> Float8LinearConfig:
    """torchao's ``Float8LinearConfig`` for ``recipe`` (see the module docstring).

    >>> config = float8_linear_config(FP8RecipeKwargs(fp8_format="E4M3"))
    >>> config.cast_config_grad_output.target_dtype
    torch.float8_e4m3fn
    """
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType

    check_fp8_recipe(recipe)
    fmt = recipe.fp8_format or "HYBRID"
    forward = torch.float8_e5m2 if fmt == "E5M2" else torch.float8_e4m3fn
    backward = torch.float8_e4m3fn if fmt == "E4M3" else torch.float8_e5m2
    fprop, dgrad, wgrad = recipe.override_linear_precision or (False, False, False)

    def cast(dtype: torch.dtype, high_precision: bool) -> CastConfig:
        # torchao wants an operand's dtype the same in both matmuls, even where one keeps it unscaled
        scaling = ScalingType.DISABLED if high_precision else ScalingType.DYNAMIC
        return CastConfig(scaling_type=scaling, target_dtype=dtype)

    return Float8LinearConfig(
        cast_config_input=cast(forward, fprop),
        cast_config_weight=cast(forward, fprop),
        cast_config_grad_output=cast(backward, dgrad),
        cast_config_weight_for_grad_input=cast(forward, dgrad),
        cast_config_input_for_grad_weight=cast(forward, wgrad),
        cast_config_grad_output_for_grad_weight=cast(backward, wgrad),
        enable_fsdp_float8_all_gather=bool(recipe.enable_fsdp_float8_all_gather),
    )


def _fits_float8(module: nn.Linear) -> bool:
    return module.in_features % _MULTIPLE == 0 and module.out_features % _MULTIPLE == 0


def keep_first_and_last_linear(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The default choice of layers to train in fp8, for ``model``: every
    ``nn.Linear`` but the first and the last, and but those whose features are
    not multiples of 16 (torchao's ``module_filter_fn`` signature).

    >>> model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 24), nn.Linear(32, 4))
    >>> keep = keep_first_and_last_linear(model)
    >>> [keep(m, name) for name, m in model.named_children()]
    [False, True, False, False]
    """
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    edges = {linears[0], linears[-1]} if linears else set()

    def convert(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and fqn not in edges and _fits_float8(module)

    return convert


def convert_to_fp8(model: nn.Module, recipe: FP8RecipeKwargs) -> nn.Module:
    """Swap ``model``'s chosen ``nn.Linear`` layers for torchao ``Float8Linear``, in place.

    Raises:
        ValueError: the recipe's ``module_filter_func`` picks a linear layer
            whose features are not multiples of 16, or no layer at all.

    >>> model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16))
    >>> type(convert_to_fp8(model, FP8RecipeKwargs())[1]).__name__
    'Float8Linear'
    """
    from torchao.float8 import convert_to_float8_training

    config = float8_linear_config(recipe)
    chosen = recipe.module_filter_func or keep_first_and_last_linear(model)
    picked = {
        fqn: module
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear) and chosen(module, fqn)
    }
    for fqn, module in picked.items():
        if not _fits_float8(module):
            raise ValueError(
                f"fp8: module_filter_func picked {fqn or 'the model'!r} ({module.in_features} -> "
                f"{module.out_features} features), but float8 matmuls need both to be multiples of "
                f"{_MULTIPLE}; leave it out"
            )
    if not picked:
        raise ValueError(
            f"fp8: no nn.Linear of {type(model).__name__} would train in float8 (the first and last "
            f"linear layers and those with features not multiples of {_MULTIPLE} stay in high "
            "precision); use fa.autocast(fa.bf16), or choose layers with "
            "FP8RecipeKwargs(module_filter_func=...)"
        )
    # a model that is itself one nn.Linear comes back as a new module
    converted: nn.Module = convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn in picked
    )
    if config.enable_fsdp_float8_all_gather:
        for fqn in picked:
            converted.get_submodule(fqn).register_state_dict_post_hook(_plain_weight)
    return converted


def _plain_weight(
    module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, local_metadata: object
) -> None:
    """For float8 all-gather, torchao wraps each weight in a tensor subclass without
    storage of its own; checkpoints read and write the plain tensor it wraps instead
    (the same storage, so a load still lands in the parameter)."""
    from torch.distributed.tensor import DTensor

    key = prefix + "weight"
    weight = state_dict.get(key)
    if weight is None:
        return
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
        return
    names, _ = local.__tensor_flatten__()
    plain = getattr(local, names[0]).detach()
    if isinstance(weight, DTensor):
        plain = DTensor.from_local(
            plain,
            weight.device_mesh,
            weight.placements,
            run_check=False,
            shape=weight.shape,
            stride=weight.stride(),
        )
    state_dict[key] = plain
