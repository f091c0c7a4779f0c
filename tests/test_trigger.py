"""set_trigger / check_trigger: one rank asks, every rank stops at the same step."""

from __future__ import annotations

from typing import Any

import torch

import fnaccel as fa
from fnaccel.trigger import check_trigger, set_trigger
from tests.test_train import loss_fn, make_model

STOP_RANK, STOP_AT = 1, 4


def train_until_triggered(state: fa.RunState) -> dict[str, Any]:
    model = make_model(dropout=0.0)
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn)
    g = torch.Generator().manual_seed(state.dist.rank)
    seen_before = []
    for _ in range(20):
        state, _ = fa.step(state, (torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)))
        if state.dist.rank == STOP_RANK and state.step == STOP_AT:
            state = set_trigger(state)  # only this rank knows
        state, stop = check_trigger(state)
        if stop:
            break
        seen_before.append(state.step)
    return {"stopped_at": state.step, "trigger_left": state.trigger, "checked": seen_before}


def test_one_rank_stops_every_rank_at_the_same_step(world: Any) -> None:
    results = world.run(train_until_triggered)
    assert [r["stopped_at"] for r in results] == [STOP_AT] * len(results)
    assert all(r["checked"] == list(range(1, STOP_AT)) for r in results)
    assert not any(r["trigger_left"] for r in results)


def _check_twice(state: fa.RunState) -> list[bool]:
    if state.dist.rank == 0:
        state = set_trigger(set_trigger(state))  # asking twice is one request
    state, first = check_trigger(state)
    state, second = check_trigger(state)
    return [first, second]


def test_a_check_clears_the_request(world2: Any) -> None:
    assert world2.run(_check_twice) == [[True, False], [True, False]]


def test_the_request_is_a_value_of_the_state() -> None:
    state = fa.init(cpu=True)
    asked = set_trigger(state)
    assert (state.trigger, asked.trigger) == (False, True)  # the old state is untouched
    assert check_trigger(state) == (state, False)
    successor = asked.advance("a test", step=1)
    assert successor.trigger  # carried by a step until checked
    cleared, stop = check_trigger(successor)
    assert stop and not cleared.trigger
