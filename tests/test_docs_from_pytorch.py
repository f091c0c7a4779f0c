"""docs/from-pytorch.md shows code that runs: each Python block is an excerpt of one of the two
scripts tests/ports/ runs on 1 and 2 processes (plain_train.py and its port fnaccel_train.py),
line for line, or a block run here as written. A block edited away from its script, or one that
is neither, fails."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "from-pytorch.md"
SCRIPTS = (ROOT / "tests" / "ports" / "plain_train.py", ROOT / "tests" / "ports" / "fnaccel_train.py")


def _lines(code: str) -> list[str]:
    return [line.strip() for line in code.splitlines() if line.strip()]


def _excerpt_of(block: str, script: Path) -> bool:
    """Whether ``block``'s lines (indentation aside) are consecutive lines of ``script``."""
    want, have = _lines(block), _lines(script.read_text())
    return any(have[i : i + len(want)] == want for i in range(len(have) - len(want) + 1))


def _run_pipeline(names: dict[str, Any], tmp: Path) -> None:
    # "fa.autocast(fa.fp16) adds fa.grad_scaler()", before the clipping
    pipeline = _prepared_state(names["pipeline"]).pipeline
    assert isinstance(pipeline, fa.Pipeline)
    assert pipeline.names == (
        "autocast",
        "grad_scaler",
        "ddp",
        "accumulate",
        "clip_grad_norm",
    )


def _run_decision(names: dict[str, Any], tmp: Path) -> None:
    assert names["stop_now"] is True and (tmp / "runs" / "stopped" / "fnaccel.json").is_file()


def _prepared_state(pipeline: fa.Pipeline | None = None) -> fa.RunState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    return fa.prepare(
        fa.init(seed=0),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        pipeline=pipeline,
        loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )


# blocks run here: a line of their own text -> (names the page leaves to the reader, what to check)
RUN = {
    "pipeline = fa.compose(fa.autocast(fa.fp16)": (dict, _run_pipeline),
    "fa.ops.broadcast_object_list(state, [stop_now])": (lambda: {"state": _prepared_state()}, _run_decision),
}


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_every_block_is_an_excerpt_of_a_tested_script_or_run_here() -> None:
    blocks = _blocks()
    assert len(blocks) > 10
    neither = [
        block
        for block in blocks
        if not any(_excerpt_of(block, script) for script in SCRIPTS) and not any(m in block for m in RUN)
    ]
    assert neither == [], "docs/from-pytorch.md blocks that are no script's excerpt and not run here"
    assert all(sum(marker in block for block in blocks) == 1 for marker in RUN)
    # and the check sees an edited excerpt
    edited = next(b for b in blocks if "fa.save(state, ckpt)" in b).replace("fa.save", "fa.utils.save")
    assert not any(_excerpt_of(edited, script) for script in SCRIPTS)


@pytest.mark.parametrize("marker", sorted(RUN))
def test_the_blocks_not_from_a_script_run_as_written(
    marker: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "STOP").touch()  # what the decision block looks for on rank 0
    names_for, check = RUN[marker]
    names = {"fa": fa, "os": os, "torch": torch, **names_for()}
    block = next(b for b in _blocks() if marker in b)
    exec(compile(block, f"docs/from-pytorch.md ({marker})", "exec"), names)
    check(names, tmp_path)
