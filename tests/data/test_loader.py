"""`prepare_loader`, `PreparedLoader` and `batches`: the data path of a run.

Sharding is a pure computation, so most tests prepare each rank's loader in
this process with a `DistContext` naming the rank (that also lets loader
workers run: the gloo world's ranks are daemons, which cannot start them);
the tests on the real 2- and 3-rank worlds check the same properties end to end.
"""

from __future__ import annotations

import functools
import operator
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import fnaccel as fa
from fnaccel._errors import CheckpointError
from fnaccel.data import prepared as prepared_module
from fnaccel.data.config import DataLoaderConfiguration
from fnaccel.data.loader import prepare_loader
from fnaccel.data.prepared import PreparedLoader, batches
from fnaccel.data.sampler import epoch_order

_TESTS = str(Path(__file__).resolve().parents[1])  # see ops/_dist_fns.py for why
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from data import _data_fns as fns  # noqa: E402
from data._data_fns import Indices, Noisy, PlainStream, Stream, as_lists, collate_list, stepping, train  # noqa: E402


def _ctx(num_processes: int = 1, rank: int = 0, device: str = "cpu") -> fa.DistContext:
    return fa.DistContext(num_processes=num_processes, rank=rank, device=torch.device(device))


def _prepare(
    loader: DataLoader[Any], num_processes: int = 1, rank: int = 0, seed: int = 0, **config: Any
) -> PreparedLoader:
    return prepare_loader(
        loader, _ctx(num_processes, rank), seed=seed, config=DataLoaderConfiguration(**config)
    )


def _state(prepared: PreparedLoader) -> fa.RunState:
    return fa.init(cpu=True).replace(loader=prepared)


def _stepping(prepared: PreparedLoader) -> fa.RunState:
    """A fresh run holding ``prepared``, whose `fa.step` consumes its batches."""
    return stepping(fa.init(seed=0, cpu=True), prepared)


# --------------------------------------------------------------------- the order


def test_the_order_depends_on_shuffle_and_seed_only_never_on_the_users_generator() -> None:
    def order(loader: DataLoader[Any]) -> list[list[int]]:
        return as_lists(_prepare(loader, seed=9))

    data = Indices(10)
    reference = order(DataLoader(data, batch_size=3, shuffle=True))
    torch.manual_seed(1)
    assert (
        order(DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(5)))
        == reference
    )
    assert order(DataLoader(data, batch_size=3, sampler=RandomSampler(data))) == reference
    assert order(StatefulDataLoader(data, batch_size=3, shuffle=True)) == reference
    assert order(DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 3, False))) == reference
    expected = epoch_order(10, seed=9, epoch=0, shuffle=True).tolist()
    assert functools.reduce(operator.iadd, reference, []) == expected
    assert [len(b) for b in reference] == [3, 3, 3, 1]  # one process: no padding
    assert order(DataLoader(data, batch_size=3)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    sequential = DataLoader(data, batch_size=3, sampler=SequentialSampler(data))
    assert order(sequential) == order(DataLoader(data, batch_size=3))
    assert as_lists(_prepare(DataLoader(data, batch_size=3, shuffle=True), seed=9, data_seed=2)) != reference


@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_of_a_step_make_the_single_process_global_batch(num_processes: int, shuffle: bool) -> None:
    num_samples, batch_size = 4 * 3 * num_processes, 3
    single = as_lists(
        _prepare(
            DataLoader(Indices(num_samples), batch_size=batch_size * num_processes, shuffle=shuffle), seed=2
        )
    )
    ranks = [
        as_lists(
            _prepare(
                DataLoader(Indices(num_samples), batch_size=batch_size, shuffle=shuffle),
                num_processes,
                rank,
                seed=2,
            )
        )
        for rank in range(num_processes)
    ]
    assert [
        functools.reduce(operator.iadd, (r[step] for r in ranks), []) for step in range(len(single))
    ] == single
    assert sorted(i for r in ranks for b in r for i in b) == list(range(num_samples))


def test_on_real_worlds_every_sample_once_and_steps_equal_one_process(world: Any) -> None:
    n = world.num_processes
    num_samples, batch_size = 5 * 2 * n, 2
    results = world.run(fns.epoch_batches, num_samples, batch_size, True, 2, {})
    single = fa.init(cpu=True).replace(
        loader=_prepare(DataLoader(Indices(num_samples), batch_size=batch_size * n, shuffle=True), seed=5)
    )
    expected = [b.tolist() for b in batches(single, epochs=2)]
    assert all(r["end"] == (2, 0) for r in results)
    stepped = [r["batches"] for r in results]
    assert all(len(r) == len(expected) for r in stepped)
    for step, global_batch in enumerate(expected):
        assert functools.reduce(operator.iadd, (r[step][0] for r in stepped), []) == global_batch
    for epoch in range(2):
        steps = [step for step, (_, e) in enumerate(stepped[0]) if e == epoch]
        assert len(steps) == len(expected) // 2
        seen = sorted(i for r in stepped for step in steps for i in r[step][0])
        assert seen == list(range(num_samples))  # every sample exactly once per epoch
    assert all(len(batch) == batch_size for r in stepped for batch, _ in r)  # nothing padded


def test_on_real_worlds_uneven_data_pads_and_counts_the_real_samples(world: Any) -> None:
    n = world.num_processes
    num_samples = 2 * n * 2 + 1  # one sample into a third global batch
    results = [r["batches"] for r in world.run(fns.epoch_batches, num_samples, 2, False, 1, {})]
    assert {len(r) for r in results} == {3}
    # the third step has one real sample (rank 0's first); the rest of the global batch is
    # padding wrapped around from the start, each rank taking its chunk of it
    assert all(
        r[2][0] == ([num_samples - 1, 0] if rank == 0 else [2 * rank - 1, 2 * rank])
        for rank, r in enumerate(results)
    )
    real = sorted([i for r in results for batch, _ in r[:2] for i in batch] + [num_samples - 1])
    assert real == list(range(num_samples))
    uneven = world.run(fns.epoch_batches, num_samples, 2, False, 1, {"even_batches": False})
    assert [r["batches"][2][0] for r in uneven] == [[num_samples - 1]] + [[]] * (n - 1)


# --------------------------------------------------------------------- uneven ends


def test_even_batches_drop_last_and_split_batches_on_the_loader() -> None:
    def ranks(loader_kwargs: dict[str, Any], **config: Any) -> list[list[list[int]]]:
        return [
            as_lists(
                _prepare(DataLoader(Indices(8), collate_fn=collate_list, **loader_kwargs), 3, rank, **config)
            )
            for rank in range(3)
        ]

    # even_batches pads a short global batch by wrapping around to the dataset's start
    assert ranks({"batch_size": 2}) == [[[0, 1], [6, 7]], [[2, 3], [0, 1]], [[4, 5], [2, 3]]]
    assert ranks({"batch_size": 2}, even_batches=False) == [[[0, 1], [6, 7]], [[2, 3], []], [[4, 5], []]]
    assert ranks({"batch_size": 2, "drop_last": True}) == [[[0, 1]], [[2, 3]], [[4, 5]]]
    assert ranks({"batch_size": 3}, split_batches=True) == [[[0], [3], [6]], [[1], [4], [7]], [[2], [5], [0]]]
    with pytest.raises(ValueError, match="multiple of 3"):
        _prepare(DataLoader(Indices(8), batch_size=4), 3, 0, split_batches=True)
    with pytest.raises(ValueError, match="needs fnaccel to shard"):
        _prepare(DataLoader(Indices(8), batch_size=3), 3, 0, split_batches=True, shard=False)


def test_an_empty_batch_that_cannot_be_collated_gets_a_clear_error() -> None:
    prepared = _prepare(DataLoader(Indices(7), batch_size=2), 3, 1, even_batches=False)
    stream = iter(prepared)
    assert next(stream).tolist() == [2, 3]
    with pytest.raises(ValueError, match="even_batches=True"):
        next(stream)


def test_a_loader_without_batching_shards_whole_items() -> None:
    per_rank = [list(_prepare(DataLoader(Indices(5), batch_size=None), 2, rank)) for rank in range(2)]
    assert per_rank == [[0, 2, 4], [1, 3, 0]]  # rank 1's last item is padding from the start


# --------------------------------------------------------------------- samplers fnaccel keeps


def test_a_distributed_sampler_is_not_sharded_twice(world: Any) -> None:
    for rank_result in world.run(fns.distributed_sampler_batches, 11, 2):
        assert rank_result["got"] == rank_result["expected"]  # its own shard, reshuffled by set_epoch
        assert rank_result["len"] == len(rank_result["expected"]) // 2


def test_shard_true_with_a_distributed_sampler_is_refused() -> None:
    data = Indices(10)
    loader = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    with pytest.raises(ValueError, match="shard it twice"):
        _prepare(loader, 2, 0, shard=True)
    kept = _prepare(loader, 2, 0)
    assert kept.sampler is None and len(kept) == 3


class _EveryOther(torch.utils.data.Sampler[int]):
    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return (self.num_samples + 1) // 2

    def __iter__(self) -> Any:
        return iter(range(0, self.num_samples, 2))


def test_a_custom_sampler_is_kept_on_one_process_and_refused_on_more() -> None:
    loader = DataLoader(Indices(7), batch_size=2, sampler=_EveryOther(7))
    assert as_lists(_prepare(loader)) == [[0, 2], [4, 6]]
    with pytest.raises(ValueError, match="custom _EveryOther across 2 processes.*shard=False"):
        _prepare(loader, 2, 1)
    assert as_lists(_prepare(loader, 2, 1, shard=False)) == [[0, 2], [4, 6]]
    custom_batches = DataLoader(Indices(6), batch_sampler=[[5, 4], [0]])
    assert as_lists(_prepare(custom_batches)) == [[5, 4], [0]]
    with pytest.raises(ValueError, match="custom list"):
        _prepare(custom_batches, 3, 0)
    replacement = DataLoader(Indices(6), batch_size=2, sampler=RandomSampler(Indices(6), replacement=True))
    with pytest.raises(ValueError, match="custom RandomSampler"):
        _prepare(replacement, 2, 0)


def test_shard_false_gives_every_rank_the_whole_dataset_in_the_seeded_order() -> None:
    per_rank = [
        as_lists(_prepare(DataLoader(Indices(6), batch_size=4, shuffle=True), 2, rank, shard=False))
        for rank in range(2)
    ]
    assert per_rank[0] == per_rank[1]
    assert (
        functools.reduce(operator.iadd, per_rank[0], [])
        == epoch_order(6, seed=0, epoch=0, shuffle=True).tolist()
    )


# --------------------------------------------------------------------- resuming


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_a_mid_epoch_state_resumes_exactly_in_a_fresh_loader(
    num_workers: int, stop_after: int, tmp_path: Path
) -> None:
    def fresh() -> fa.RunState:
        loader = DataLoader(Indices(23), batch_size=2, shuffle=True, num_workers=num_workers)
        return _stepping(_prepare(loader, 2, 1, seed=3))

    reference = as_lists(fresh().loader)
    state, head = train(fresh(), epochs=1, stop_after=stop_after)  # one more batch fetched, not stepped
    assert state.data_position == fa.DataPosition(epoch=0, num_batches=stop_after)
    fa.save(state, tmp_path / "ckpt")
    state, tail = train(state, epochs=1)
    assert state.data_position == fa.DataPosition(epoch=1)
    resumed = fa.load(fresh(), tmp_path / "ckpt")
    assert resumed.data_position == fa.DataPosition(epoch=0, num_batches=stop_after)  # not started yet
    resumed, again = train(resumed, epochs=1)
    assert again == tail and resumed.data_position == fa.DataPosition(epoch=1)
    assert head + tail == reference and len(reference) == len(state.loader) == 6


def test_resuming_reads_only_the_remaining_samples() -> None:
    result = fns.resumed_batches(fa.init(seed=0, cpu=True), 1000, 10, stop_after=95)
    assert result["saved"] == (0, 95) and result["end"] == (1, 0)
    assert result["resumed"] == result["tail"] and len(result["tail"]) == 5
    assert result["reads"] == 50  # no replay of the 950 samples before the position
    # len() of what fa.batches returns: the batches it yields from the state's position
    assert result["lengths"] == {
        "epoch": 100,
        "three_epochs": 300,
        "rest": 5,
        "after_the_epoch": 0,
        "resumed": 5,
    }


def test_resuming_on_real_worlds(world: Any) -> None:
    steps = -(-40 // (2 * world.num_processes))  # a padded last step on 3 ranks
    for result in world.run(fns.resumed_batches, 40, 2, 3):
        assert result["saved"] == (0, 3) and result["end"] == (1, 0)
        assert result["resumed"] == result["tail"] and len(result["head"]) + len(result["tail"]) == steps
        assert result["reads"] == 2 * len(result["tail"])
        # this rank's batches, as the prepared loader of Accelerate counts them
        rest = len(result["tail"])
        assert result["lengths"] == {
            "epoch": steps,
            "three_epochs": 3 * steps,
            "rest": rest,
            "after_the_epoch": 0,
            "resumed": rest,
        }


def test_the_length_of_a_streams_batches_is_refused_naming_why() -> None:
    state = fns.stepping(
        fa.init(seed=0, cpu=True),
        prepare_loader(DataLoader(fns.Stream(6), batch_size=2), fa.init(cpu=True).dist, seed=0),
    )
    with pytest.raises(TypeError, match="fa.batches: the loader reads a stream .* has no len\\(\\)"):
        len(fa.batches(state))
    assert len(list(fa.batches(state))) == 3  # list() still reads it (len() is only a hint to it)


def test_persistent_workers_cross_epochs_and_resume(tmp_path: Path) -> None:
    def prepared() -> PreparedLoader:
        loader = DataLoader(Indices(10), batch_size=2, shuffle=True, num_workers=2, persistent_workers=True)
        return _prepare(loader, 2, 1)

    reference = as_lists(batches(_state(prepared()), epochs=3))
    state, head = train(_stepping(prepared()), epochs=3, stop_after=4)  # into the second epoch
    assert state.data_position == fa.DataPosition(epoch=1, num_batches=1)
    fa.save(state, tmp_path / "ckpt")
    resumed, tail = train(fa.load(_stepping(prepared()), tmp_path / "ckpt"), epochs=3)
    assert head + tail == reference and resumed.data_position == fa.DataPosition(epoch=3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_reading_leaves_the_process_generators_alone(num_workers: int) -> None:
    loader = _prepare(DataLoader(Indices(9), batch_size=2, shuffle=True, num_workers=num_workers), 3, 2)
    before = torch.get_rng_state()
    as_lists(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_worker_seeds_are_pure_in_seed_epoch_and_rank() -> None:
    def draws(rank: int, seed: int = 0) -> list[list[float]]:
        loader = DataLoader(Noisy(), batch_size=2, num_workers=2)
        return [b.tolist() for b in batches(_state(_prepare(loader, 2, rank, seed=seed)), epochs=2)]

    first = draws(0)
    assert draws(0) == first  # a fresh loader augments the same way
    assert draws(1) != first and draws(0, seed=1) != first
    assert first[:2] != first[2:]  # and each epoch differently


def test_a_state_at_an_epoch_boundary_resumes_the_next_epoch(tmp_path: Path) -> None:
    def fresh() -> fa.RunState:
        return _stepping(_prepare(DataLoader(Indices(6), batch_size=2, shuffle=True)))

    state, first = train(fresh(), epochs=1)
    assert state.data_position == fa.DataPosition(epoch=1)  # no loader snapshot: the epoch alone
    fa.save(state, tmp_path / "ckpt")
    state, expected = train(state, epochs=2)
    assert (
        sorted(functools.reduce(operator.iadd, expected, [])) == list(range(6)) and expected != first
    )  # the next epoch, reshuffled
    resumed = fa.load(fresh(), tmp_path / "ckpt")
    assert resumed.data_position == fa.DataPosition(epoch=1)
    resumed, again = train(resumed, epochs=2)
    assert again == expected and resumed.epoch == 2


def test_a_state_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    def fresh(num_processes: int = 2, **loader: Any) -> fa.RunState:
        return _stepping(_prepare(DataLoader(Indices(10), batch_size=2, **loader), num_processes, 0))

    state, _ = train(fresh(), epochs=1, stop_after=1)
    fa.save(state, tmp_path / "ckpt")
    for other, message in [
        (
            fresh(3),
            "global batch of 4 samples per step \\(2 per process x 2 process\\(es\\)\\) but this run reads 6",
        ),
        (fresh(num_workers=1), "num_workers=0 but this run's loader has num_workers=1"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            fa.load(other, tmp_path / "ckpt")
        assert not other.is_spent  # refused before anything was consumed
    layout = state.loader.layout
    with pytest.raises(CheckpointError, match="lacks 'batch_size'"):
        layout.check_resume({"num_samples": 10}, "here")
    with pytest.raises(CheckpointError, match="must be a mapping"):
        layout.check_resume(None, "here")
    fa.save(state.replace(data_position=fa.DataPosition(epoch=0, num_batches=9)), tmp_path / "past")
    with pytest.raises(CheckpointError, match="9 batches into an epoch of 3"):
        fa.load(fresh(), tmp_path / "past")
    fa.save(state.replace(data_position=fa.DataPosition(epoch=-1)), tmp_path / "negative")
    with pytest.raises(CheckpointError, match="'epoch' must be an integer >= 0"):
        fa.load(fresh(), tmp_path / "negative")


# --------------------------------------------------------------------- iterable datasets


@pytest.mark.parametrize("num_processes", [2, 3])
def test_an_iterable_dataset_is_split_by_global_batch(num_processes: int) -> None:
    num_samples = 2 * num_processes * 3 + 1
    ranks = [
        as_lists(_prepare(DataLoader(Stream(num_samples), batch_size=2), num_processes, rank))
        for rank in range(num_processes)
    ]
    assert {len(r) for r in ranks} == {4}
    single = as_lists(_prepare(DataLoader(Stream(num_samples), batch_size=2 * num_processes)))
    for step in range(3):
        assert functools.reduce(operator.iadd, (r[step] for r in ranks), []) == single[step]
    assert sorted(i for r in ranks for b in r[:3] for i in b) == list(range(num_samples - 1))
    last = [r[3] for r in ranks]  # one real sample, padded by cycling the last global batch
    assert last == [[num_samples - 1] * 2] * num_processes
    dropped = [
        as_lists(_prepare(DataLoader(Stream(num_samples), batch_size=2, drop_last=True), num_processes, r))
        for r in range(num_processes)
    ]
    assert [len(r) for r in dropped] == [3] * num_processes


def test_iterable_sharding_on_real_worlds(world: Any) -> None:
    n = world.num_processes
    results = world.run(fns.iterable_batches, 4 * n, 2)
    assert sorted(i for r in results for batch in r for i in batch) == list(range(4 * n))
    assert [r[0] for r in results] == [[2 * rank, 2 * rank + 1] for rank in range(n)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_resumes_through_its_own_state(num_workers: int, tmp_path: Path) -> None:
    def fresh() -> fa.RunState:
        return _stepping(_prepare(DataLoader(Stream(40), batch_size=2, num_workers=num_workers), 2, 1))

    reference = as_lists(fresh().loader)
    state, head = train(fresh(), stop_after=3)
    assert state.data_position.key == (0, 3) and state.data_position.loader_state is not None
    fa.save(state, tmp_path / "ckpt")  # the loader's snapshot goes through JSON
    state, tail = train(state)
    assert state.data_position.key == (0, 10)  # a stream's end shows only at the next fetch
    resumed, again = train(fa.load(fresh(), tmp_path / "ckpt"))
    assert again == tail and head + tail == reference and len(reference) == 10
    if num_workers == 0:
        assert resumed.loader.dataloader.dataset.dataset.reads == 4 * len(tail)  # only the rest is read


def test_an_iterable_dataset_without_state_resumes_by_replaying(tmp_path: Path) -> None:
    def fresh() -> fa.RunState:
        return _stepping(_prepare(DataLoader(PlainStream(12), batch_size=2), 2, 0))

    state, head = train(fresh(), stop_after=1)
    fa.save(state, tmp_path / "ckpt")
    state, tail = train(state)
    _, again = train(fa.load(fresh(), tmp_path / "ckpt"))
    assert head == [[0, 1]] and again == tail == [[4, 5], [8, 9]]


def test_set_epoch_reaches_the_dataset() -> None:
    data = Stream(4)
    state = _state(_prepare(DataLoader(data, batch_size=2), 2, 0))
    list(batches(state, epochs=3))
    assert data.epochs == [0, 1, 2]


# --------------------------------------------------------------------- fa.batches


def test_batches_cross_epochs_and_reshuffle() -> None:
    state = _stepping(_prepare(DataLoader(Indices(8), batch_size=4, shuffle=True), seed=1))
    seen = []
    for batch in batches(state, epochs=2):
        seen.append((batch.tolist(), state.epoch))  # the epoch of the batch about to be stepped
        state, _ = fa.step(state, batch)
    assert [e for _, e in seen] == [0, 0, 1, 1] and state.data_position == fa.DataPosition(epoch=2)
    assert (
        functools.reduce(operator.iadd, (b for b, _ in seen[:2]), [])
        == epoch_order(8, seed=1, epoch=0, shuffle=True).tolist()
    )
    assert (
        functools.reduce(operator.iadd, (b for b, _ in seen[2:]), [])
        == epoch_order(8, seed=1, epoch=1, shuffle=True).tolist()
    )
    assert list(batches(state, epochs=2)) == []  # already through epoch 1


def test_batches_without_epochs_yields_the_rest_of_the_current_epoch() -> None:
    state = _stepping(_prepare(DataLoader(Indices(6), batch_size=2)))
    stream = batches(state)
    state, _ = fa.step(state, next(stream))
    assert state.data_position == fa.DataPosition(epoch=0, num_batches=1)
    state, rest = train(state)
    assert rest == [[2, 3], [4, 5]]  # from the state's position: the live loader continues
    assert state.epoch == 1
    state, rest = train(state)
    assert rest == [[0, 1], [2, 3], [4, 5]] and state.epoch == 2
    assert len(state.loader) == 3


@pytest.mark.parametrize("num_workers", [0, 2])
def test_end_epoch_skips_the_rest_unread_and_the_next_epoch_comes_whole(
    num_workers: int, tmp_path: Path
) -> None:
    import multiprocessing

    data = fns.Logged(40, str(tmp_path / "reads"))
    prepared = _prepare(DataLoader(data, batch_size=2, shuffle=True, num_workers=num_workers), seed=2)
    before = set(multiprocessing.active_children())
    state, head = train(_stepping(prepared), stop_after=3)  # 3 batches stepped, a 4th fetched
    state = fa.end_epoch(state)
    assert state.data_position == fa.DataPosition(epoch=1)
    assert set(multiprocessing.active_children()) == before  # the epoch's workers ended with it
    read_in_epoch_0 = len(data.reads())
    # unread: the stepped batches, the one fetched, and what 2 workers prefetch (2 batches each)
    assert read_in_epoch_0 <= (4 if num_workers == 0 else 4 + 2 * 2) * 2 < 40
    assert head == as_lists([epoch_order(40, seed=2, epoch=0, shuffle=True)[:6].view(3, 2)][0])
    state, epoch_1 = train(state)
    assert (
        functools.reduce(operator.iadd, epoch_1, [])
        == epoch_order(40, seed=2, epoch=1, shuffle=True).tolist()
    )
    assert state.data_position == fa.DataPosition(epoch=2) and len(data.reads()) == read_in_epoch_0 + 40


def test_end_epoch_on_real_worlds_every_rank_reads_the_next_epoch_whole(world: Any) -> None:
    n = world.num_processes
    results = world.run(fns.ended_epoch, 24, 2, 1)
    assert all(r["ended"] == (1, 0) and r["end"] == (2, 0) for r in results)
    steps = zip(*(r["epoch_1"] for r in results), strict=False)  # each step's batches, in rank order
    assert (
        functools.reduce(operator.iadd, (functools.reduce(operator.iadd, step, []) for step in steps), [])
        == epoch_order(24, seed=7, epoch=1, shuffle=True).tolist()
    )
    assert len(results[0]["epoch_1"]) == 24 // (2 * n)


def test_end_epoch_at_an_epoch_start_never_skips_that_epoch() -> None:
    state = _stepping(_prepare(DataLoader(Indices(4), batch_size=2)))
    state, _ = train(state)  # the whole epoch: the state moved to the start of the next
    state = fa.end_epoch(state)
    assert state.data_position == fa.DataPosition(epoch=1)
    state, again = train(state)
    assert again == [[0, 1], [2, 3]]


def test_end_epoch_works_on_a_stream_and_a_kept_sampler_without_rewinding_them() -> None:
    """A stream (located by loader snapshots) and a sampler that cannot rewind both
    start their next epoch fresh: jumping forward to an epoch start re-reads nothing."""
    stream = _stepping(_prepare(DataLoader(Stream(10), batch_size=2)))
    stream, _ = train(stream, stop_after=2)
    stream, rest = train(fa.end_epoch(stream))
    assert rest == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    data = Indices(8)
    sampler = RandomSampler(data, replacement=True, generator=torch.Generator().manual_seed(1))
    kept = _stepping(_prepare(DataLoader(data, batch_size=2, sampler=sampler)))
    kept, _ = train(kept, stop_after=1)
    kept, rest = train(fa.end_epoch(kept))
    assert len(rest) == 4 and kept.data_position == fa.DataPosition(epoch=2)


def test_end_epoch_consumes_the_state_and_needs_a_prepared_loader() -> None:
    with pytest.raises(ValueError, match=r"fa.end_epoch: the state has no prepared loader"):
        fa.end_epoch(fa.init(cpu=True))
    state = _stepping(_prepare(DataLoader(Indices(4), batch_size=2)))
    fa.end_epoch(state)
    with pytest.raises(fa.StaleStateError, match="consumed by fa.end_epoch"):
        fa.end_epoch(state)


def test_batches_needs_a_prepared_loader() -> None:
    with pytest.raises(ValueError, match=r"prepare one first .*fa\.prepare"):
        batches(fa.init(cpu=True))
    with pytest.raises(TypeError, match="not a prepared loader"):
        batches(fa.init(cpu=True).replace(loader=DataLoader(Indices(2))))
    with pytest.raises(ValueError, match="epochs must be an int >= 0"):
        batches(_state(_prepare(DataLoader(Indices(2)))), epochs=-1)


def test_batches_are_placed_on_the_device_with_the_configured_non_blocking(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = getattr(prepared_module, "send_to_device")  # the name the prepared loader moves batches with

    def recording(batch: Any, device: Any, non_blocking: bool = False) -> Any:
        calls.append((device, non_blocking))
        return real(batch, device, non_blocking=non_blocking)

    monkeypatch.setattr(prepared_module, "send_to_device", recording)
    loader = DataLoader(Indices(4), batch_size=2)
    prepared = prepare_loader(
        loader, _ctx(device="meta"), seed=0, config=DataLoaderConfiguration(non_blocking=True)
    )
    out = list(batches(fa.init(cpu=True).replace(loader=prepared)))
    assert [b.device.type for b in out] == ["meta", "meta"]
    assert calls == [(torch.device("meta"), True)] * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_batches_reach_the_gpu() -> None:
    loader = DataLoader(Indices(8), batch_size=4, pin_memory=True, num_workers=2)
    prepared = prepare_loader(
        loader, _ctx(device="cuda:0"), seed=0, config=DataLoaderConfiguration(non_blocking=True)
    )
    out = list(batches(fa.init(cpu=True).replace(loader=prepared)))
    assert all(b.device == torch.device("cuda:0") for b in out)
    assert torch.cat(out).tolist() == list(range(8))


# --------------------------------------------------------------------- bad input


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match="takes a torch.utils.data.DataLoader"):
        prepare_loader([1, 2], _ctx(), seed=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="seed must be an int"):
        prepare_loader(DataLoader(Indices(2)), _ctx(), seed=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a DataLoaderConfiguration"):
        prepare_loader(DataLoader(Indices(2)), _ctx(), seed=0, config={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="in_order=False"):
        _prepare(DataLoader(Indices(4), batch_size=2, num_workers=1, in_order=False))


def test_a_sampler_with_its_own_generator_resumes_in_new_objects_and_refuses_a_rewind(tmp_path: Path) -> None:
    """A kept sampler that draws from its own generator cannot re-read a position in the
    same process (the generator moved on): that is refused, never silently other batches.
    In freshly prepared objects, after fa.load, the position replays exactly."""

    def fresh() -> fa.RunState:
        data = Indices(8)
        sampler = RandomSampler(data, replacement=True, generator=torch.Generator().manual_seed(1))
        return stepping(
            fa.init(seed=0, cpu=True),
            prepare_loader(DataLoader(data, batch_size=2, sampler=sampler), fa.DistContext(), seed=0),
        )

    _, whole = train(fresh(), epochs=1)
    state, head = train(fresh(), epochs=1, stop_after=1)  # fetched a second batch, never stepped it
    fa.save(state, tmp_path / "ckpt")
    _, rest = train(fa.load(fresh(), tmp_path / "ckpt"), epochs=1)
    assert head + rest == whole
    with pytest.raises(ValueError, match="cannot be rewound.*shuffle=True"):
        train(state, epochs=1)
