"""`fa.evaluate` and `fa.eval_batches`: every sample once, in dataset order, on every rank,
without touching the run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import fnaccel as fa
from tests import _eval_fns as fns


def _assert_exact(seen: dict[int, dict[str, Any]]) -> None:
    for n, got in seen.items():
        assert got["index"] == list(range(n)), n
        assert got["doubled"] == [2 * i for i in range(n)], n
        assert got["names"] == [f"s{i}" for i in range(n)], n
        assert got["ragged_rows"] == list(range(n)), n
        assert got["outputs_match"] and got["mode_restored"], (n, got)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_one_process_returns_every_sample_once_in_order(batch_size: int) -> None:
    _assert_exact(fns.check_sizes(fa.init(cpu=True), batch_size))


def test_two_and_three_ranks_return_every_sample_once_in_order_on_every_rank(world: Any) -> None:
    # sizes 1 and 2 leave ranks with no real sample at all; 203 ends on an uneven step
    for seen in world.run(fns.check_sizes, 3):
        _assert_exact(seen)


@pytest.mark.parametrize("batch_size", [4, 5])
def test_one_process_yields_the_loaders_own_batches_so_a_literal_port_counts_exactly_n(
    batch_size: int,
) -> None:
    """As Accelerate on one process: no padding, so a port that truncates only when
    distributed sees each of the N samples once (it saw 128 of 103 when the last batch
    was padded)."""
    seen = fns.literal_port_counts(fa.init(cpu=True), (1, 7, 103), batch_size)
    for n, got in seen.items():
        assert got["indices"] == list(range(n)), n
        assert got["num_valid_is_length"], n
        assert got["length"] == got["num_batches"] == -(-n // batch_size), n


def test_a_literal_port_counts_exactly_n_on_two_and_three_ranks(world: Any) -> None:
    """run_glue's loop truncates at ``step == len(eval_dataloader) - 1``: with the
    unsplit loader's length it counted 112 of 103 on 2 ranks; ``len()`` of what
    `fa.eval_batches` returns is the batches this rank yields."""
    for seen in world.run(fns.literal_port_counts, (1, 7, 103), 4):
        for n, got in seen.items():
            assert got["indices"] == list(range(n)), n
            assert got["length"] == got["num_batches"] == -(-n // (4 * world.num_processes)), n


def test_evaluating_between_steps_leaves_the_run_bit_identical() -> None:
    assert fns.train_with_and_without_evaluation(fa.init(cpu=True))


def test_evaluating_twice_gives_the_same_outputs_even_with_random_draws() -> None:
    state = fns.model_and_state(fa.init(seed=0, cpu=True))
    data = DataLoader(fns.Rows(5), batch_size=2, collate_fn=fns.collate)
    noisy = lambda model, batch: torch.rand(len(batch["index"]))  # noqa: E731
    process_draw = torch.get_rng_state()
    assert torch.equal(fa.evaluate(state, data, noisy), fa.evaluate(state, data, noisy))
    assert torch.equal(torch.get_rng_state(), process_draw)  # the process's generator is given back


def test_a_frozen_submodule_stays_in_eval_mode() -> None:
    state = fns.model_and_state(fa.init(seed=0, cpu=True))
    assert state.model is not None
    state.model[1].eval()  # a user's choice (e.g. frozen batch norm) survives evaluation
    fa.evaluate(state, DataLoader(fns.Rows(3), batch_size=2, collate_fn=fns.collate), fns.outputs)
    assert state.model.training and not state.model[1].training


class Stream(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(5.0).view(5, 1))


class SizedStream(Stream):
    def __len__(self) -> int:
        return 5


def test_the_length_of_a_streams_eval_batches_is_its_steps_or_refused_naming_why() -> None:
    state = fa.init(cpu=True)
    assert len(fa.eval_batches(state, DataLoader(SizedStream(), batch_size=2))) == 3
    unsized = fa.eval_batches(state, DataLoader(Stream(), batch_size=2))
    with pytest.raises(TypeError, match="fa.eval_batches: the evaluation data has no length"):
        len(unsized)
    assert len(list(unsized)) == 3


def test_eval_batches_reads_a_stream_unpadded_on_one_process() -> None:
    pairs = [
        (b.view(-1).tolist(), n)
        for b, n in fa.eval_batches(fa.init(cpu=True), DataLoader(Stream(), batch_size=2))
    ]
    assert pairs == [([0.0, 1.0], 2), ([2.0, 3.0], 2), ([4.0], 1)]


def test_bad_input_is_refused_with_the_fix() -> None:
    state = fa.init(cpu=True)
    with pytest.raises(ValueError, match="no model"):
        fa.evaluate(state, DataLoader(fns.Rows(3), batch_size=2), fns.outputs)
    with pytest.raises(TypeError, match="DataLoader"):
        fa.eval_batches(state, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        fa.eval_batches(state, DataLoader(fns.Rows(3), batch_size=None))
    prepared = fns.model_and_state(fa.init(cpu=True))
    with pytest.raises(TypeError, match="per-sample outputs"):
        fa.evaluate(prepared, DataLoader(fns.Rows(3), batch_size=2, collate_fn=fns.collate), lambda m, b: 3.0)
    assert prepared.model is not None and prepared.model.training  # restored after the error


def _assert_indexed(seen: dict[int, dict[str, Any]]) -> None:
    for n, got in seen.items():
        assert got["same_batches"] and got["same_outputs"] and got["labels_in_order"], (n, got)
        assert got["reads"] <= 2, (n, got)  # the fetch's probe of two samples; not one read per sample


def test_a_tensor_dataset_is_read_by_indexing_with_the_same_batches_and_outputs() -> None:
    """fa.evaluate read a TensorDataset one sample at a time (9x slower than fa.batches'
    indexed read on 100k rows); now as fa.batches does, with the same batches."""
    _assert_indexed(fns.tensor_dataset_reads(fa.init(seed=0, cpu=True), (1, 7, 103), 8))


def test_a_tensor_dataset_is_read_by_indexing_on_two_and_three_ranks(world: Any) -> None:
    for seen in world.run(fns.tensor_dataset_reads, (1, 7, 103), 8):
        _assert_indexed(seen)
