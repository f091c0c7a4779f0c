"""fa.load on another number of processes: a run saved mid-epoch on 2 processes and
resumed on 4 or on 1 reads the same samples in the same global order and ends where
the uninterrupted 2-process run ends (replicated and fsdp() checkpoints)."""

from __future__ import annotations

import functools
import operator
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fnaccel as fa
from fnaccel.transforms.parallel import unwrap_model

NUM_SAMPLES, GLOBAL_BATCH, EPOCHS = 48, 8, 2  # 6 steps an epoch, 12 in all
SAVE_AT = 9  # epoch 1, batch 3: mid-epoch


class Ids(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(NUM_SAMPLES, 4, generator=g)
        self.y = torch.randn(NUM_SAMPLES, 1, generator=g)

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    _, x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _prepared(state: fa.RunState, kind: str, batch_size: int) -> fa.RunState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    pipelines = {"fsdp": fa.compose(fa.fsdp()), "accumulate": fa.compose(fa.ddp(), fa.accumulate(2))}
    pipeline = pipelines.get(kind)  # None: ddp() on several processes
    loader = DataLoader(Ids(), batch_size=batch_size, shuffle=True)
    # The schedule is sized in updates, which another number of processes keeps; under
    # Accelerate's rule (steps per update = processes) the rate per update would change with them.
    handlers = {
        **state.kwargs_handlers,
        "SchedulerConfiguration": fa.SchedulerConfiguration(step_per_process=False),
    }
    return fa.prepare(
        state.replace(kwargs_handlers=MappingProxyType(handlers)),
        model,
        optimizer,
        loader,
        scheduler,
        pipeline=pipeline,
        loss_fn=loss_fn,
    )


def job(
    state: fa.RunState,
    kind: str,
    batch_size: int,
    *,
    save_to: str | None = None,
    load_from: str | None = None,
    allow: bool = False,
) -> dict[str, Any]:
    """Runs on every rank: train to the end (saving at SAVE_AT, or resuming first) and report
    each step's sample ids on this rank, the full parameters and the generators."""
    state = _prepared(state, kind, batch_size)
    loaded_rng = None
    if load_from is not None:
        state = fa.load(state, load_from, allow_global_batch_change=allow)
        loaded_rng = state.rng.torch.clone()
    ids, saved_rng = [], None
    for batch in fa.batches(state, epochs=EPOCHS):
        state, _ = fa.step(state, batch)
        ids.append(batch[0].tolist())
        if save_to is not None and state.micro_step == SAVE_AT:
            fa.save(state, save_to)
            saved_rng = state.rng.torch.clone()
    params = [
        p.full_tensor() if hasattr(p, "full_tensor") else p for p in unwrap_model(state.model).parameters()
    ]
    return {
        "ids": ids,
        "params": [p.detach().clone() for p in params],
        "saved_rng": saved_rng,
        "loaded_rng": loaded_rng,
        "steps": (state.step, state.epoch),
    }


def global_ids(results: list[dict[str, Any]]) -> list[list[int]]:
    """Each step's global batch: the ranks' batches concatenated in rank order."""
    return [
        functools.reduce(operator.iadd, (r["ids"][k] for r in results), [])
        for k in range(len(results[0]["ids"]))
    ]


def assert_continues(whole: list[dict[str, Any]], resumed: list[dict[str, Any]]) -> None:
    assert global_ids(resumed) == global_ids(whole)[SAVE_AT:]  # the same samples, the same global order
    for r in resumed:
        assert r["steps"] == (EPOCHS * NUM_SAMPLES // GLOBAL_BATCH, EPOCHS)
        for p, q in zip(r["params"], whole[0]["params"], strict=False):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def saved(worlds: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A replicated and an fsdp() run on 2 processes, each saved at SAVE_AT and run to the end."""
    root = tmp_path_factory.mktemp("reshard")
    out = {}
    for kind in ("ddp", "fsdp"):
        path = str(root / kind)
        out[kind] = (path, worlds.get(2).run(job, kind, GLOBAL_BATCH // 2, save_to=path))
    return out


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_two_process_run_resumes_on_four_and_on_one(worlds: Any, saved: dict[str, Any], kind: str) -> None:
    path, whole = saved[kind]
    assert [len(ids) for ids in global_ids(whole)] == [GLOBAL_BATCH] * 12
    # on 4 processes, as ddp() and as fsdp(): DCP reshards an fsdp() checkpoint; a replicated one's whole
    # tensors are sharded into fsdp()
    for as_kind in ("ddp", "fsdp"):
        on_four = worlds.get(4).run(job, as_kind, GLOBAL_BATCH // 4, load_from=path)
        assert_continues(whole, on_four)
        if as_kind == "ddp":  # ranks 0 and 1 continue their own streams; ranks 2 and 3 get derived ones
            assert all(torch.equal(on_four[r]["loaded_rng"], whole[r]["saved_rng"]) for r in (0, 1))
            news = [on_four[r]["loaded_rng"] for r in (2, 3)]
            assert not any(torch.equal(n, w["saved_rng"]) for n in news for w in whole)
            assert not torch.equal(news[0], news[1])
    # on one process, a plain (unwrapped) model
    assert_continues(whole, [job(fa.init(seed=0, cpu=True), "ddp", GLOBAL_BATCH, load_from=path)])


def test_another_global_batch_is_refused_with_the_fix_unless_allowed(saved: dict[str, Any]) -> None:
    path, whole = saved["ddp"]
    state = _prepared(fa.init(seed=0, cpu=True), "ddp", GLOBAL_BATCH // 2)
    with pytest.raises(
        fa.CheckpointError,
        match=r"global batch of 8 samples per step \(4 per process x 2 "
        r"process\(es\)\) but this run reads 4 .* batch_size of 8, .*allow_global_batch_change=True",
    ):
        fa.load(state, path)
    assert not state.is_spent  # refused before anything was touched
    # allowed: the epoch continues from the samples consumed (3 global batches of 8 = 6 of 4)
    resumed = job(fa.init(seed=0, cpu=True), "ddp", GLOBAL_BATCH // 2, load_from=path, allow=True)
    assert functools.reduce(operator.iadd, resumed["ids"], []) == functools.reduce(
        operator.iadd, global_ids(whole)[SAVE_AT:], []
    )
    assert resumed["steps"] == (SAVE_AT + 6, EPOCHS)


def _save_mid_accumulation(state: fa.RunState, path: str) -> None:
    """One process, a global batch of 8, saved between accumulate(2)'s micro-steps."""
    state = _prepared(state, "accumulate", GLOBAL_BATCH)
    for batch in fa.batches(state, epochs=1):
        state, _ = fa.step(state, batch)
        break
    fa.save(state, path)


def _load(state: fa.RunState, path: str) -> None:
    fa.load(_prepared(state, "accumulate", GLOBAL_BATCH // state.dist.num_processes), path)


def test_gradients_between_micro_steps_load_on_the_saving_number_of_processes_only(
    worlds: Any, tmp_path: Any
) -> None:
    path = str(tmp_path / "mid")
    _save_mid_accumulation(fa.init(seed=0, cpu=True), path)
    with pytest.raises(
        fa.CheckpointError, match="between accumulation micro-steps by 1 process.*on 1 process"
    ):
        worlds.get(2).run(_load, path)


def test_a_loader_snapshot_resumes_only_as_it_was_saved(tmp_path: Any) -> None:
    """An iterable dataset's position is each rank's loader snapshot: it does not move to another
    number of processes (the same run resumes as before: tests/data/test_loader.py)."""
    from fnaccel.data.loader import prepare_loader
    from tests.data._data_fns import Stream, stepping, train

    def fresh(num_processes: int) -> fa.RunState:
        loader = DataLoader(Stream(12), batch_size=4 // num_processes)
        return stepping(
            fa.init(seed=0, cpu=True),
            prepare_loader(loader, fa.DistContext(num_processes=num_processes), seed=0),
        )

    state, _ = train(fresh(2), epochs=1, stop_after=1)
    fa.save(state, tmp_path / "mid")
    other = fresh(1)
    with pytest.raises(fa.CheckpointError, match="snapshot of each process's loader .* saved by 2 processes"):
        fa.load(other, tmp_path / "mid")
    assert not other.is_spent


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_size", "4", "batch_size must be an integer >= 1 or null"),
        ("num_processes", 0, "num_processes must be an integer >= 1, got 0"),
        ("num_workers", -1, "num_workers must be an integer >= 0, got -1"),
        ("drop_last", 1, "drop_last must be True or False"),
        ("extra", 1, "unknown key 'extra'"),
    ],
)
def test_a_hostile_data_layout_is_refused_naming_the_field(field: str, value: Any, message: str) -> None:
    layout = _prepared(fa.init(seed=0, cpu=True), "ddp", 4).loader.layout
    with pytest.raises(fa.CheckpointError, match=message):
        layout.check_resume({**layout.to_dict(), field: value}, "rank0.json")


@pytest.mark.parametrize("num_samples", [3, 13, 16])
@pytest.mark.parametrize("even_batches", [True, False])
def test_the_global_batches_depend_on_the_global_batch_size_only(
    num_samples: int, even_batches: bool
) -> None:
    """The ranks' batches of each step, concatenated, are the same on 2, 4 and 8 processes with
    a global batch of 8, padding included; one process (which never pads) reads the same real samples."""
    from fnaccel.data.sampler import ShardedBatchSampler

    def global_batches(num_processes: int) -> tuple[list[list[int]], list[int]]:
        samplers = [
            ShardedBatchSampler(
                num_samples,
                GLOBAL_BATCH // num_processes,
                num_processes=num_processes,
                rank=r,
                seed=3,
                shuffle=True,
                even_batches=even_batches and num_processes > 1,
            )
            for r in range(num_processes)
        ]
        per_rank = [list(s) for s in samplers]
        steps = range(len(samplers[0]))
        return (
            [functools.reduce(operator.iadd, (batches[k] for batches in per_rank), []) for k in steps],
            [sum(s.num_valid(k) for s in samplers) for k in steps],
        )

    two, valid = global_batches(2)
    assert global_batches(4) == global_batches(8) == (two, valid)
    one, _ = global_batches(1)
    assert [batch[:n] for batch, n in zip(two, valid, strict=False)] == one
    assert sorted(functools.reduce(operator.iadd, one, [])) == list(range(num_samples))


def test_the_global_batch_counts_the_ranks_that_split_the_data() -> None:
    from fnaccel.data.config import DataLoaderConfiguration
    from fnaccel.data.loader import prepare_loader

    def layout(**config: Any) -> Any:
        loader = DataLoader(Ids(), batch_size=4, shuffle=True)
        return prepare_loader(
            loader, fa.DistContext(num_processes=2), seed=0, config=DataLoaderConfiguration(**config)
        ).layout

    assert (layout().num_shards, layout().global_batch_size) == (2, 8)
    whole = layout(shard=False)  # every rank reads the whole order: its batch is the global one
    assert (whole.num_processes, whole.num_shards, whole.global_batch_size) == (2, 1, 4)
    assert layout(split_batches=True).global_batch_size == 4
    saved = {**layout().to_dict()}
    assert layout().check_resume(saved, "rank0.json") == layout()
    del saved["num_shards"]  # every layout of this schema records it: one without it was edited
    with pytest.raises(fa.CheckpointError, match="rank0.json: the data layout lacks 'num_shards'"):
        layout().check_resume(saved, "rank0.json")


def test_another_global_batch_maps_the_position_by_the_samples_consumed() -> None:
    from fnaccel.data.loader import prepare_loader

    def loader(batch_size: int) -> Any:
        data = DataLoader(Ids(), batch_size=batch_size, shuffle=True, drop_last=True)
        return prepare_loader(data, fa.DistContext(), seed=0)

    saved = {**loader(32).layout.to_dict(), "batch_size": 8}  # 6 steps an epoch
    at = fa.DataPosition(epoch=1, num_batches=5)  # 40 samples consumed
    assert loader(16).resume_position(saved, at, "r", allow_global_batch_change=True) == fa.DataPosition(
        epoch=1, num_batches=2
    )  # 32 of the 40 counted: 8 read again, none skipped
    # 32 per step with drop_last: the epoch has one batch, [0, 32), all consumed: the next epoch starts
    assert loader(32).resume_position(saved, at, "r", allow_global_batch_change=True) == fa.DataPosition(
        epoch=2
    )
    with pytest.raises(fa.CheckpointError, match="global batch of 8"):
        loader(32).resume_position(saved, at, "r")
    with pytest.raises(fa.CheckpointError, match="6 batches into an epoch of 6"):
        loader(16).resume_position(
            saved, fa.DataPosition(epoch=1, num_batches=6), "r", allow_global_batch_change=True
        )


def test_allow_global_batch_change_must_be_a_bool(saved: dict[str, Any]) -> None:
    state = _prepared(fa.init(seed=0, cpu=True), "ddp", GLOBAL_BATCH)
    with pytest.raises(TypeError, match="allow_global_batch_change must be True or False, got 'yes'"):
        fa.load(state, saved["ddp"][0], allow_global_batch_change="yes")  # type: ignore[arg-type]
    assert not state.is_spent
