"""Accelerate's plugins: validated settings that build the transforms carrying them out.

A launch config's ``fsdp_config``, ``dynamo_config`` and ``deepspeed_config``
sections (or `fnaccel launch`'s flags) become these plugins, and the default
pipeline (`fa.default_pipeline`) uses the transform each builds. One module per
plugin: `fsdp` (`fa.fsdp`), `dynamo` (`fa.compile`), `accumulation`
(`fa.accumulate`), `deepspeed` (`fa.deepspeed`, and the JSON config the engine
gets) and `megatron` (validated; its engine is refused: CUDA only). A key or
option this build cannot carry out is refused with a `ConfigError` naming it.

>>> GradientAccumulationPlugin(num_steps=4).transform()
accumulate(num_steps=4)
"""

from fnaccel.transforms.plugins.accumulation import GradientAccumulationPlugin
from fnaccel.transforms.plugins.deepspeed import DeepSpeedPlugin
from fnaccel.transforms.plugins.dynamo import TorchDynamoPlugin
from fnaccel.transforms.plugins.fsdp import FullyShardedDataParallelPlugin
from fnaccel.transforms.plugins.megatron import MegatronLMPlugin

__all__ = [
    "DeepSpeedPlugin",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "MegatronLMPlugin",
    "TorchDynamoPlugin",
]
