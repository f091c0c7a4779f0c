"""A GAN: two models, two runs side by side in one process.

    python examples/gan.py
    fnaccel launch --cpu --num_processes 2 examples/gan.py

A `RunState` holds one model and its optimizer, so a GAN holds two: the discriminator's run
(which owns the real data's loader) and the generator's. They never see each other's state:
each has its own optimizer, its own process group on several processes, and its own random
generators (the noise each one draws inside its step comes from its own run).

The generator's loss flows through the discriminator, but `fa.step` differentiates only with
respect to its own run's parameters, so the generator's step leaves no gradient on the
discriminator. Inside the other model's loss, each model is used as the plain module you built:
the prepared (DDP-wrapped) model belongs to its own run's step.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa

LATENT = 8
MODES = torch.tensor(
    [[2 * math.cos(2 * math.pi * k / 8), 2 * math.sin(2 * math.pi * k / 8)] for k in range(8)]
)


def ring_of_gaussians(num_samples: int) -> torch.Tensor:
    """The real data: 2-D points around 8 modes on a circle."""
    generator = torch.Generator().manual_seed(0)
    modes = MODES[torch.randint(0, 8, (num_samples,), generator=generator)]
    return modes + 0.05 * torch.randn(num_samples, 2, generator=generator)


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, outputs)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--tiny", action="store_true", help="a few steps, for tests")
    args = parser.parse_args()
    if args.tiny:
        args.epochs = 2

    torch.manual_seed(0)
    generator, discriminator = mlp(LATENT, 2), mlp(2, 1)
    bce = nn.functional.binary_cross_entropy_with_logits

    def discriminator_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        (real,) = batch
        with torch.no_grad():  # the generator is not trained here
            fake = generator(torch.randn(len(real), LATENT))  # noise from the discriminator's run
        logits = model(torch.cat([real, fake]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)])
        return bce(logits, labels)

    def generator_loss(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
        (real,) = batch  # only its size: the generator sees no real data
        fake = model(torch.randn(len(real), LATENT))  # noise from the generator's run
        return bce(discriminator(fake), torch.ones(len(fake), 1))  # "call these real"

    loader = DataLoader(
        TensorDataset(ring_of_gaussians(512 if args.tiny else 8192)), batch_size=args.batch_size, shuffle=True
    )
    d_state = fa.prepare(
        fa.init(seed=0),
        discriminator,
        torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        loader,
        loss_fn=discriminator_loss,
    )
    g_state = fa.prepare(
        fa.init(seed=1),
        generator,
        torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        loss_fn=generator_loss,
    )

    for epoch in range(args.epochs):
        for batch in fa.batches(d_state, epochs=epoch + 1):
            d_state, d_metrics = fa.step(d_state, batch)
            g_state, g_metrics = fa.step(g_state, batch)
        with torch.no_grad():  # how close do samples fall to the real modes?
            samples = generator(torch.randn(1000, LATENT, generator=torch.Generator().manual_seed(epoch)))
            distance, nearest = torch.cdist(samples, MODES).min(dim=1)
        covered = len(set(nearest[distance < 0.2].tolist()))
        fa.print_on_main(
            d_state,
            f"epoch {epoch}: discriminator loss {d_metrics['loss'].item():.3f}, "
            f"generator loss {g_metrics['loss'].item():.3f}, "
            f"{(distance < 0.2).float().mean().item():.0%} of samples near a mode, "
            f"{covered}/8 modes covered",
        )
    fa.shutdown(g_state)
    fa.shutdown(d_state)


if __name__ == "__main__":
    main()
