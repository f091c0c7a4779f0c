"""skip_nonfinite: a NaN on one rank skips the update on every rank, equal to a hand
loop that skips it; the limit names where; the count resumes exactly."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from tests.test_train import make_model

NUM_UPDATES, BAD = 5, 2  # rank 1's loss is NaN in update BAD
NAN = float("nan")


def _batches(rank: int, num: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(num)]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _hand_loop(rank: int, variant: str, accumulate: int, group: Any) -> dict[str, Any]:
    """PyTorch alone: DDP, accumulation under no_sync, and update BAD skipped by hand (its
    gradients dropped, no optimizer or scheduler step); under fp16, torch's GradScaler
    meets rank 1's NaN loss and skips the update itself, as it does for any NaN gradient."""
    model = DistributedDataParallel(make_model(dropout=0.0), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9**n)
    scaler = torch.amp.GradScaler("cpu") if variant == "fp16" else None
    batches = _batches(rank, NUM_UPDATES * accumulate)
    collectives = []
    for update in range(NUM_UPDATES):
        for micro in range(accumulate):
            before = group._get_sequence_number_for_group()
            x, y = batches[update * accumulate + micro]
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last else model.no_sync():
                if scaler is not None:
                    with torch.autocast("cpu", dtype=torch.float16):
                        out = model(x)
                    loss = nn.functional.cross_entropy(out.float(), y)
                    if update == BAD and rank == 1:
                        loss = loss * NAN
                    scaler.scale(loss).backward()
                else:
                    loss = _loss(model, x, y)
                    (loss / accumulate if accumulate > 1 else loss).backward()
            if last:
                if scaler is not None:
                    scaler.unscale_(opt)
                if variant == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                elif update != BAD:
                    opt.step()
                if update != BAD:
                    for _ in range(dist.get_world_size(group)):  # fa.step's scheduler steps per update
                        sched.step()
                opt.zero_grad(set_to_none=True)
            collectives.append(group._get_sequence_number_for_group() - before)
    return {"params": [p.detach().clone() for p in model.parameters()], "collectives": collectives}


def train_with_a_nan(state: fa.RunState, variant: str) -> dict[str, Any]:
    """fa.step with skip_nonfinite; rank 1's loss plus NaN in update BAD (in its first
    micro-batch under accumulate(2): a micro-step whose gradients stay local)."""
    rank, group = state.dist.rank, state.dist.process_group
    accumulate = 2 if variant == "accumulate" else 1
    expected = _hand_loop(rank, variant, accumulate, group)
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9**n)
    by_variant: dict[str, list[fa.Transform]] = {
        "ddp": [fa.ddp()],
        "accumulate": [fa.ddp(), fa.accumulate(2)],
        "clip": [fa.ddp(), fa.clip_grad_norm(1.0)],
        "fp16": [fa.autocast(fa.fp16), fa.grad_scaler(), fa.ddp()],
    }
    parts = by_variant[variant]
    state = fa.prepare(
        state,
        model,
        opt,
        scheduler=sched,
        pipeline=fa.compose(*parts, fa.skip_nonfinite(3)),
        loss_fn=lambda m, b: _loss(m, b[0], b[1]) + b[2],
    )  # + NaN or + 0.0 (no bit changes)
    skipped, collectives, grad_norms, cleared = [], [], [], []
    for i, (x, y) in enumerate(_batches(rank, NUM_UPDATES * accumulate)):
        poison = NAN if rank == 1 and i == BAD * accumulate else 0.0
        before = group._get_sequence_number_for_group()
        state, metrics = fa.step(state, (x, y, torch.tensor(poison)))
        collectives.append(group._get_sequence_number_for_group() - before)
        if "skipped" in metrics:
            skipped.append(bool(metrics["skipped"]))
            grad_norms.append(float(metrics.get("grad_norm", 0.0)))
            cleared.append(all(p.grad is None for p in model.parameters()))
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(params, expected["params"], strict=True)),
        "params": params,
        "skipped": skipped,
        "cleared": cleared,
        "grad_norms": grad_norms,
        "collectives": (collectives, expected["collectives"]),
        "count": state.transform_states["skip_nonfinite"].state_dict(),
        "step": state.step,
        "lr": opt.param_groups[0]["lr"],
    }


@pytest.mark.parametrize("variant", ["ddp", "accumulate", "clip", "fp16"])
def test_a_nan_on_one_rank_skips_the_update_on_both_as_a_hand_loop_that_skips_it(
    world2: Any, variant: str
) -> None:
    results = world2.run(train_with_a_nan, variant)
    want = [update == BAD for update in range(NUM_UPDATES)]
    for rank, result in enumerate(results):
        assert result["skipped"] == want, (rank, result["skipped"])
        assert result["equal"], (
            f"rank {rank}: the weights differ from the hand loop that skipped update {BAD}"
        )
        assert result["cleared"] == want  # a skipped update leaves no gradients behind
        assert result["count"] == {"num_skipped": 1, "num_consecutive": 0}
        assert result["step"] == NUM_UPDATES  # a skipped update is still an update: the data moved on
        assert result["lr"] == pytest.approx(0.1 * 0.9 ** (2 * (NUM_UPDATES - 1)))  # the scheduler held once
        ours, hand = result["collectives"]
        assert ours == hand, "the check must ride on DDP's reduction, with no collective of its own"
        if variant == "clip":  # clip's norm is the check: NaN at the skipped update only
            assert [math.isnan(n) for n in result["grad_norms"]] == want
    for a, b in zip(*(r["params"] for r in results), strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in results[0]["params"])


def train_fsdp_with_one_nan_element(state: fa.RunState) -> dict[str, Any]:
    """fsdp(): gradients are sharded, so a NaN in one element lands on one rank's shard
    only (planted after fa.backward's reduce-scatter, on rank 0); both ranks must skip."""
    rank, group = state.dist.rank, state.dist.process_group
    expected = _hand_loop(rank, "ddp", 1, group)
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 0.9**n)
    state = fa.prepare(
        state, model, opt, scheduler=sched, pipeline=fa.compose(fa.fsdp(), fa.skip_nonfinite())
    )
    skipped = []
    for update, (x, y) in enumerate(_batches(rank, NUM_UPDATES)):
        state = fa.backward(state, _loss(state.model, x, y))  # type: ignore[arg-type]
        if update == BAD and rank == 0:
            grad = next(p.grad for p in model.parameters() if p.grad.to_local().numel())  # type: ignore[union-attr]
            grad.to_local().view(-1)[0] = NAN  # type: ignore[union-attr]
        state, metrics = fa.apply_gradients(state)
        skipped.append(bool(metrics["skipped"]))
    full = [p.full_tensor().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]
    return {"skipped": skipped, "params": full, "expected": expected["params"]}


def test_under_fsdp_a_nan_in_one_shard_skips_the_update_on_every_rank(world2: Any) -> None:
    for result in world2.run(train_fsdp_with_one_nan_element):
        assert result["skipped"] == [update == BAD for update in range(NUM_UPDATES)]
        for ours, hand in zip(result["params"], result["expected"], strict=True):
            torch.testing.assert_close(ours, hand, rtol=1e-6, atol=1e-6)  # FSDP's sums in another order


def train_until_the_limit(state: fa.RunState) -> str:
    """A prepared loader; rank 1's loss NaN from its 4th batch on: updates 3, 4, 5 skip
    and the third in a row raises."""
    rank = state.dist.rank
    data = TensorDataset(
        torch.randn(80, 8, generator=torch.Generator().manual_seed(3)),
        torch.randint(0, 4, (80,), generator=torch.Generator().manual_seed(4)),
    )
    calls = [0]

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        calls[0] += 1
        loss = _loss(model, *batch)
        return loss * NAN if rank == 1 and calls[0] > 3 else loss

    model = make_model(dropout=0.0)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        DataLoader(data, batch_size=4),
        pipeline=fa.compose(fa.ddp(), fa.skip_nonfinite(max_consecutive=3)),
        loss_fn=loss_fn,
    )
    steps = []
    try:
        for batch in fa.batches(state):
            state, metrics = fa.step(state, batch)
            steps.append(bool(metrics["skipped"]))
    except fa.NonFiniteUpdateError as error:
        assert steps == [False, False, False, True, True], steps
        assert all(torch.isfinite(p).all() for p in model.parameters())
        return str(error)
    return "no error"


def test_max_consecutive_skips_raise_on_every_rank_naming_the_step_and_the_data_position(world2: Any) -> None:
    messages = world2.run(train_until_the_limit)
    for message in messages:
        assert "3 updates in a row had a NaN or inf loss or gradients (max_consecutive=3)" in message
        assert (
            "update 5 (state.step), whose last batch ends at data position DataPosition(epoch=0, num_batches=6"
            in message
        )


# One process from here on: the parts of the contract that need no reduction.


def _nan_rows(batches: set[int]) -> TensorDataset:
    """Batches of 4 rows; every row of the listed batches is NaN."""
    x = torch.randn(40, 8, generator=torch.Generator().manual_seed(5))
    for b in batches:
        x[4 * b : 4 * b + 4] = NAN
    return TensorDataset(x, torch.randint(0, 4, (40,), generator=torch.Generator().manual_seed(6)))


def _resumable_run() -> fa.RunState:
    model = make_model(dropout=0.1)  # dropout: the run's RNG resumes too
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        opt,
        DataLoader(_nan_rows({1, 4, 5}), batch_size=4),
        pipeline=fa.compose(fa.clip_grad_norm(1.0), fa.skip_nonfinite(max_consecutive=2)),
        loss_fn=lambda m, b: _loss(m, *b),
    )


def _run_to_the_limit(state: fa.RunState, save_at: Path | None = None) -> tuple[list[bool], str]:
    skipped = []
    with pytest.raises(fa.NonFiniteUpdateError) as raised:
        for batch in fa.batches(state):
            state, metrics = fa.step(state, batch)
            skipped.append(bool(metrics["skipped"]))
            if save_at is not None and state.step == 5:
                fa.save(state, save_at)
    return skipped, str(raised.value)


def test_the_count_resumes_exactly_and_the_resumed_run_stops_where_the_whole_run_does(tmp_path: Path) -> None:
    whole = _resumable_run()
    skipped, message = _run_to_the_limit(whole, tmp_path / "ckpt")
    assert skipped == [False, True, False, False, True]  # batch 5 makes two in a row: it raises
    assert (
        "update 5 (state.step), whose last batch ends at data position DataPosition(epoch=0, num_batches=6"
        in message
    )
    resumed = fa.load(_resumable_run(), tmp_path / "ckpt")  # saved with one skip in a row pending
    assert resumed.transform_states["skip_nonfinite"].state_dict() == {"num_skipped": 2, "num_consecutive": 1}
    after, resumed_message = _run_to_the_limit(resumed)
    assert after == [] and resumed_message == message
    for a, b in zip(whole.model.parameters(), resumed.model.parameters(), strict=True):  # type: ignore[union-attr]
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


def test_after_the_limit_the_state_held_counts_what_was_applied_and_its_save_resumes_exactly(
    tmp_path: Path,
) -> None:
    """Before: the state left in the caller's hands when fa.step raised counted the failed update
    (step 5, num_skipped 3, 2 in a row) and fa.save wrote that."""
    held = _resumable_run()
    with pytest.raises(fa.NonFiniteUpdateError):
        for batch in fa.batches(held):
            held, _ = fa.step(held, batch)  # the raising step leaves `held` the state before it
    assert held.step == 5
    assert held.transform_states["skip_nonfinite"].state_dict() == {"num_skipped": 2, "num_consecutive": 1}
    fa.save(held, tmp_path / "after_the_error")
    before = _resumable_run()  # the same run, saved before it tried the failing update
    for batch in fa.batches(before):
        before, _ = fa.step(before, batch)
        if before.step == 5:
            break
    fa.save(before, tmp_path / "before_it")
    assert not fa.diff(tmp_path / "after_the_error", tmp_path / "before_it")
    # resumed, it meets the same batch and stops as the whole run did, at the same update
    resumed = fa.load(_resumable_run(), tmp_path / "after_the_error")
    after, message = _run_to_the_limit(resumed)
    assert (
        after == []
        and "update 5 (state.step), whose last batch ends at data position DataPosition(epoch=0, "
        "num_batches=6"
        in message
    )


def test_without_the_transform_a_nan_batch_poisons_every_weight() -> None:
    """What the transform is for: PyTorch's own loop, and fa.step without it, go NaN."""
    model = make_model(dropout=0.0)
    state = fa.prepare(
        fa.init(seed=0, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=lambda m, b: _loss(m, *b),
    )
    state, _ = fa.step(state, (torch.full((4, 8), NAN), torch.zeros(4, dtype=torch.long)))
    assert not any(torch.isfinite(p).any() for p in model.parameters())


def test_a_finite_run_is_bit_for_bit_the_run_without_it() -> None:
    runs = []
    for pipeline in (fa.compose(fa.accumulate(2)), fa.compose(fa.accumulate(2), fa.skip_nonfinite())):
        model = make_model(dropout=0.1)
        state = fa.prepare(
            fa.init(seed=0, cpu=True),
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            DataLoader(_nan_rows(set()), batch_size=4),
            pipeline=pipeline,
            loss_fn=lambda m, b: _loss(m, *b),
        )
        for batch in fa.batches(state):
            state, _ = fa.step(state, batch)
        runs.append([p.detach() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_bad_arguments_and_combinations_are_refused_with_the_fix() -> None:
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(ValueError, match=f"max_consecutive must be a positive int .*got {bad!r}"):
            fa.skip_nonfinite(max_consecutive=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local SGD .* would let ranks disagree"):
        fa.compose(fa.ddp(), fa.local_sgd(4), fa.skip_nonfinite())
    assert repr(fa.skip_nonfinite(max_consecutive=5)) == "skip_nonfinite(max_consecutive=5)"
    state = fa.init(seed=0, cpu=True)
    model = make_model()
    state = fa.prepare(
        state, model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=fa.compose(fa.skip_nonfinite())
    )
    with pytest.raises(ValueError, match="num_consecutive"):
        state.transform_states["skip_nonfinite"].load_state_dict({"num_skipped": 1, "num_consecutive": 2})


def test_a_save_inside_the_window_keeps_its_nan_and_the_resumed_run_skips_that_update(tmp_path: Path) -> None:
    def run() -> fa.RunState:
        model = make_model(dropout=0.0)
        return fa.prepare(
            fa.init(seed=0, cpu=True),
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            DataLoader(_nan_rows({2}), batch_size=4),
            pipeline=fa.compose(fa.accumulate(2), fa.skip_nonfinite()),
            loss_fn=lambda m, b: _loss(m, *b),
        )

    def updates(state: fa.RunState, save_at: int | None = None) -> tuple[fa.RunState, list[bool]]:
        skipped = []
        for batch in fa.batches(state):
            state, metrics = fa.step(state, batch)
            if "skipped" in metrics:
                skipped.append(bool(metrics["skipped"]))
            if state.micro_step == save_at:  # after the NaN batch, before its window's update
                fa.save(state, tmp_path / "ckpt")
        return state, skipped

    whole, skipped = updates(run(), save_at=3)
    assert skipped == [False, True, False, False, False]
    resumed, rest = updates(fa.load(run(), tmp_path / "ckpt"))
    assert rest == skipped[1:]
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            whole.model.parameters(),
            resumed.model.parameters(),  # type: ignore[union-attr]
            strict=True,
        )
    )
