"""Hunt a loss spike with fnaccel's debugging tools (the walk-through in docs/debugging.md).

    python examples/loss_spike.py --output /tmp/spike

1. Train, saving a checkpoint every few steps; one sample of the data set is
   corrupt (its features 1000x too large), and the loss spikes where it lands.
2. Find the last checkpoint before the spike, `fnaccel checkpoint verify` and
   `inspect` it (the data position is in it).
3. `fa.diff` that checkpoint against the first one after: which parameters
   moved, and by how much.
4. Resume the checkpoint and read the next batches without stepping them
   (the data order is a function of the state): the spike's batch, and the
   sample in it.
5. `find_divergence`: step the run without and with `clip_grad_norm` side by
   side from the checkpoint, on the same batches: they part exactly at the
   spike, in the first layer.
6. `verify_resume`: the preflight that the setup resumes bit for bit.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.testing import find_divergence, verify_resume

NUM_SAMPLES, BATCH, SAVE_EVERY, BAD_SAMPLE = 256, 8, 4, 77


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(NUM_SAMPLES, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) / 4
    x[BAD_SAMPLE] *= 1000  # the corrupt sample
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y, _ = batch
    return (model(x) - y).pow(2).mean()


def make_run(pipeline: fa.Pipeline | None = None) -> fa.RunState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(data(), batch_size=BATCH, shuffle=True)
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        optimizer,
        loader,
        pipeline=pipeline or fa.compose(),
        loss_fn=loss_fn,
    )


def main(output: Path) -> dict[str, object]:
    # 1. train, a checkpoint every SAVE_EVERY steps
    state, losses = make_run(), []
    for batch in fa.batches(state, epochs=1):
        state, metrics = fa.step(state, batch)
        losses.append(metrics["loss"].item())
        if state.step % SAVE_EVERY == 0:
            fa.save(state, output / f"step_{state.step}")
    fa.shutdown(state)
    spike = next(i for i in range(4, len(losses)) if losses[i] > 20 * statistics.median(losses[:i]))
    print(
        f"loss spike at step {spike + 1}: {losses[spike]:.1f} (median before {statistics.median(losses[:spike]):.2f})"
    )

    # 2. the last checkpoint before it: intact? where in the data?
    before = output / f"step_{spike // SAVE_EVERY * SAVE_EVERY}"
    after = output / f"step_{(spike // SAVE_EVERY + 1) * SAVE_EVERY}"
    for command in ("verify", "inspect"):  # what you would type in a shell
        subprocess.run([sys.executable, "-m", "fnaccel", "checkpoint", command, str(before)], check=True)

    # 3. what changed across the spike
    moved = fa.diff(before, after)
    biggest = sorted(
        (d for d in moved.differences if d.item.startswith("model/")), key=lambda d: -(d.max_rel or 0)
    )
    print("parameters that moved most across the spike:", *(f"  {d}" for d in biggest[:2]), sep="\n")

    # 4. the batches after the checkpoint, read without stepping them
    reader = fa.load(make_run(), before)
    upcoming = list(itertools.islice(fa.batches(reader), SAVE_EVERY))
    fa.shutdown(reader)
    culprit = upcoming[spike - reader.step]
    worst = int(culprit[0].abs().amax(dim=1).argmax())
    sample = int(culprit[2][worst])
    print(f"step {spike + 1}'s batch holds sample {sample}, |x| up to {culprit[0].abs().max():.0f}")

    # 5. the same batches without and with clipping, side by side from the checkpoint
    plain = fa.load(make_run(), before)
    with warnings.catch_warnings():  # the clipped run differs on purpose: fa.load names the difference
        warnings.simplefilter("ignore", fa.ResumeDriftWarning)
        clipped = fa.load(make_run(fa.compose(fa.clip_grad_norm(20.0))), before)
    report = find_divergence(plain, clipped, upcoming, stop_at_first=True)
    print(report)
    fa.shutdown(report.a)
    fa.shutdown(report.b)

    # 6. the preflight: this setup resumes bit for bit
    verify_resume(make_run, steps=3)
    print("verify_resume: resumes bit for bit")
    first = report.first
    return {
        "spike": spike,
        "sample": sample,
        "divergence_step": None if first is None else reader.step + first.step,
        "parameter": None if first is None else first.parameter,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="A new directory for the checkpoints.")
    main(parser.parse_args().output)
