"""The config file's FSDP and TorchDynamo sections as validated plugins.

``fsdp_config`` and ``dynamo_config`` in a launch config (or the
``--fsdp_*`` / ``--dynamo_*`` flags of `fnaccel launch`) hold Accelerate's
keys. Each plugin reads its section, checks every key against its type and
the values this build can honour, and builds the transform the default
pipeline uses: `FullyShardedDataParallelPlugin.transform` gives `fa.fsdp`,
`TorchDynamoPlugin.transform` gives `fa.compile`.

An option that this build cannot carry out (FSDP1-only knobs without an
FSDP2 counterpart, regional compilation) is refused
with a `ConfigError` naming the key, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fnaccel._errors import ConfigError
from fnaccel.config.environment import str_to_bool
from fnaccel.kwargs.base import KwargsHandler

__all__ = [
    "FullyShardedDataParallelPlugin", "GradientAccumulationPlugin", "TorchDynamoPlugin", "require_count",
    "require_number",
]

T = TypeVar("T")

# FSDP1's strategies by number and name; FSDP2 expresses the first two with reshard_after_forward.
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


def _bool(value: Any, key: str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return str_to_bool(value, to_bool=True)
        except ValueError:
            pass
    raise ConfigError(f"{source}: key '{key}' must be true or false, got {value!r}")


def _int(value: Any, key: str, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{source}: key '{key}' must be an integer, got {value!r}")


def _str(value: Any, key: str, source: str) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(f"{source}: key '{key}' must be a string, got {value!r}")


def _names(value: Any, key: str, source: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(",") if name.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ConfigError(f"{source}: key '{key}' must be class names (a list or a comma-separated "
                      f"string), got {value!r}")


def _choice(value: Any, key: str, source: str, choices: tuple[str, ...]) -> str:
    text = _str(value, key, source).upper()
    if text not in choices:
        raise ConfigError(f"{source}: key '{key}' must be one of {', '.join(choices)}, got {value!r}")
    return text


def require_bools(record: Any, optional: tuple[str, ...], required: tuple[str, ...]) -> None:
    """A record's yes/no fields hold real bools (None allowed for ``optional``): a
    string such as "false" would otherwise read as true."""
    for name in (*optional, *required):
        value = getattr(record, name)
        if not isinstance(value, bool) and not (value is None and name in optional):
            allowed = "True, False or None" if name in optional else "True or False"
            raise _refuse(name, type(record).__name__, f"must be {allowed}, got {value!r}")


def require_count(owner: str, name: str, value: Any, least: int = 1) -> None:
    """``value`` is None or an int (not a bool) of at least ``least`` (1 or 0).

    >>> require_count("Plugin", "steps", 0)
    Traceback (most recent call last):
    ...
    fnaccel._errors.ConfigError: Plugin: steps must be a positive int, got 0
    """
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise ConfigError(f"{owner}: {name} must be {'a positive' if least else 'a non-negative'} int, "
                          f"got {value!r}")


def require_number(owner: str, name: str, value: Any) -> None:
    """``value`` is None or a non-negative int or float (not a bool)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise ConfigError(f"{owner}: {name} must be a non-negative number, got {value!r}")


def _refuse(key: str, source: str, why: str) -> ConfigError:
    return ConfigError(f"{source}: key '{key}': {why}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings, carried out by FSDP2 (`fa.fsdp`).

    ``sharding_strategy`` FULL_SHARD and SHARD_GRAD_OP become
    ``reshard_after_forward`` True and False; HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2 are the same over the mesh's ``dp_replicate`` x
    ``dp_shard`` dimensions (HSDP; `fa.init` gives a config without a
    ``parallelism_config`` one replica per machine);
    ``activation_checkpointing`` adds `fa.checkpoint_activations` for the
    layer classes to wrap (every block of the model's ``nn.ModuleList``s without them); ``fsdp_version`` 1 configs run
    on FSDP2 (fnaccel ships no FSDP1). ``sync_module_states`` (default True,
    as in Accelerate) broadcasts rank 0's weights before sharding; ``cpu_ram_efficient_loading`` (which needs it)
    means the script loads real weights on rank 0 only, into a model of the
    right shapes on the other ranks. Options without an FSDP2 counterpart in
    this build are refused when the plugin is built.

    >>> plugin = FullyShardedDataParallelPlugin.from_config(
    ...     {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    ...      "fsdp_transformer_layer_cls_to_wrap": "Block", "fsdp_sharding_strategy": 2})
    >>> plugin.transform()
    fsdp(transformer_cls_names_to_wrap=('Block',), reshard_after_forward=False, sync_module_states=True)
    """

    fsdp_version: int = 2
    sharding_strategy: str | None = None
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    auto_wrap_policy: str | None = None
    transformer_cls_names_to_wrap: tuple[str, ...] = ()
    min_num_params: int | None = None
    backward_prefetch: str | None = None
    forward_prefetch: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"
    use_orig_params: bool = True
    sync_module_states: bool = True
    cpu_ram_efficient_loading: bool = False
    activation_checkpointing: bool = False

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any], source: str = "fsdp_config"
    ) -> FullyShardedDataParallelPlugin:
        """Read a config file's ``fsdp_config`` mapping (Accelerate's ``fsdp_*`` keys).

        Raises:
            ConfigError: an unknown key, a wrongly typed value, or an option
                this build cannot carry out; the message names the key.
        """
        values: dict[str, Any] = {}
        for key, raw in section.items():
            name = key.removeprefix("fsdp_")
            if name in ("version", "min_num_params"):
                values["fsdp_version" if name == "version" else name] = _int(raw, key, source)
            elif name == "sharding_strategy":
                number = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
                if number is None and isinstance(raw, str) and raw.strip().isdigit():
                    number = int(raw)
                if number is not None:
                    if not 1 <= number <= len(_STRATEGIES):
                        raise ConfigError(f"{source}: key '{key}' must be 1-{len(_STRATEGIES)} or one "
                                          f"of {', '.join(_STRATEGIES)}, got {raw!r}")
                    values[name] = _STRATEGIES[number - 1]
                else:
                    values[name] = _choice(raw, key, source, _STRATEGIES)
            elif name in ("reshard_after_forward", "forward_prefetch", "use_orig_params",
                          "sync_module_states", "cpu_ram_efficient_loading", "activation_checkpointing"):
                values[name] = _bool(raw, key, source)
            elif name == "offload_params":
                values["cpu_offload"] = _bool(raw, key, source)
            elif name == "auto_wrap_policy":
                values[name] = _choice(raw, key, source, _WRAP_POLICIES)
            elif name == "transformer_layer_cls_to_wrap":
                values["transformer_cls_names_to_wrap"] = _names(raw, key, source)
            elif name in ("backward_prefetch", "backward_prefetch_policy"):
                values["backward_prefetch"] = _choice(raw, key, source, _PREFETCH)
            elif name == "state_dict_type":
                values[name] = _choice(raw, key, source, _STATE_DICT_TYPES)
            else:
                known = ("fsdp_version", "fsdp_sharding_strategy", "fsdp_reshard_after_forward",
                         "fsdp_offload_params", "fsdp_auto_wrap_policy",
                         "fsdp_transformer_layer_cls_to_wrap", "fsdp_min_num_params",
                         "fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_state_dict_type",
                         "fsdp_use_orig_params", "fsdp_sync_module_states",
                         "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing")
                raise ConfigError(f"{source}: unknown key '{key}'; known keys are {', '.join(known)}")
        return _built(cls, values, source)

    def __post_init__(self) -> None:
        require_bools(self, ("reshard_after_forward",), ("cpu_offload", "forward_prefetch",
                       "use_orig_params", "sync_module_states", "cpu_ram_efficient_loading",
                       "activation_checkpointing"))
        self.check(type(self).__name__)

    def check(self, source: str = "fsdp_config") -> None:
        """Refuse what FSDP2 in this build cannot carry out (ConfigError naming the key)."""
        if self.fsdp_version not in (1, 2):
            raise _refuse("fsdp_version", source, f"must be 1 or 2, got {self.fsdp_version}")
        if self.sharding_strategy == "NO_SHARD":
            raise _refuse("fsdp_sharding_strategy", source,
                          "NO_SHARD is plain data parallelism: use distributed_type MULTI_CPU/MULTI_GPU "
                          "(fa.ddp()), or FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD")
        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and not self.transformer_cls_names_to_wrap:
            raise _refuse("fsdp_transformer_layer_cls_to_wrap", source,
                          "TRANSFORMER_BASED_WRAP needs the layer class names to wrap")
        if self.auto_wrap_policy == "SIZE_BASED_WRAP" and self.min_num_params is None:
            raise _refuse("fsdp_min_num_params", source, "SIZE_BASED_WRAP needs fsdp_min_num_params")
        if None not in (self.reshard_after_forward, self.sharding_strategy) and (
                self.reshard_after_forward != (self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"))):
            raise _refuse("fsdp_reshard_after_forward", source,
                          f"{self.reshard_after_forward} contradicts fsdp_sharding_strategy "
                          f"{self.sharding_strategy} (FULL_SHARD and HYBRID_SHARD reshard, SHARD_GRAD_OP "
                          "and _HYBRID_SHARD_ZERO2 do not); "
                          "keep one of the two")
        if self.state_dict_type != "SHARDED_STATE_DICT":
            raise _refuse("fsdp_state_dict_type", source,
                          f"{self.state_dict_type} is not supported: fa.save always writes sharded "
                          "checkpoints under FSDP; full weights come from fa.save_model or "
                          "`fnaccel merge-weights`. Use SHARDED_STATE_DICT")
        if not self.use_orig_params:
            raise _refuse("fsdp_use_orig_params", source,
                          "false is not supported: FSDP2 always keeps the original parameters; "
                          "set it true or leave it out")
        if self.backward_prefetch not in (None, "BACKWARD_PRE"):
            raise _refuse("fsdp_backward_prefetch", source,
                          f"{self.backward_prefetch} has no FSDP2 counterpart; FSDP2 prefetches "
                          "the next module in backward (BACKWARD_PRE): use that or leave it out")
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise _refuse("fsdp_sync_module_states", source,
                          "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states true: only "
                          "rank 0's weights are real, and the others receive them")
        if self.forward_prefetch:
            raise _refuse("fsdp_forward_prefetch", source,
                          "true is not supported: explicit forward prefetching is not built")

    def transform(self) -> Any:
        """The `fa.fsdp` transform these settings describe."""
        from fnaccel.transforms.parallel import fsdp

        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = self.sharding_strategy not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
        wrap = self.auto_wrap_policy
        return fsdp(  # every field reaches fsdp() or was refused by check()
            transformer_cls_names_to_wrap=self.transformer_cls_names_to_wrap
            if wrap in (None, "TRANSFORMER_BASED_WRAP") else (),
            min_num_params=self.min_num_params if wrap in (None, "SIZE_BASED_WRAP") else None,
            reshard_after_forward=reshard,
            cpu_offload=self.cpu_offload,
            sync_module_states=self.sync_module_states,
        )

    def checkpointing(self) -> Any:
        """The `fa.checkpoint_activations` transform ``activation_checkpointing`` asks for, or None."""
        from fnaccel.transforms.checkpointing import checkpoint_activations

        if not self.activation_checkpointing:
            return None
        return checkpoint_activations(*self.transformer_cls_names_to_wrap)


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchDynamoPlugin(KwargsHandler):
    """Accelerate's TorchDynamo settings, carried out by `fa.compile`; a `KwargsHandler`
    whose `to_kwargs()` gives ``torch.compile``'s arguments, as Accelerate's does.

    >>> TorchDynamoPlugin.from_config({"dynamo_backend": "AOT_EAGER", "dynamo_use_fullgraph": True}).transform()
    compile(backend='aot_eager', fullgraph=True)
    >>> TorchDynamoPlugin(backend="INDUCTOR", mode="max-autotune").to_kwargs()
    {'backend': 'inductor', 'mode': 'max-autotune'}
    """

    backend: str = "NO"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    options: Mapping[str, Any] | None = None
    disable: bool = False
    use_regional_compilation: bool = False

    @classmethod
    def from_config(cls, section: Mapping[str, Any], source: str = "dynamo_config") -> TorchDynamoPlugin:
        """Read a config file's ``dynamo_config`` mapping (Accelerate's ``dynamo_*`` keys).

        Raises:
            ConfigError: an unknown key, a wrongly typed value, an unknown
                backend or mode; the message names the key.
        """
        from fnaccel.transforms.compile import COMPILE_MODES
        from fnaccel.constants import DynamoBackend

        values: dict[str, Any] = {}
        for key, raw in section.items():
            name = key.removeprefix("dynamo_")
            if name == "backend":
                values[name] = _choice(raw, key, source, tuple(b.value for b in DynamoBackend))
            elif name == "mode":
                if raw not in COMPILE_MODES:
                    raise ConfigError(f"{source}: key '{key}' must be one of "
                                      f"{', '.join(str(m) for m in COMPILE_MODES[1:])}, got {raw!r}")
                values[name] = raw
            elif name in ("use_fullgraph", "use_dynamic", "use_regional_compilation"):
                field_name = {"use_fullgraph": "fullgraph", "use_dynamic": "dynamic"}.get(name, name)
                values[field_name] = None if raw is None and name == "use_dynamic" else _bool(raw, key, source)
            else:
                raise ConfigError(
                    f"{source}: unknown key '{key}'; known keys are dynamo_backend, dynamo_mode, "
                    "dynamo_use_fullgraph, dynamo_use_dynamic, dynamo_use_regional_compilation"
                )
        return _built(cls, values, source)

    def __post_init__(self) -> None:
        from fnaccel.constants import DynamoBackend

        from fnaccel.transforms.compile import COMPILE_MODES

        source = type(self).__name__
        require_bools(self, ("dynamic",), ("fullgraph", "disable", "use_regional_compilation"))
        if self.mode not in COMPILE_MODES:
            raise _refuse("mode", source, f"must be one of {', '.join(str(m) for m in COMPILE_MODES[1:])}, "
                          f"got {self.mode!r}")
        if str(self.backend).upper() not in tuple(b.value for b in DynamoBackend):
            raise _refuse("dynamo_backend", source, f"unknown backend {self.backend!r}")
        if self.use_regional_compilation:
            raise _refuse("dynamo_use_regional_compilation", source,
                          "true is not supported: regional compilation is not built; compile "
                          "the whole model")
        if self.options:
            raise _refuse("options", source, "backend options are not passed on by fa.compile; "
                          "call torch.compile yourself for them")

    def to_kwargs(self) -> dict[str, Any]:
        """The fields changed from their defaults, as ``torch.compile(model, **kwargs)``
        takes them: the backend in torch's lowercase spelling, left out when it is NO."""
        kwargs = KwargsHandler.to_kwargs(self)
        if "backend" in kwargs:
            backend = str(kwargs["backend"]).lower()
            if backend == "no":
                del kwargs["backend"]
            else:
                kwargs["backend"] = backend
        return kwargs

    def transform(self) -> Any:
        """The `fa.compile` transform, or None when the backend is NO or ``disable`` is set."""
        from fnaccel.transforms.compile import compile

        if str(self.backend).upper() == "NO" or self.disable:
            return None
        return compile(backend=str(self.backend).lower(), mode=self.mode, fullgraph=self.fullgraph,
                       dynamic=self.dynamic)


def _built(cls: type[T], values: Mapping[str, Any], source: str) -> T:
    """``cls(**values)``, its validation errors naming ``source`` (the config file's section)."""
    try:
        return cls(**values)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(cls.__name__, source, 1)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class GradientAccumulationPlugin:
    """Accelerate's gradient accumulation settings, carried out by `fa.accumulate`.

    `fa.step` steps the scheduler only at optimizer updates, never on the
    micro-steps between (``adjust_scheduler=True``; how many steps per update:
    `fnaccel.train.SchedulerConfiguration`). Accumulation boundaries run across
    epoch ends (every ``num_steps`` batches), so ``sync_with_dataloader``
    defaults to False here and True is refused rather than ignored.

    >>> GradientAccumulationPlugin(num_steps=4).transform()
    accumulate(num_steps=4)
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = False
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        source = type(self).__name__
        require_bools(self, (), ("adjust_scheduler", "sync_with_dataloader", "sync_each_batch"))
        if self.num_steps is None or isinstance(self.num_steps, bool) or not isinstance(self.num_steps, int) \
                or self.num_steps < 1:
            raise _refuse("num_steps", source, f"must be a positive int, got {self.num_steps!r}")
        if not self.adjust_scheduler:
            raise _refuse("adjust_scheduler", source, "false is not supported: fa.step steps the "
                          "scheduler only at optimizer updates, never between")
        if self.sync_with_dataloader:
            raise _refuse("sync_with_dataloader", source, "true is not built: boundaries fall every "
                          "num_steps batches across epoch ends; pick num_steps dividing an epoch")

    def transform(self) -> Any:
        """The `fa.accumulate` transform these settings describe."""
        from fnaccel.transforms.accumulate import accumulate

        assert self.num_steps is not None
        return accumulate(self.num_steps, sync_each_batch=self.sync_each_batch)
