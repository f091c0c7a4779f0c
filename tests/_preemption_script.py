"""A script that `fnaccel launch` runs in tests/test_preemption.py.

    _preemption_script.py OUT (full|preempt|resume)

Two epochs of a small DDP model under ``accumulate(2)`` with `fa.PreemptionKwargs`.
``full``: uninterrupted, writes OUT/full.<rank>.pt (the weights). ``preempt``: steps
slowly and touches OUT/running once past step 3 (the test then sends SIGTERM to the
launcher); when `fa.batches` ends early it saves OUT/ckpt, and each rank writes
OUT/stop.<rank>.json (its micro-step, step, `state.preempted` and when it had saved). ``resume``: loads
OUT/ckpt, finishes the two epochs and writes OUT/resumed.<rank>.pt; then, in the same processes
(a launch fewer: its imports are most of a launch's seconds), runs ``full`` from a new `fa.init`.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main(out: Path, mode: str) -> None:
    import fnaccel as fa

    (out / f"pid.{os.getpid()}").touch()  # the test ends every worker by its pid
    state = fa.init(cpu=True, seed=0, kwargs_handlers=[fa.PreemptionKwargs(check_every=2)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    state = fa.prepare(state, model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                       DataLoader(data, batch_size=4, shuffle=True),
                       pipeline=fa.compose(fa.ddp(), fa.accumulate(2)),
                       loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    if mode == "resume":
        state = fa.load(state, out / "ckpt")
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
        if mode == "preempt":
            time.sleep(0.02)
            if state.step == 3 and state.dist.rank == 0:
                (out / "running").touch()
    rank = state.dist.rank
    if mode == "preempt":
        if state.preempted:
            fa.save(state, out / "ckpt")
        (out / f"stop.{rank}.json").write_text(json.dumps(
            {"micro_step": state.micro_step, "step": state.step, "preempted": state.preempted,
             "epoch": state.epoch, "saved_at": time.time()}))
    else:
        torch.save(model.state_dict(), out / f"{'full' if mode == 'full' else 'resumed'}.{rank}.pt")
    fa.shutdown(state)
    if mode == "resume":  # the resumed run came first, in fresh processes; the reference after it
        main(out, "full")


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(Path(sys.argv[1]), sys.argv[2])
