"""DeepSpeedPlugin: validated settings that build fa.deepspeed.

The engine itself: tests/transforms/test_deepspeed.py.
"""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.utils import DeepSpeedPlugin


def test_deepspeed_settings_are_validated_and_build_fa_deepspeed() -> None:
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0)
    assert plugin.zero_stage == 2 and plugin.is_train_batch_min is True  # Accelerate's defaults
    assert repr(plugin.transform()) == (
        "deepspeed(gradient_clipping=1.0, zero_stage=2, offload_optimizer_device='cpu')"
    )
    assert plugin.transform() == fa.deepspeed(
        zero_stage=2, offload_optimizer_device="cpu", gradient_clipping=1.0
    )
    assert plugin.ds_config() == {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "gradient_clipping": 1.0,
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"zero_stage": 5}, "zero_stage must be 0, 1, 2 or 3"),
        ({"offload_param_device": "gpu"}, "offload_param_device must be one of none, cpu, nvme"),
        ({"offload_optimizer_device": "nvme"}, "needs offload_optimizer_nvme_path"),
        ({"gradient_accumulation_steps": 0}, "must be a positive int"),
        ({"gradient_clipping": -1.0}, "non-negative number"),
        ({"zero3_init_flag": True, "zero_stage": 2}, "only applies to zero_stage 3"),
        ({"hf_ds_config": 3}, "a path to a JSON file or a dict"),
        (
            {"hf_ds_config": {"train_batch_size": 8}, "zero_stage": 2},
            "zero_stage is given beside hf_ds_config",
        ),
        ({"hf_ds_config": "/nonexistent/ds.json"}, "cannot read the DeepSpeed config file"),
        ({"zero3_save_16bit_model": "yes"}, "True, False or None"),
    ],
)
def test_bad_deepspeed_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(fa.ConfigError, match=message):
        DeepSpeedPlugin(**kwargs)  # type: ignore[arg-type]
