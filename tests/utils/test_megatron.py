"""Megatron-LM: the settings are validated, the engine refused with the measured reason."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.engines import MegatronLMPlugin


def test_megatron_is_refused_with_the_measured_reason() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4)
    with pytest.raises(fa.ConfigError, match=r"CUDA GPUs only.*torch\.cuda\.current_device\(\).*fa\.fsdp"):
        plugin.transform()
