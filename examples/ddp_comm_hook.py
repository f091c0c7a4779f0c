"""DDP communication hooks: compress the gradients the processes exchange.

    fnaccel launch --cpu --num_processes 2 examples/ddp_comm_hook.py --comm-hook fp16
    fnaccel launch --cpu --num_processes 2 examples/ddp_comm_hook.py --comm-hook power_sgd --comm-wrapper fp16
    python examples/ddp_comm_hook.py      # one process: no DDP, so no hook

DDP all-reduces every gradient at every update. A communication hook changes what travels:
`fp16` halves the bytes by sending the gradients in half precision (`bf16` does the same in
bfloat16, on NCCL only); `power_sgd` sends a low-rank approximation of each gradient matrix
(its rank and warm-up in `--comm-state`), and `--comm-wrapper fp16` sends even those factors in
half precision. The hook is an option of `fa.ddp` (`DistributedDataParallelKwargs`' fields);
the script prints the final loss so that the hooks' cost in accuracy can be compared.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 32, generator=generator)
    return TensorDataset(x, torch.tanh(x @ torch.randn(32, 4, generator=generator)))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comm-hook", default="fp16", choices=["no", "fp16", "bf16", "power_sgd"])
    parser.add_argument("--comm-wrapper", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's matrix approximation rank")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()

    state = fa.init(seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(make_dataset(256 if args.tiny else 8192), batch_size=args.batch_size, shuffle=True)
    # PowerSGD runs plain all-reduces for its first `start_powerSGD_iter` updates (a warm-up
    # that keeps the first, largest gradients exact), then compresses.
    power_sgd = {"matrix_approximation_rank": args.rank, "start_powerSGD_iter": 2}
    ddp = fa.ddp(
        comm_hook=args.comm_hook,
        comm_wrapper=args.comm_wrapper,
        comm_state_option=power_sgd if "power_sgd" in args.comm_hook else {},
    )
    state = fa.prepare(state, model, optimizer, loader, loss_fn=loss_fn, pipeline=fa.compose(ddp))

    for epoch in range(args.epochs):
        losses = []
        for batch in fa.batches(state, epochs=epoch + 1):
            state, metrics = fa.step(state, batch)
            losses.append(metrics["loss"])
        mean_loss = fa.ops.reduce(state, torch.stack(losses).mean())  # the mean over the processes
        fa.print_on_main(
            state,
            f"epoch {epoch} ({args.comm_hook} hook, {args.comm_wrapper} wrapper): "
            f"loss {mean_loss.item():.5f}",
        )
    fa.shutdown(state)


if __name__ == "__main__":
    main()
