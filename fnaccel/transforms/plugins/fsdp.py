"""`FullyShardedDataParallelPlugin`: the launch config's ``fsdp_config`` section, carried out by `fa.fsdp`.

``fsdp_config`` in a launch config (or the ``--fsdp_*`` flags of `fnaccel launch`)
holds Accelerate's keys; the plugin reads the section, checks every key against
its type and the values this build can honour, and builds the transform the
default pipeline uses. An option FSDP2 cannot carry out here (FSDP1-only knobs)
is refused with a `ConfigError` naming the key, never silently dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fnaccel._errors import ConfigError
from fnaccel.checks import config_bool, config_choice, config_int, config_names, is_int, require_bools
from fnaccel.transforms.plugins.sections import refuse, section_record

if TYPE_CHECKING:
    from fnaccel.transforms.kinds import ParallelismTransform, Transform

__all__ = ["FullyShardedDataParallelPlugin"]

# FSDP1's strategies by number and name; FSDP2 expresses the first two with reshard_after_forward.
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
_STATE_DICT_TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")


@dataclass(frozen=True, slots=True, kw_only=True)
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP settings, carried out by FSDP2 (`fa.fsdp`).

    ``sharding_strategy`` FULL_SHARD and SHARD_GRAD_OP become
    ``reshard_after_forward`` True and False; HYBRID_SHARD and
    _HYBRID_SHARD_ZERO2 are the same over the mesh's ``dp_replicate`` x
    ``dp_shard`` dimensions (HSDP; `fa.init` gives a config without a
    ``parallelism_config`` one replica per machine);
    ``activation_checkpointing`` adds `fa.checkpoint_activations` for the
    layer classes to wrap (every block of the model's ``nn.ModuleList``s without them), with
    ``offload=True`` under ``activation_checkpointing_offload`` (Accelerate
    1.15's; like Accelerate, refused without ``activation_checkpointing``);
    ``fsdp_version`` 1 configs run
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
    activation_checkpointing_offload: bool = False

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
            name, what = key.removeprefix("fsdp_"), f"{source}: key '{key}'"
            if name in ("version", "min_num_params"):
                values["fsdp_version" if name == "version" else name] = config_int(raw, what)
            elif name == "sharding_strategy":
                number = raw if is_int(raw) else None
                if number is None and isinstance(raw, str) and raw.strip().isdigit():
                    number = int(raw)
                if number is not None:
                    if not 1 <= number <= len(_STRATEGIES):
                        raise ConfigError(
                            f"{source}: key '{key}' must be 1-{len(_STRATEGIES)} or one "
                            f"of {', '.join(_STRATEGIES)}, got {raw!r}"
                        )
                    values[name] = _STRATEGIES[number - 1]
                else:
                    values[name] = config_choice(raw, what, _STRATEGIES)
            elif name in (
                "reshard_after_forward",
                "forward_prefetch",
                "use_orig_params",
                "sync_module_states",
                "cpu_ram_efficient_loading",
                "activation_checkpointing",
                "activation_checkpointing_offload",
            ):
                values[name] = config_bool(raw, what)
            elif name == "offload_params":
                values["cpu_offload"] = config_bool(raw, what)
            elif name == "auto_wrap_policy":
                values[name] = config_choice(raw, what, _WRAP_POLICIES)
            elif name == "transformer_layer_cls_to_wrap":
                values["transformer_cls_names_to_wrap"] = config_names(raw, what)
            elif name in ("backward_prefetch", "backward_prefetch_policy"):
                values["backward_prefetch"] = config_choice(raw, what, _PREFETCH)
            elif name == "state_dict_type":
                values[name] = config_choice(raw, what, _STATE_DICT_TYPES)
            else:
                known = (
                    "fsdp_version",
                    "fsdp_sharding_strategy",
                    "fsdp_reshard_after_forward",
                    "fsdp_offload_params",
                    "fsdp_auto_wrap_policy",
                    "fsdp_transformer_layer_cls_to_wrap",
                    "fsdp_min_num_params",
                    "fsdp_backward_prefetch",
                    "fsdp_forward_prefetch",
                    "fsdp_state_dict_type",
                    "fsdp_use_orig_params",
                    "fsdp_sync_module_states",
                    "fsdp_cpu_ram_efficient_loading",
                    "fsdp_activation_checkpointing",
                    "fsdp_activation_checkpointing_offload",
                )
                raise ConfigError(f"{source}: unknown key '{key}'; known keys are {', '.join(known)}")
        return section_record(cls, values, source)

    def __post_init__(self) -> None:
        require_bools(
            self,
            ("reshard_after_forward",),
            (
                "cpu_offload",
                "forward_prefetch",
                "use_orig_params",
                "sync_module_states",
                "cpu_ram_efficient_loading",
                "activation_checkpointing",
                "activation_checkpointing_offload",
            ),
        )
        self.check(type(self).__name__)

    def check(self, source: str = "fsdp_config") -> None:
        """Refuse what FSDP2 in this build cannot carry out (ConfigError naming the key)."""
        if self.fsdp_version not in (1, 2):
            raise refuse("fsdp_version", source, f"must be 1 or 2, got {self.fsdp_version}")
        if self.sharding_strategy == "NO_SHARD":
            raise refuse(
                "fsdp_sharding_strategy",
                source,
                "NO_SHARD is plain data parallelism: use distributed_type MULTI_CPU/MULTI_GPU "
                "(fa.ddp()), or FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD",
            )
        if self.auto_wrap_policy == "TRANSFORMER_BASED_WRAP" and not self.transformer_cls_names_to_wrap:
            raise refuse(
                "fsdp_transformer_layer_cls_to_wrap",
                source,
                "TRANSFORMER_BASED_WRAP needs the layer class names to wrap",
            )
        if self.auto_wrap_policy == "SIZE_BASED_WRAP" and self.min_num_params is None:
            raise refuse("fsdp_min_num_params", source, "SIZE_BASED_WRAP needs fsdp_min_num_params")
        if None not in (self.reshard_after_forward, self.sharding_strategy) and (
            self.reshard_after_forward != (self.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"))
        ):
            raise refuse(
                "fsdp_reshard_after_forward",
                source,
                f"{self.reshard_after_forward} contradicts fsdp_sharding_strategy "
                f"{self.sharding_strategy} (FULL_SHARD and HYBRID_SHARD reshard, SHARD_GRAD_OP "
                "and _HYBRID_SHARD_ZERO2 do not); "
                "keep one of the two",
            )
        if self.state_dict_type != "SHARDED_STATE_DICT":
            raise refuse(
                "fsdp_state_dict_type",
                source,
                f"{self.state_dict_type} is not supported: fa.save always writes sharded "
                "checkpoints under FSDP; full weights come from fa.save_model or "
                "`fnaccel merge-weights`. Use SHARDED_STATE_DICT",
            )
        if not self.use_orig_params:
            raise refuse(
                "fsdp_use_orig_params",
                source,
                "false is not supported: FSDP2 always keeps the original parameters; "
                "set it true or leave it out",
            )
        if self.backward_prefetch not in (None, "BACKWARD_PRE"):
            raise refuse(
                "fsdp_backward_prefetch",
                source,
                f"{self.backward_prefetch} has no FSDP2 counterpart; FSDP2 prefetches "
                "the next module in backward (BACKWARD_PRE): use that or leave it out",
            )
        if self.cpu_ram_efficient_loading and not self.sync_module_states:
            raise refuse(
                "fsdp_sync_module_states",
                source,
                "fsdp_cpu_ram_efficient_loading needs fsdp_sync_module_states true: only "
                "rank 0's weights are real, and the others receive them",
            )
        if self.activation_checkpointing_offload and not self.activation_checkpointing:
            # Accelerate 1.15 refuses it too; it offloads what checkpointing saves, and nothing is
            raise refuse(
                "fsdp_activation_checkpointing_offload",
                source,
                "true needs fsdp_activation_checkpointing true: it offloads the inputs the "
                "checkpointed blocks keep; turn both on, or leave the offload out",
            )
        if self.forward_prefetch:
            raise refuse(
                "fsdp_forward_prefetch",
                source,
                "true is not supported: explicit forward prefetching is not built",
            )

    def transform(self) -> ParallelismTransform:
        """The `fa.fsdp` transform these settings describe."""
        from fnaccel.transforms.parallel import fsdp

        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = self.sharding_strategy not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
        wrap = self.auto_wrap_policy
        return fsdp(  # every field reaches fsdp() or was refused by check()
            transformer_cls_names_to_wrap=self.transformer_cls_names_to_wrap
            if wrap in (None, "TRANSFORMER_BASED_WRAP")
            else (),
            min_num_params=self.min_num_params if wrap in (None, "SIZE_BASED_WRAP") else None,
            reshard_after_forward=reshard,
            cpu_offload=self.cpu_offload,
            sync_module_states=self.sync_module_states,
        )

    def checkpointing(self) -> Transform | None:
        """The `fa.checkpoint_activations` transform ``activation_checkpointing`` asks for, or None."""
        from fnaccel.transforms.checkpointing import checkpoint_activations

        if not self.activation_checkpointing:
            return None
        return checkpoint_activations(
            *self.transformer_cls_names_to_wrap, offload=self.activation_checkpointing_offload
        )
