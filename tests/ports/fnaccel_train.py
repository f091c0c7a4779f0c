"""plain_train.py ported to fnaccel by following docs/from-pytorch.md, line by line.

    python tests/ports/fnaccel_train.py --out runs/port
    fnaccel launch --cpu --num_processes 2 tests/ports/fnaccel_train.py --out runs/port

What changed from plain_train.py, and nothing else: `fa.init` instead of `init_process_group`
(the `master_process` guard stays for printing and the script's own files); the loop body
becomes `loss_fn` and `fa.step`, with `fa.ddp()`, `fa.accumulate` (which turns DDP's sync off on
the micro-steps between updates, as `no_sync` did) and `fa.clip_grad_norm` in the pipeline; the
learning rate is still set by hand on the live optimizer before each update; `estimate_loss`
runs through `fa.evaluate` on every rank; the `torch.save`d dict becomes `fa.save` on every rank,
with `best_val_loss` registered beside it (the iteration number is the run's `state.step`), and a
run that finds the checkpoint resumes from it exactly. ``--stop-after N`` ends the run after the
save at iteration N, as a preempted job would.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, Subset

import fnaccel as fa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptlike import GPTConfig, TinyGPT, splits

# -------------------------------------------------------------------------------- settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True)
parser.add_argument("--max-iters", type=int, default=12)
parser.add_argument("--dim", type=int, default=32)
parser.add_argument("--eval-interval", type=int, default=4)
parser.add_argument("--stop-after", type=int, help="end the run after the save at this iteration")
parser.add_argument("--timings", help="write each iteration's CPU seconds (rank 0) to this JSON file")
args = parser.parse_args()
out_dir = Path(args.out)
eval_interval, eval_iters, log_interval = args.eval_interval, 2, 1
batch_size = 4  # per process and micro-step
gradient_accumulation_steps = 4  # over all processes: 4 micro-steps on 1 process, 2 each on 2
max_iters = args.max_iters
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 2, args.max_iters
weight_decay, beta1, beta2 = 0.1, 0.9, 0.95
always_save_checkpoint = True  # save at every evaluation, not only when the loss improved
grad_clip = 0.25  # below this small model's gradient norms (about 0.5): clipping acts at every update
config = GPTConfig(dim=args.dim, dropout=0.0)

# -------------------------------------------------------------------------------- distributed
# shard=False: each process draws its own random windows (below), as the plain script's do
state = fa.init(seed=1337, kwargs_handlers=[fa.DataLoaderConfiguration(shard=False)])
master_process = state.dist.is_main_process  # this process prints and writes the weights file
seed_offset = state.dist.rank
gradient_accumulation_steps //= state.dist.num_processes
if master_process:
    out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(1337 + seed_offset)  # fa.init(seed=...) seeds the run, not the process

# -------------------------------------------------------------------------------- data
train_data, val_data = splits(config, num_tokens=4096)
sampler = RandomSampler(train_data, replacement=True,
                        num_samples=batch_size * (gradient_accumulation_steps * max_iters + 1),
                        generator=torch.Generator().manual_seed(1337 + seed_offset))
train_loader = DataLoader(train_data, batch_size=batch_size, sampler=sampler)
val_loader = DataLoader(Subset(val_data, range(eval_iters * batch_size)), batch_size=batch_size)

# -------------------------------------------------------------------------------- model
model = TinyGPT(config)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))


def get_lr(it: int) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1]


def sample_losses(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits, _ = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


def estimate_loss(state: fa.RunState) -> float:
    # eval mode, no_grad, each rank a share of the windows, the same result on every rank
    return fa.evaluate(state, val_loader, sample_losses).mean().item()


class Progress:
    """What the plain script's checkpoint dict held beside the model and the optimizer."""

    def __init__(self) -> None:
        self.best_val_loss = 1e9

    def state_dict(self) -> dict[str, float]:
        return {"best_val_loss": self.best_val_loss}

    def load_state_dict(self, saved: dict[str, float]) -> None:
        self.best_val_loss = saved["best_val_loss"]


progress = Progress()
state = fa.prepare(state, model, optimizer, train_loader, loss_fn=loss_fn,
                   pipeline=fa.compose(fa.ddp(), fa.accumulate(gradient_accumulation_steps),
                                       fa.clip_grad_norm(grad_clip)))
state = fa.utils.register_for_checkpointing(state, progress=progress)
ckpt = out_dir / "ckpt"
if (ckpt / "fnaccel.json").is_file():  # built the model, the optimizer and the loader first
    state = fa.load(state, ckpt)
    if master_process:
        print(f"resumed from {ckpt} at iteration {state.step}")

# -------------------------------------------------------------------------------- training
timings: list[float] = []
last_update = time.process_time()
for X, Y in fa.batches(state, epochs=1):
    iter_num = state.step  # updates taken: the plain script's iter_num, saved with the run
    if state.micro_step % gradient_accumulation_steps == 0:  # an update begins
        lr = get_lr(iter_num)
        for param_group in state.optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % eval_interval == 0:
            val_loss = estimate_loss(state)  # on every rank: fa.evaluate is collective
            if master_process:
                print(f"step {iter_num}: val loss {val_loss:.4f}")
            if (val_loss < progress.best_val_loss or always_save_checkpoint) and iter_num > 0:
                progress.best_val_loss = min(val_loss, progress.best_val_loss)
                fa.save(state, ckpt)  # on every rank: each writes its part
            if iter_num == args.stop_after:
                break
    state, metrics = fa.step(state, (X, Y))
    if "grad_norm" in metrics:  # an update was made
        timings.append(time.process_time() - last_update)
        last_update += timings[-1]
        if iter_num % log_interval == 0 and master_process:
            print(f"iter {iter_num}: loss {metrics['loss'].item():.4f}, "
                  f"grad norm {metrics['grad_norm'].item():.4f}, lr {lr:.3e}")
        if state.step >= max_iters:
            break

if master_process and args.stop_after is None:
    save_file(model.state_dict(), out_dir / "weights.safetensors")
    if args.timings:
        Path(args.timings).write_text(json.dumps(timings))
fa.shutdown(state)
