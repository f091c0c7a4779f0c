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


def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    epochs_seen = set()
    # several kill points: right after the first save, then after `saves` more, at growing
    # fractions of a save's duration (measured by the loop: a fixed delay would land in the
    # same save on a slow or busy machine)
    for saves, fraction in enumerate((0.0, 0.2, 0.45, 0.7, 0.9)):
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(path)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "first save done"
        duration = 0.0
        for _ in range(saves):
            line = proc.stdout.readline().split()
            assert line[0] == "saved", line
            duration = float(line[-1])
        time.sleep(fraction * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

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
