"""A plain PyTorch DDP training script, in the style most research code is written in.

    python tests/ports/plain_train.py --out runs/plain
    python -m torch.distributed.run --nproc_per_node 2 tests/ports/plain_train.py --out runs/plain

Written from scratch for fnaccel's port tests in the shape of nanoGPT's train.py (which is the
reference for the style, not the source): module-level settings, `init_process_group` from
torchrun's variables, a `master_process` guard, random training windows drawn with replacement,
AdamW with decay and no-decay groups, a cosine learning rate set by hand on the optimizer at every
iteration, gradient accumulation under `no_sync`, `clip_grad_norm_(model.parameters(), ...)`, an
`estimate_loss` in eval mode and a `torch.save`d checkpoint dict. fnaccel_train.py is its port,
made by following docs/from-pytorch.md; tests/ports/test_ports.py runs both.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, RandomSampler, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gptlike import GPTConfig, TinyGPT, splits

# -------------------------------------------------------------------------------- settings
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--out", required=True)
parser.add_argument("--max-iters", type=int, default=12)
parser.add_argument("--dim", type=int, default=32)
parser.add_argument("--eval-interval", type=int, default=4)
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
ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
if ddp:
    init_process_group(backend="gloo")
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0  # this process logs and writes checkpoints
    seed_offset = ddp_rank  # each process draws its own windows
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(1337 + seed_offset)

# -------------------------------------------------------------------------------- data
train_data, val_data = splits(config, num_tokens=4096)
# windows at random, with replacement, from this process's own generator (nanoGPT's get_batch)
sampler = RandomSampler(train_data, replacement=True,
                        num_samples=batch_size * (gradient_accumulation_steps * max_iters + 1),
                        generator=torch.Generator().manual_seed(1337 + seed_offset))
train_loader = DataLoader(train_data, batch_size=batch_size, sampler=sampler)
val_loader = DataLoader(Subset(val_data, range(eval_iters * batch_size)), batch_size=batch_size)

# -------------------------------------------------------------------------------- model
model = TinyGPT(config)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
raw_model = model
if ddp:
    model = DDP(model)  # broadcasts rank 0's weights


def get_lr(it: int) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss() -> float:
    model.eval()
    losses = [model(x, y)[1] for x, y in val_loader]
    model.train()
    return torch.stack(losses).mean().item()


# -------------------------------------------------------------------------------- training
iter_num, best_val_loss, timings = 0, 1e9, []
batches = iter(train_loader)
X, Y = next(batches)
last_update = time.process_time()
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num % eval_interval == 0 and master_process:
        val_loss = estimate_loss()
        print(f"step {iter_num}: val loss {val_loss:.4f}")
        if (val_loss < best_val_loss or always_save_checkpoint) and iter_num > 0:
            best_val_loss = min(val_loss, best_val_loss)
            torch.save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter_num": iter_num, "best_val_loss": best_val_loss}, out_dir / "ckpt.pt")

    for micro_step in range(gradient_accumulation_steps):
        last = micro_step == gradient_accumulation_steps - 1
        with model.no_sync() if ddp and not last else nullcontext():  # sync on the last micro-step only
            _, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
            X, Y = next(batches)  # the next batch while this one's backward is pending
            loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    timings.append(time.process_time() - last_update)
    last_update += timings[-1]

    if iter_num % log_interval == 0 and master_process:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}, "
              f"grad norm {grad_norm.item():.4f}, lr {lr:.3e}")
    iter_num += 1
    if iter_num >= max_iters:
        break

if master_process:
    save_file(raw_model.state_dict(), out_dir / "weights.safetensors")
    if args.timings:
        Path(args.timings).write_text(json.dumps(timings))
if ddp:
    destroy_process_group()
