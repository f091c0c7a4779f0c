"""DeepSpeedPlugin, MegatronLMPlugin and GradientAccumulationPlugin: validated records."""

from __future__ import annotations

import importlib.util

import pytest

import fnaccel as fa
from fnaccel.utils import DeepSpeedPlugin, GradientAccumulationPlugin, MegatronLMPlugin


def test_deepspeed_settings_are_validated_then_refused_by_engine() -> None:
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0,
                             hf_ds_config={"train_batch_size": 8})
    assert plugin.zero_stage == 2 and plugin.is_train_batch_min is True  # Accelerate's defaults
    installed = importlib.util.find_spec("deepspeed") is not None
    with pytest.raises(fa.ConfigError, match="is installed, but" if installed else "DeepSpeed is not installed"):
        plugin.transform()
    with pytest.raises(fa.ConfigError, match=r"fa\.fsdp\(\)"):
        plugin.transform()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"zero_stage": 5}, "zero_stage must be 0, 1, 2 or 3"),
    ({"offload_param_device": "gpu"}, "offload_param_device must be one of none, cpu, nvme"),
    ({"offload_optimizer_device": "nvme"}, "needs offload_optimizer_nvme_path"),
    ({"gradient_accumulation_steps": 0}, "must be a positive int"),
    ({"gradient_clipping": -1.0}, "non-negative number"),
    ({"zero3_init_flag": True, "zero_stage": 2}, "only applies to zero_stage 3"),
    ({"hf_ds_config": 3}, "a path to a JSON file or a dict"),
    ({"zero3_save_16bit_model": "yes"}, "True, False or None"),
])
def test_bad_deepspeed_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(fa.ConfigError, match=message):
        DeepSpeedPlugin(**kwargs)  # type: ignore[arg-type]


def test_megatron_settings_are_validated_then_refused_by_engine() -> None:
    plugin = MegatronLMPlugin(tp_degree=2, pp_degree=2, num_micro_batches=4, sequence_parallelism=True)
    assert plugin.lr_decay_style == "linear" and plugin.eval_iters == 100  # Accelerate's defaults
    with pytest.raises(fa.ConfigError, match="Megatron-LM"):
        plugin.transform()
    for kwargs, message in (({"tp_degree": 0}, "tp_degree must be a positive int"),
                            ({"pp_degree": 2}, "needs num_micro_batches"),
                            ({"lr_decay_style": "step"}, "lr_decay_style must be one of"),
                            ({"lr_warmup_fraction": 2.0}, "within"),
                            ({"return_logits": 1}, "True, False or None")):
        with pytest.raises(fa.ConfigError, match=message):
            MegatronLMPlugin(**kwargs)  # type: ignore[arg-type]


def test_gradient_accumulation_plugin() -> None:
    assert repr(GradientAccumulationPlugin(num_steps=2, sync_each_batch=True).transform()) == (
        "accumulate(num_steps=2, sync_each_batch=True)")
    for kwargs, message in (({}, "'num_steps': must be a positive int"),
                            ({"num_steps": 2, "sync_with_dataloader": True}, "across epoch ends"),
                            ({"num_steps": 2, "adjust_scheduler": False}, "once per optimizer step")):
        with pytest.raises(fa.ConfigError, match=message):
            GradientAccumulationPlugin(**kwargs)  # type: ignore[arg-type]
