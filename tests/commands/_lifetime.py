"""A script that `fnaccel launch` runs in tests/commands/test_launch_lifetime.py.

    _lifetime.py OUT (sleep|save|reduce|init)

Every process leaves an empty file OUT/pid.<its pid> once it is ready, then
sleeps until it is ended. ``sleep``: nothing else (the launcher is killed).
``save``: SIGTERM makes it exit 0 (as a script that saves on SIGTERM does);
before sleeping it saves a checkpoint to OUT/ckpt, takes a step, and starts
an asynchronous save over it, which may still be writing when SIGTERM comes
(each rank writes OUT/in_flight.<rank> saying whether it was). ``reduce``: all-reduces
one number every 50 ms until it is ended (a machine of the run is killed; its pid
file comes after the first one). ``init``: rank 0 calls ``fa.init``, which waits for
rank 1, which never calls it (a machine is killed before its ranks joined the run).
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main(out: Path, mode: str) -> None:
    if mode == "save":
        import fnaccel as fa

        state = fa.init(cpu=True, seed=0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # 4 MB with AdamW's moments x3
        data = TensorDataset(torch.randn(16, 512), torch.randn(16, 512))
        state = fa.prepare(
            state,
            model,
            torch.optim.AdamW(model.parameters()),
            DataLoader(data, batch_size=4),
            loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        )
        fa.save(state, out / "ckpt")
        state, _ = fa.step(state, next(iter(fa.batches(state))))
        handle = fa.save(state, out / "ckpt", blocking=False)

        def stop(_signum: int, _frame: object) -> None:
            (out / f"in_flight.{state.dist.rank}").write_text(str(not handle.done()))
            sys.exit(0)  # the interpreter's exit waits for the save's thread

        signal.signal(signal.SIGTERM, stop)
    if mode == "reduce":
        import fnaccel as fa

        state = fa.init(cpu=True, seed=0)
        fa.ops.reduce(state, torch.ones(1))  # both ranks are in the run before the test kills one
        (out / f"pid.{os.getpid()}").touch()
        while True:
            fa.ops.reduce(state, torch.ones(1))
            time.sleep(0.05)
    (out / f"pid.{os.getpid()}").touch()
    if mode == "init" and os.environ["RANK"] == "0":
        import fnaccel as fa

        fa.init(cpu=True, seed=0)  # waits for rank 1, which never calls it
    time.sleep(600)


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    main(Path(sys.argv[1]), sys.argv[2])
