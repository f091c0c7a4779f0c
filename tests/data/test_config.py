"""`DataLoaderConfiguration`: Accelerate's fields and defaults, fnaccel's `shard`, validation."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import fnaccel as fa
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.kwargs import KwargsHandler


def test_fields_and_defaults_follow_accelerate() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(DataLoaderConfiguration)}
    assert fields == {
        "split_batches": False,
        "dispatch_batches": None,
        "even_batches": True,
        "data_seed": None,
        "non_blocking": False,
        "shard": None,
    }
    config = DataLoaderConfiguration()
    assert isinstance(config, KwargsHandler) and config.to_kwargs() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.shard = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        DataLoaderConfiguration(True)  # type: ignore[misc]  # keyword-only


def test_to_kwargs_gives_the_changed_fields() -> None:
    config = DataLoaderConfiguration(split_batches=True, data_seed=3, shard=False)
    assert config.to_kwargs() == {"split_batches": True, "data_seed": 3, "shard": False}
    assert pickle.loads(pickle.dumps(config)) == config


def test_it_reaches_the_state_through_init() -> None:
    config = DataLoaderConfiguration(even_batches=False)
    state = fa.init(cpu=True, kwargs_handlers=[config])
    assert state.kwargs_handlers["DataLoaderConfiguration"] is config


def test_dispatch_batches_true_is_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="fnaccel has no dispatching loader"):
        DataLoaderConfiguration(dispatch_batches=True)
    assert DataLoaderConfiguration(dispatch_batches=False).dispatch_batches is False


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"split_batches": 1}, "split_batches must be True or False"),
        ({"even_batches": None}, "even_batches must be True or False"),
        ({"non_blocking": "yes"}, "non_blocking must be True or False"),
        ({"shard": 0}, "shard must be True or False or None"),
        ({"data_seed": 1.5}, "data_seed must be an int or None"),
        ({"data_seed": True}, "data_seed must be an int or None"),
    ],
)
def test_types_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataLoaderConfiguration(**kwargs)  # type: ignore[arg-type]
