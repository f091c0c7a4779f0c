"""GradientAccumulationPlugin: validated settings that build fa.accumulate."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.utils import GradientAccumulationPlugin


def test_gradient_accumulation_plugin() -> None:
    assert repr(GradientAccumulationPlugin(num_steps=2, sync_each_batch=True).transform()) == (
        "accumulate(num_steps=2, sync_each_batch=True)"
    )
    for kwargs, message in (
        ({}, "'num_steps': must be a positive int"),
        ({"num_steps": 2, "sync_with_dataloader": True}, "across epoch ends"),
        ({"num_steps": 2, "adjust_scheduler": False}, "only at optimizer updates"),
    ):
        with pytest.raises(fa.ConfigError, match=message):
            GradientAccumulationPlugin(**kwargs)  # type: ignore[arg-type]
