"""DeepSpeed's settings: `DeepSpeedPlugin` and the JSON config fnaccel hands to the engine.

One source of truth per setting. A setting the pipeline already states
(accumulation, clipping, precision, the batch size from the loader) fills the
DeepSpeed config's ``"auto"`` values, as Accelerate fills them; a number in the
config that disagrees with the pipeline is refused with the fix. The
optimizer and scheduler are the ones passed to `fa.prepare`: a config that
also names an ``optimizer`` or ``scheduler`` section is refused.

Nothing here imports DeepSpeed: a config is checked where it is written.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fnaccel._errors import ConfigError
from fnaccel.checks import config_bool, require_bools, require_count, require_number
from fnaccel.config.launch import read_config_bytes

if TYPE_CHECKING:
    from fnaccel.state import RunState
    from fnaccel.transforms.kinds import EngineTransform

__all__ = ["DeepSpeedPlugin", "EngineSettings", "resolve_ds_config"]

_OFFLOAD_DEVICES = ("none", "cpu", "nvme")
MAX_DS_CONFIG_BYTES = 1 << 20  # a DeepSpeed config is a page of JSON
# fnaccel drives accumulation itself (fa.backward, fa.apply_gradients): DeepSpeed reduces and
# steps when told (managed_gradient_accumulation false), and any torch optimizer is allowed
_FIXED = MappingProxyType(
    {
        "managed_gradient_accumulation": False,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
)
_QUIET_STEPS = 2**62  # DeepSpeed prints progress every steps_per_print steps unless told otherwise

# Sections DeepSpeed 0.19.6-0.19.8 removed (DeepSpeed issue #8489) and now refuses at initialize, with
# what a run does instead: refused here, before the engine (and its CUDA probing) starts.
_REMOVED_SECTIONS = MappingProxyType(
    {
        "amp": "Apex AMP is gone: mixed precision comes from the pipeline, "
        "fa.autocast(fa.fp16) or fa.autocast(fa.bf16)",
        "compression_training": "the compression library is gone, with no replacement: the model would train "
        "unquantized",
        "curriculum_learning": "move it under data_efficiency.data_sampling.curriculum_learning",
        "eigenvalue": "eigenvalue-based quantization is gone, with no replacement",
        "elasticity": 'elastic batch sizes are gone: give train_micro_batch_size_per_gpu (or "auto") and restart '
        "failed runs with fnaccel launch --max_restarts (torchrun's elastic agent)",
        "graph_harvesting": "graph harvesting is gone, with no replacement",
        "nebula": "Nebula checkpointing is gone: fa.save writes the checkpoint (fa.save_policy for asynchronous tiers)",
        "progressive_layer_drop": "progressive layer dropping is gone, with no replacement",
        "quantize_training": "quantization-aware training (MoQ) is gone, with no replacement",
        "sparse_attention": "sparse attention is gone, with no replacement",
        "sparse_gradients": "the flag is gone: an nn.Embedding(sparse=True) still has its gradients reduced sparsely, "
        "with no flag",
    }
)
_REMOVED_ZERO_KEYS = MappingProxyType(
    {
        "mics_shard_size": "MiCS is gone: shard within a group of ranks and replicate across groups with HSDP, "
        "fa.fsdp() and ParallelismConfig(dp_replicate_size=...)",
        "mics_hierarchical_params_gather": "MiCS is gone: HSDP is fa.fsdp() with "
        "ParallelismConfig(dp_replicate_size=...)",
        "zeropp_loco_param": "LoCo is gone: remove the key (ZeRO++'s quantized gradients run without it)",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeepSpeedPlugin:
    """Accelerate's DeepSpeed settings, validated; `transform` builds `fa.deepspeed`.

    Either ``hf_ds_config`` (a DeepSpeed JSON file or dict) or the fields below
    it, as Accelerate takes them; ``zero_stage`` is 2 when nothing sets it.

    >>> plugin = DeepSpeedPlugin(zero_stage=3, offload_param_device="cpu")
    >>> plugin.ds_config()["zero_optimization"]["offload_param"]
    {'device': 'cpu'}
    >>> DeepSpeedPlugin(zero_stage=4)
    Traceback (most recent call last):
    ...
    fnaccel._errors.ConfigError: DeepSpeedPlugin: zero_stage must be 0, 1, 2 or 3, got 4
    """

    hf_ds_config: str | Path | Mapping[str, object] | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    zero_stage: int | None = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool | None = None
    zero3_save_16bit_model: bool | None = None
    transformer_moe_cls_names: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.hf_ds_config is not None and not isinstance(self.hf_ds_config, (str, Path, Mapping)):
            raise ConfigError(
                f"{owner}: hf_ds_config must be a path to a JSON file or a dict, "
                f"got {type(self.hf_ds_config).__name__}"
            )
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"{owner}: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        require_count(owner, "gradient_accumulation_steps", self.gradient_accumulation_steps)
        require_number(owner, "gradient_clipping", self.gradient_clipping)
        require_bools(self, ("is_train_batch_min", "zero3_init_flag", "zero3_save_16bit_model"), ())
        for kind in ("optimizer", "param"):
            device = getattr(self, f"offload_{kind}_device")
            if device is not None and device not in _OFFLOAD_DEVICES:
                raise ConfigError(
                    f"{owner}: offload_{kind}_device must be one of "
                    f"{', '.join(_OFFLOAD_DEVICES)}, got {device!r}"
                )
            if device == "nvme" and not getattr(self, f"offload_{kind}_nvme_path"):
                raise ConfigError(f"{owner}: offload_{kind}_device 'nvme' needs offload_{kind}_nvme_path")
        if self.offload_param_device not in (None, "none") and self.zero_stage not in (None, 3):
            raise ConfigError(
                f"{owner}: offload_param_device only applies to zero_stage 3 (parameters are "
                f"partitioned only there), got zero_stage {self.zero_stage}"
            )
        if self.zero3_init_flag and self.zero_stage not in (None, 3):
            raise ConfigError(
                f"{owner}: zero3_init_flag only applies to zero_stage 3, got zero_stage {self.zero_stage}"
            )
        if self.hf_ds_config is not None:
            given = [
                f.name
                for f in fields(self)
                if f.name not in ("hf_ds_config", "is_train_batch_min") and getattr(self, f.name) is not None
            ]
            if given:
                raise ConfigError(
                    f"{owner}: {given[0]} is given beside hf_ds_config (the DeepSpeed config "
                    f"file); set it in the file instead, so that one place says it"
                )
            load_ds_config(self.hf_ds_config)  # a bad file fails here, where it is named

    @classmethod
    def from_config(cls, section: Mapping[str, Any], source: str = "deepspeed_config") -> DeepSpeedPlugin:
        """The plugin a launch config's ``deepspeed_config`` section (or the
        ``--zero_stage``, ``--offload_*`` ... flags) describes; Accelerate's keys.

        >>> DeepSpeedPlugin.from_config({"zero_stage": 1, "offload_optimizer_device": "none"}).zero_stage
        1
        """
        owner = source
        known = {
            "deepspeed_config_file",
            "zero_stage",
            "offload_optimizer_device",
            "offload_param_device",
            "offload_optimizer_nvme_path",
            "offload_param_nvme_path",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "zero3_init_flag",
            "zero3_save_16bit_model",
            "deepspeed_moe_layer_cls_names",
            "deepspeed_hostfile",
            "deepspeed_multinode_launcher",
            "deepspeed_inclusion_filter",
            "deepspeed_exclusion_filter",
        }
        unknown = sorted(set(section) - known)
        if unknown:
            raise ConfigError(
                f"{owner}: unknown key '{unknown[0]}'; known keys are {', '.join(sorted(known))}"
            )
        launcher = [
            k
            for k in (
                "deepspeed_hostfile",
                "deepspeed_multinode_launcher",
                "deepspeed_inclusion_filter",
                "deepspeed_exclusion_filter",
            )
            if section.get(k) not in (None, "", "none", "standard")
        ]
        if launcher:
            raise ConfigError(
                f"{owner}: {launcher[0]}: fnaccel launches with torchrun, not DeepSpeed's "
                "launcher; for several machines give num_machines, machine_rank, "
                "main_process_ip and main_process_port"
            )

        def number(key: str, kind: type) -> Any:
            value = section.get(key)
            if value is None or value == "auto":
                return None
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{owner}: {key} must be a number, got {value!r}") from None

        def text(key: str) -> str | None:
            value = section.get(key)
            return None if value in (None, "") else str(value)

        file = text("deepspeed_config_file")
        values: dict[str, Any] = {
            "zero_stage": number("zero_stage", int),
            "offload_optimizer_device": text("offload_optimizer_device"),
            "offload_param_device": text("offload_param_device"),
            "offload_optimizer_nvme_path": text("offload_optimizer_nvme_path"),
            "offload_param_nvme_path": text("offload_param_nvme_path"),
            "gradient_accumulation_steps": number("gradient_accumulation_steps", int),
            "gradient_clipping": number("gradient_clipping", float),
            "zero3_init_flag": config_bool(
                section.get("zero3_init_flag"), f"{owner}: zero3_init_flag", optional=True
            ),
            "zero3_save_16bit_model": config_bool(
                section.get("zero3_save_16bit_model"), f"{owner}: zero3_save_16bit_model", optional=True
            ),
            "transformer_moe_cls_names": text("deepspeed_moe_layer_cls_names"),
        }
        if values["gradient_accumulation_steps"] == 1:
            values["gradient_accumulation_steps"] = None  # Accelerate's config writes 1 for "none"
        for kind in ("optimizer", "param"):  # "none" is what `accelerate config` writes for "no offload"
            if values[f"offload_{kind}_device"] == "none":
                values[f"offload_{kind}_device"] = None
        if file is not None:
            # Accelerate's rule: with a config file, the other keys stay unset (the file says them)
            given = sorted(k for k, v in values.items() if v not in (None, False))
            if given:
                raise ConfigError(
                    f"{owner}: {given[0]} is given beside deepspeed_config_file; set it in "
                    f"{file} instead, so that one place says it"
                )
            values = {"hf_ds_config": file}
        try:
            return cls(**values)
        except ConfigError as exc:  # name the section the value came from
            raise ConfigError(f"{owner}: {str(exc).removeprefix(cls.__name__ + ': ')}") from None

    def ds_config(self) -> dict[str, Any]:
        """The DeepSpeed JSON config these settings describe, ``"auto"`` values unfilled."""
        if self.hf_ds_config is not None:
            return load_ds_config(self.hf_ds_config)
        zero: dict[str, Any] = {"stage": 2 if self.zero_stage is None else self.zero_stage}
        for kind in ("optimizer", "param"):
            device = getattr(self, f"offload_{kind}_device")
            if device not in (None, "none"):
                zero[f"offload_{kind}"] = {"device": device}
                if device == "nvme":
                    zero[f"offload_{kind}"]["nvme_path"] = getattr(self, f"offload_{kind}_nvme_path")
        if self.zero3_save_16bit_model is not None:
            zero["stage3_gather_16bit_weights_on_model_save"] = self.zero3_save_16bit_model
        config: dict[str, Any] = {"zero_optimization": zero}
        if self.gradient_accumulation_steps is not None:
            config["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = self.gradient_clipping
        return config

    def zero3_init_context_manager(self, state: RunState) -> AbstractContextManager[object]:
        """Accelerate's method: a context in which modules are built with their parameters
        already partitioned over ``state``'s processes (``deepspeed.zero.Init``), for
        models too large for one process; a no-op context unless ``zero3_init_flag``.

        Build the model inside, then `fa.prepare` it with ``self.transform()`` (the same
        settings): the engine takes the partitioned model as it is.

        >>> with DeepSpeedPlugin(zero_stage=2).zero3_init_context_manager(None):
        ...     pass
        """
        if not self.zero3_init_flag:
            return contextlib.nullcontext()
        from fnaccel.transforms.deepspeed import zero_init

        return zero_init(self, state)

    def transform(self) -> EngineTransform:
        """`fa.deepspeed` with these settings.

        >>> DeepSpeedPlugin(zero_stage=1).transform()
        deepspeed(zero_stage=1)
        """
        from fnaccel.transforms.deepspeed import deepspeed

        defaults = DeepSpeedPlugin()
        return deepspeed(
            **{
                f.name: getattr(self, f.name)
                for f in fields(self)
                if getattr(self, f.name) != getattr(defaults, f.name)
            }
        )


def load_ds_config(config: str | Path | Mapping[str, object]) -> dict[str, Any]:
    """A DeepSpeed JSON config (a path or a mapping) as a fresh dict, checked to be an object."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    path = Path(config)
    raw = read_config_bytes(path, MAX_DS_CONFIG_BYTES, "DeepSpeed config file")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not a JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a DeepSpeed config holds a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """What the run says about settings a DeepSpeed config also holds.

    Attributes:
        micro_steps: batches per update from ``fa.accumulate`` (None: the
            pipeline has none).
        max_grad_norm: ``fa.clip_grad_norm``'s ``max_norm`` (None: no clipping
            in the pipeline).
        precision: ``"bf16"``, ``"fp16"`` or None (fp32), from ``fa.autocast``.
        micro_batch_size: the prepared loader's batch size per process, or None.
        num_processes: the world size.
        hidden_size: ``model.config.hidden_size`` when the model has one (for
            the bucket sizes Accelerate derives from it), else None.
    """

    micro_steps: int | None = None
    max_grad_norm: float | None = None
    precision: str | None = None
    micro_batch_size: int | None = None
    num_processes: int = 1
    hidden_size: int | None = None


def _fill(config: dict[str, object], key: str, value: float | None, ours: str, where: str) -> None:
    """Put ``value`` (what the run says, None if it says nothing) under ``key``: an ``"auto"``
    or absent entry takes it; a number that disagrees is refused."""
    current = config.get(key, "auto")
    if current == "auto":
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    elif value is not None and current != value:
        raise ConfigError(
            f"{where}: {key} is {current!r} but the pipeline's {ours} says {value!r}; set "
            f'{key} to "auto" (or remove it) so that the pipeline says it, or change the pipeline'
        )


def resolve_ds_config(
    raw: Mapping[str, Any], run: EngineSettings, where: str = "the DeepSpeed config"
) -> dict[str, Any]:
    """The config handed to ``deepspeed.initialize``: ``raw`` with ``"auto"`` filled from
    ``run`` and checked against it.

    Raises:
        ConfigError: a section DeepSpeed removed (``elasticity``, ``amp``,
            ``nebula``, MiCS' keys, ...), an ``optimizer`` or ``scheduler`` section, a stage outside
            0-3, a number that disagrees with the pipeline, an ``"auto"`` left
            that nothing fills; the message names the key and the fix.

    >>> cfg = resolve_ds_config({"gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 1}},
    ...                         EngineSettings(micro_steps=2, micro_batch_size=4, num_processes=2))
    >>> cfg["train_batch_size"], cfg["gradient_accumulation_steps"]
    (16, 2)
    """
    config = copy.deepcopy(dict(raw))
    zero_raw = config.get("zero_optimization")
    removed = [(key, key, fix) for key, fix in _REMOVED_SECTIONS.items() if key in config] + [
        (f"zero_optimization.{key}", key, fix)
        for key, fix in _REMOVED_ZERO_KEYS.items()
        if isinstance(zero_raw, dict) and key in zero_raw
    ]
    if removed:
        shown, _, fix = removed[0]
        raise ConfigError(
            f"{where}: '{shown}' names a feature DeepSpeed 0.19.6 removed (DeepSpeed issue #8489; "
            f"0.19.8, the version fnaccel runs, refuses it): {fix}. Remove the key"
        )
    for name, what in (("optimizer", "optimizer"), ("scheduler", "lr scheduler")):
        if name in config:
            raise ConfigError(
                f"{where}: has a '{name}' section; fnaccel trains with the {what} passed to "
                f"fa.prepare (one source of truth): remove the section and build the {what} in "
                "the script"
            )
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: zero_optimization must be an object, got {zero!r}")
    stage = zero.setdefault("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ConfigError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    _fill(config, "gradient_accumulation_steps", run.micro_steps, "fa.accumulate", where)
    config.setdefault("gradient_accumulation_steps", 1)
    _fill(config, "gradient_clipping", run.max_grad_norm, "fa.clip_grad_norm max_norm", where)
    for precision in ("bf16", "fp16"):
        section = config.get(precision)
        if section is None:
            continue
        enabled = section.get("enabled", "auto") if isinstance(section, dict) else section
        wanted = run.precision == precision
        if enabled != "auto" and bool(enabled) != wanted:
            raise ConfigError(
                f"{where}: {precision}.enabled is {enabled!r} but the pipeline "
                f'{"asks for" if wanted else "has no"} fa.autocast(fa.{precision}); set it to "auto" so that '
                "the pipeline says it, or change the pipeline"
            )
    if run.precision in ("bf16", "fp16"):
        current = config.get(run.precision)
        config[run.precision] = {**(current if isinstance(current, dict) else {}), "enabled": True}
    for precision in ("bf16", "fp16"):
        if isinstance(config.get(precision), dict) and config[precision].get("enabled") == "auto":
            config[precision]["enabled"] = False
    _fill(config, "train_micro_batch_size_per_gpu", run.micro_batch_size, "loader batch size", where)
    micro = config.setdefault("train_micro_batch_size_per_gpu", 1)
    total = micro * config["gradient_accumulation_steps"] * run.num_processes
    if config.get("train_batch_size", "auto") == "auto":
        config["train_batch_size"] = total
    elif config["train_batch_size"] != total:
        raise ConfigError(
            f"{where}: train_batch_size is {config['train_batch_size']!r} but batch {micro} x accumulation "
            f"{config['gradient_accumulation_steps']} x {run.num_processes} processes is {total}; set it to "
            '"auto"'
        )
    hidden = run.hidden_size
    for key, value in (
        ("reduce_bucket_size", None if hidden is None else hidden * hidden),
        ("stage3_prefetch_bucket_size", None if hidden is None else int(0.9 * hidden * hidden)),
        ("stage3_param_persistence_threshold", None if hidden is None else 10 * hidden),
    ):
        if zero.get(key) == "auto":
            if value is None:
                del zero[key]  # DeepSpeed's default, as no model.config.hidden_size says better
            else:
                zero[key] = value
    left = _first_auto(config)
    if left is not None:
        raise ConfigError(f'{where}: {left} is "auto" and nothing in the run fills it; give a value')
    for key, value in _FIXED.items():
        if key in config and config[key] != value:
            raise ConfigError(
                f"{where}: {key} must be {json.dumps(value)} under fnaccel, which drives the "
                f"accumulation and brings its own optimizer; remove the key"
            )
        config[key] = value
    config.setdefault("steps_per_print", _QUIET_STEPS)
    return config


def _first_auto(tree: object, prefix: str = "") -> str | None:
    if isinstance(tree, dict):
        for key, value in tree.items():
            found = _first_auto(value, f"{prefix}{key}.")
            if found is not None:
                return found
    elif tree == "auto":
        return prefix.rstrip(".")
    return None
