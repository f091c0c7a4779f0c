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


def _kill_during_save(args: list[str], saves: int, delay: float) -> None:
    """Run the save loop: its first save, ``saves`` more one at a time, then start one
    more and SIGKILL it ``delay`` seconds in (which lands inside that save or, where it
    was quicker, while the loop waits for the next go-ahead: never in a later save)."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "first save done"
        for _ in range(saves):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().startswith("saved")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    epochs_seen = set()
    # several kill points: after a number of saves, at growing delays into the next one
    for saves, delay in ((0, 0.0), (1, 0.05), (2, 0.13), (1, 0.29), (3, 0.41)):
        _kill_during_save([str(path)], saves, delay)
        # the killed save either committed or left the one before it: never anything else
        assert manifest_epoch(path) in (saves, saves + 1)

        # the next run's first save removed what this one's killed save left: one at most (and the
        # killed save's lock file, which the kernel unlocked at its death: the next save takes it over)
        assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.") and p.name != ".ckpt.lock"]) <= 1
        manifest = json.loads((path / "fnaccel.json").read_text())
        epochs_seen.add(manifest["epoch"])
        state = fa.load(_fresh(), path)  # verifies every checksum
        assert state.epoch == manifest["epoch"]
        # nothing beside it that could pass for a checkpoint: only hidden temporaries
        others = [p.name for p in tmp_path.iterdir() if p.name not in ("ckpt", ".ckpt.lock")]
        assert all(name.startswith(".ckpt.tmp-") for name in others), others
        for leftover in others:  # a temporary with a manifest is complete (killed before the swap)
            if (tmp_path / leftover / "fnaccel.json").exists():
                fa.load(_fresh(), tmp_path / leftover)
    assert len(epochs_seen) > 1  # by construction: after 0 saves the epoch is 0 or 1, after 3 it is 3 or 4


def test_sigkill_during_rotation_never_shows_a_checkpoint_without_its_manifest(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for saves, delay in ((1, 0.0), (2, 0.19), (3, 0.43)):
        _kill_during_save([str(tmp_path), "rotate"], saves, delay)
        visible = [p for p in root.iterdir() if not p.name.startswith(".")]
        assert visible and all((p / "fnaccel.json").is_file() for p in visible), sorted(os.listdir(root))
        newest = max(visible, key=lambda p: int(p.name.removeprefix("checkpoint_")))
        assert fa.load(_fresh(), newest).epoch == manifest_epoch(newest)
        # the leftovers of earlier kills went with later saves: only this kill's remain
        assert len([p for p in root.iterdir() if p.name.startswith(".")]) <= 2, sorted(os.listdir(root))
