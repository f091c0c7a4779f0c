"""notebook_launcher / debug_launcher: real gloo processes, forked, failing fast."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from fnaccel.launchers import ProcessFailedError, debug_launcher, notebook_launcher
from tests.test_train import loss_fn, make_model
from tests.test_train_dist import global_batches, my_part, single_process_reference

FREE_PORT = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0"}  # the agent picks the port
NUM_STEPS = 3


def train(num_steps: int) -> list[torch.Tensor]:
    state = fa.init(cpu=True)
    model = make_model(dropout=0.0)
    state = fa.prepare(
        state, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=loss_fn
    )
    for batch in global_batches(num_steps):
        state, _ = fa.step(state, my_part(batch, state.dist.rank, state.dist.num_processes))
    fa.shutdown(state)
    return [p.detach() for p in model.parameters()]


@pytest.mark.multiprocess
def test_two_processes_train_as_one_process_on_the_whole_batch() -> None:
    # this process runs OpenMP's thread pool first, as a notebook kernel has: the forked workers still compute
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert (torch.ones(512, 512) @ torch.ones(512, 512)).sum() > 0
        expected = single_process_reference(NUM_STEPS)
        results = notebook_launcher(train, (NUM_STEPS,), num_processes=2, **FREE_PORT)
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 2
    for params in results:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(params, expected, strict=False))
    assert _launched_children() == []


def _world_facts(tag: str) -> tuple[str, int, int, str, str]:
    state = fa.init()
    facts = (
        tag,
        state.dist.rank,
        state.dist.num_processes,
        state.dist.backend or "",
        state.mixed_precision.value,
    )
    fa.shutdown(state)
    return facts


@pytest.mark.multiprocess
def test_debug_launcher_runs_cpu_gloo_ranks_and_passes_the_precision() -> None:
    assert debug_launcher(_world_facts, ("x",), num_processes=3) == [
        ("x", r, 3, "gloo", "no") for r in range(3)
    ]
    facts = notebook_launcher(_world_facts, ("y",), num_processes=2, mixed_precision="bf16", **FREE_PORT)
    assert [f[4] for f in facts] == ["bf16", "bf16"]


def _fails_on_rank_one(where: str) -> None:
    state = fa.init(cpu=True)
    if state.dist.rank == 1:
        raise ValueError("rank one gives up")
    if where == "collective":
        fa.ops.reduce(state, torch.ones(1), "sum")  # would wait forever for rank 1
    else:
        time.sleep(600)  # busy elsewhere: ended by the agent's SIGTERM


@pytest.mark.parametrize("where", ["collective", "sleeping"])
@pytest.mark.multiprocess
def test_one_failing_rank_ends_every_rank_within_seconds(where: str) -> None:
    start = time.monotonic()
    with pytest.raises(
        ProcessFailedError, match="rank 1 failed first: ValueError: rank one gives up"
    ) as info:
        debug_launcher(_fails_on_rank_one, (where,), num_processes=2)
    assert time.monotonic() - start < 60  # generous: about 2 s here; the settle barrier alone is 60 s
    assert info.value.rank == 1 and "_fails_on_rank_one" in info.value.traceback
    assert _launched_children() == []


def _exits_hard() -> None:
    state = fa.init(cpu=True)
    if state.dist.rank == 0:
        import os

        os._exit(3)
    time.sleep(600)


@pytest.mark.multiprocess
def test_a_rank_that_dies_without_raising_is_named() -> None:
    with pytest.raises(ProcessFailedError, match="rank 0 failed first: exited with code 3"):
        debug_launcher(_exits_hard)


def test_one_process_runs_here() -> None:
    assert notebook_launcher(_world_facts, ("here",), num_processes=1) == [("here", 0, 1, "", "no")]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_processes": 0}, "num_processes must be an int >= 1, got 0"),
        ({"num_processes": 2, "mixed_precision": "fp12"}, "unknown mixed_precision 'fp12'"),
        ({"num_processes": 2, "rdzv_backend": "etcd"}, "rdzv_backend must be 'static' or 'c10d'"),
        ({"num_processes": 2, "num_nodes": 2, "node_rank": 2}, "node_rank 2 is outside 0..1"),
    ],
)
def test_bad_arguments_say_what_to_do(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        notebook_launcher(_world_facts, ("x",), **kwargs)


NOTEBOOK_CELLS = [
    """import time, torch, fnaccel as fa
from fnaccel.launchers import ProcessFailedError, notebook_launcher""",
    # defined in the notebook itself: a function the workers could not unpickle if spawned
    """def train(num_steps):
    state = fa.init(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    state = fa.prepare(state, model, torch.optim.SGD(model.parameters(), lr=0.1),
                       loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    g = torch.Generator().manual_seed(state.dist.rank)
    for _ in range(num_steps):
        state, metrics = fa.step(state, (torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)))
    fa.shutdown(state)
    return [p.detach() for p in model.parameters()]""",
    """results = notebook_launcher(train, (3,), num_processes=2, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0")
assert len(results) == 2 and all(torch.equal(a, b) for a, b in zip(*results))
print("trained", results[0][1].item())""",
    """def breaks():
    state = fa.init(cpu=True)
    if state.dist.rank == 1:
        raise RuntimeError("lost the data")
    fa.ops.reduce(state, torch.ones(1), "sum")""",
    """start = time.monotonic()
try:
    notebook_launcher(breaks, num_processes=2, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0")
except ProcessFailedError as error:
    print("failed rank", error.rank, error.reason, "after", time.monotonic() - start < 60)""",
]


@pytest.mark.multiprocess  # the notebook's kernel starts the group: the guard cannot see it
def test_a_real_notebook_trains_two_processes_and_fails_fast(tmp_path: Path) -> None:
    nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the test extra)")
    nbclient = pytest.importorskip("nbclient", reason="needs nbclient (the test extra)")
    pytest.importorskip("ipykernel", reason="needs ipykernel (the test extra) for a Python kernel")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOK_CELLS])
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    outputs = [
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
        for cell in notebook.cells
    ]
    assert outputs[2].startswith("trained ")
    assert outputs[4] == "failed rank 1 RuntimeError: lost the data after True\n"


def _launched_children() -> list[multiprocessing.process.BaseProcess]:
    """This process's children other than the session's test worlds (tests/conftest.py)."""
    return [p for p in multiprocessing.active_children() if not p.name.startswith("fnaccel-world-")]
