"""`ShardedBatchSampler` and the split it shares with `eval_shards`.

The specification: the order of an epoch is a pure function of (seed, epoch);
step ``s`` is the ``s``-th global batch of that order and rank ``r`` its
``r``-th chunk, so the ranks' batches of a step, concatenated, are the batch of
one process with the global batch size; the position is two ints and resuming
is a jump.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from fnaccel.data.sampler import ShardedBatchSampler, epoch_order
from fnaccel.data.sharding import EvalShard, eval_shards, num_steps, shard_batch


def _ranks(num_samples: int, batch_size: int, num_processes: int, **kwargs: Any) -> list[ShardedBatchSampler]:
    return [
        ShardedBatchSampler(num_samples, batch_size, num_processes=num_processes, rank=rank, **kwargs)
        for rank in range(num_processes)
    ]


def test_the_order_is_a_pure_function_of_seed_and_epoch() -> None:
    a = ShardedBatchSampler(20, 4, seed=3, shuffle=True)
    b = ShardedBatchSampler(20, 4, seed=3, shuffle=True)
    torch.manual_seed(123)  # the process generator plays no part
    first = list(a)
    torch.manual_seed(456)
    assert list(b) == first
    expected = torch.randperm(20, generator=torch.Generator().manual_seed(3)).tolist()
    assert list(itertools.chain.from_iterable(first)) == expected
    a.set_epoch(1)
    assert list(itertools.chain.from_iterable(a)) == epoch_order(20, seed=3, epoch=1, shuffle=True).tolist()
    assert list(a) != first  # a new epoch reshuffles
    assert list(ShardedBatchSampler(6, 4, even_batches=False)) == [[0, 1, 2, 3], [4, 5]]  # dataset order


@pytest.mark.parametrize("num_processes", [1, 2, 3])
@pytest.mark.parametrize("num_samples", [1, 5, 12, 13, 24])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_concatenated_are_the_single_process_global_batch(
    num_processes: int, num_samples: int, drop_last: bool, shuffle: bool
) -> None:
    batch_size = 2
    ranks = _ranks(num_samples, batch_size, num_processes, seed=7, shuffle=shuffle, drop_last=drop_last)
    single = ShardedBatchSampler(
        num_samples,
        batch_size * num_processes,
        seed=7,
        shuffle=shuffle,
        drop_last=drop_last,
        even_batches=False,
    )
    per_rank = [list(s) for s in ranks]
    assert {len(b) for b in per_rank} == {len(single)} == {len(ranks[0])}
    for step, expected in enumerate(single):
        real = [i for r, s in enumerate(ranks) for i in per_rank[r][step][: s.num_valid(step)]]
        assert real == expected
    seen = [
        i
        for step in range(len(single))
        for r, s in enumerate(ranks)
        for i in per_rank[r][step][: s.num_valid(step)]
    ]
    if drop_last:
        assert len(seen) == num_samples // (batch_size * num_processes) * batch_size * num_processes
    else:
        assert sorted(seen) == list(range(num_samples))  # every sample exactly once


@pytest.mark.parametrize("num_processes", [2, 3])
def test_divisible_epochs_cover_every_sample_once_without_padding(num_processes: int) -> None:
    ranks = _ranks(12 * num_processes, 4, num_processes, shuffle=True, seed=0)
    batches = [b for s in ranks for b in s]
    assert all(len(b) == 4 for b in batches)
    assert sorted(i for b in batches for i in b) == list(range(12 * num_processes))
    assert all(s.num_valid(k) == 4 for s in ranks for k in range(len(s)))


def test_even_batches_pad_by_wrapping_to_the_epoch_start() -> None:
    ranks = _ranks(5, 2, 2, seed=1, shuffle=True)
    order = epoch_order(5, seed=1, epoch=0, shuffle=True).tolist()
    assert [list(s) for s in ranks] == [
        [order[0:2], [order[4], order[0]]],
        [order[2:4], order[1:3]],  # the global batch wraps: order[4], order[0], order[1], order[2]
    ]
    assert [[s.num_valid(k) for k in range(len(s))] for s in ranks] == [[2, 1], [2, 0]]


def test_uneven_batches_are_short_or_empty_but_as_many_on_every_rank() -> None:
    ranks = _ranks(5, 2, 3, even_batches=False)
    assert [list(s) for s in ranks] == [[[0, 1]], [[2, 3]], [[4]]]
    ranks = _ranks(7, 2, 3, even_batches=False)
    assert [list(s) for s in ranks] == [[[0, 1], [6]], [[2, 3], []], [[4, 5], []]]
    assert [s.num_valid(1) for s in ranks] == [1, 0, 0]


def test_drop_last_drops_the_incomplete_global_batch() -> None:
    ranks = _ranks(11, 2, 2, drop_last=True)
    assert [list(s) for s in ranks] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert len(ranks[0]) == 2
    assert list(ShardedBatchSampler(3, 2, num_processes=2, rank=1, drop_last=True)) == []


def test_split_batches_divides_the_global_batch() -> None:
    ranks = _ranks(12, 6, 3, split_batches=True)
    assert [s.batch_size for s in ranks] == [2, 2, 2]
    assert [next(iter(s)) for s in ranks] == [[0, 1], [2, 3], [4, 5]]
    assert len(ranks[0]) == 2
    with pytest.raises(ValueError, match="multiple of 4"):
        ShardedBatchSampler(12, 6, num_processes=4, rank=0, split_batches=True)


def test_eval_shards_is_the_same_split() -> None:
    for num_processes, even in itertools.product([1, 2, 3], [True, False]):
        for rank in range(num_processes):
            shards = eval_shards(7, 2, num_processes, rank, even_batches=even)
            sampler = ShardedBatchSampler(7, 2, num_processes=num_processes, rank=rank, even_batches=even)
            assert [list(s.indices) for s in shards] == list(sampler)
            assert [s.num_valid for s in shards] == [sampler.num_valid(k) for k in range(len(sampler))]
    assert num_steps(7, 2, 3) == 2 and num_steps(7, 2, 3, drop_last=True) == 1
    assert shard_batch(torch.tensor([3, 1, 2]), 0, 2, 2, 1) == EvalShard(indices=(2, 3), num_valid=1)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 5])
def test_resuming_from_a_state_dict_yields_exactly_the_rest(stop_after: int) -> None:
    sampler = ShardedBatchSampler(21, 2, num_processes=2, rank=1, seed=4, shuffle=True)
    sampler.set_epoch(3)
    full = list(sampler)
    stream = iter(sampler)
    head = [next(stream) for _ in range(stop_after)]
    saved = sampler.state_dict()
    assert saved == {"epoch": 3, "batches_yielded": stop_after}
    fresh = ShardedBatchSampler(21, 2, num_processes=2, rank=1, seed=4, shuffle=True)
    fresh.load_state_dict(saved)
    assert head + list(fresh) == full
    assert list(stream) == full[stop_after:]


def test_a_finished_epoch_starts_over_until_set_epoch() -> None:
    sampler = ShardedBatchSampler(6, 2, shuffle=True)
    first = list(sampler)
    assert sampler.state_dict() == {"epoch": 0, "batches_yielded": 0}
    assert list(sampler) == first
    sampler.set_epoch(1)
    assert list(sampler) != first and sampler.state_dict() == {"epoch": 1, "batches_yielded": 0}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0}, "num_samples must be an int >= 1"),
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"batch_size": 2.0}, "batch_size must be an int"),
        ({"num_processes": 0}, "num_processes must be an int >= 1"),
        ({"rank": 2}, "rank=2 is not a rank of 2 processes"),
        ({"seed": None}, "seed must be an int"),
        ({"shuffle": 1}, "shuffle must be True or False"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], match: str) -> None:
    arguments: dict[str, object] = {"num_samples": 10, "batch_size": 2, "num_processes": 2, "rank": 0}
    arguments.update(kwargs)
    num_samples, batch_size = arguments.pop("num_samples"), arguments.pop("batch_size")
    with pytest.raises(ValueError, match=match):
        ShardedBatchSampler(num_samples, batch_size, **arguments)  # type: ignore[arg-type]


def test_bad_positions_are_refused() -> None:
    sampler = ShardedBatchSampler(10, 2)
    with pytest.raises(ValueError, match="batches_yielded"):
        sampler.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="another dataset size"):
        sampler.load_state_dict({"epoch": 0, "batches_yielded": 6})
    with pytest.raises(IndexError, match="outside the epoch's 5 batches"):
        sampler.num_valid(5)
    with pytest.raises(ValueError, match="epoch must be an int >= 0"):
        sampler.set_epoch(-1)


@pytest.mark.parametrize("num_samples", [1, 3, 10, 23])
@pytest.mark.parametrize(("num_processes", "rank"), [(1, 0), (2, 1), (3, 0), (3, 2)])
@pytest.mark.parametrize("cut", [{}, {"drop_last": True}, {"even_batches": False}])
def test_index_batches_are_the_iterated_batches_as_tensors(
    num_samples: int, num_processes: int, rank: int, cut: dict[str, bool]
) -> None:
    def sampler() -> ShardedBatchSampler:
        s = ShardedBatchSampler(
            num_samples, 4, num_processes=num_processes, rank=rank, seed=2, shuffle=True, **cut
        )
        s.set_epoch(1)
        return s

    lists, tensors = sampler(), sampler()
    expected, got = list(lists), list(tensors.index_batches())
    assert [t.tolist() for t in got] == expected and all(t.dtype == torch.int64 for t in got)
    resumed = sampler()
    if len(resumed):
        resumed.load_state_dict({"epoch": 1, "batches_yielded": len(resumed) - 1})
        assert [t.tolist() for t in resumed.index_batches()] == expected[-1:]
    assert tensors.state_dict() == lists.state_dict() == {"epoch": 1, "batches_yielded": 0}
