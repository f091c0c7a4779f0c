"""local_sgd(k): on 2 real gloo ranks, equal to its definition, and silent between averages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fnaccel as fa
from fnaccel.transforms.local_sgd import local_sgd
from tests.test_train import loss_fn, make_model

NUM_STEPS, K = 7, 3


def _my_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data: the replicas drift apart
    return [
        (torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(NUM_STEPS)
    ]


def _definition(rank: int, group: Any) -> list[torch.Tensor]:
    """Local SGD by hand: plain local steps; every K-th step, every parameter replaced by the mean."""
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i, batch in enumerate(_my_batches(rank), start=1):
        loss_fn(model, batch).backward()
        opt.step()
        opt.zero_grad()
        if i % K == 0:
            with torch.no_grad():
                for p in model.parameters():
                    p.div_(dist.get_world_size(group))
                    dist.all_reduce(p, group=group)
    return [p.detach().clone() for p in model.parameters()]


def train_local_sgd(state: fa.RunState) -> dict[str, Any]:
    group = state.dist.process_group
    expected = _definition(state.dist.rank, group)
    model = make_model(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = fa.prepare(state, model, opt, loss_fn=loss_fn, pipeline=fa.compose(fa.ddp(), local_sgd(K)))
    collectives = []
    for batch in _my_batches(state.dist.rank):
        # the group's sequence number counts every collective on it, the ones DDP's C++ reducer issues too
        before = group._get_sequence_number_for_group()
        state, _ = fa.step(state, batch)
        collectives.append(group._get_sequence_number_for_group() - before)
    params = [p.detach().clone() for p in model.parameters()]
    return {
        "equal": all(torch.equal(a, b) for a, b in zip(params, expected, strict=False)),
        "collectives": collectives,
        "params": params,
    }


def test_local_sgd_equals_its_definition_and_communicates_only_to_average(world2: Any) -> None:
    results = world2.run(train_local_sgd)
    assert [r["equal"] for r in results] == [True, True]
    # one all-reduce at steps 3 and 6 and nothing else, but for DDP's one-time agreement on its
    # bucket order in its second forward (two small broadcasts of indices, no gradients)
    for r in results:
        assert r["collectives"] == [0, 2, 1, 0, 0, 1, 0], r["collectives"]
    # after step 6 both replicas were equal; step 7 was local, so they differ again
    assert not all(
        torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"], strict=False)
    )


def _averaged_at(state: fa.RunState) -> list[bool]:
    model = make_model(dropout=0.0)
    state = fa.prepare(
        state,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        loss_fn=loss_fn,
        pipeline=fa.compose(fa.ddp(), local_sgd(K)),
    )
    equal_after = []
    for batch in _my_batches(state.dist.rank)[:K]:
        state, _ = fa.step(state, batch)
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = fa.ops.gather(state, mine[None])
        equal_after.append(bool(torch.equal(both[0], both[1])))
    return equal_after


def test_the_replicas_agree_exactly_after_an_average(world2: Any) -> None:
    assert world2.run(_averaged_at) == [[False, False, True]] * 2


def test_one_process_is_plain_training() -> None:
    model, reference = make_model(dropout=0.0), make_model(dropout=0.0)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    state = fa.prepare(fa.init(cpu=True), model, opt, loss_fn=loss_fn, pipeline=fa.compose(local_sgd(2)))
    for batch in _my_batches(0):
        state, _ = fa.step(state, batch)
        loss_fn(reference, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(), strict=False))
    assert state.transform_states["local_sgd"].state_dict() == {"steps_since_average": NUM_STEPS % 2}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_step_counts_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="local_sgd_steps must be an int >= 1"):
        local_sgd(bad)


def test_fsdp_is_refused_at_compose() -> None:
    with pytest.raises(ValueError, match="local_sgd"):
        fa.compose(fa.fsdp(), local_sgd(2))


def _with_comm_hook(state: fa.RunState) -> str:
    model = make_model(dropout=0.0)
    try:
        fa.prepare(
            state,
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=loss_fn,
            pipeline=fa.compose(fa.ddp(comm_hook="fp16"), local_sgd(2)),
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_ddp_comm_hook_is_refused(world2: Any) -> None:
    assert all("drop comm_hook" in message for message in world2.run(_with_comm_hook))


def test_the_count_since_the_last_average_is_saved_with_the_run(tmp_path: Any) -> None:
    def prepared() -> fa.RunState:
        model = make_model(dropout=0.0)
        return fa.prepare(
            fa.init(cpu=True),
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=loss_fn,
            pipeline=fa.compose(local_sgd(5)),
        )

    state = prepared()
    for batch in _my_batches(0)[:3]:
        state, _ = fa.step(state, batch)
    fa.save(state, tmp_path / "ckpt")
    resumed = fa.load(prepared(), tmp_path / "ckpt")
    assert resumed.transform_states["local_sgd"].state_dict() == {"steps_since_average": 3}
