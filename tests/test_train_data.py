"""fa.batches with fa.step: the data path end to end, in one process and over DDP."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from tests.test_train import make_model

NUM_SAMPLES = 48


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(NUM_SAMPLES, 8, generator=g)
    y = torch.randint(0, 4, (NUM_SAMPLES,), generator=g)
    return TensorDataset(x, y, torch.arange(NUM_SAMPLES))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, ids = batch
    return nn.functional.cross_entropy(model(x), y), ids


def test_batches_and_step_equal_a_hand_loop_over_the_documented_order() -> None:
    seed, batch_size, epochs = 4, 8, 2
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = dataset()
    torch.manual_seed(seed)
    ref_ids = []
    for epoch in range(epochs):
        order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, NUM_SAMPLES, batch_size):
            batch = data[order[start : start + batch_size]]
            loss, ids = loss_fn(ref, list(batch))
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            ref_ids.append(ids.tolist())

    model = make_model()
    loader = DataLoader(data, batch_size=batch_size, shuffle=True)
    state = fa.prepare(
        fa.init(seed=seed, cpu=True),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        loss_fn=loss_fn,
    )
    seen, epochs_before, epochs_after = [], [], []
    for batch in fa.batches(state, epochs=epochs):
        epochs_before.append(state.epoch)
        state, metrics = fa.step(state, batch)
        seen.append(metrics["aux"].tolist())
        epochs_after.append(state.epoch)
    assert seen == ref_ids
    assert epochs_before == [0] * 6 + [1] * 6  # state.epoch before a step: the epoch of its batch
    assert epochs_after == [0] * 5 + [1] * 6 + [2]  # an epoch's last step moves the state to the next
    assert state.data_position == fa.DataPosition(epoch=2) and state.step == 12
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=False))


def train_over_epochs(state: fa.RunState, batch_size: int, epochs: int) -> dict[str, Any]:
    model = make_model(dropout=0.0)
    loader = DataLoader(dataset(), batch_size=batch_size, shuffle=True)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loader,
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.ddp()),
    )
    ids: dict[int, list[int]] = {}
    for batch in fa.batches(state, epochs=epochs):
        epoch = state.epoch  # the epoch of the batch about to be stepped
        state, metrics = fa.step(state, batch)
        ids.setdefault(epoch, []).extend(metrics["aux"].tolist())
    return {
        "ids": ids,
        "params": [p.detach() for p in model.parameters()],
        "step": state.step,
        "epoch": state.epoch,
    }


def test_ddp_sees_each_sample_once_per_epoch_and_equals_one_process(world: Any) -> None:
    n = world.num_processes
    per_rank = 24 // n  # a global batch of 24 over 2 or 3 ranks
    results = world.run(train_over_epochs, per_rank, 2)
    for epoch in (0, 1):
        everyone = sorted(i for r in results for i in r["ids"][epoch])
        assert everyone == list(range(NUM_SAMPLES))  # every sample once, none twice

    # one process with the global batch size sees the same global batches
    model = make_model(dropout=0.0)
    loader = DataLoader(dataset(), batch_size=24, shuffle=True)
    state = fa.prepare(
        fa.init(seed=0, cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), loader, loss_fn=loss_fn
    )
    for batch in fa.batches(state, epochs=2):
        state, _ = fa.step(state, batch)
    for result in results:
        assert result["step"] == state.step == 4
        assert result["epoch"] == state.epoch == 2
        for p, q in zip(result["params"], model.parameters(), strict=False):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def test_end_epoch_mid_window_keeps_the_window_open_and_a_save_right_after_resumes_there(
    tmp_path: Any,
) -> None:
    """Early stopping under accumulate(4): two batches of epoch 0 stepped, then fa.end_epoch.
    The window stays open and epoch 1's first two batches complete it, as a hand loop over
    a global micro-step counter does (Accelerate's counter too, across a break): every
    update averages 4 stepped batches. A save right after end_epoch resumes at epoch 1,
    in fresh objects, bit for bit."""
    seed, batch_size, num_steps = 4, 8, 4
    data = dataset()

    def order(epoch: int) -> torch.Tensor:
        return torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(seed + epoch))

    epoch_1 = [order(1)[start : start + batch_size] for start in range(0, NUM_SAMPLES, batch_size)]
    ref = make_model(dropout=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i, ids in enumerate([order(0)[:8], order(0)[8:16], *epoch_1]):
        loss, _ = loss_fn(ref, list(data[ids]))
        (loss / num_steps).backward()
        if (i + 1) % num_steps == 0:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)

    def fresh() -> fa.RunState:
        model = make_model(dropout=0.0)
        return fa.prepare(
            fa.init(seed=seed, cpu=True),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(data, batch_size=batch_size, shuffle=True),
            loss_fn=loss_fn,
            pipeline=fa.compose(fa.accumulate(num_steps)),
        )

    def rest_of_epoch(state: fa.RunState) -> tuple[fa.RunState, list[list[int]]]:
        seen = []
        for batch in fa.batches(state):
            state, metrics = fa.step(state, batch)
            seen.append(metrics["aux"].tolist())
        return state, seen

    state = fresh()
    for batch in fa.batches(state):
        state, _ = fa.step(state, batch)
        if state.micro_step == 2:  # the early-stopping criterion fired mid-window
            state = fa.end_epoch(state)
            break
    assert (state.step, state.micro_step, state.data_position) == (0, 2, fa.DataPosition(epoch=1))
    fa.save(state, tmp_path / "ckpt")
    state, seen = rest_of_epoch(state)
    assert seen == [ids.tolist() for ids in epoch_1] and state.step == 2
    assert state.model is not None and all(
        torch.equal(p, q) for p, q in zip(state.model.parameters(), ref.parameters(), strict=False)
    )

    resumed = fa.load(fresh(), tmp_path / "ckpt")
    assert (resumed.micro_step, resumed.data_position) == (2, fa.DataPosition(epoch=1))
    resumed, again = rest_of_epoch(resumed)
    assert (
        again == seen
        and resumed.model is not None
        and all(torch.equal(p, q) for p, q in zip(resumed.model.parameters(), ref.parameters(), strict=False))
    )
