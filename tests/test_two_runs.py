"""Two runs in one process: a GAN's generator and discriminator, each its own `RunState`.

The generator's loss flows through the discriminator, so its backward leaves
gradients on the discriminator's parameters. Those must never reach the
discriminator's next update: it must equal the update computed from the
discriminator's own loss alone.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fnaccel as fa


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), nn.Sequential(nn.Linear(3, 1))


def _d_loss(d: nn.Module, fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return nn.functional.softplus(-d(real)).mean() + nn.functional.softplus(d(fake)).mean()


@pytest.mark.parametrize("micro_steps", [1, 2])
@pytest.mark.parametrize("generator_step", ["fa.step", "raw backward"])
def test_the_discriminators_update_uses_only_its_own_gradients(micro_steps: int, generator_step: str) -> None:
    g, d = _models()
    reference_d = copy.deepcopy(d)
    g_run = fa.prepare(
        fa.init(seed=1, cpu=True),
        g,
        torch.optim.SGD(g.parameters(), lr=0.1),
        loss_fn=lambda model, z: -d(model(z)).mean(),
    )  # flows into d: leaves grads on it
    d_run = fa.prepare(
        fa.init(seed=2, cpu=True),
        d,
        torch.optim.SGD(d.parameters(), lr=0.1),
        pipeline=fa.compose(fa.accumulate(micro_steps)),
        loss_fn=lambda model, batch: _d_loss(model, *batch),
    )
    reference_opt = torch.optim.SGD(reference_d.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        windows = []
        for i in range(micro_steps):
            z, real = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
            if generator_step == "fa.step":  # another run: its backward writes only its own parameters
                g_run, _ = fa.step(g_run, z)
            elif i == 0:  # code outside fnaccel, before d's window starts: cleared at its start
                (-d(g(z))).mean().backward()
                assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in d.parameters())
            with torch.no_grad():
                fake = g(z)
            windows.append((fake, real))
            d_run, _ = fa.step(d_run, (fake, real))
        # the reference: d's own loss only, averaged over the window, by hand
        reference_opt.zero_grad(set_to_none=True)
        for fake, real in windows:
            (_d_loss(reference_d, fake, real) / micro_steps).backward()
        reference_opt.step()
        for p, q in zip(d.parameters(), reference_d.parameters(), strict=False):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert d_run.step == 3


def test_a_runs_backward_writes_no_gradient_on_another_runs_model() -> None:
    g, d = _models()
    g_run = fa.prepare(
        fa.init(seed=1, cpu=True),
        g,
        torch.optim.SGD(g.parameters(), lr=0.1),
        loss_fn=lambda model, z: -d(model(z)).mean(),
    )
    fa.step(g_run, torch.randn(5, 4))
    assert all(p.grad is None for p in d.parameters())
    assert all(p.grad is not None for p in g.parameters())  # zeroed at the next window's start


# ---- two runs alive at once end in any order ------------------------------------------------


def _prepared(seed: int) -> fa.RunState:
    torch.manual_seed(seed)
    model = nn.Linear(4, 1)
    return fa.prepare(
        fa.init(seed=seed, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: m(b).pow(2).mean(),
    )


def _works(state: fa.RunState) -> fa.RunState:
    """One step and one collective on the run's own group."""
    state, _ = fa.step(state, torch.ones(2, 4))
    total = fa.ops.reduce(state, torch.tensor(float(state.dist.rank + 1)), "sum").item()
    n = state.dist.num_processes
    assert total == n * (n + 1) / 2, total
    return state


def end_two_runs_in_every_order(state: fa.RunState | None = None) -> list[str]:
    """Runs on each rank (or in one process): two runs alive at once, ended oldest first, newest
    first, and the oldest between the newest's steps; the survivor keeps working each time."""
    ended = []
    for order in ("oldest first", "newest first", "interleaved"):
        first, second = _works(_prepared(1)), _works(_prepared(2))
        survivor = second if order != "newest first" else first
        fa.shutdown(first if order != "newest first" else second)
        if order == "interleaved":
            survivor = _works(_works(survivor))
        fa.shutdown(survivor)
        fa.shutdown(survivor)  # twice is harmless
        ended.append(order)
    return ended


def test_two_runs_end_in_any_order_on_one_process() -> None:
    assert end_two_runs_in_every_order() == ["oldest first", "newest first", "interleaved"]


def test_two_runs_over_a_shared_default_group_end_in_any_order(world2: Any) -> None:
    """In a World, the world's own run holds the default group and outlives both runs; the launch
    where the first run holds it is benchmarks/reinit.py's (tests/test_reinit.py)."""
    assert world2.run(end_two_runs_in_every_order) == [["oldest first", "newest first", "interleaved"]] * 2
