"""Early stopping: stop every process at the same step, and resume at the next epoch, whole.

    python examples/early_stopping.py                      # stops once the loss is under 0.3
    python examples/early_stopping.py --target-loss 0.2    # continues from the next epoch
    fnaccel launch --cpu --num_processes 2 examples/early_stopping.py

Any process may find that the run should stop (here: its smoothed training loss fell under
`--target-loss`, or the loss is not finite). `fa.set_trigger` records that in its state;
`fa.check_trigger`, called by every process at the same place, agrees on it with one
all-reduce, so every process leaves the loop at the same step (a process leaving alone would
leave the others waiting in their next collective). The run also stops when the validation loss
has not improved for `--patience` epochs.

`fa.end_epoch` then skips the rest of the interrupted epoch, so the checkpoint saved after it
resumes at the start of the next epoch. Without it, the next `fa.batches` (in this process or
after a resume) would go on with the rest of the interrupted epoch, which is what a run stopped
for a save, rather than for good, needs.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 12, generator=generator)
    y = (x[:, :6].sum(dim=1) + 0.5 * torch.randn(num_samples, generator=generator) > 0).long()  # noisy labels
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument(
        "--target-loss", type=float, default=0.3, help="a smoothed training loss that stops the run"
    )
    parser.add_argument("--patience", type=int, default=2, help="epochs without improvement before stopping")
    parser.add_argument("--output", default="runs/early_stopping")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    checkpoint = os.path.join(args.output, "checkpoint")

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train = DataLoader(
        make_dataset(256 if args.tiny else 4096, seed=1), batch_size=args.batch_size, shuffle=True
    )
    validation = DataLoader(make_dataset(128 if args.tiny else 1024, seed=2), batch_size=256)
    state = fa.prepare(state, model, optimizer, train, loss_fn=loss_fn)
    if os.path.exists(os.path.join(checkpoint, "fnaccel.json")):
        state = fa.load(state, checkpoint)
        fa.print_on_main(state, f"resumed at the start of epoch {state.epoch} (step {state.step})")

    best_loss, best_epoch = math.inf, state.epoch - 1
    smoothed, num_steps = None, 0  # an average over several steps, not one lucky batch
    for epoch in range(state.epoch, args.epochs):
        stop = False
        for batch in fa.batches(state):  # the rest of the current epoch
            state, metrics = fa.step(state, batch)
            loss = metrics["loss"]
            smoothed, num_steps = (loss if smoothed is None else 0.9 * smoothed + 0.1 * loss), num_steps + 1
            if not torch.isfinite(loss) or (num_steps >= 10 and smoothed < args.target_loss):  # syncs
                state = fa.set_trigger(state)
            state, stop = fa.check_trigger(state)  # the same answer on every process
            if stop:
                fa.print_on_main(state, f"smoothed loss {smoothed.item():.4f} at step {state.step}: stopping")
                state = fa.end_epoch(state)  # the rest of this epoch is never read
                break

        losses = fa.evaluate(
            state,
            validation,
            lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none"),
        )
        validation_loss = losses.mean().item()
        fa.print_on_main(state, f"epoch {epoch}: validation loss {validation_loss:.4f}")
        fa.save(state, checkpoint)  # after fa.end_epoch too: resumes at the next epoch's start
        if validation_loss < best_loss:
            best_loss, best_epoch = validation_loss, epoch
        elif epoch - best_epoch >= args.patience:
            fa.print_on_main(state, f"no improvement for {args.patience} epochs: stopping")
            break
        if stop:
            break

    fa.print_on_main(state, f"stopped at step {state.step}; a resume starts at epoch {state.epoch}")
    fa.shutdown(state)


if __name__ == "__main__":
    main()
