"""Log hyperparameters and metrics: the built-in JSONL tracker, and a tracker of your own.

    python examples/tracking.py
    fnaccel launch --cpu --num_processes 2 examples/tracking.py
    tail -f runs/tracking/tracking/metrics.jsonl      # one JSON object per fa.log call

Trackers belong to the run (`state.trackers`), not to the process, and only the main process
opens them, so every process can call `fa.log` unconditionally. Metrics stay tensors on the
device; `fa.log` reads all of a call's tensors in one transfer, so log every few steps rather
than every step. `log_with="tensorboard"` (or a list of names) picks other trackers.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


class PrintTracker:
    """Any object with these five members is a tracker: here, one printing to the terminal."""

    name = "print"
    tracker = None  # the object underneath, for `fa.get_tracker(..., unwrap=True)`

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        print(f"[print tracker] config {values}")

    def log(self, values: Mapping[str, Any], step: int) -> None:
        print(f"[print tracker] step {step}: {values}")  # plain Python values: tensors already read

    def finish(self) -> None:
        print("[print tracker] finished")


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 10, generator=generator)
    return TensorDataset(x, (x[:, 0] * x[:, 1] > 0).long())


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=10, help="steps between two fa.log calls")
    parser.add_argument("--output", default="runs/tracking")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0, project_dir=args.output)  # trackers write under the project directory
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train = DataLoader(
        make_dataset(128 if args.tiny else 4096, seed=1), batch_size=args.batch_size, shuffle=True
    )
    test = DataLoader(make_dataset(64 if args.tiny else 1024, seed=2), batch_size=128)
    state = fa.prepare(state, model, optimizer, train, loss_fn=loss_fn)

    # `config` is recorded once (config.json beside metrics.jsonl); every process calls this.
    state = fa.init_trackers(state, "tracking", config=vars(args), log_with=["jsonl", PrintTracker()])

    for epoch in range(args.epochs):
        for batch in fa.batches(state, epochs=epoch + 1):
            state, metrics = fa.step(state, batch)
            if state.step % args.log_every == 0:
                fa.log(state, {"train/loss": metrics["loss"], "lr": metrics["lr"]})  # at state.step
        hits = fa.evaluate(state, test, lambda model, batch: model(batch[0]).argmax(1) == batch[1])
        fa.log(state, {"test/accuracy": hits.float().mean(), "epoch": epoch})

    fa.shutdown(state)  # flushes and closes the trackers, then ends the process group

    if state.dist.is_main_process:  # the file is plain JSON lines: read it back with anything
        with open(os.path.join(args.output, "tracking", "metrics.jsonl")) as file:
            lines = [json.loads(line) for line in file]
        accuracy = [line["values"]["test/accuracy"] for line in lines if "test/accuracy" in line["values"]]
        print(f"{len(lines)} lines logged; test accuracy by epoch: {[round(a, 3) for a in accuracy]}")


if __name__ == "__main__":
    main()
