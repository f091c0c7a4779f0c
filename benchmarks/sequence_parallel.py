"""Activation memory per rank under `fa.sp` (Ulysses) on this machine (gloo, CPU): sp 1, 2 and 4
at sequence lengths 4k and 16k, and what the all-to-alls cost.

    PYTHONPATH=. .venv/bin/python benchmarks/sequence_parallel.py [--lengths 4096 16384]

Model: a causal transformer of 2 blocks (width 64, 4 heads, torch SDPA, MLP 4x),
vocabulary 256, one row per step, SGD. Each layout runs in a
`fnaccel.testing.World` of its size (sp 1 in this process); per rank it reports

- the bytes the step's forward keeps for backward (`saved_tensors_hooks`, each
  storage counted once): the activation memory, exact and independent of load;
- the bytes this rank's all-to-alls send in one step (4 per block forward: q,
  k, v and the output; as many backward), exact;
- the step's CPU seconds on this rank (`time.process_time`, gloo's threads
  included), the least of ``--steps`` steps: noisy on a shared machine.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import fnaccel as fa
from fnaccel.testing import World

VOCAB, DIM, HEADS, LAYERS = 256, 64, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, length, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, length, DIM))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, length: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, DIM), nn.Embedding(length, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def measure(base: fa.RunState | None, sp_size: int, length: int, steps: int) -> dict[str, Any]:
    layout = fa.ParallelismConfig(sp_size=sp_size) if sp_size > 1 else None
    state = fa.init(cpu=True, seed=0, parallelism=layout)
    try:
        torch.manual_seed(0)
        model = Model(length)
        state = fa.prepare(
            state, model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=loss_fn, pipeline=fa.sp()
        )
        generator = torch.Generator().manual_seed(1)
        batch = {
            "input_ids": torch.randint(0, VOCAB, (1, length), generator=generator),
            "labels": torch.randint(0, VOCAB, (1, length), generator=generator),
        }
        seen: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        cpu = []
        for step in range(steps):
            start = time.process_time()
            if step == 0:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    state, _ = fa.step(state, batch)
            else:
                state, _ = fa.step(state, batch)
            cpu.append(time.process_time() - start)
        part = length // sp_size
        # q, k, v and the output, forward and backward; a rank keeps 1/sp of what it exchanges
        sent = 0 if sp_size == 1 else LAYERS * 8 * part * DIM * 4 * (sp_size - 1) // sp_size
        return {"saved": sum(seen.values()), "sent": sent, "cpu": min(cpu)}
    finally:
        fa.shutdown(state)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print(
        "| sequence | sp | saved for backward per rank (MiB) | vs sp 1 | all-to-all sent per rank per step (MiB) "
        "| step CPU s per rank (least) |"
    )
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        base_saved = None
        for size in args.sizes:
            if size == 1:  # this process (a World of one has no group to lend)
                results = [measure(None, size, length, args.steps)]
            else:
                world = World(size, timeout=1800)
                try:
                    results = world.run(measure, size, length, args.steps)
                finally:
                    world.close()
            saved = max(r["saved"] for r in results)
            base_saved = base_saved or saved
            print(
                f"| {length} | {size} | {saved / 2**20:.1f} | {saved / base_saved:.2f} | "
                f"{max(r['sent'] for r in results) / 2**20:.1f} | {max(r['cpu'] for r in results):.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
