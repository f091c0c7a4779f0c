"""Mixed precision: `autocast(dtype)` (fp16, bf16, fp8) and the fp16 `grad_scaler()`.

`autocast` wraps the model's ``forward`` once, at `fa.prepare`, in
``torch.autocast`` and casts its outputs back to fp32 (as Accelerate does), so
every forward, in `fa.step` or in a hand-written step, runs under it and a
loss computed outside the model sees fp32. Under `fsdp()` the precision goes
into FSDP2's `MixedPrecisionPolicy` instead (see `fnaccel.transforms.parallel`).
``autocast(fa.fp8)`` first swaps the model's linear layers for torchao's
float8 ones (`fnaccel.transforms.fp8`) and autocasts the rest to bf16.

`grad_scaler` keeps a live `torch.amp.GradScaler` as its state: it scales the
loss before backward, unscales before clipping, and replaces the optimizer
step, skipping it (and the scheduler) when a gradient is inf or nan.
`fa.prepare` adds it on its own to a pipeline that autocasts to fp16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from fnaccel.constants import PrecisionType
from fnaccel.dist import DistContext
from fnaccel.kwargs import FP8RecipeKwargs, GradScalerKwargs
from fnaccel.ops.tree import convert_to_fp32
from fnaccel.transforms.contract import PipelineView, PrepareRequest
from fnaccel.transforms.declared import Capability, Precision
from fnaccel.transforms.fp8 import check_fp8_recipe, convert_to_fp8
from fnaccel.transforms.kinds import PrecisionTransform, StepTransform, options
from fnaccel.transforms.phases import Phase
from fnaccel.transforms.pipeline import Pipeline, compose

__all__ = ["autocast", "bf16", "fp8", "fp16", "fp32", "grad_scaler", "precision_dtype"]

fp16 = torch.float16
bf16 = torch.bfloat16
fp32 = torch.float32
# Not a dtype: fp8 training is a recipe (float8 linear layers, bf16 elsewhere).
fp8 = PrecisionType.FP8

_BY_NAME = MappingProxyType(
    {
        "fp16": fp16,
        "float16": fp16,
        "bf16": bf16,
        "bfloat16": bf16,
        "fp32": fp32,
        "float32": fp32,
        "no": fp32,
    }
)
_PRECISION_OF = MappingProxyType({fp16: PrecisionType.FP16, bf16: PrecisionType.BF16, fp32: PrecisionType.NO})


def precision_dtype(precision: torch.dtype | str | PrecisionType) -> torch.dtype:
    """``fa.fp16`` / ``"fp16"`` / ``PrecisionType.FP16`` -> ``torch.float16`` (and so
    on); ``fa.fp8`` -> ``torch.bfloat16``, the dtype of what its float8 layers leave.

    >>> precision_dtype("fp16"), precision_dtype(fp8)
    (torch.float16, torch.bfloat16)
    """
    if isinstance(precision, torch.dtype):
        if precision not in (fp16, bf16, fp32):
            raise ValueError(f"autocast: {precision} is not fa.fp16, fa.bf16, fa.fp32 or fa.fp8")
        return precision
    name = str(precision).lower()
    if name == fp8:
        return bf16
    if name not in _BY_NAME:
        raise ValueError(f"unknown precision {precision!r}: use fa.fp16, fa.bf16, fa.fp32 or fa.fp8")
    return _BY_NAME[name]


class AutocastForward:
    """``forward`` run under ``torch.autocast``, outputs cast to fp32 (picklable)."""

    def __init__(
        self, forward: Callable[..., object], device_type: str, dtype: torch.dtype, cache_enabled: bool | None
    ) -> None:
        self.forward, self.device_type = forward, device_type
        self.dtype, self.cache_enabled = dtype, cache_enabled
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=self.cache_enabled):
            out = self.forward(*args, **kwargs)
        return convert_to_fp32(out)


def autocast(
    dtype: torch.dtype | str, cache_enabled: bool | None = None, *, recipe: FP8RecipeKwargs | None = None
) -> PrecisionTransform:
    """Run the model's forward under ``torch.autocast(dtype)`` (AutocastKwargs' options).

    With ``fa.fp8``, the model's linear layers train in float8 (torchao's
    ``Float8Linear``, see `fnaccel.transforms.fp8`) and the rest under bf16
    autocast; the first and last linear layers, and those with features not
    multiples of 16, stay in high precision unless ``recipe`` chooses.

    Args:
        dtype: ``fa.fp16``, ``fa.bf16``, ``fa.fp8`` or ``fa.fp32`` (no autocast).
        cache_enabled: ``torch.autocast``'s weight-cast cache (None: torch's default).
        recipe: fp8 only: `FP8RecipeKwargs` (format, high-precision matmuls,
            float8 all-gather under `fa.fsdp()`, the layers to convert).

    Raises:
        ValueError: a recipe without ``fa.fp8``, or a recipe this build cannot
            run (TransformerEngine, MS-AMP, delayed scaling), with the reason.
        ImportError: ``fa.fp8`` without torchao installed.

    >>> import fnaccel as fa
    >>> fa.autocast(fa.bf16)
    autocast(dtype=torch.bfloat16)
    >>> fa.autocast(fp8, recipe=fa.FP8RecipeKwargs(fp8_format="HYBRID"))  # fa.fp8
    autocast(dtype='fp8', recipe=FP8RecipeKwargs(fp8_format='HYBRID'))
    """
    resolved = precision_dtype(dtype)
    is_fp8 = not isinstance(dtype, torch.dtype) and str(dtype).lower() == fp8
    if recipe is not None and not is_fp8:
        raise ValueError(
            f"autocast: recipe= configures fp8 training, but the precision is {dtype!r}; "
            "use fa.autocast(fa.fp8, recipe=...) or drop the recipe"
        )
    if recipe is not None and not isinstance(recipe, FP8RecipeKwargs):
        raise TypeError(f"autocast: recipe must be an fa.FP8RecipeKwargs, got {type(recipe).__name__}")
    fp8_recipe = recipe or FP8RecipeKwargs()
    if is_fp8:
        check_fp8_recipe(fp8_recipe)  # refuse TE/MS-AMP or a missing torchao now, not at prepare

    def prepare_model(ctx: DistContext, model: nn.Module, state: object) -> nn.Module:
        if resolved is fp32:
            return model
        if is_fp8:
            model = convert_to_fp8(model, fp8_recipe)
        model.forward = AutocastForward(model.forward, ctx.device.type, resolved, cache_enabled)
        return model

    opts = (
        options(dtype=str(fp8) if is_fp8 else resolved)
        + (options(cache_enabled=cache_enabled) if cache_enabled is not None else ())
        + (options(recipe=recipe) if recipe is not None else ())
    )

    def check(request: PrepareRequest) -> PipelineView:
        pipeline = request.pipeline
        if resolved is not fp16 or Capability.SCALES_LOSS in pipeline.capabilities:
            return pipeline  # only fp16 needs scaling; DeepSpeed scales fp16 losses itself
        # nested, compose puts it in its canonical place: after autocast, before ddp/fsdp and the rest
        assert isinstance(pipeline, Pipeline), "fa.prepare hands the checks its Pipeline"
        return compose(pipeline, grad_scaler())

    precision = fp8 if is_fp8 else _PRECISION_OF[resolved]
    return PrecisionTransform(
        name="autocast",
        options=opts,
        phase=Phase.AUTOCAST,
        prepare_model=prepare_model,
        settings=Precision(precision=precision, dtype=resolved, cache_enabled=cache_enabled),
        check=check,
    )


def _check_scaled_precision(request: PrepareRequest) -> PipelineView:
    pipeline = request.pipeline
    precision = pipeline.settings(Precision)
    if precision is None or precision.precision is not PrecisionType.FP16:
        raise ValueError("fa.prepare: grad_scaler() only makes sense with autocast(fa.fp16)")
    return pipeline


def grad_scaler(**kwargs: Any) -> StepTransform:
    """Dynamic loss scaling for fp16, with `GradScalerKwargs`' options.

    Metrics at an update: ``scale`` (the scale from now on) and ``skipped``
    (a bool tensor, True when inf/nan gradients skipped the optimizer step).

    >>> import fnaccel as fa
    >>> fa.grad_scaler(init_scale=1024.0)
    grad_scaler(init_scale=1024.0)
    """
    handler = GradScalerKwargs(**kwargs)

    def init(ctx: DistContext) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(ctx.device.type, **handler.to_kwargs())

    def scale_loss(loss: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
        return scaler.scale(loss)

    def before_update(
        model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> dict[str, torch.Tensor]:
        scaler.unscale_(optimizer)  # clipping, which comes next, sees true gradients
        return {}

    def optimizer_step(
        optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> dict[str, torch.Tensor]:
        scaler.step(optimizer)
        # torch keeps the per-device inf flags of this step here until update()
        flags = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        skipped = torch.stack(flags).sum() > 0 if flags else torch.tensor(False)
        scaler.update()
        scale = scaler._scale  # the scale tensor itself: get_scale() would sync with the host
        assert scale is not None, "the scaler scaled this step's loss"
        return {"skipped": skipped, "scale": scale.detach().clone()}

    return StepTransform(
        name="grad_scaler",
        options=options(**handler.to_kwargs()),
        phase=Phase.GRAD_SCALER,
        capabilities=frozenset({Capability.SCALES_LOSS}),
        check=_check_scaled_precision,
        init=init,
        scale_loss=scale_loss,
        before_update=before_update,
        optimizer_step=optimizer_step,
    )
