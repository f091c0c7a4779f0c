"""`deepspeed(...)`: hand the model and optimizer to the real DeepSpeed engine (ZeRO 0-3).

`fa.prepare` builds the engine (``deepspeed.initialize``) from the
`DeepSpeedPlugin` fields given here and from the pipeline: ``fa.accumulate``,
``fa.clip_grad_norm`` and ``fa.autocast`` fill the DeepSpeed config's
``"auto"`` values (`fnaccel.transforms.plugins.deepspeed`). The step keeps its
shape: `fa.backward` runs the engine's backward (ZeRO-2/3 reduce gradients
there), `fa.apply_gradients` at an accumulation boundary runs the engine's
step (reduce for ZeRO-0/1, clip, optimizer step, zero the gradients), then the
scheduler passed to `fa.prepare`. DeepSpeed is told fnaccel owns the boundary
(``managed_gradient_accumulation: false``), so the two counters never
disagree.

DeepSpeed's communication runs over the run's default process group (gloo on
CPU, nccl on CUDA). On the CPU, ``deepspeed.init_distributed`` would compile a
shared-memory extension (``deepspeed_shm_comm``: gcc and ninja, 25-64 s the
first time) that only inference all-reduce uses; fnaccel tells DeepSpeed's own
op table it is unavailable before the engine starts, so training needs no
compiler and pays no build.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from fnaccel._errors import CheckpointError
from fnaccel.checkpoint.storage.files import read_json, read_tensors, untie, verify_file
from fnaccel.checkpoint.storage.layout import CheckpointFiles
from fnaccel.checkpoint.storage.parts import (
    check_tensors,
    optimizer_payload,
    optimizer_state,
    saved_weights,
    unwrap_compiled,
    unwrap_model,
)
from fnaccel.checks import is_int
from fnaccel.constants import PrecisionType
from fnaccel.dist import DistContext
from fnaccel.transforms.contract import EngineRequest
from fnaccel.transforms.declared import Accumulation, Capability, GradientClipping, Precision
from fnaccel.transforms.kinds import EngineTransform, options
from fnaccel.transforms.phases import Phase
from fnaccel.transforms.plugins.deepspeed import DeepSpeedPlugin, EngineSettings, resolve_ds_config

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = [
    "DeepSpeedState",
    "ZeroLayout",
    "deepspeed",
    "deepspeed_engine",
    "gathered_parameters",
    "master_partitions",
    "optimizer_over_partitions",
    "refresh_parameters",
    "zero_init",
]


class ZeroOptimizer(Protocol):
    """What fnaccel reads of a DeepSpeed engine's optimizer wrapper for every stage (the
    stage-specific members are asked with ``getattr``/``hasattr``)."""

    optimizer: torch.optim.Optimizer  # the base optimizer, stepping the master partitions


class _Stage3Optimizer(ZeroOptimizer, Protocol):
    """ZeRO-3's optimizer wrapper: its masters are partitioned flat groups that it swaps
    into the base optimizer's parameter groups for a step."""

    fp32_partitioned_groups_flat: list[torch.Tensor]

    def _set_fp32_optimizer_param_groups(self) -> None: ...

    def _clear_fp32_optimizer_param_groups(self) -> None: ...

    def _reassign_or_swap_out_partitioned_parameters(self, sub_group_id: int) -> None: ...


class _LowPrecisionCopies(ZeroOptimizer, Protocol):
    """ZeRO-1/2's (and bf16's) optimizer wrapper: sets the model's parameters from its masters."""

    def update_lp_params(self) -> None: ...


def _stage3(opt: ZeroOptimizer) -> _Stage3Optimizer | None:
    # DeepSpeed's classes are untyped: the member ZeRO-3's wrapper alone has says which it is
    return cast(_Stage3Optimizer, opt) if hasattr(opt, "_set_fp32_optimizer_param_groups") else None


class DeepSpeedEngine(Protocol):
    """What fnaccel asks of a ``deepspeed.DeepSpeedEngine`` (DeepSpeed ships no types)."""

    module: torch.nn.Module
    optimizer: ZeroOptimizer

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool) -> object: ...

    def step(self) -> None: ...

    def was_step_applied(self) -> bool: ...

    def get_global_grad_norm(self) -> float | torch.Tensor | None: ...

    def destroy(self) -> None: ...


def deepspeed_engine(model: object) -> DeepSpeedEngine | None:
    """The DeepSpeed engine ``model`` is, or None (DeepSpeed is not imported for this)."""
    ds = sys.modules.get("deepspeed")
    if ds is None or not isinstance(model, ds.DeepSpeedEngine):
        return None
    return cast(DeepSpeedEngine, model)  # the isinstance above; DeepSpeed's class is untyped


class DeepSpeedState:
    """``deepspeed()``'s state: the engine `fa.prepare` built (None before), and the
    settings it was built from. `fa.shutdown` closes it (the engine's hooks and buffers)."""

    __slots__ = ("clipping", "config", "engine")

    def __init__(self, ctx: DistContext) -> None:
        self.engine: DeepSpeedEngine | None = None
        self.config: dict[str, object] = {}
        self.clipping = False

    def close(self) -> None:
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None


def _settings(request: EngineRequest) -> EngineSettings:
    """What the pipeline says about the settings a DeepSpeed config also holds; the
    combinations the engine cannot run are refused here, naming the fix."""
    pipeline = request.pipeline
    accumulate = pipeline.settings(Accumulation)
    clip = pipeline.settings(GradientClipping)
    cast = pipeline.settings(Precision)
    if accumulate is not None:
        if accumulate.sums_items:
            raise ValueError(
                "fa.deepspeed: accumulate(normalize='items') scales the gradients by the item "
                "count, which DeepSpeed's partitioned gradients do not expose; use "
                "normalize='mean'"
            )
        if accumulate.sync_each_batch:
            raise ValueError(
                "fa.deepspeed: accumulate(sync_each_batch=True) has no meaning here: ZeRO-2/3 "
                "reduce every backward, ZeRO-0/1 at the boundary; drop sync_each_batch"
            )
    max_norm = None
    if clip is not None:
        if clip.norm_type != 2.0:
            raise ValueError(
                f"fa.deepspeed: DeepSpeed clips the 2-norm only, not the {clip.norm_type}-norm; "
                "use fa.clip_grad_norm(max_norm)"
            )
        max_norm = float(clip.max_norm)
    precision = None
    if cast is not None:
        if cast.precision is PrecisionType.FP8:
            raise ValueError(
                "fa.deepspeed: fa.autocast(fa.fp8) is not a DeepSpeed precision; use "
                "fa.autocast(fa.bf16) or fa.autocast(fa.fp16), or fp8 with fa.ddp() or fa.fsdp()"
            )
        if cast.precision is not PrecisionType.NO:
            precision = cast.precision.value  # "bf16" or "fp16"
    if precision == "fp16" and request.ctx.device.type == "cpu":
        raise ValueError(
            "fa.deepspeed: DeepSpeed's CPU accelerator has no fp16 training; use "
            "fa.autocast(fa.bf16) (or train on CUDA)"
        )
    config = getattr(request.model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    return EngineSettings(
        micro_steps=None if accumulate is None else accumulate.micro_steps,
        max_grad_norm=max_norm,
        precision=precision,
        micro_batch_size=request.micro_batch_size,
        num_processes=request.ctx.num_processes,
        hidden_size=hidden if isinstance(hidden, int) else None,
    )


def _start_comm(ctx: DistContext) -> None:
    """Let DeepSpeed use the run's process group, without building its CPU shared-memory op."""
    import deepspeed  # loads deepspeed.comm and deepspeed.ops with it

    if not dist.is_initialized():
        raise ValueError(
            "fa.deepspeed: DeepSpeed runs over torch.distributed's default process group, "
            "and this process has none; launch with `fnaccel launch` or torchrun "
            "(2 or more processes), or leave fa.deepspeed out in a world of one"
        )
    if ctx.process_group is not None and dist.get_world_size(ctx.process_group) != dist.get_world_size():
        raise ValueError(
            "fa.deepspeed: DeepSpeed communicates over the default process group, which "
            "is not this run's; start the run with fa.init in a fresh process"
        )
    if deepspeed.comm.comm.cdb is None and ctx.device.type == "cpu":
        # DeepSpeed's own table of usable ops (kept for the process, by design): the shm op
        # serves inference all-reduce only, and building it needs a compiler and half a minute
        deepspeed.ops.__compatible_ops__[deepspeed.ops.op_builder.cpu.ShareMemCommBuilder.NAME] = False
    deepspeed.comm.init_distributed(dist_backend=ctx.backend, dist_init_required=False)


def _prepare_engine(
    plugin: DeepSpeedPlugin, request: EngineRequest
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import deepspeed as ds  # loads deepspeed.utils with it

    if request.optimizer is None:
        raise ValueError(
            "fa.prepare: fa.deepspeed() builds its engine from the model and the optimizer "
            "together; pass both in the same fa.prepare call"
        )
    state = request.state
    assert isinstance(state, DeepSpeedState), "fa.prepare hands the engine its own state"
    if state.engine is not None:
        raise ValueError(
            "fa.prepare: this fa.deepspeed() already holds an engine; each model gets its own "
            "pipeline (fa.compose(fa.deepspeed(...)) per model and state)"
        )
    config = resolve_ds_config(
        plugin.ds_config(),
        _settings(request),
        str(plugin.hf_ds_config) if plugin.hf_ds_config is not None else "fa.deepspeed",
    )
    _start_comm(request.ctx)
    model = request.model
    if plugin.transformer_moe_cls_names:
        names = {name.strip() for name in plugin.transformer_moe_cls_names.split(",")}
        classes = list({type(m) for m in model.modules() if type(m).__name__ in names})
        if not classes:
            raise ValueError(
                f"fa.deepspeed: transformer_moe_cls_names {sorted(names)} names no class of "
                "the model's modules"
            )
        ds.utils.set_z3_leaf_modules(model, classes)
    engine, _, _, _ = ds.initialize(
        model=model, optimizer=request.optimizer, config=config, dist_init_required=False
    )
    state.engine = engine
    state.config = config
    state.clipping = float(config.get("gradient_clipping", 0) or 0) > 0
    return engine, request.optimizer


def zero_init(plugin: DeepSpeedPlugin, state: RunState) -> AbstractContextManager[object]:
    """``deepspeed.zero.Init`` for ``plugin``'s ZeRO-3 settings over ``state``'s processes, its
    parameters in the launch's precision (bf16 under ``mixed_precision`` bf16)."""
    import deepspeed as ds

    precision = state.mixed_precision.value
    settings = EngineSettings(
        precision=precision if precision in ("bf16", "fp16") else None, num_processes=state.dist.num_processes
    )
    config = resolve_ds_config(plugin.ds_config(), settings, "zero3_init_context_manager")
    if config["zero_optimization"]["stage"] != 3:
        raise ValueError("zero3_init_context_manager: zero3_init_flag needs zero_stage 3")
    _start_comm(state.dist)
    init: AbstractContextManager[object] = ds.zero.Init(config_dict_or_path=config)
    return init


def _engine(state: DeepSpeedState) -> DeepSpeedEngine:
    assert state.engine is not None, "fa.prepare built the engine before any step"
    return state.engine


def _backward(loss: torch.Tensor, state: DeepSpeedState) -> None:
    # fnaccel has divided the loss by the accumulation already
    _engine(state).backward(loss, scale_wrt_gas=False)


def _optimizer_step(optimizer: torch.optim.Optimizer, state: DeepSpeedState) -> dict[str, torch.Tensor]:
    engine = _engine(state)
    engine.step()
    metrics: dict[str, torch.Tensor] = {}
    if not engine.was_step_applied():
        # DeepSpeed skipped it (gradients with inf/NaN: bf16's check_grad_overflow, on by default
        # in 0.19.8, or fp16's scaler): fa.step holds the scheduler and says so, as for fp16's scaler
        metrics["skipped"] = torch.tensor(True)
    if state.clipping:
        norm = engine.get_global_grad_norm()
        if norm is not None:
            metrics["grad_norm"] = torch.as_tensor(norm, dtype=torch.float32).detach()
    return metrics


def deepspeed(**settings: Any) -> EngineTransform:
    """Train through DeepSpeed's engine (ZeRO stage 0-3, offload), configured by
    `DeepSpeedPlugin`'s fields.

    Args:
        **settings: `DeepSpeedPlugin` fields: ``zero_stage`` (2 when unset),
            ``offload_optimizer_device`` / ``offload_param_device`` ("none",
            "cpu", "nvme" with ``offload_*_nvme_path``),
            ``gradient_accumulation_steps``, ``gradient_clipping``,
            ``zero3_init_flag``, ``zero3_save_16bit_model``,
            ``transformer_moe_cls_names``; or ``hf_ds_config``: a DeepSpeed
            JSON file or dict (its ``"auto"`` values filled from the run).

    Accumulation, clipping and precision come from the pipeline
    (``fa.accumulate``, ``fa.clip_grad_norm``, ``fa.autocast(fa.bf16)``) or
    from these settings; given in both places they must agree. The optimizer
    and scheduler are the ones passed to `fa.prepare`. Needs ``pip install
    'fnaccel[deepspeed]'`` and a process group (`fnaccel launch`).

    >>> import fnaccel as fa
    >>> fa.compose(fa.deepspeed(zero_stage=3), fa.accumulate(2), fa.clip_grad_norm(1.0))
    compose(deepspeed(zero_stage=3), accumulate(num_steps=2), clip_grad_norm(max_norm=1.0))
    >>> fa.deepspeed(zero_stage=4)
    Traceback (most recent call last):
    ...
    fnaccel._errors.ConfigError: DeepSpeedPlugin: zero_stage must be 0, 1, 2 or 3, got 4
    """
    plugin = DeepSpeedPlugin(**settings)
    raw = plugin.ds_config()
    steps = raw.get("gradient_accumulation_steps")
    defaults = DeepSpeedPlugin()
    shown = {
        f.name: getattr(plugin, f.name)
        for f in fields(plugin)
        if getattr(plugin, f.name) != getattr(defaults, f.name)
    }
    if isinstance(shown.get("hf_ds_config"), Mapping):
        shown["hf_ds_config"] = "{...}"
    return EngineTransform(
        name="deepspeed",
        options=options(**shown),
        phase=Phase.DATA_PARALLEL,
        conflicts=frozenset({"ddp", "fsdp", "grad_scaler", "clip_grad_value", "local_sgd", "compile"}),
        capabilities=frozenset({Capability.AVERAGES_GRADIENTS, Capability.SCALES_LOSS}),
        init=DeepSpeedState,
        optimizer_step=_optimizer_step,
        prepare_engine=lambda request: _prepare_engine(plugin, request),
        backward=_backward,
        takes_over=frozenset({Capability.CLIPS_GRADIENTS}),
        micro_steps=steps if is_int(steps) and steps > 1 else 1,
        layout=ZeroLayout(),
    )


def master_partitions(engine: DeepSpeedEngine) -> list[torch.Tensor] | None:
    """This rank's fp32 master partitions (the tensors its base optimizer steps), or None
    when the engine steps the model's own parameters (stage 0 in fp32)."""
    opt = engine.optimizer
    for name in (
        "fp32_partitioned_groups_flat",
        "single_partition_of_fp32_groups",
        "fp32_groups_flat_partition",
    ):
        found = getattr(opt, name, None)
        if found is not None:
            return list(found)
    return None


@contextlib.contextmanager
def optimizer_over_partitions(engine: DeepSpeedEngine) -> Iterator[torch.optim.Optimizer]:
    """The base optimizer with its parameter groups over the master partitions (ZeRO-3
    empties them between steps), for reading or loading its state."""
    opt = _stage3(engine.optimizer)
    if opt is None:
        yield engine.optimizer.optimizer
        return
    opt._set_fp32_optimizer_param_groups()
    try:
        yield opt.optimizer
    finally:
        opt._clear_fp32_optimizer_param_groups()


def refresh_parameters(engine: DeepSpeedEngine) -> None:
    """Set the model's (16-bit or fp32) parameters from the master partitions, as a step does."""
    opt = _stage3(engine.optimizer)
    if opt is not None:
        for group in range(len(opt.fp32_partitioned_groups_flat)):
            opt._reassign_or_swap_out_partitioned_parameters(group)
    else:
        cast(_LowPrecisionCopies, engine.optimizer).update_lp_params()  # ZeRO-1/2's, bf16's


@contextlib.contextmanager
def gathered_parameters(module: torch.nn.Module) -> Iterator[None]:
    """ZeRO-3: every rank holds the full parameters inside (a collective); otherwise nothing."""
    params = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not params:
        yield
        return
    import deepspeed as ds

    with ds.zero.GatheredParameters(params, modifier_rank=None):
        yield


# -- its checkpoint layout: DeepSpeed's own save_checkpoint pickles (torch.save), so each rank
# writes the optimizer partitions it holds in safetensors, and rank 0 the consolidated weights.


def zero_engine(model: torch.nn.Module | None) -> DeepSpeedEngine | None:
    """The DeepSpeed engine of a run whose optimizer steps master partitions, or None."""
    engine = None if model is None else deepspeed_engine(unwrap_compiled(model))
    return engine if engine is not None and master_partitions(engine) is not None else None


def _held_zero_engine(state: RunState) -> DeepSpeedEngine:
    engine = zero_engine(state.model)
    assert engine is not None, "ZeroLayout.holds found this engine"
    return engine


def _names(masters: list[torch.Tensor]) -> dict[int, str]:
    return {id(m): f"partition{i}" for i, m in enumerate(masters)}


def snapshot_zero(
    state: RunState, engine: DeepSpeedEngine
) -> tuple[str, dict[str, torch.Tensor], str, dict[str, object]]:
    """``(tensor file, tensors, json file, json)`` of this rank's ZeRO files."""
    if state.plan is not None and state.micro_step % state.plan.micro_steps != 0:
        raise CheckpointError(
            f"fa.save: micro-step {state.micro_step} falls inside an accumulation of "
            f"{state.plan.micro_steps}, and DeepSpeed keeps the partial gradients in buffers of its own; "
            "save after the update (when state.micro_step is a multiple of the accumulation)"
        )
    masters = master_partitions(engine)
    assert masters is not None, "ZeroLayout.holds found this engine"
    with optimizer_over_partitions(engine) as base:
        tensors, saved = optimizer_payload(base, _names(masters))
    tensors.update({f"master/{i}": m.detach() for i, m in enumerate(masters)})
    rank = state.dist.rank
    return f"rank{rank}.zero.safetensors", tensors, f"rank{rank}.zero.json", saved


def read_zero(
    state: RunState, engine: DeepSpeedEngine, directory: Path, manifest: dict[str, Any]
) -> tuple[list[torch.Tensor], dict[str, object]]:
    """This rank's ZeRO files, checked against the live engine: ``(masters, optimizer state_dict)``."""
    rank = state.dist.rank
    name = f"rank{rank}.zero.safetensors"
    tensors = read_tensors(directory, name, manifest)
    saved = read_json(directory, f"rank{rank}.zero.json", manifest)
    live = master_partitions(engine)
    assert live is not None, "ZeroLayout.holds found this engine"
    masters = {key: t for key, t in tensors.items() if key.startswith("master/")}
    check_tensors(
        masters,
        {f"master/{i}": m for i, m in enumerate(live)},
        str(directory / name),
        "this rank's master partitions (same model, stage and world size?)",
    )
    rest = {key: t for key, t in tensors.items() if not key.startswith("master/")}
    names = _names(live)
    with optimizer_over_partitions(engine) as base:
        state_dict = optimizer_state(
            base, {names[id(m)]: m for m in live}, rest, saved, str(directory / f"rank{rank}.zero.json")
        )
    return [masters[f"master/{i}"] for i in range(len(live))], state_dict


def load_zero(engine: DeepSpeedEngine, masters: list[torch.Tensor], state_dict: dict[str, object]) -> None:
    """Restore what `read_zero` read, then the model's parameters from the masters."""
    live = master_partitions(engine)
    assert live is not None and len(live) == len(masters)
    with torch.no_grad():
        for now, saved in zip(live, masters, strict=False):
            now.copy_(saved)
    with optimizer_over_partitions(engine) as base:
        base.load_state_dict(state_dict)
    refresh_parameters(engine)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroRead:
    """What `ZeroLayout.read` checked, for `ZeroLayout.restore`."""

    engine: DeepSpeedEngine
    masters: list[torch.Tensor]
    optimizer: dict[str, object]


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroLayout:
    """Each rank's master partitions and optimizer state in ``rank<r>.zero.*``, the
    consolidated weights in ``model.safetensors``: `deepspeed`'s checkpoint layout
    (`fnaccel.checkpoint.storage.layout.CheckpointLayout`). A ZeRO-0 engine in fp32
    steps the model's own parameters and is stored plainly."""

    def holds(self, state: RunState) -> bool:
        return zero_engine(state.model) is not None

    def snapshot(self, state: RunState, files: CheckpointFiles) -> None:
        tensor_file, tensors, json_file, values = snapshot_zero(state, _held_zero_engine(state))
        files.add_tensors(tensor_file, tensors)
        files.add_json(json_file, values)
        module = unwrap_model(state.model)
        with gathered_parameters(module):  # ZeRO-3: a collective, every rank takes part
            weights, files.tied = untie(saved_weights(state, module))
            if files.writer:  # ZeRO-3's gathered data goes when the block ends: copied now
                files.add_tensors("model.safetensors", weights, transient=True)

    def write(self, captured: None, ctx: DistContext, directory: Path) -> dict[str, Any]:
        return {}  # every file is in the snapshot's own

    def read(
        self,
        state: RunState,
        directory: Path,
        manifest: dict[str, Any],
        gradients: Mapping[str, torch.Tensor],
    ) -> ZeroRead:
        if gradients:
            raise CheckpointError(
                f"{directory}: holds gradients saved between accumulation micro-steps; a "
                "DeepSpeed ZeRO run keeps them in buffers of its own and cannot take them"
            )
        engine = _held_zero_engine(state)
        verify_file(
            directory, "model.safetensors", manifest
        )  # the masters hold the weights: checked, not used
        masters, optimizer = read_zero(state, engine, directory, manifest)
        return ZeroRead(engine=engine, masters=masters, optimizer=optimizer)

    def restore(self, state: RunState, read: ZeroRead) -> None:
        load_zero(read.engine, read.masters, read.optimizer)
