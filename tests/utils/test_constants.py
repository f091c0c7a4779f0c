from __future__ import annotations

import json
from typing import Any

import pytest

from fnaccel import constants as c
from fnaccel.constants import (
    ComputeEnvironment,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
)

ALL_ENUMS = [
    ComputeEnvironment,
    DDPCommunicationHookType,
    DistributedType,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
    SageMakerDistributedType,
]


def test_values_match_accelerate() -> None:
    assert [m.value for m in PrecisionType] == ["no", "fp8", "fp16", "bf16"]
    assert DistributedType.list() == [
        "NO",
        "MULTI_CPU",
        "MULTI_GPU",
        "MULTI_NPU",
        "MULTI_MLU",
        "MULTI_MUSA",
        "MULTI_XPU",
        "MULTI_HPU",
        "DEEPSPEED",
        "FSDP",
        "XLA",
        "MEGATRON_LM",
    ]
    assert DynamoBackend.INDUCTOR.value == "INDUCTOR"
    assert DynamoBackend.AOT_EAGER.value == "AOT_EAGER"
    assert {"NO", "EAGER", "CUDAGRAPHS", "IPEX", "TVM", "ONNXRT", "TENSORRT"} <= set(DynamoBackend.list())
    assert LoggerType.COMETML.value == "comet_ml"
    assert {"all", "aim", "tensorboard", "wandb", "mlflow", "clearml", "dvclive", "swanlab"} <= set(
        LoggerType.list()
    )
    assert RNGType.list()[:9] == ["torch", "cuda", "npu", "mlu", "musa", "xla", "xpu", "hpu", "generator"]
    assert {"python", "numpy"} <= set(RNGType.list())
    assert ComputeEnvironment.list() == ["LOCAL_MACHINE", "AMAZON_SAGEMAKER"]
    assert SageMakerDistributedType.list() == ["NO", "DATA_PARALLEL", "MODEL_PARALLEL"]
    assert DDPCommunicationHookType.list() == ["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]


@pytest.mark.parametrize("enum_cls", ALL_ENUMS)
def test_members_are_their_values(enum_cls: Any) -> None:
    assert issubclass(enum_cls, str)
    for member in enum_cls:
        assert member == member.value
        assert str(member) == member.value
        assert f"{member}" == member.value
        assert enum_cls(member.value) is member
        assert member.value in enum_cls
        assert member in enum_cls
    assert "surely-not-a-member" not in enum_cls
    assert 3 not in enum_cls


def test_bad_value_names_the_choices() -> None:
    with pytest.raises(
        ValueError, match="'fp32' is not a valid PrecisionType: use one of no, fp8, fp16, bf16"
    ):
        PrecisionType("fp32")


def test_members_serialise_as_plain_strings() -> None:
    assert json.dumps({"mixed_precision": PrecisionType.BF16}) == '{"mixed_precision": "bf16"}'


def test_checkpoint_file_names() -> None:
    assert c.SAFE_WEIGHTS_NAME == "model.safetensors"
    assert c.SAFE_WEIGHTS_INDEX_NAME == "model.safetensors.index.json"
    assert c.WEIGHTS_NAME == "pytorch_model.bin"
    assert c.WEIGHTS_INDEX_NAME == "pytorch_model.bin.index.json"
    assert c.SAFE_MODEL_NAME == "model"
    assert c.MODEL_NAME == "pytorch_model"
    assert c.OPTIMIZER_NAME == "optimizer"
    assert c.SCHEDULER_NAME == "scheduler"
    assert c.SCALER_NAME == "scaler.pt"
    assert c.RNG_STATE_NAME == "random_states"
    assert c.SAMPLER_NAME == "sampler"
    assert c.PROFILE_PATTERN_NAME.format(suffix=2) == "profile_2.json"


def test_all_lists_every_public_name() -> None:
    constants = {name for name in vars(c) if name.isupper()}
    assert set(c.__all__) == constants | {cls.__name__ for cls in ALL_ENUMS}
