"""DeepSpeedPlugin, MegatronLMPlugin and GradientAccumulationPlugin: validated records."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.utils import DeepSpeedPlugin, GradientAccumulationPlugin, MegatronLMPlugin


def test_deepspeed_settings_are_validated_and_build_fa_deepspeed() -> None:
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0)
    assert plugin.zero_stage == 2 and plugin.is_train_batch_min is True  # Accelerate's defaults
    assert repr(plugin.transform()) == (
        "deepspeed(gradient_clipping=1.0, zero_stage=2, offload_optimizer_device='cpu')")
    assert plugin.transform() == fa.deepspeed(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0)
    assert plugin.ds_config() == {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                  "gradient_clipping": 1.0}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"zero_stage": 5}, "zero_stage must be 0, 1, 2 or 3"),
    ({"offload_param_device": "gpu"}, "offload_param_device must be one of none, cpu, nvme"),
    ({"offload_optimizer_device": "nvme"}, "needs offload_optimizer_nvme_path"),
    ({"gradient_accumulation_steps": 0}, "must be a positive int"),
    ({"gradient_clipping": -1.0}, "non-negative number"),
    ({"zero3_init_flag": True, "zero_stage": 2}, "only applies to zero_stage 3"),
    ({"hf_ds_config": 3}, "a path to a JSON file or a dict"),
    ({"hf_ds_config": {"train_batch_size": 8}, "zero_stage": 2}, "zero_stage is given beside hf_ds_config"),
    ({"hf_ds_config": "/nonexistent/ds.json"}, "cannot read the DeepSpeed config file"),
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
                            ({"num_steps": 2, "adjust_scheduler": False}, "only at optimizer updates")):
        with pytest.raises(fa.ConfigError, match=message):
            GradientAccumulationPlugin(**kwargs)  # type: ignore[arg-type]
