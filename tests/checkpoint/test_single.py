"""fnaccel.utils.save: one safetensors file from the main process, atomically."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fnaccel as fa
from fnaccel.dist import DistContext
from fnaccel.utils import save


def test_the_main_process_writes_and_the_others_do_not(tmp_path: Path) -> None:
    shared = torch.ones(3)
    save(fa.init(cpu=True), {"a": shared, "b": shared, "c": torch.arange(2)}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    assert torch.equal(loaded["a"], shared) and torch.equal(loaded["c"], torch.arange(2))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temporary left
    second = DistContext(
        num_processes=2, rank=1, local_rank=0, num_local_processes=1, node_rank=1, num_nodes=2
    )
    save(second, {"a": shared}, tmp_path / "rank1.safetensors")
    assert not (tmp_path / "rank1.safetensors").exists()
    save(second, {"a": shared}, tmp_path / "node1.safetensors", save_on_each_node=True)
    assert (tmp_path / "node1.safetensors").exists()  # the main process of its machine


def test_pickles_and_non_tensors_are_refused(tmp_path: Path) -> None:
    state = fa.init(cpu=True)
    with pytest.raises(ValueError, match="would write a pickle"):
        save(state, {"a": torch.ones(1)}, tmp_path / "x.bin", safe_serialization=False)
    with pytest.raises(ValueError, match="'step' is a int"):
        save(state, {"step": 3}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="must map names to tensors"):
        save(state, [torch.ones(1)], tmp_path / "x.safetensors")  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
