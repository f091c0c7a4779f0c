"""The Python blocks of README.md and docs/ that a user runs as written, run as written.

Each block is found by a line of its own text and executed on one CPU process
with the names its page leaves to the reader (a model, an optimizer, a loader,
a prepared `state`, ...) bound to small real ones; then what the page says of
its result is checked. A block edited so that it no longer runs fails here.
Blocks that need several processes, a GPU or a package outside the test extra
run in their own tests (examples/, tests/test_launchers.py, tests/modeling/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.utils import check_trigger, set_trigger

ROOT = Path(__file__).resolve().parents[1]
DATASET = TensorDataset(
    torch.randn(48, 8, generator=torch.Generator().manual_seed(0)),
    torch.randint(0, 3, (48,), generator=torch.Generator().manual_seed(1)),
)
TEST_SET = TensorDataset(torch.randn(10, 8), torch.randint(0, 3, (10,)))


def _block(page: str, marker: str) -> str:
    blocks = [
        code for code in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S) if marker in code
    ]
    assert len(blocks) == 1, f"{page}: {len(blocks)} python blocks contain {marker!r}"
    return blocks[0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class _ReturnsLoss(nn.Module):
    """A model whose forward takes the batch and returns the loss, as a transformers model given labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def _loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _reader(model: nn.Module | None = None) -> dict[str, Any]:
    """The names the pages leave to the reader."""
    model = model or _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "fa": fa,
        "torch": torch,
        "F": F,
        "nn": nn,
        "DataLoader": DataLoader,
        "model": model,
        "optimizer": optimizer,
        "opt": optimizer,
        "loader": DataLoader(DATASET, batch_size=4, shuffle=True),
        "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 5),
        "loss_fn": _loss_fn,
        "dataset": DATASET,
        "test_set": TEST_SET,
        "test_loader": DataLoader(TEST_SET, batch_size=4),
        "set_trigger": set_trigger,
        "check_trigger": check_trigger,
    }


def _make_run(pipeline: fa.Pipeline | None = None) -> fa.RunState:
    names = _reader()
    return fa.prepare(
        fa.init(seed=0),
        names["model"],
        names["optimizer"],
        names["loader"],
        pipeline=pipeline,
        loss_fn=_loss_fn,
    )


def _prepared(**more: Any) -> dict[str, Any]:
    state = _make_run()
    return {**_reader(), "state": state, "model": state.model, **more}


def _check_readme(names: dict[str, Any], tmp: Path) -> None:
    assert names["preds"].shape == (len(TEST_SET),)
    assert names["labels"]["labels"].shape == (2, 3)
    assert (tmp / "ckpt" / "fnaccel.json").is_file()


def _check_break(names: dict[str, Any], tmp: Path) -> None:
    # "a fresh process loads it and reads that batch first"
    resumed = fa.load(_make_run(), "ckpt")
    first = next(iter(fa.batches(resumed, epochs=2)))
    assert resumed.micro_step == 3
    assert all(torch.equal(a, b) for a, b in zip(first, names["batch"], strict=True))


def _check_end_epoch(names: dict[str, Any], tmp: Path) -> None:
    # the criterion fired at every epoch's second step (of 12): 3 epochs of 2 steps, each
    # ended early; the save resumes at the start of the next epoch
    state = names["state"]
    assert (state.step, state.data_position) == (6, fa.DataPosition(epoch=3))
    assert fa.load(_make_run(), "ckpt").data_position == fa.DataPosition(epoch=3)


def _check_default_pipeline(names: dict[str, Any], tmp: Path) -> None:
    assert names["pipeline"].names == ("accumulate", "clip_grad_norm")  # one process, fp32: nothing else


def _check_own_transform(names: dict[str, Any], tmp: Path) -> None:
    state = _make_run(fa.compose(names["allreduce_gradients"]()))
    assert fa.Capability.AVERAGES_GRADIENTS in state.pipeline.capabilities
    state, _ = fa.step(state, next(iter(fa.batches(state))))
    assert state.step == 1


def _check_tracking(names: dict[str, Any], tmp: Path) -> None:
    lines = (tmp / "runs" / "classifier" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 30 and "loss" in json.loads(lines[-1])["values"]


def _check_migration(names: dict[str, Any], tmp: Path) -> None:
    logged = [
        json.loads(line)
        for line in (tmp / "runs" / "demo" / "demo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [entry["values"]["epoch"] for entry in logged] == [0, 1, 2]
    assert (tmp / "runs" / "demo" / "ckpt" / "fnaccel.json").is_file()


def _check_summed_loss(names: dict[str, Any], tmp: Path) -> None:
    # 8 batches, accumulate(4): two updates, each the mean over the tokens its window scored
    metrics = names["metrics"]
    assert names["state"].step == 2
    assert torch.allclose(metrics["loss"], (metrics["loss_sum"] / metrics["num_items"]).float())
    assert (
        0 < metrics["num_items"] < 4 * 4 * 15
    )  # 4 batches of 4 rows, 15 predicted tokens each, some unscored


def _check_policy(names: dict[str, Any], tmp: Path) -> None:
    # 3 epochs of 12 steps, the continuous RAM member keeping one checkpoint (no disk save by
    # step 500); a second attempt of the same block starts from it and ends at the same step
    kept = sorted(p.name for p in (tmp / "ram").iterdir())
    assert names["found"] is None and names["state"].step == 36 and len(kept) == 1, kept
    again = {**_reader(), "ram": names["ram"]}
    exec(compile(_block("docs/checkpoints.md", "fa.autosave(state, policy)"), "again", "exec"), again)
    assert again["found"] == tmp / "ram" / kept[0] and again["state"].step == 36


def _transformers_reader() -> dict[str, Any]:
    pytest.importorskip("transformers")
    return _reader()


CASES: dict[
    str, tuple[str, str, Callable[[], dict[str, Any]], Callable[[dict[str, Any], Path], None] | None]
] = {
    "README": (
        "README.md",
        "state = fa.init(seed=0)",
        lambda: {**_reader(), "labels": torch.zeros(2, 3)},
        _check_readme,
    ),
    "training": ("docs/training.md", "F.cross_entropy(model(batch[0])", _reader, None),
    "data: the loop": ("docs/data.md", "even_batches=True", lambda: _reader(_ReturnsLoss()), None),
    "data: break and save": ("docs/data.md", "state.micro_step == K", lambda: _prepared(K=3), _check_break),
    "data: end_epoch": (
        "docs/data.md",
        "state = fa.end_epoch(state)",
        # a fresh counter per snippet run: the inner lambda is made anew each time
        lambda: _prepared(early_stop=lambda loss, calls=iter(range(99)): next(calls) % 2 == 1),  # noqa: B008
        _check_end_epoch,
    ),
    "training: default_pipeline": (
        "docs/training.md",
        "fa.compose(fa.default_pipeline(state)",
        _prepared,
        _check_default_pipeline,
    ),
    "training: normalize=items with transformers": (
        "docs/training.md",
        "num_items_in_batch=1",
        _transformers_reader,
        _check_summed_loss,
    ),
    "training: a transform of one's own": (
        "docs/training.md",
        "def allreduce_gradients",
        _reader,
        _check_own_transform,
    ),
    "data: evaluate": ("docs/data.md", "fa.evaluate(state", _prepared, None),
    "data: eval_batches": ("docs/data.md", "fa.eval_batches(state", lambda: _prepared(preds=[]), None),
    "collectives: compose": (
        "docs/collectives.md",
        "collect = fa.compose",
        lambda: _prepared(labels=torch.zeros(2, 3)),
        None,
    ),
    "checkpoints": (
        "docs/checkpoints.md",
        "fresh_prepared_state",
        lambda: _prepared(fresh_prepared_state=_make_run()),
        None,
    ),
    "checkpoints: a policy": (
        "docs/checkpoints.md",
        "fa.autosave(state, policy)",
        lambda: {**_reader(), "ram": Path("ram").absolute()},
        _check_policy,
    ),
    "helpers: trigger": ("docs/helpers.md", "set_trigger(state)", _prepared, None),
    "tracking": ("docs/tracking.md", 'fa.init_trackers(state, "classifier"', _reader, _check_tracking),
    "migration: the script": ("docs/migration.md", "import fnaccel as fa", dict, _check_migration),
    "debugging: verify_resume": (
        "docs/debugging.md",
        "verify_resume(make_run, steps=3)",
        lambda: {**_reader(), "make_run": _make_run},
        None,
    ),
}


@pytest.mark.filterwarnings(
    "ignore:This DataLoader will create 4 worker processes"
)  # data.md's num_workers=4
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_documented_block_runs_as_written(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page, marker, names_for, check = CASES[case]
    monkeypatch.chdir(tmp_path)
    names = names_for()
    exec(compile(_block(page, marker), f"{page} ({case})", "exec"), names)
    if check is not None:
        check(names, tmp_path)
