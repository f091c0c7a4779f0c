"""TorchDynamoPlugin: Accelerate's dynamo_config section, validated and carried out by fa.compile."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.utils import TorchDynamoPlugin


def test_dynamo_plugin() -> None:
    assert TorchDynamoPlugin.from_config({}).transform() is None
    assert TorchDynamoPlugin.from_config({"dynamo_backend": "NO"}).transform() is None
    plugin = TorchDynamoPlugin.from_config(
        {"dynamo_backend": "eager", "dynamo_mode": "max-autotune", "dynamo_use_dynamic": "true"}
    )
    assert repr(plugin.transform()) == "compile(backend='eager', mode='max-autotune', dynamic=True)"
    for section, message in (
        ({"dynamo_backend": "TURBO"}, "must be one of"),
        ({"dynamo_mode": "fastest"}, "key 'dynamo_mode'"),
        ({"dynamo_use_regional_compilation": True}, "regional compilation"),
        ({"dynamo_cache": 1}, "unknown key 'dynamo_cache'"),
    ):
        with pytest.raises(fa.ConfigError, match=message):
            TorchDynamoPlugin.from_config(section)
