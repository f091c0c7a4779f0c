"""FullyShardedDataParallelPlugin: Accelerate's fsdp_config section, validated and carried out by fa.fsdp;
and the section errors every plugin shares."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import fnaccel as fa
from fnaccel.config.launch import load_config, with_launch_env
from fnaccel.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin

# what `accelerate config` writes for FSDP (accelerate 1.x)
ACCELERATE_FSDP_FILE = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_an_accelerate_fsdp_config_becomes_fsdp2(tmp_path: Path) -> None:
    path = tmp_path / "default_config.yaml"
    path.write_text(ACCELERATE_FSDP_FILE)
    config = load_config(path)
    plugin = FullyShardedDataParallelPlugin.from_config(config.fsdp_config)
    assert plugin.transformer_cls_names_to_wrap == ("LlamaDecoderLayer",)
    assert plugin.sync_module_states and plugin.cpu_ram_efficient_loading
    assert repr(plugin.transform()) == (
        "fsdp(transformer_cls_names_to_wrap=('LlamaDecoderLayer',), sync_module_states=True)"
    )


def test_hybrid_sharding_and_activation_checkpointing_build_their_transforms() -> None:
    plugin = FullyShardedDataParallelPlugin.from_config(
        {
            "fsdp_sharding_strategy": 5,
            "fsdp_activation_checkpointing": True,
            "fsdp_transformer_layer_cls_to_wrap": "Block",
        }
    )
    assert plugin.sharding_strategy == "_HYBRID_SHARD_ZERO2"
    assert repr(plugin.transform()) == (
        "fsdp(transformer_cls_names_to_wrap=('Block',), reshard_after_forward=False, sync_module_states=True)"
    )
    assert plugin.checkpointing() == fa.checkpoint_activations("Block")
    hybrid = FullyShardedDataParallelPlugin.from_config({"fsdp_sharding_strategy": "HYBRID_SHARD"})
    assert repr(hybrid.transform()) == "fsdp(sync_module_states=True)" and hybrid.checkpointing() is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"fsdp_sharding_strategy": "NO_SHARD"}, "NO_SHARD is plain data parallelism"),
        ({"fsdp_sharding_strategy": 0}, "must be 1-5"),
        ({"fsdp_offload_params": "maybe"}, "key 'fsdp_offload_params' must be true or false"),
        ({"fsdp_min_num_params": "many"}, "key 'fsdp_min_num_params' must be an integer"),
        ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}, "needs the layer class names"),
        ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, "needs fsdp_min_num_params"),
        ({"fsdp_backward_prefetch": "BACKWARD_POST"}, "no FSDP2 counterpart"),
        (
            {"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": False},
            "needs fsdp_sync_module_states",
        ),
        ({"fsdp_forward_prefetch": "true"}, "explicit forward prefetching is not built"),
        ({"fsdp_state_dict_type": "FULL_STATE_DICT"}, "fa.save always writes sharded"),
        ({"fsdp_use_orig_params": False}, "FSDP2 always keeps the original parameters"),
        ({"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_reshard_after_forward": True}, "contradicts"),
        (
            {"fsdp_sharding_strategy": "_HYBRID_SHARD_ZERO2", "fsdp_reshard_after_forward": True},
            "contradicts",
        ),
        ({"fsdp_shard_everything": True}, "unknown key 'fsdp_shard_everything'"),
    ],
)
def test_fsdp_options_this_build_cannot_honour_are_refused_by_key(
    section: dict[str, object], message: str
) -> None:
    with pytest.raises(fa.ConfigError, match=message) as info:
        FullyShardedDataParallelPlugin.from_config(section, "c.yaml: fsdp_config")
    assert str(info.value).startswith("c.yaml: fsdp_config")


def test_sharding_strategies_and_wrapping() -> None:
    plugin = FullyShardedDataParallelPlugin.from_config(
        {
            "fsdp_sharding_strategy": "2",
            "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_min_num_params": "1000",
            "fsdp_offload_params": "true",
            "fsdp_version": 1,
            "fsdp_transformer_layer_cls_to_wrap": "A,B",
            "fsdp_sync_module_states": False,
        }
    )
    # SIZE_BASED_WRAP: the class names are not used
    assert (
        repr(plugin.transform()) == "fsdp(min_num_params=1000, reshard_after_forward=False, cpu_offload=True)"
    )
    explicit = FullyShardedDataParallelPlugin.from_config({"fsdp_reshard_after_forward": False})
    assert repr(explicit.transform()) == "fsdp(reshard_after_forward=False, sync_module_states=True)"
    assert repr(FullyShardedDataParallelPlugin.from_config({}).transform()) == "fsdp(sync_module_states=True)"


def test_sections_round_trip_through_the_environment(tmp_path: Path) -> None:
    env = {
        "FNACCEL_FSDP_OFFLOAD_PARAMS": "false",
        "FNACCEL_FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP": "A,B",
        "FNACCEL_FSDP_MIN_NUM_PARAMS": "10",
    }
    path = tmp_path / "c.yaml"
    path.write_text(
        textwrap.dedent("""\
        fsdp_config: {fsdp_offload_params: true, fsdp_version: 2}
    """)
    )
    config = with_launch_env(load_config(path), {"FNACCEL_USE_FSDP": "1", **env})
    assert config.distributed_type == "FSDP"
    assert config.fsdp_config == {
        "fsdp_offload_params": "false",
        "fsdp_version": 2,
        "fsdp_transformer_layer_cls_to_wrap": "A,B",
        "fsdp_min_num_params": "10",
    }
    plugin = FullyShardedDataParallelPlugin.from_config(config.fsdp_config)
    assert plugin.transformer_cls_names_to_wrap == ("A", "B") and plugin.min_num_params == 10


def test_plugins_built_directly_check_their_yes_no_fields() -> None:
    from fnaccel.utils import GradientAccumulationPlugin

    for build, message in (
        (
            lambda: FullyShardedDataParallelPlugin(sync_module_states="false"),
            "sync_module_states': must be True or False",
        ),
        (lambda: FullyShardedDataParallelPlugin(reshard_after_forward="no"), "True, False or None"),
        (lambda: TorchDynamoPlugin(backend="EAGER", fullgraph="false"), "fullgraph': must be True or False"),
        (lambda: TorchDynamoPlugin(backend="EAGER", mode="fastest"), "mode': must be one of"),
        (lambda: GradientAccumulationPlugin(num_steps=2, sync_each_batch="no"), "sync_each_batch'"),
    ):
        with pytest.raises(fa.ConfigError, match=message):
            build()
    # from a config file, strings are read as yes/no before the record is built
    assert (
        FullyShardedDataParallelPlugin.from_config({"fsdp_sync_module_states": "false"}).sync_module_states
        is False
    )
