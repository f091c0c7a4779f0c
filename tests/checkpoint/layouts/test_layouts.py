"""Checkpoint layouts are types: one per kind of run, each in its own module, chosen from what the
pipeline declares; fa.save and fa.load read top to bottom without layout flags."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fnaccel as fa
from fnaccel.checkpoint.files import read_tensors
from fnaccel.checkpoint.layouts import PlainLayout, ShardedLayout, ZeroLayout, layout_for
from fnaccel.protocols import CheckpointLayout
from fnaccel.transforms.base import Capability, Transform

CHECKPOINT = Path(fa.__file__).parent / "checkpoint"
# what decides or implements one layout: only checkpoint/layouts/ (and the DCP machinery) may name them
LAYOUT_NAMES = {
    "is_sharded",
    "is_pipelined",
    "is_stored_sharded",
    "zero_engine",
    "shard_into",
    "load_sharded",
    "snapshot_sharded",
    "write_sharded",
    "snapshot_zero",
    "read_zero",
    "load_zero",
    "ShardedSnapshot",
    "sharded",
    "into_shards",
    "zero",
}


def _function(module: ast.Module, name: str) -> ast.FunctionDef:
    return next(n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name)


def test_save_and_load_are_at_most_60_lines_and_pass_no_layout_flags() -> None:
    run = ast.parse((CHECKPOINT / "run.py").read_text())
    for name in ("save", "load"):
        fn = _function(run, name)
        docstring = fn.body[0]
        assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant)
        assert fn.end_lineno is not None and docstring.end_lineno is not None
        code = fn.end_lineno - docstring.end_lineno  # the lines below the docstring
        assert code <= 60, f"fa.{name} is {code} lines below its docstring"
    for module in ("run.py", "writer.py"):  # the modules every fa.save and fa.load goes through
        tree = ast.parse((CHECKPOINT / module).read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        named |= {
            a.arg
            for n in ast.walk(tree)
            if isinstance(n, ast.arguments)
            for a in [*n.posonlyargs, *n.args, *n.kwonlyargs]
        }
        named |= {k.arg for n in ast.walk(tree) if isinstance(n, ast.Call) for k in n.keywords if k.arg}
        named |= {
            a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert not named & LAYOUT_NAMES, f"checkpoint/{module} names {sorted(named & LAYOUT_NAMES)}"


def test_each_layout_has_its_own_module_and_implements_the_protocol() -> None:
    layouts = {PlainLayout: "plain", ShardedLayout: "sharded", ZeroLayout: "zero"}
    for cls, module in layouts.items():
        assert cls.__module__ == f"fnaccel.checkpoint.layouts.{module}"
        assert isinstance(cls(), CheckpointLayout)
    assert len({cls.__module__ for cls in layouts}) == 3


PIPELINES = {
    "fsdp": lambda: fa.compose(fa.fsdp()),
    "fsdp_undeclared": lambda: fa.compose(
        dataclasses.replace(  # fsdp's hooks, sharding undeclared
            fa.fsdp(), capabilities=fa.fsdp().capabilities - {Capability.SHARDS_PARAMETERS}
        )
    ),
    "ddp": lambda: fa.compose(fa.ddp()),
    "fsdp_own_layout": lambda: fa.compose(dataclasses.replace(fa.fsdp(), layout=_WeightsOnly())),
}


def _chosen(state: fa.RunState, pipeline: str) -> str:
    """The layout this rank's run gets under ``pipeline``."""
    model = nn.Linear(4, 4)
    state = fa.prepare(
        state, model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=PIPELINES[pipeline]()
    )
    return type(layout_for(state)).__name__


def test_the_layout_follows_what_the_pipeline_declares(world2: Any) -> None:
    # fsdp() declares SHARDS_PARAMETERS: sharded; the same hooks without the declaration: plain; a layout
    # of the transform's own wins over the declaration
    expected = {
        "fsdp": "ShardedLayout",
        "fsdp_undeclared": "PlainLayout",
        "ddp": "PlainLayout",
        "fsdp_own_layout": "_WeightsOnly",
    }
    for pipeline, layout in expected.items():
        assert world2.run(_chosen, pipeline) == [layout] * 2, pipeline
    # in a world of one, fsdp() leaves the model whole: plain; a sharded checkpoint loads through DCP
    state = fa.prepare(fa.init(cpu=True), nn.Linear(1, 1), pipeline=fa.compose(fa.fsdp()))
    assert isinstance(layout_for(state), PlainLayout)
    assert isinstance(layout_for(state, {"files": {"sharded/metadata.json": {}}}), ShardedLayout)
    engine = fa.prepare(
        fa.init(cpu=True),
        nn.Linear(1, 1),
        pipeline=fa.compose(
            Transform(name="engine", capabilities=frozenset({Capability.OWNS_OPTIMIZER_STEP}))
        ),
    )
    assert isinstance(layout_for(engine), PlainLayout)  # no DeepSpeed master partitions to save


class _WeightsOnly:
    """An outsider's layout: the model's weights alone, in a file of its own, no optimizer state."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def snapshot(self, state: Any, files: Any) -> None:
        self.calls.append("snapshot")
        if files.writer:
            files.add_tensors("outsider.safetensors", state.model.state_dict())

    def write(self, captured: None, ctx: Any, directory: Path) -> dict[str, Any]:
        self.calls.append("write")
        return {}

    def read(self, state: Any, directory: Path, manifest: dict[str, Any], gradients: Any) -> dict[str, Any]:
        self.calls.append("read")
        return read_tensors(directory, "outsider.safetensors", manifest)

    def restore(self, state: Any, read: dict[str, Any]) -> None:
        self.calls.append("restore")
        state.model.load_state_dict(read)


def test_an_outsider_transform_brings_its_own_layout(tmp_path: Path) -> None:
    layout = _WeightsOnly()
    pipeline = fa.compose(Transform(name="outsider", layout=layout))

    def prepared(seed: int) -> fa.RunState:
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)
        return fa.prepare(
            fa.init(seed=0, cpu=True),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            pipeline=pipeline,
            loss_fn=lambda m, batch: m(batch).sum(),
        )

    state, _ = fa.step(prepared(0), torch.ones(4, 3))
    fa.save(state, tmp_path / "ckpt")
    files = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert "outsider.safetensors" in files and not {"model.safetensors", "optimizer.safetensors"} & files
    loaded = fa.load(prepared(1), tmp_path / "ckpt")
    assert layout.calls == ["snapshot", "write", "read", "restore"]
    assert loaded.step == 1
    for name, tensor in state.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
