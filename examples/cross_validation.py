"""k-fold cross-validation: one run per fold in one script, and an ensemble of the folds' models.

    python examples/cross_validation.py --folds 4
    fnaccel launch --cpu --num_processes 2 examples/cross_validation.py

Each fold is a run of its own: `fa.init` starts it (and, on several processes, its process
group), `fa.shutdown` ends it completely, and the next fold starts afresh. Nothing of a run
stays in the process, and no fnaccel call moves the process's generators, so each fold's model
draws the next initial weights after the one `torch.manual_seed(0)`, the same on every process:
fold k's model is the (k+1)-th built after it (tests/test_examples.py checks). A script without
fnaccel seeded the same way builds the same first model but not the later ones: each epoch its
`iter(DataLoader(..., shuffle=True))` draws the loader's seeds from that same generator, and
fnaccel's batches draw nothing from it (their order comes from `fa.init(seed=...)`). The folds'
predictions on the test set are averaged into an ensemble, as Accelerate's cross-validation
example does.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import fnaccel as fa


def make_dataset(num_samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, 6, generator=generator)
    y = (x[:, 0] * x[:, 1] + 0.3 * torch.randn(num_samples, generator=generator) > 0).long()  # XOR-like
    return TensorDataset(x, y)


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def probabilities(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).softmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folds", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    if args.tiny:
        args.folds, args.epochs = 2, 2

    dataset = make_dataset(128 if args.tiny else 2048, seed=1)
    test_set = make_dataset(64 if args.tiny else 1024, seed=2)
    test = DataLoader(test_set, batch_size=256)
    fold_of = torch.arange(len(dataset)) % args.folds  # sample i belongs to fold i mod k
    torch.manual_seed(0)  # once: every fold's model draws the next weights from here

    test_probabilities = []
    for fold in range(args.folds):
        state = fa.init(seed=fold)
        model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 2))
        initial_weight = model[0].weight[0, 0].item()  # differs from fold to fold
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train = Subset(dataset, torch.nonzero(fold_of != fold).flatten().tolist())
        held_out = Subset(dataset, torch.nonzero(fold_of == fold).flatten().tolist())
        state = fa.prepare(
            state,
            model,
            optimizer,
            DataLoader(train, batch_size=args.batch_size, shuffle=True),
            loss_fn=loss_fn,
        )
        for batch in fa.batches(state, epochs=args.epochs):
            state, _metrics = fa.step(state, batch)

        held_out_labels = torch.tensor([int(dataset[i][1]) for i in held_out.indices])
        predicted = fa.evaluate(state, DataLoader(held_out, batch_size=256), probabilities).argmax(1)
        fa.print_on_main(
            state,
            f"fold {fold}: initial weight[0, 0] {initial_weight:+.4f}, "
            f"held-out accuracy {(predicted == held_out_labels).float().mean().item():.3f}",
        )
        test_probabilities.append(fa.evaluate(state, test, probabilities))
        main_process = state.dist.is_main_process
        fa.shutdown(state)  # the fold's run ends here, process group included

    test_labels = test_set.tensors[1]
    ensemble = torch.stack(test_probabilities).mean(dim=0).argmax(1)
    alone = [(p.argmax(1) == test_labels).float().mean().item() for p in test_probabilities]
    if main_process:
        print(
            f"test accuracy of each fold's model {[round(a, 3) for a in alone]}, "
            f"of their ensemble {(ensemble == test_labels).float().mean().item():.3f}"
        )


if __name__ == "__main__":
    main()
