"""A script in which rank 1 raises, for tests/commands/test_launch.py.

    _crashing.py PID_DIR (init|step) (plain|finally)

Every process first leaves an empty file named after its pid in PID_DIR;
rank 1 writes the time it raises to PID_DIR/failed_at.
``init``: rank 1 raises right after `fa.init` while rank 0 enters a
collective. ``step``: rank 1 raises in its loss function at step 3 under
``ddp()``, while rank 0 waits in the gradients' all-reduce. ``finally``:
the run is wrapped in ``try: ... finally: fa.shutdown(state)``.
"""

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def main(where: str, ending: str) -> None:
    state = fa.init(cpu=True, seed=0)
    rank = state.dist.rank
    steps = [0]

    def fail(message: str) -> None:
        Path(sys.argv[1], "failed_at").write_text(repr(time.time()))
        raise RuntimeError(message)

    def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        if where == "step" and rank == 1 and steps[0] == 3:
            fail("rank 1 fails mid-step")
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    def run(state: fa.RunState) -> fa.RunState:
        if where == "init" and rank == 1:
            fail("rank 1 fails after fa.init")
        fa.ops.reduce(state, torch.tensor(1.0), "sum")
        model = nn.Linear(8, 2)
        data = TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
        state = fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(data, batch_size=4),
            pipeline=fa.compose(fa.ddp()),
            loss_fn=loss_fn,
        )
        for batch in fa.batches(state, epochs=1):
            steps[0] = state.step
            state, _ = fa.step(state, batch)
        return state

    if ending == "finally":
        try:
            state = run(state)
        finally:
            fa.shutdown(state)
    else:
        fa.shutdown(run(state))


if __name__ == "__main__":  # a script: importing it (doctest collection) must not run it
    Path(sys.argv[1], f"pid.{os.getpid()}").touch()
    main(sys.argv[2], sys.argv[3])
