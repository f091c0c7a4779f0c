"""A script that `fnaccel launch` runs in tests/test_preemption.py.

    _preemption_script.py OUT (evaluate|resume|prepare|save|finish)

Two epochs of a small DDP model under ``accumulate(2)`` with `fa.PreemptionKwargs`.
Every worker leaves OUT/pid.<pid> holding its rank (the test signals workers, and ends
them, by their pids).

``resume``: loads OUT/ckpt, finishes the two epochs and writes
OUT/resumed.<rank>.pt; then, in the same processes (a launch fewer: its imports are most
of a launch's seconds), runs ``finish`` from a new `fa.init`: the uninterrupted reference.

Where the signal lands (the test sends it, except in ``save``):

- ``evaluate``: after step 2, `fa.evaluate` over 64 samples, slowly; rank 0 touches
  OUT/evaluating at its first batch;
- ``prepare``: touches OUT/preparing.<rank> after `fa.init` and waits for OUT/go before
  `fa.prepare`;
- ``save``: at step 3, rank 1 sends itself SIGTERM from a thread as soon as the save of
  OUT/mid has started writing (its hidden temporary exists);
- ``finish``: after the loop, touches OUT/finished.<rank> and waits for OUT/go before its
  final save (OUT/final), writing OUT/full.<rank>.pt (the weights), and `fa.shutdown`.

When `fa.batches` ends early each of these saves OUT/ckpt; each rank writes
OUT/stop.<rank>.json (micro-step, step, epoch, `state.preempted`, when it had saved, and
the samples `fa.evaluate` returned).
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def _signal_during_save(out: Path) -> threading.Thread:
    """SIGTERM to this process once the save of OUT/mid writes its hidden temporary."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not any(out.glob(".mid.tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.0005)
        (out / "in_flight").write_text(str(not (out / "mid").exists()))
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def main(out: Path, mode: str) -> None:
    import fnaccel as fa

    state = fa.init(cpu=True, seed=0, kwargs_handlers=[fa.PreemptionKwargs(check_every=2)])
    rank = state.dist.rank
    (out / f"pid.{os.getpid()}").write_text(str(rank))
    if mode == "prepare":
        (out / f"preparing.{rank}").touch()
        _wait_for(out / "go")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
    state = fa.prepare(
        state,
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        DataLoader(data, batch_size=4, shuffle=True),
        pipeline=fa.compose(fa.ddp(), fa.accumulate(2)),
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
    )
    if mode == "resume":
        state = fa.load(state, out / "ckpt")
    evaluated = None
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
        if mode == "evaluate" and state.step == 2 and evaluated is None:

            def slowly(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
                (out / "evaluating").touch()
                time.sleep(0.1)
                return m(x)[:, 0]

            evaluated = len(fa.evaluate(state, DataLoader(data.tensors[0][:64], batch_size=2), slowly))
        elif mode == "save" and state.step == 3 and not (out / "mid").exists():
            watcher = _signal_during_save(out) if rank == 1 else None
            fa.save(state, out / "mid")
            if watcher is not None:
                watcher.join()
    if mode == "finish":
        (out / f"finished.{rank}").touch()
        _wait_for(out / "go")
        fa.save(state, out / "final")
        torch.save(model.state_dict(), out / f"full.{rank}.pt")
    elif mode != "resume":
        if state.preempted:
            fa.save(state, out / "ckpt")
        (out / f"stop.{rank}.json").write_text(
            json.dumps(
                {
                    "micro_step": state.micro_step,
                    "step": state.step,
                    "preempted": state.preempted,
                    "epoch": state.epoch,
                    "saved_at": time.time(),
                    "evaluated": evaluated,
                }
            )
        )
    else:
        torch.save(model.state_dict(), out / f"resumed.{rank}.pt")
    fa.shutdown(state)
    if mode == "resume":  # the resumed run came first, in fresh processes; the reference after it
        main(out, "finish")


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(Path(sys.argv[1]), sys.argv[2])
