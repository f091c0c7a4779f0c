"""`gather_for_metrics` and the evaluation split it relies on (`eval_shards`).

The acceptance test: an evaluation over N samples on 3 ranks, gathered step by
step, gives back exactly the N samples in dataset order, for padded
(``even_batches=True``, ``num_valid``) and uneven (possibly empty) batches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.data.sharding import EvalShard, eval_shards
from tests.ops import _dist_fns as fns
from tests.ops._dist_fns import Pair, assert_tree_equal


@pytest.fixture
def state() -> fa.RunState:
    return fa.init(cpu=True)


@pytest.fixture
def world3(worlds: Any) -> Any:
    return worlds.get(3)


def _expected_outputs(num_samples: int) -> dict[str, Any]:
    return fns.model_outputs(tuple(range(num_samples)))


def _concat_steps(steps: list[dict[str, Any]]) -> dict[str, Any]:
    for step in steps:  # each step's result keeps the model's containers
        assert type(step) is dict and type(step["nested"]) is list
    return {
        "pred": torch.cat([s["pred"] for s in steps]),
        "nested": [torch.cat([s["nested"][0] for s in steps])],
    }


# --------------------------------------------------------------------- acceptance, 3 ranks


@pytest.mark.parametrize("num_samples", [1, 2, 7, 10])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("even_batches", [True, False], ids=["even", "uneven"])
def test_returns_exactly_n_items_in_dataset_order(
    world3: Any, num_samples: int, batch_size: int, even_batches: bool
) -> None:
    expected = _expected_outputs(num_samples)
    results = world3.run(fns.evaluate, num_samples, batch_size, even_batches)
    for rank, steps in enumerate(results):
        assert_tree_equal(_concat_steps(steps), expected, f"rank {rank}")


@pytest.mark.parametrize("even_batches", [True, False], ids=["even", "uneven"])
def test_the_transform_form_gives_the_same_samples(world: Any, even_batches: bool) -> None:
    expected = _expected_outputs(7)
    results = world.run(fns.evaluate, 7, 2, even_batches, as_transform=True)
    for rank, steps in enumerate(results):
        assert_tree_equal(_concat_steps(steps), expected, f"rank {rank}")


@pytest.mark.parametrize("num_samples", [2, 7])
@pytest.mark.parametrize("even_batches", [True, False], ids=["even", "uneven"])
@pytest.mark.parametrize("use_gather_object", [True, False], ids=["explicit", "auto"])
def test_objects_return_exactly_n_items_in_dataset_order(
    world3: Any, num_samples: int, even_batches: bool, use_gather_object: bool
) -> None:
    expected = [f"sample-{i}" for i in range(num_samples)]
    results = world3.run(fns.evaluate_objects, num_samples, 4, even_batches, use_gather_object)
    for gathered in results:
        assert gathered == expected


def test_ranks_with_different_sample_counts(world: Any) -> None:
    n = world.num_processes
    rows = torch.cat([torch.arange(r * 2, dtype=torch.int64)[:, None] + 100 * r for r in range(n)])
    for out in world.run(fns.metrics_ragged_rows):
        assert_tree_equal(out, Pair(x=rows, y=rows.bool()))


def test_trailing_dim_mismatch_across_ranks(world: Any) -> None:
    with pytest.raises(fa.CollectiveMismatchError, match="differs beyond dim 0") as info:
        world.run(fns.metrics_trailing_mismatch)
    for rank in range(world.num_processes):
        assert f"rank {rank}: (2, {rank + 1})" in str(info.value)
    assert_tree_equal(world.run(fns.gather_rank)[0], torch.arange(world.num_processes))


def test_a_reduced_value_is_rejected_on_every_rank(world2: Any) -> None:
    with pytest.raises(ValueError, match="already reduced"):
        world2.run(fns.metrics_reduced)
    assert_tree_equal(world2.run(fns.gather_rank)[0], torch.tensor([0, 1]))


# --------------------------------------------------------------------- one process


def _outputs(num_samples: int) -> dict[str, Any]:
    rows = Pair(x=torch.ones(num_samples, 2), y=torch.zeros(num_samples, dtype=torch.bool))
    return {"p": torch.arange(num_samples), "n": [rows]}


def test_single_process_returns_the_input(state: fa.RunState) -> None:
    outputs = _outputs(3)
    assert_tree_equal(fa.ops.gather_for_metrics(state, outputs), outputs)
    assert_tree_equal(fa.ops.gather_for_metrics(state, outputs, num_valid=3), outputs)


def test_single_process_drops_the_padding(state: fa.RunState) -> None:
    outputs = _outputs(4)
    assert_tree_equal(fa.ops.gather_for_metrics(state, outputs, num_valid=1), _outputs(1))
    empty = fa.ops.gather_for_metrics(state, outputs, num_valid=0)
    assert empty["p"].shape == (0,) and empty["n"][0].x.shape == (0, 2)
    assert_tree_equal(outputs, _outputs(4))


def test_single_process_objects(state: fa.RunState) -> None:
    texts = ["a", "b", "pad"]
    assert fa.ops.gather_for_metrics(state, texts, num_valid=2) == ["a", "b"]
    assert fa.ops.gather_for_metrics(state, texts) == ["a", "b", "pad"]
    assert fa.ops.gather_for_metrics(state, [torch.ones(1)], use_gather_object=True, num_valid=0) == []
    assert texts == ["a", "b", "pad"]


@pytest.mark.parametrize("num_valid", [-1, 4])
def test_num_valid_out_of_range(state: fa.RunState, num_valid: int) -> None:
    with pytest.raises(ValueError, match=f"num_valid={num_valid}.*3 samples"):
        fa.ops.gather_for_metrics(state, torch.arange(3), num_valid=num_valid)


def test_a_0d_tensor_is_rejected(state: fa.RunState) -> None:
    with pytest.raises(ValueError, match="0-d") as info:
        fa.ops.gather_for_metrics(state, {"loss": torch.tensor(0.5), "p": torch.arange(2)})
    assert "already reduced" in str(info.value)


def test_leaves_with_different_sample_counts_are_rejected(state: fa.RunState) -> None:
    with pytest.raises(ValueError, match=r"dim 0 sizes \[2, 3\]"):
        fa.ops.gather_for_metrics(state, {"a": torch.zeros(3), "b": [torch.zeros(2, 4)]})


def test_non_tensor_outputs_must_be_a_list(state: fa.RunState) -> None:
    with pytest.raises(TypeError, match="one entry per sample, got dict"):
        fa.ops.gather_for_metrics(state, {"text": "abc", "p": torch.ones(1)})


# --------------------------------------------------------------------- eval_shards


@pytest.mark.parametrize("num_samples", [1, 2, 5, 7, 10, 12, 13])
@pytest.mark.parametrize("batch_size", [1, 3, 4])
@pytest.mark.parametrize("num_processes", [1, 2, 3])
@pytest.mark.parametrize("even_batches", [True, False], ids=["even", "uneven"])
def test_eval_shards_cover_every_index_once_in_order(
    num_samples: int, batch_size: int, num_processes: int, even_batches: bool
) -> None:
    per_rank = [
        eval_shards(num_samples, batch_size, num_processes, rank, even_batches=even_batches)
        for rank in range(num_processes)
    ]
    num_steps = len(per_rank[0])
    assert all(len(shards) == num_steps for shards in per_rank)
    assert num_steps == -(-num_samples // (batch_size * num_processes))
    # real samples, step by step, rank by rank: the dataset order, each index once
    valid = [
        i
        for step in range(num_steps)
        for shards in per_rank
        for i in shards[step].indices[: shards[step].num_valid]
    ]
    assert valid == list(range(num_samples))
    for shards in per_rank:
        for shard in shards:
            assert isinstance(shard, EvalShard)
            if even_batches:
                assert len(shard.indices) == batch_size
                assert all(0 <= i < num_samples for i in shard.indices[shard.num_valid :])
            else:
                assert len(shard.indices) == shard.num_valid <= batch_size


def test_eval_shards_pads_by_wrapping_to_the_start() -> None:
    assert eval_shards(5, 2, 2, 1) == [
        EvalShard(indices=(2, 3), num_valid=2),
        EvalShard(indices=(1, 2), num_valid=0),  # the global batch (4, 0, 1, 2), wrapped once
    ]
    assert eval_shards(5, 2, 2, 0) == [
        EvalShard(indices=(0, 1), num_valid=2),
        EvalShard(indices=(4, 0), num_valid=1),
    ]
    assert eval_shards(1, 4, 3, 2) == [EvalShard(indices=(0, 0, 0, 0), num_valid=0)]
    assert eval_shards(5, 2, 2, 1, even_batches=False) == [
        EvalShard(indices=(2, 3), num_valid=2),
        EvalShard(indices=(), num_valid=0),
    ]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, 1, 0), "num_samples=0"),
        ((5, 0, 1, 0), "batch_size=0"),
        ((5, 1, 0, 0), "num_processes=0"),
        ((5, 1, 2, 2), "rank=2"),
        ((5, 1, 2, -1), "rank=-1"),
    ],
)
def test_eval_shards_bad_arguments(args: tuple[int, int, int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        eval_shards(*args)


@pytest.mark.parametrize("kind", ["reduced", "num_valid"])
def test_one_rank_with_bad_input_makes_every_rank_raise(world: Any, kind: str) -> None:
    results = world.run(fns.metrics_one_rank_rejects, kind)
    last = world.num_processes - 1
    *healthy, bad = results
    assert bad[0] == "ValueError"
    for name, message, elapsed in healthy:
        assert name == "CollectiveMismatchError"
        assert f"rank {last} rejected its input" in message
        assert elapsed < 30  # the process-group timeout is 30 minutes
    assert world.run(fns.gather_rank)  # the world is still usable
