"""Find the largest batch that fits in memory, and keep the samples per update with accumulation.

    python examples/batch_size_search.py                      # a pretend device of 40 samples
    python examples/batch_size_search.py --device-capacity 0  # the device's real limit (a GPU's)

`find_executable_batch_size` calls the training function with a batch size and, when the
device runs out of memory, frees what it can and calls it again with a smaller one. Everything
that depends on the batch size is therefore built inside the function: the run (`fa.init` ...
`fa.shutdown` once per try), the model, the optimizer and the loader.

The search changes how many samples fit in one forward pass, not the recipe: the update should
still average `--batch-size` samples. So each try halves the batch (`reduce_batch_size_fn`) and
doubles the accumulation (`fa.accumulate`), keeping the samples per update the same.

A CPU does not run out of memory at these sizes, so `--device-capacity` plays a small
accelerator: a forward pass over more samples raises `torch.OutOfMemoryError`, the exception a
GPU's allocator raises. On a GPU, pass `--device-capacity 0` and the real limit applies. (On several
processes each one searches on its own; if they could stop at different sizes, search on one
process and launch the others with the size it found.)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.utils import find_executable_batch_size


def make_dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_samples, 32, generator=generator)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="samples per update, and the first try")
    parser.add_argument(
        "--device-capacity",
        type=int,
        default=40,
        help="emulate a device that holds at most this many samples per forward pass (0: off)",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    dataset = make_dataset(256 if args.tiny else 8192)

    def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        if args.device_capacity and len(x) > args.device_capacity:
            raise torch.OutOfMemoryError(f"emulated: {len(x)} samples do not fit in {args.device_capacity}")
        return nn.functional.cross_entropy(model(x), y)

    tried: list[int] = []

    def halve() -> int:
        return tried[-1] // 2

    @find_executable_batch_size(starting_batch_size=args.batch_size, reduce_batch_size_fn=halve)
    def train(batch_size: int) -> None:
        tried.append(batch_size)
        accumulation = max(1, args.batch_size // batch_size)
        state = fa.init(seed=0)
        try:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
            state = fa.prepare(
                state,
                model,
                optimizer,
                loader,
                loss_fn=loss_fn,
                pipeline=fa.compose(fa.default_pipeline(state), fa.accumulate(accumulation)),
            )
            fa.print_on_main(state, f"trying batch {batch_size} x {accumulation} accumulation steps")
            for batch in fa.batches(state, epochs=args.epochs):
                state, metrics = fa.step(state, batch)
            fa.print_on_main(
                state,
                f"batch {batch_size} fits (tried {tried}); {accumulation} accumulation steps; "
                f"final loss {metrics['loss'].item():.4f}",
            )
        finally:
            fa.shutdown(state)  # also after an out-of-memory error: the next try starts a new run

    train()  # the decorator passes the batch size


if __name__ == "__main__":
    main()
