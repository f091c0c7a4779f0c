"""FSDP2: shard the parameters, gradients and optimizer state over the processes, and watch memory.

    fnaccel launch --cpu --num_processes 2 examples/fsdp_peak_memory.py
    fnaccel launch --cpu --num_processes 2 examples/fsdp_peak_memory.py --ddp   # every process holds all
    python examples/fsdp_peak_memory.py

`fa.fsdp(...)` shards each `Block` of the model (and then the rest) over the processes with
FSDP2's `fully_shard`: each process keeps 1/N of every parameter, of its gradient and of the
optimizer's state, and gathers a block's full parameters only while it computes with them. The
script prints what each process holds and the peak memory of each epoch: on a GPU the CUDA
allocator's peak; on a CPU, where torch keeps no such count, the process's peak resident memory
(which includes the Python interpreter and torch themselves). At the end `fa.save_model` gathers
the full weights into one `model.safetensors`.
"""

from __future__ import annotations

import argparse
import resource

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def make_model(dim: int, depth: int) -> nn.Module:
    return nn.Sequential(*[Block(dim) for _ in range(depth)], nn.Linear(dim, 1))


def mebibytes(tensors: list[torch.Tensor]) -> float:
    """The bytes this process holds for `tensors` (a sharded tensor's local shard only)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]  # FSDP2's DTensors
    return sum(t.numel() * t.element_size() for t in local) / 2**20


def peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"peak allocated {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB"
    return (
        f"peak resident {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"  # KiB on Linux
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ddp", action="store_true", help="replicate instead of sharding, to compare")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--output", default="runs/fsdp_peak_memory")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    if args.tiny:
        args.dim, args.depth = 32, 2

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = make_model(args.dim, args.depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # its state is sharded too
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64 if args.tiny else 2048, args.dim, generator=generator)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=16, shuffle=True)
    shard = fa.ddp() if args.ddp else fa.fsdp(transformer_cls_names_to_wrap=["Block"])
    state = fa.prepare(
        state,
        model,
        optimizer,
        loader,
        pipeline=fa.compose(shard, fa.clip_grad_norm(1.0)),
        loss_fn=lambda model, batch: nn.functional.mse_loss(model(batch[0]), batch[1]),
    )

    for epoch in range(args.epochs):
        if state.dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(state.dist.device)
        for batch in fa.batches(state, epochs=epoch + 1):
            state, metrics = fa.step(state, batch)
        # `optimizer` holds the prepared model's parameters: under FSDP2 they are the shards.
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer_state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
        # Each process prints its own figures (fa.print_on_main would show rank 0's only).
        print(
            f"rank {state.dist.rank} epoch {epoch}: loss {metrics['loss'].item():.4f}; holds "
            f"parameters {mebibytes(parameters):.2f} MiB, gradients "
            f"{mebibytes([p.grad for p in parameters if p.grad is not None]):.2f} MiB, "
            f"optimizer state {mebibytes(optimizer_state):.2f} MiB; {peak_memory(state.dist.device)}"
        )

    fa.save_model(state, args.output)  # every process takes part in gathering the shards
    fa.print_on_main(state, f"full weights written to {args.output}/model.safetensors")
    fa.shutdown(state)


if __name__ == "__main__":
    main()
