"""Megatron-LM: the settings are validated, the engine refused with the measured reason."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.utils import MegatronLMPlugin


def test_megatron_is_refused_with_the_measured_reason() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4)
    with pytest.raises(fa.ConfigError, match=r"CUDA GPUs only.*torch\.cuda\.current_device\(\).*fa\.fsdp"):
        plugin.transform()


def test_megatron_settings_are_validated_then_refused_by_engine() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4, sequence_parallelism=True)
    assert plugin.lr_decay_style == "linear" and plugin.eval_iters == 100  # Accelerate's defaults
    with pytest.raises(fa.ConfigError, match="Megatron-LM"):
        plugin.transform()
    for kwargs, message in (
        ({"tp_degree": 0}, "tp_degree must be a positive int"),
        ({"pp_degree": 2}, "needs num_micro_batches"),
        ({"lr_decay_style": "step"}, "lr_decay_style must be one of"),
        ({"lr_warmup_fraction": 2.0}, "within"),
        ({"return_logits": 1}, "True, False or None"),
    ):
        with pytest.raises(fa.ConfigError, match=message):
            MegatronLMPlugin(**kwargs)  # type: ignore[arg-type]
