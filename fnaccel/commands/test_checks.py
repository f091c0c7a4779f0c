"""The checks of ``fnaccel test`` (run by `fnaccel.commands.test_script`), one function each.

A check takes the run's `RunState`, runs on every rank, and returns a detail
for the report; it raises `CheckFailed` on a wrong result, `CheckSkipped` when
it does not apply to this launch. `CHECKS` lists them in the order they run:
the process group, each collective, the data loader's sharding, training steps
through `fa.step` against a hand-written PyTorch loop, three resumes within an
epoch that must be bit for bit, a resume on one process and back (equal within
float tolerance), and mixed precision when the launch configures it.
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import fnaccel as fa
from fnaccel.checkpoint.project import ProjectConfiguration
from fnaccel.constants import PrecisionType
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.testing import verify_resume

__all__ = [
    "CHECKS",
    "SEED",
    "Check",
    "CheckFailed",
    "CheckSkipped",
    "check_broadcast",
    "check_broadcast_object_list",
    "check_data_loader",
    "check_gather",
    "check_gather_object",
    "check_mixed_precision",
    "check_pad_across_processes",
    "check_process_group",
    "check_reduce",
    "check_repeated_resumes",
    "check_resume_world_size",
    "check_training",
    "kwargs_handlers",
]

SEED = 0
NUM_STEPS = 4
BATCH_SIZE = 4  # per process: any number of processes divides the global batch
# Long enough for a loaded machine; short enough that a rank left waiting in a
# collective that a failed rank never joined gives up instead of hanging.
COLLECTIVE_TIMEOUT = timedelta(seconds=180)


class CheckFailed(Exception):
    """A check saw a wrong result; the message says what it expected."""


class CheckSkipped(Exception):
    """A check does not apply to this launch; the message says how to enable it."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual = actual.cpu()
    _require(
        actual.shape == expected.shape and torch.equal(actual, expected),
        f"{what}: got {actual.tolist()}, expected {expected.tolist()}",
    )


def kwargs_handlers(project: ProjectConfiguration | None = None) -> tuple[KwargsHandler, ...]:
    """The ``kwargs_handlers`` of every run the check makes: a collective timeout, and ``project``."""
    timeout = fa.InitProcessGroupKwargs(timeout=COLLECTIVE_TIMEOUT)
    return (timeout,) if project is None else (timeout, project)


def _fresh_run(
    state: fa.RunState, project: ProjectConfiguration | None = None, mixed_precision: str | None = "no"
) -> fa.RunState:
    """A new run beside ``state`` on the same device, in fp32 unless told otherwise."""
    return fa.init(
        seed=SEED,
        cpu=state.dist.device.type == "cpu",
        mixed_precision=mixed_precision,
        kwargs_handlers=kwargs_handlers(project),
    )


# ---- the process group and the collectives -------------------------------------------------


def check_process_group(state: fa.RunState) -> str:
    """Every rank is present once and an all-reduce adds up."""
    ctx = state.dist
    ranks = fa.ops.gather_object(state, [ctx.rank])
    _require(ranks == list(range(ctx.num_processes)), f"the ranks reported are {ranks}")
    total = fa.ops.reduce(state, torch.ones((), device=ctx.device), "sum").item()
    _require(total == ctx.num_processes, f"an all-reduce of ones gave {total}")
    if ctx.num_processes == 1:
        return f"1 process, no process group needed, device {ctx.device.type}"
    return (
        f"{ctx.num_processes} processes on {ctx.num_nodes} machine(s), backend {ctx.backend}, "
        f"device {ctx.device.type}"
    )


def check_gather(state: fa.RunState) -> str:
    ctx = state.dist
    rank, n = ctx.rank, ctx.num_processes
    tree = {
        "vector": torch.tensor([rank, rank + 0.5], device=ctx.device),
        "scalar": torch.tensor(float(rank), device=ctx.device),
    }
    out = fa.ops.gather(state, tree)
    _same(out["vector"], torch.tensor([v for k in range(n) for v in (k, k + 0.5)]), "a vector per rank")
    _same(out["scalar"], torch.arange(n, dtype=torch.float32), "a 0-d tensor per rank")
    return ""


def check_reduce(state: fa.RunState) -> str:
    ctx = state.dist
    n = ctx.num_processes
    value = torch.tensor([1.0, 2.0], device=ctx.device) * (ctx.rank + 1)
    total = n * (n + 1) / 2
    _same(fa.ops.reduce(state, value, "sum"), torch.tensor([total, 2 * total]), "sum")
    _same(fa.ops.reduce(state, value, "mean"), torch.tensor([total, 2 * total]) / n, "mean")
    count = fa.ops.reduce(state, torch.tensor([1], device=ctx.device), "sum")
    _same(count, torch.tensor([n]), "sum of integers")
    return ""


def check_broadcast(state: fa.RunState) -> str:
    ctx = state.dist
    source = ctx.num_processes - 1  # the last rank: a source other than 0 when there are several
    out = fa.ops.broadcast(state, torch.full((3,), float(ctx.rank), device=ctx.device), from_process=source)
    _same(out, torch.full((3,), float(source)), f"from rank {source}")
    return ""


def check_pad_across_processes(state: fa.RunState) -> str:
    ctx = state.dist
    rank, n = ctx.rank, ctx.num_processes
    mine = torch.full((rank + 1, 2), float(rank), device=ctx.device)  # a different length per rank
    padded = fa.ops.pad_across_processes(state, mine, dim=0, pad_index=-1)
    expected = torch.full((n, 2), -1.0)
    expected[: rank + 1] = rank
    _same(padded, expected, "padded to the longest rank")
    everyone = fa.ops.gather(state, padded)
    _require(
        tuple(everyone.shape) == (n * n, 2), f"gathering the padded tensors gave {tuple(everyone.shape)}"
    )
    return ""


def check_gather_object(state: fa.RunState) -> str:
    rank, n = state.dist.rank, state.dist.num_processes
    out = fa.ops.gather_object(state, [f"rank {rank}", {"rank": rank}])
    expected = [item for k in range(n) for item in (f"rank {k}", {"rank": k})]
    _require(out == expected, f"got {out}, expected {expected}")
    return ""


def check_broadcast_object_list(state: fa.RunState) -> str:
    rank, source = state.dist.rank, state.dist.num_processes - 1
    out = fa.ops.broadcast_object_list(state, [{"from": rank}, f"rank {rank}"], from_process=source)
    expected = [{"from": source}, f"rank {source}"]
    _require(out == expected, f"got {out}, expected {expected}")
    return ""


# ---- training --------------------------------------------------------------------------------


def _model(dropout: bool = True) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):  # the same weights on every rank, the process RNG untouched
        torch.manual_seed(SEED)
        return nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1 if dropout else 0.0), nn.Linear(32, 4)
        )


def _fp8_model() -> nn.Sequential:
    """`_model` with a middle layer whose dims (multiples of 16) float8 can train."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return nn.Sequential(
            nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)
        )


def _loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _data(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(num_samples, 8, generator=generator)
    return x, torch.randint(0, 4, (num_samples,), generator=generator)


def _my_batches(ctx: fa.DistContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of each global batch, on its device."""
    x, y = _data(NUM_STEPS * BATCH_SIZE * ctx.num_processes)
    for step in range(NUM_STEPS):
        start = (step * ctx.num_processes + ctx.rank) * BATCH_SIZE
        yield x[start : start + BATCH_SIZE].to(ctx.device), y[start : start + BATCH_SIZE].to(ctx.device)


def _pipeline(ctx: fa.DistContext) -> fa.Pipeline:
    return fa.compose(fa.ddp()) if ctx.num_processes > 1 else fa.compose()


def _hand_written_loop(model: nn.Module, ctx: fa.DistContext) -> list[float]:
    """What a user would write with PyTorch alone, DDP over the default group included."""
    model = model.to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if ctx.num_processes > 1:
        model = DistributedDataParallel(model, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    losses = []
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        torch.manual_seed(SEED)  # the generators fa.init(seed=SEED) gives the run
        for batch in _my_batches(ctx):
            loss = _loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def check_training(state: fa.RunState) -> str:
    """`fa.step` against the hand-written loop: same losses, same parameters."""
    ctx = state.dist
    model = _model()
    reference = copy.deepcopy(model)
    run = _fresh_run(state)
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run = fa.prepare(run, model, optimizer, loss_fn=_loss, pipeline=_pipeline(ctx))
        losses = []
        for batch in _my_batches(ctx):
            run, metrics = fa.step(run, batch)
            losses.append(metrics["loss"].item())
        _require(run.step == NUM_STEPS, f"state.step is {run.step} after {NUM_STEPS} steps")
    finally:
        fa.shutdown(run)
    expected = _hand_written_loop(reference, ctx)
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    if losses == expected and all(torch.equal(p, q) for p, q in pairs):
        return f"{NUM_STEPS} steps, parameters bit-identical to plain PyTorch"
    worst = max((p - q).abs().max().item() for p, q in pairs)
    # Summation order may differ between two all-reduce bucketings (3+ ranks): equal within float32.
    close = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in pairs) and all(
        math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6) for a, b in zip(losses, expected, strict=True)
    )
    _require(
        close,
        f"after {NUM_STEPS} steps the parameters differ from plain PyTorch by up to {worst:.3g} "
        f"(losses {losses} vs {expected})",
    )
    return f"{NUM_STEPS} steps, parameters equal to plain PyTorch within {worst:.1g}"


def check_data_loader(state: fa.RunState) -> str:
    """The prepared loader gives every sample to exactly one rank, once per epoch."""
    ctx = state.dist
    num_samples = 3 * BATCH_SIZE * ctx.num_processes
    loader = DataLoader(TensorDataset(torch.arange(num_samples)), batch_size=BATCH_SIZE, shuffle=True)
    run = fa.prepare(_fresh_run(state), loader=loader)
    try:
        seen = [b[0].tolist() for b in fa.batches(run, epochs=1)]
    finally:
        fa.shutdown(run)
    _require(
        [len(b) for b in seen] == [BATCH_SIZE] * 3,
        f"rank {ctx.rank} got batches of sizes {[len(b) for b in seen]}, expected 3 of {BATCH_SIZE}",
    )
    everyone = sorted(i for b in fa.ops.gather_object(state, seen) for i in b)
    _require(
        everyone == list(range(num_samples)),
        "one epoch did not give each sample to exactly one rank exactly once",
    )
    return f"{num_samples} samples shuffled and sharded over {ctx.num_processes} process(es)"


# ---- checkpoints -----------------------------------------------------------------------------


def _checkpoint_root(state: fa.RunState) -> Path:
    """A fresh directory: made by each machine's first process, its name gathered by the others
    (machines may not share a filesystem, so each writes its own: save_on_each_node)."""
    ctx = state.dist
    made = tempfile.mkdtemp(prefix="fnaccel-test-") if ctx.is_local_main_process else None
    everyone = fa.ops.gather_object(state, [(ctx.node_rank, made)])
    return Path(next(path for node, path in everyone if node == ctx.node_rank and path is not None))


def _verify_resume(state: fa.RunState, make_state: Callable[[], fa.RunState], **options: Any) -> None:
    """`fnaccel.testing.verify_resume` in a fresh directory on each machine; a difference fails the check."""
    root = _checkpoint_root(state)
    try:
        verify_resume(make_state, directory=root / "checkpoints", **options)
    except AssertionError as exc:
        raise CheckFailed(str(exc)) from None
    finally:
        fa.wait_for_everyone(state)  # nobody still reads the files
        if state.dist.is_local_main_process:
            shutil.rmtree(root, ignore_errors=True)


def check_repeated_resumes(state: fa.RunState) -> str:
    """`fnaccel.testing.verify_resume` with 3 resumes in one epoch of 8 batches, under accumulate(3):
    every batch read, every loss and the whole final state equal the uninterrupted run's, bit for bit."""
    ctx = state.dist
    project = ProjectConfiguration(save_on_each_node=ctx.num_nodes > 1)

    def make_state() -> fa.RunState:
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        loader = DataLoader(
            TensorDataset(*_data(8 * BATCH_SIZE * ctx.num_processes)), batch_size=BATCH_SIZE, shuffle=True
        )  # 8 batches an epoch on each rank
        pipeline = fa.compose(_pipeline(ctx), fa.accumulate(3))
        return fa.prepare(
            _fresh_run(state, project), model, optimizer, loader, scheduler, loss_fn=_loss, pipeline=pipeline
        )

    _verify_resume(state, make_state, steps=2, resumes=3)
    return (
        "saved at batches 2, 4 and 6 of an epoch of 8 under accumulate(3) (twice between micro-steps), "
        "each loaded into a fresh run: every batch and the final state identical bit for bit"
    )


def check_resume_world_size(state: fa.RunState) -> str:
    """`verify_resume` on another number of processes: N processes, rank 0 alone, N again (DESIGN
    principle 5): the same global batches, the losses and final state equal within float tolerance."""
    ctx = state.dist
    n = ctx.num_processes
    if n == 1:
        raise CheckSkipped(
            "one process; launch with --num_processes 2 or more to check a resume on another "
            "number of processes"
        )
    if ctx.num_nodes > 1:
        raise CheckSkipped(
            "several machines: the one-process part would save on the first machine only; "
            "run fnaccel test on one machine with several processes to check it"
        )
    global_batch = BATCH_SIZE * n

    def make_state() -> fa.RunState:
        # a schedule sized in updates: Accelerate's rule steps it once per process, so another number of
        # processes would step it another number of times (docs/training.md)
        run = fa.init(
            seed=SEED,
            cpu=ctx.device.type == "cpu",
            mixed_precision="no",
            kwargs_handlers=(*kwargs_handlers(), fa.SchedulerConfiguration(step_per_process=False)),
        )
        model = _model(dropout=False)  # a rank's dropout stream has no counterpart on another world size
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        loader = DataLoader(
            TensorDataset(*_data(6 * global_batch)),
            batch_size=global_batch // run.dist.num_processes,
            shuffle=True,
        )
        pipeline = fa.compose(_pipeline(run.dist), fa.accumulate(2))
        return fa.prepare(run, model, optimizer, loader, scheduler, loss_fn=_loss, pipeline=pipeline)

    atol, rtol = 1e-5, 1e-4
    _verify_resume(state, make_state, steps=2, resumes=2, num_processes=(1, n), atol=atol, rtol=rtol)
    return (
        f"{n} processes, resumed on 1, then on {n} under accumulate(2): the same global batches, the losses "
        f"and final state equal within atol={atol:g}, rtol={rtol:g}"
    )


# ---- mixed precision -------------------------------------------------------------------------


def check_mixed_precision(state: fa.RunState) -> str:
    """The launch's precision: the default pipeline autocasts, training stays finite."""
    precision = state.mixed_precision
    if precision == PrecisionType.NO:
        raise CheckSkipped("not configured; launch with --mixed_precision fp16, bf16 or fp8 to check it")
    ctx = state.dist
    fp8 = precision == PrecisionType.FP8
    model = _fp8_model() if fp8 else _model()
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    before = [p.detach().clone() for p in model.parameters()]
    run = _fresh_run(state, mixed_precision=None)  # None: the launch's precision
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        run = fa.prepare(run, model, optimizer, loss_fn=_loss)  # the default pipeline follows the launch
        losses, scales = [], []
        for batch in _my_batches(ctx):
            run, metrics = fa.step(run, batch)
            losses.append(metrics["loss"].item())
            scales.append(metrics.get("scale"))
        pipeline = repr(run.pipeline)
    finally:
        fa.shutdown(run)
    low = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}[precision.value]
    if fp8:  # the first and last layers stay in bf16, as torchao recommends; the middle one is float8
        _require(
            any(type(m).__name__ == "Float8Linear" for m in model.modules()),
            f"no layer trains in float8 (pipeline {pipeline})",
        )
    _require(
        bool(dtypes) and all(d == low for d in dtypes),
        f"the first layer computed in {sorted(set(map(str, dtypes)))}, expected {low} (pipeline {pipeline})",
    )
    _require(all(math.isfinite(v) for v in losses), f"non-finite losses {losses}")
    _require(all(torch.isfinite(p).all().item() for p in model.parameters()), "non-finite parameters")
    _require(
        any(not torch.equal(p.cpu(), q) for p, q in zip(model.parameters(), before, strict=True)),
        "the parameters did not change",
    )
    if precision == PrecisionType.FP16:
        _require(all(s is not None for s in scales), "fp16 steps report no loss scale (no grad scaler)")
    kind = "float8 and bf16" if fp8 else str(low)
    return f"{pipeline} on {ctx.device.type}: the model computes in {kind}, {NUM_STEPS} finite steps"


# ---- the list --------------------------------------------------------------------------------

Check = Callable[[fa.RunState], str]

CHECKS: tuple[tuple[str, Check], ...] = (
    ("process group", check_process_group),
    ("gather", check_gather),
    ("reduce", check_reduce),
    ("broadcast", check_broadcast),
    ("pad_across_processes", check_pad_across_processes),
    ("gather_object", check_gather_object),
    ("broadcast_object_list", check_broadcast_object_list),
    ("data loader sharding", check_data_loader),
    ("training vs PyTorch", check_training),
    ("resume x3 in an epoch", check_repeated_resumes),
    ("resume on 1 process", check_resume_world_size),
    ("mixed precision", check_mixed_precision),
)
