"""Save a run every few steps and resume it, mid-epoch, in a fresh process.

    python examples/checkpointing.py --stop-after 7    # ends after step 7, as a preempted job would
    python examples/checkpointing.py                   # resumes from the last save and finishes
    fnaccel launch --cpu --num_processes 2 examples/checkpointing.py

`fa.save` writes everything the run needs to go on (weights, optimizer, scheduler, every
generator, the data position) into one directory, atomically: a job killed during a save leaves
the previous checkpoint whole. `fa.load` restores it into a run prepared like the one that saved;
that run then reads the same remaining batches with the same dropout masks, so its final weights
are bit-identical to a run that never stopped (compare the printed fingerprints). There is no
epoch bookkeeping and no `skip_first_batches`: the data position is part of the checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 8, generator=generator)
    y = (x[:, :4].sum(dim=1) > 0).long()  # a rule the model can learn
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def fingerprint(model: nn.Module) -> str:
    """A hash of every weight's bytes: equal fingerprints mean bit-identical weights."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None, help="end the process after this step")
    parser.add_argument("--output", default="runs/checkpointing")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    checkpoint = os.path.join(args.output, "checkpoint")

    state = fa.init(seed=0)
    torch.manual_seed(0)  # the same initial weights on every process
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = DataLoader(make_dataset(128 if args.tiny else 2048), batch_size=args.batch_size, shuffle=True)
    state = fa.prepare(state, model, optimizer, loader, scheduler, loss_fn=loss_fn)

    # A checkpoint loads into objects prepared exactly as the saving run prepared them.
    if os.path.exists(os.path.join(checkpoint, "fnaccel.json")):
        state = fa.load(state, checkpoint)
        fa.print_on_main(state, f"resumed from {checkpoint}: epoch {state.epoch}, step {state.step}")

    for batch in fa.batches(state, epochs=args.epochs):  # from the state's data position on
        state, metrics = fa.step(state, batch)
        if state.step % args.save_every == 0:
            fa.save(state, checkpoint)  # every process calls it; `state` stays usable
        if state.step == args.stop_after:
            # No save here: a preempted job gets no warning. The next start resumes from the
            # last save and redoes the steps after it, identically.
            fa.print_on_main(state, f"stopped after step {state.step}")
            fa.shutdown(state)
            return

    fa.print_on_main(
        state,
        f"done: step {state.step}, loss {metrics['loss'].item():.4f}, "
        f"weights fingerprint {fingerprint(model)}",
    )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
