"""The RNG is a value: states draw independently of each other and of the process."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fnaccel as fa
from fnaccel.rng import ALL_KINDS, RNGState, installed


def _draw() -> tuple[Any, ...]:
    """Draw from every generator a training step may touch, dropout included."""
    mask = torch.nn.functional.dropout(torch.ones(8), p=0.5, training=True)
    return (random.random(), torch.rand(3).tolist(), np.random.rand(2).tolist(), mask.tolist())


def _process_generators() -> tuple[Any, ...]:
    return random.getstate(), torch.get_rng_state(), np.random.get_state()[1].tolist()


def _same_process_generators(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2]


def test_creating_seeded_states_does_not_touch_the_process_generators() -> None:
    before = _process_generators()
    fa.init(seed=123, cpu=True)
    RNGState.seeded(5)
    assert _same_process_generators(before, _process_generators())


def test_seeded_state_matches_seeding_the_generators() -> None:
    state = fa.init(seed=9, cpu=True)
    _, drawn = fa.with_rng(state, _draw)
    random.seed(9), torch.manual_seed(9), np.random.seed(9)
    assert drawn == _draw()


def test_two_states_used_alternately_draw_what_each_draws_alone() -> None:
    def run_alone(seed: int) -> list[Any]:
        state = fa.init(seed=seed, cpu=True)
        out = []
        for _ in range(4):
            state, value = fa.with_rng(state, _draw)
            out.append(value)
        return out

    alone_a, alone_b = run_alone(1), run_alone(2)
    a, b = fa.init(seed=1, cpu=True), fa.init(seed=2, cpu=True)
    interleaved_a, interleaved_b = [], []
    for _ in range(4):
        a, value = fa.with_rng(a, _draw)
        interleaved_a.append(value)
        torch.rand(5), random.random()  # a stray draw from the process generators
        b, value = fa.with_rng(b, _draw)
        interleaved_b.append(value)
    assert interleaved_a == alone_a
    assert interleaved_b == alone_b
    assert alone_a != alone_b


def test_with_rng_gives_the_process_its_generators_back() -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    state = fa.init(seed=5, cpu=True)
    fa.with_rng(state, torch.rand, 100)
    assert torch.equal(torch.rand(4), expected)


def test_installed_restores_process_generators_on_exception() -> None:
    before = _process_generators()
    try:
        with installed(RNGState.seeded(3)):
            torch.rand(2)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert _same_process_generators(before, _process_generators())


def test_seed_none_starts_from_the_process_generators() -> None:
    torch.manual_seed(77)
    state = fa.init(cpu=True)
    _, drawn = fa.with_rng(state, torch.rand, 2)
    torch.manual_seed(77)
    assert torch.equal(drawn, torch.rand(2))
    assert state.seed is None


def test_set_seed_replaces_the_rng_and_device_specific_adds_the_rank() -> None:
    state = fa.set_seed(fa.init(cpu=True), 11)
    _, drawn = fa.with_rng(state, torch.rand, 2)
    _, again = fa.with_rng(fa.init(seed=11, cpu=True), torch.rand, 2)
    assert torch.equal(drawn, again) and state.seed == 11
    assert fa.set_seed(fa.init(cpu=True), 11, device_specific=True).seed == 11  # the data order's seed


def _seed_per_rank_then_sync(state: fa.RunState) -> tuple[list[float], list[float], list[float]]:
    state = fa.set_seed(state, 100, device_specific=True)
    state, own = fa.with_rng(state, torch.rand, 3)
    generator = torch.Generator().manual_seed(state.dist.rank)
    synced = fa.synchronize_rng_states(state, generator=generator)
    synced, common = fa.with_rng(synced, torch.rand, 3)
    _, own_again = fa.with_rng(fa.set_seed(synced, 100, device_specific=True), torch.rand, 3)
    assert own_again.tolist() == own.tolist()
    return own.tolist(), common.tolist(), torch.rand(2, generator=generator).tolist()


def test_device_specific_seeds_differ_and_synchronize_makes_them_equal(world: Any) -> None:
    results = world.run(_seed_per_rank_then_sync)
    own = [r[0] for r in results]
    assert len({tuple(o) for o in own}) == world.num_processes
    assert all(r[1] == results[0][1] for r in results)
    # everyone continues from rank 0's stream: its next draw after `own`
    rank0 = torch.Generator().manual_seed(100)
    torch.rand(3, generator=rank0)
    assert results[0][1] == torch.rand(3, generator=rank0).tolist()
    assert all(r[2] == results[0][2] for r in results)


def _dropout_run(state: fa.RunState, directory: str, device_specific: bool) -> dict[str, Any]:
    """nanoGPT's per-rank seeding by keyword: a run of its own (`fa.init`, no launch config),
    4 steps, a save, 4 more, then a load and the same 4 again. Each step's dropout mask
    and the samples this rank read."""
    run = fa.init(seed=1337, cpu=True, device_specific=device_specific)
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
        masks: list[list[bool]] = []
        model[1].register_forward_hook(lambda module, args, out: masks.append((out != 0).view(-1).tolist()))
        data: torch.utils.data.DataLoader[torch.Tensor] = torch.utils.data.DataLoader(
            torch.arange(48.0).view(48, 1) / 48,  # type: ignore[arg-type]  # a tensor is a map-style dataset
            batch_size=2,
            shuffle=True,
        )
        run = fa.prepare(
            run,
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            data,
            pipeline=fa.ddp(),
            loss_fn=lambda m, x: m(x).pow(2).mean(),
        )
        samples: list[list[float]] = []

        def steps(run: fa.RunState) -> fa.RunState:
            for batch in fa.batches(run):
                run, _ = fa.step(run, batch)
                samples.append(batch.view(-1).tolist())
                if len(samples) % 4 == 0:
                    break
            return run

        run = steps(run)
        fa.save(run, directory)
        run = steps(run)
        weights = [p.detach().clone() for p in model.parameters()]
        run = steps(fa.load(run, directory))
        return {
            "masks": masks,
            "samples": samples,
            "seed": run.seed,
            "resumed": all(torch.equal(p, q) for p, q in zip(weights, model.parameters(), strict=False)),
        }
    finally:
        fa.shutdown(run)


def test_device_specific_gives_each_rank_its_dropout_keeps_the_data_order_and_resumes(
    world2: Any, tmp_path: Path
) -> None:
    per_rank = world2.run(_dropout_run, str(tmp_path / "per_rank"), True)
    same = world2.run(_dropout_run, str(tmp_path / "same"), False)
    for run in (*per_rank, *same):
        assert run["seed"] == 1337 and run["resumed"]
        assert run["masks"][8:] == run["masks"][4:8] and run["samples"][8:] == run["samples"][4:8]
    assert per_rank[0]["masks"][:8] != per_rank[1]["masks"][:8]  # each rank its own dropout
    assert same[0]["masks"][:8] == same[1]["masks"][:8]
    assert per_rank[0]["masks"] == same[0]["masks"]  # rank 0 draws from seed + 0 either way
    assert [r["samples"] for r in per_rank] == [r["samples"] for r in same]  # the data order is the run's


def test_device_specific_needs_a_seed() -> None:
    with pytest.raises(
        ValueError, match=r"device_specific=True seeds each rank with seed \+ rank, so it needs a seed"
    ):
        fa.init(cpu=True, device_specific=True)
    with pytest.raises(TypeError, match="device_specific must be True or False"):
        fa.init(seed=0, cpu=True, device_specific=1)  # type: ignore[arg-type]


def test_synchronize_rejects_unknown_types() -> None:
    import pytest

    with pytest.raises(ValueError, match="cannot synchronise"):
        fa.synchronize_rng_states(fa.init(cpu=True), rng_types=["xla"])
    with pytest.raises(ValueError, match="no generator given"):
        fa.synchronize_rng_states(fa.init(cpu=True), rng_types=["generator"])


def test_recapture_replaces_only_the_named_generators() -> None:
    base = RNGState.seeded(5)
    base.install()
    torch.rand(4), random.random()
    torch_only = base.recapture(("torch", "cuda"))
    everything = base.recapture(ALL_KINDS)
    now = RNGState.capture()
    assert torch.equal(torch_only.torch, now.torch) and not torch.equal(torch_only.torch, base.torch)
    assert torch_only.python == base.python and everything.python == now.python != base.python
    assert torch_only.numpy is base.numpy
    with pytest.raises(dataclasses.FrozenInstanceError):
        torch_only.torch = base.torch  # type: ignore[misc]
    # the value installs as any other: the same draws follow
    torch_only.install()
    first = torch.rand(3)
    now.install()
    assert torch.equal(first, torch.rand(3))
