"""fa.utils.get_model_tp_size: what transformers recorded, or the tp mesh of fa.tp's DTensors
(the latter on 2 processes in tests/transforms/test_mesh.py, `test_tp_on_two_ranks...`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from fnaccel.utils import get_model_tp_size


def test_get_model_tp_size_reads_what_transformers_recorded() -> None:
    assert get_model_tp_size(nn.Linear(2, 2)) is None  # not split
    old = nn.Linear(2, 2)
    setattr(old, "tp_size", 2)  # transformers < 5 kept it on the model
    assert get_model_tp_size(old) == 2
    for distributed in ({"tp_size": 4}, SimpleNamespace(tp_size=4)):  # transformers >= 5: the config's
        new = nn.Linear(2, 2)
        setattr(new, "tp_size", None)  # the stub transformers 5 leaves behind
        setattr(new, "config", SimpleNamespace(distributed_config=distributed))
        assert get_model_tp_size(new) == 4
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        get_model_tp_size("model")  # type: ignore[arg-type]
