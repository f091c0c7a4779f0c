"""Crash safety: SIGKILL in the middle of fa.save never costs the last good checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

import fnaccel as fa

SCRIPT = Path(__file__).with_name("_save_loop.py")


def _fresh() -> fa.RunState:
    torch.manual_seed(1)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(20)])
    return fa.prepare(fa.init(seed=0, cpu=True), model, torch.optim.AdamW(model.parameters()),
                      loss_fn=lambda m, b: m(b).pow(2).mean())


def manifest_epoch(path: Path) -> int:
    return int(json.loads((path / "fnaccel.json").read_text())["epoch"])


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    epochs_seen = set()
    # several kill points: after a number of saves, at growing delays into the next one
    for saves, delay in ((0, 0.0), (1, 0.05), (2, 0.13), (1, 0.29), (3, 0.41)):
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(path)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first save done"
        for _ in range(saves):
            assert proc.stdout.readline().startswith("saved")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert manifest_epoch(path) >= saves

        # the next run's first save removed what this one's killed save left: one at most
        assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.")]) <= 1
        manifest = json.loads((path / "fnaccel.json").read_text())
        epochs_seen.add(manifest["epoch"])
        state = fa.load(_fresh(), path)  # verifies every checksum
        assert state.epoch == manifest["epoch"]
        # nothing beside it that could pass for a checkpoint: only hidden temporaries
        others = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
        assert all(name.startswith(".ckpt.tmp-") for name in others), others
        for leftover in others:  # a temporary with a manifest is complete (killed before the swap)
            if (tmp_path / leftover / "fnaccel.json").exists():
                fa.load(_fresh(), tmp_path / leftover)
    assert len(epochs_seen) > 1  # the kills did land at different points of the loop


def test_sigkill_during_rotation_never_shows_a_checkpoint_without_its_manifest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for saves, delay in ((1, 0.0), (2, 0.19), (3, 0.43)):
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), "rotate"], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first save done"
        for _ in range(saves):
            assert proc.stdout.readline().startswith("saved")
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        visible = [p for p in root.iterdir() if not p.name.startswith(".")]
        assert visible and all((p / "fnaccel.json").is_file() for p in visible), sorted(os.listdir(root))
        newest = max(visible, key=lambda p: int(p.name.removeprefix("checkpoint_")))
        assert fa.load(_fresh(), newest).epoch == manifest_epoch(newest)
        # the leftovers of earlier kills went with later saves: only this kill's remain
        assert len([p for p in root.iterdir() if p.name.startswith(".")]) <= 2, sorted(os.listdir(root))
