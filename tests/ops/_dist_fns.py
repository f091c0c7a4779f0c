"""Shared tree types, a strict tree comparison, and the functions gloo workers run.

`fnaccel.testing.World` workers unpickle each function by its module name,
``tests.ops._dist_fns``: pyproject's ``pythonpath = ["."]`` puts the
repository root on ``sys.path``, which spawned workers inherit.

Every worker function takes the run state first (``world.run(fn, ...)``) and
builds its inputs from ``rank`` and ``num_processes`` alone, so the test can
compute every rank's expected result by hand.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch

import fnaccel as fa
from fnaccel.data.sharding import eval_shards

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "bool": torch.bool,
    "complex64": torch.complex64,
}


class Pair(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass
class Box:
    value: Any
    extra: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenBox:
    value: Any


def assert_tree_equal(actual: Any, expected: Any, path: str = "tree", *, exact: bool = True) -> None:
    """Same container types (exactly), keys, lengths, dtypes, devices, shapes and values
    (equal, or within `torch.testing.assert_close`'s tolerances unless ``exact``)."""
    assert type(actual) is type(expected), (
        f"{path}: got a {type(actual).__name__}, expected a {type(expected).__name__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, f"{path}: device {actual.device} != {expected.device}"
        assert actual.shape == expected.shape, f"{path}: shape {actual.shape} != {expected.shape}"
        if expected.device.type == "meta":
            return
        if exact:
            assert torch.equal(actual, expected), f"{path}: {actual} != {expected}"
        else:
            torch.testing.assert_close(actual, expected, msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, Mapping):
        assert list(actual) == list(expected), f"{path}: keys {list(actual)} != {list(expected)}"
        if isinstance(expected, defaultdict):
            assert actual.default_factory is expected.default_factory, f"{path}: default_factory"
        for key in expected:
            assert_tree_equal(actual[key], expected[key], f"{path}[{key!r}]", exact=exact)
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
            assert_tree_equal(a, e, f"{path}[{i}]", exact=exact)
    elif dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            assert_tree_equal(
                getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}", exact=exact
            )
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def leaf(rank: int, shape: tuple[int, ...], dtype: torch.dtype, *, transpose: bool = False) -> torch.Tensor:
    """A tensor whose values depend on ``rank`` (exact in every dtype for small worlds).

    ``transpose`` returns the transpose of a tensor of ``shape``: a non-contiguous leaf.
    """
    base = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape) + 10 * rank
    if dtype == torch.bool:
        value = (base + rank) % 3 == 0
    elif dtype == torch.complex64:
        value = torch.complex(base.float(), -base.float())
    else:
        value = base.to(dtype)
    return value.T if transpose else value


Make = Callable[..., torch.Tensor]  # make(shape, dtype, transpose=False) -> tensor


def mixed_tree(make: Make) -> dict[str, Any]:
    """A nested tree of every dtype, with a 0-d leaf, empty leaves and a transposed leaf.

    ``make`` builds each leaf; calling it with one rank's `leaf` gives that rank's
    input, calling it with a function of all ranks' leaves gives an expected result.
    """
    return {
        "f32": make((2, 3), torch.float32),
        "transposed": make((3, 2), torch.float32, transpose=True),
        "pair": Pair(
            x=make((), torch.int64),
            y=[make((1, 2), torch.float16), make((0, 4), torch.bfloat16)],
        ),
        "box": Box(
            value=make((3,), torch.bool),
            extra=(make((2,), torch.complex64), make((2, 0), torch.int64)),
        ),
        "frozen": FrozenBox(value=make((1, 2), torch.bfloat16)),
    }


def float_tree(make: Make, with_int: bool) -> dict[str, Any]:
    """A nested tree `reduce` accepts: floating and complex leaves, and an integer
    leaf (summed, or kept, never scaled) when ``with_int``."""
    tree: dict[str, Any] = {
        "f32": make((2, 3), torch.float32),
        "transposed": make((3, 2), torch.float32, transpose=True),
        "pair": Pair(x=make((), torch.float32), y=[make((2,), torch.float16), make((2,), torch.bfloat16)]),
        "frozen": FrozenBox(value=make((2,), torch.complex64)),
        "empty": make((0, 2), torch.float32),
    }
    if with_int:
        tree["int"] = make((2,), torch.int64)
    return tree


def rank_leaf(rank: int) -> Make:
    return lambda shape, dtype, transpose=False: leaf(rank, shape, dtype, transpose=transpose)


def ragged_tree(rank: int, num_processes: int, make: Callable[..., torch.Tensor] = leaf) -> Any:
    """A tree for padding: leaves whose sizes differ by rank in every dimension
    (largest on the last rank for some, on rank 0 for others), a 1-d leaf, a 0-d
    leaf, a bool leaf and an empty one. ``make(rank, shape, dtype)``."""
    n = num_processes
    return {
        "a": make(rank, (rank + 1, n - rank), torch.float32),
        "pair": Pair(
            x=make(rank, (2, rank + 2), torch.int64),
            y=[make(rank, (n + rank,), torch.float32)],
        ),
        "mask": Box(value=make(rank, (n - rank, rank + 1), torch.bool), extra=make(rank, (), torch.float16)),
        "frozen": FrozenBox(value=make(rank, (1, rank), torch.bfloat16)),
        "complex": make(rank, (1, 2), torch.complex64),
    }


# --------------------------------------------------------------------- collectives


def gather_mixed(state: Any) -> tuple[list[Any], Any]:
    """Three gathers of one tree: the first checks in full, the repeated ones carry
    their check in the smallest leaf's bytes."""
    rank = state.dist.rank
    tree = mixed_tree(rank_leaf(rank))
    return [fa.ops.gather(state, tree) for _ in range(3)], tree


def tiny_tree(make: Make) -> dict[str, Any]:
    """Leaves all under 16 bytes (a repeated gather's flag then follows the smallest
    one, here not the first): a 0-d int64, a bool triple, an empty float leaf."""
    return {"n": make((), torch.int64), "mask": make((3,), torch.bool), "none": make((0,), torch.float32)}


def gather_tiny(state: Any) -> list[Any]:
    return [fa.ops.gather(state, tiny_tree(rank_leaf(state.dist.rank))) for _ in range(3)]


def marked_bytes(rank: int) -> torch.Tensor:
    """32 bytes that begin with the mark a rank whose gather differs sends."""
    from fnaccel.ops._shapes import MARK

    return torch.frombuffer(bytearray(MARK + bytes([rank]) * 16), dtype=torch.uint8)


def gather_marked_data(state: Any) -> list[torch.Tensor]:
    """Repeated gathers of data that begins with the mark: a false alarm each time."""
    value = marked_bytes(state.dist.rank)
    return [fa.ops.gather(state, value) for _ in range(3)]


def reduce_non_finite_data(state: Any) -> dict[str, list[Any]]:
    """Repeated reduces whose data's first element is inf or NaN (a false alarm of
    the flag a differing rank sends), and repeated reduces of integers only (whose
    flag needs a collective of its own)."""
    rank = state.dist.rank
    out: dict[str, list[Any]] = {}
    for reduction in ("sum", "max", "min"):
        value = {
            "x": torch.tensor([math.inf if rank == 0 else 1.0, 2.0 + rank]),
            "nan": torch.tensor([math.nan, 1.0]),
        }
        out[reduction] = [fa.ops.reduce(state, value, reduction) for _ in range(3)]
    out["ints"] = [fa.ops.reduce(state, torch.tensor([rank, 1]), "sum") for _ in range(3)]
    return out


def broadcast_mixed(state: Any, from_process: int) -> tuple[Any, Any]:
    rank = state.dist.rank
    tree = mixed_tree(rank_leaf(rank))
    return fa.ops.broadcast(state, tree, from_process=from_process), tree


def per_dtype(state: Any) -> dict[str, Any]:
    """For each dtype: gather of a (2, 3) and a 0-d tensor, broadcast from the last rank."""
    rank, last = state.dist.rank, state.dist.num_processes - 1
    out = {}
    for name, dtype in DTYPES.items():
        matrix, scalar = leaf(rank, (2, 3), dtype), leaf(rank, (), dtype)
        assert_tree_equal(
            fa.ops.gather(state, matrix), fa.ops.gather(state, matrix)
        )  # checked, then repeated
        out[name] = (
            fa.ops.gather(state, matrix),
            fa.ops.gather(state, scalar),
            fa.ops.broadcast(state, matrix, from_process=last),
            fa.ops.broadcast(state, scalar, from_process=last),
        )
    return out


def reduce_floats(state: Any, reduction: str, scale: float) -> tuple[Any, Any]:
    tree = float_tree(rank_leaf(state.dist.rank), with_int=reduction != "mean" and scale == 1.0)
    return fa.ops.reduce(state, tree, reduction, scale=scale), tree  # type: ignore[arg-type]


def objects(state: Any) -> dict[str, Any]:
    """gather_object of ragged lists, broadcast_object_list from rank 0 and the last rank."""
    rank, last = state.dist.rank, state.dist.num_processes - 1
    mine = [f"r{rank}-{i}" for i in range(rank + 1)] + [{"rank": rank}]
    offered = [rank, f"from {rank}", {"nested": (rank,)}]
    return {
        "gathered": fa.ops.gather_object(state, mine),
        "from_first": fa.ops.broadcast_object_list(state, offered, from_process=0),
        "from_last": fa.ops.broadcast_object_list(state, offered, from_process=last),
        "offered_after": offered,
    }


def pad_ragged(state: Any, dim: int, pad_index: int, pad_first: bool) -> tuple[Any, Any]:
    rank, n = state.dist.rank, state.dist.num_processes
    tree = ragged_tree(rank, n)
    padded = fa.ops.pad_across_processes(state, tree, dim=dim, pad_index=pad_index, pad_first=pad_first)
    return padded, tree


def composed(state: Any) -> dict[str, Any]:
    """The collectives as transforms, on rank-dependent inputs."""
    rank, n = state.dist.rank, state.dist.num_processes
    labels = {
        "labels": leaf(rank, (2, rank + 1), torch.int64),
        "extra": Pair(x=leaf(rank, (1, n - rank), torch.bool), y=leaf(rank, (), torch.float32)),
    }
    collect = fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    return {
        "pad_gather": collect(state, labels),
        "sum": fa.reduce("sum")(state, {"x": leaf(rank, (2,), torch.float32)}),
        "mean_scaled": fa.reduce("mean", scale=2.0)(state, [leaf(rank, (2,), torch.float32)]),
        "broadcast_first": fa.broadcast(0)(state, FrozenBox(value=leaf(rank, (3,), torch.float32))),
        "broadcast_last": fa.broadcast(n - 1)(state, (leaf(rank, (3,), torch.int64),)),
        "metrics": fa.gather_for_metrics()(state, leaf(rank, (3, 2), torch.int64), num_valid=rank % 3),
        "objects": fa.gather_object()(state, [rank] * (rank + 1)),
        "object_list": fa.broadcast_object_list(n - 1)(state, [rank, "x"]),
        "labels_after": labels,
    }


def pad_then_gather_other_dim_differs(state: Any) -> Any:
    rank = state.dist.rank
    collect = fa.compose(fa.pad_across_processes(dim=1), fa.gather())
    return collect(state, {"x": torch.zeros(rank + 1, rank + 2)})


def pad_mismatched(state: Any, kind: str) -> Any:
    """Trees that differ by rank beyond sizes (no debug mode needed to catch it)."""
    rank = state.dist.rank
    if kind == "leaves":
        tree: Any = [torch.zeros(2) for _ in range(rank + 1)]
    elif kind == "dtype":
        tree = {"x": torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.float64)}
    else:  # ndim
        tree = {"x": torch.zeros((2,) * (rank + 1))}
    return fa.ops.pad_across_processes(state, tree)


def debug_mismatch(state: Any, op: str, same_ndim: bool) -> tuple[str, float, torch.Tensor]:
    """An op on shapes that differ by rank, in debug mode: returns the error message,
    how long the op took to fail, and a gather run afterwards on the same group."""
    ctx = dataclasses.replace(state.dist, debug=True)
    rank = ctx.rank
    x = torch.zeros(2 + rank, 3) if same_ndim else torch.zeros((2,) * (rank + 1))
    start = time.perf_counter()
    try:
        if op == "gather":
            fa.ops.gather(ctx, {"x": x})
        elif op == "reduce":
            fa.ops.reduce(ctx, {"x": x}, "sum")
        else:
            fa.ops.broadcast(ctx, {"x": x})
    except fa.CollectiveMismatchError as exc:
        message = str(exc)
    else:
        message = "no error"
    elapsed = time.perf_counter() - start
    return message, elapsed, fa.ops.gather(ctx, torch.tensor([rank]))


def debug_matching(state: Any) -> tuple[Any, Any, Any]:
    """Debug mode on matching shapes: the checks pass and the results are the usual ones."""
    ctx = dataclasses.replace(state.dist, debug=True)
    x = leaf(ctx.rank, (2, 3), torch.float32)
    return (
        fa.ops.gather(ctx, {"x": x}),
        fa.ops.reduce(ctx, {"x": x}, "sum"),
        fa.ops.broadcast(ctx, {"x": x}, from_process=ctx.num_processes - 1),
    )


def gather_with_str_leaf(state: Any) -> Any:
    return fa.ops.gather(state, {"x": torch.ones(1), "name": "a string"})


def gather_rank(state: Any) -> torch.Tensor:
    return fa.ops.gather(state, torch.tensor([state.dist.rank]))


# --------------------------------------------------------------------- metrics


def model_outputs(indices: tuple[int, ...]) -> dict[str, Any]:
    """What a model returns for the samples ``indices``: per-sample rows."""
    return {
        "pred": torch.tensor(indices, dtype=torch.int64) * 10,
        "nested": [torch.tensor(indices, dtype=torch.float64)[:, None].expand(-1, 3)],
    }


def evaluate(
    state: Any, num_samples: int, batch_size: int, even_batches: bool, as_transform: bool = False
) -> list[Any]:
    """An evaluation loop over `eval_shards`: each step's gathered outputs, in order."""
    rank, n = state.dist.rank, state.dist.num_processes
    collect = fa.gather_for_metrics() if as_transform else None
    gathered = []
    for shard in eval_shards(num_samples, batch_size, n, rank, even_batches=even_batches):
        outputs = model_outputs(shard.indices)
        num_valid = shard.num_valid if even_batches else None
        if collect is not None:
            gathered.append(collect(state, outputs, num_valid=num_valid))
        else:
            gathered.append(fa.ops.gather_for_metrics(state, outputs, num_valid=num_valid))
    return gathered


def evaluate_objects(
    state: Any, num_samples: int, batch_size: int, even_batches: bool, use_gather_object: bool
) -> list[Any]:
    """Like `evaluate`, with per-sample strings: the gathered samples, in order."""
    rank, n = state.dist.rank, state.dist.num_processes
    gathered: list[Any] = []
    for shard in eval_shards(num_samples, batch_size, n, rank, even_batches=even_batches):
        texts = [f"sample-{i}" for i in shard.indices]
        gathered.extend(
            fa.ops.gather_for_metrics(
                state,
                texts,
                use_gather_object=use_gather_object,
                num_valid=shard.num_valid if even_batches else None,
            )
        )
    return gathered


def metrics_trailing_mismatch(state: Any) -> Any:
    return fa.ops.gather_for_metrics(state, {"x": torch.zeros(2, state.dist.rank + 1)})


def metrics_reduced(state: Any) -> Any:
    return fa.ops.gather_for_metrics(state, {"loss": torch.tensor(1.0)})


def metrics_ragged_rows(state: Any) -> Any:
    """Ranks with different sample counts (zero on rank 0), no num_valid."""
    rank = state.dist.rank
    rows = torch.arange(rank * 2, dtype=torch.int64)[:, None] + 100 * rank
    return fa.ops.gather_for_metrics(state, Pair(x=rows, y=rows.bool()))


def metrics_one_rank_rejects(state: Any, kind: str) -> tuple[str, str, float]:
    """Only the last rank passes bad input; every rank must raise, none may wait."""
    import time

    bad = state.dist.is_last_process
    outputs = torch.arange(4.0)
    kwargs: dict[str, Any] = {}
    if bad and kind == "reduced":
        outputs = outputs.sum()
    if bad and kind == "num_valid":
        kwargs["num_valid"] = 9
    started = time.monotonic()
    try:
        fa.ops.gather_for_metrics(state, outputs, **kwargs)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "none", "", time.monotonic() - started


# --------------------------------------------------------------------- mismatches in every mode


def mismatched_input(rank: int, kind: str) -> Any:
    """Rank 0's and the other ranks' trees differ in exactly one way."""
    first = rank == 0
    if kind == "dtype":  # same bytes: gloo would move them and reinterpret the bits
        return {"x": torch.arange(4, dtype=torch.float32 if first else torch.int32)}
    if kind == "keys":
        return {"a" if first else "b": torch.arange(4.0)}
    if kind == "ndim":  # same element count
        return {"x": torch.arange(4.0) if first else torch.arange(4.0).reshape(2, 2)}
    if kind == "length":
        return {"x": torch.arange(3.0 if first else 4.0)}
    raise ValueError(kind)


def _call(ctx: Any, op: str, tree: Any) -> Any:
    if op == "gather":
        return fa.ops.gather(ctx, tree)
    if op == "reduce":
        return fa.ops.reduce(ctx, tree, "sum")
    if op == "reduce_max":
        return fa.ops.reduce(ctx, tree, "max")
    if op == "reduce_min":
        return fa.ops.reduce(ctx, tree, "min")
    if op == "broadcast":
        return fa.ops.broadcast(ctx, tree)
    raise ValueError(op)


def mismatch_everywhere(
    state: Any, op: str, kind: str, debug: bool, agreed_first: str | None = None
) -> tuple[str, str, Any]:
    """``op`` on a tree that differs by rank: what this rank raised, and a gather of
    the ranks afterwards (the group still works). With ``agreed_first``, every rank
    first makes that call twice with rank 0's tree, so the group has an agreed
    call: rank 0's mismatching call is then like it (``agreed_first == op``), or
    no rank's is (another op), and the check travels beside the data."""
    ctx = dataclasses.replace(state.dist, debug=debug)
    tree = mismatched_input(ctx.rank, kind)
    if agreed_first is not None:
        for _ in range(2):
            _call(ctx, agreed_first, mismatched_input(0, kind))
    try:
        out = fa.ops.pad_across_processes(ctx, tree) if op == "pad_across_processes" else _call(ctx, op, tree)
    except Exception as exc:
        return type(exc).__name__, str(exc), fa.ops.gather(ctx, torch.tensor([ctx.rank]))
    return "none", repr(out), fa.ops.gather(ctx, torch.tensor([ctx.rank]))


def changing_layouts(state: Any) -> list[tuple[Any, Any, Any, Any]]:
    """gather, reduce and broadcast, each twice in a row per layout, the row count
    cycling 1, 2, 3: a call like the last agreed one, then one of a new layout."""
    rank, n = state.dist.rank, state.dist.num_processes
    results = []
    for i in range(7):
        rows = 1 + i % 3
        value = torch.full((rows, 2), float(rank + i))
        for _ in range(2):
            gathered = fa.ops.gather(state, {"x": value})
        for _ in range(2):
            summed = fa.ops.reduce(state, value[:, 0], "sum")
        for _ in range(2):
            # no leaves: nothing to carry a flag
            empty: dict[str, torch.Tensor] = fa.ops.reduce(state, {}, "sum")
        assert empty == {}
        for _ in range(2):
            low = fa.ops.reduce(state, {"v": value[:, 1], "n": torch.full((rows,), rank + i)}, "min")
        for _ in range(2):
            received = fa.ops.broadcast(state, [value[:, 0].clone()], from_process=n - 1)
        results.append((gathered, summed, received, low))
    return results


def object_problem_everywhere(state: Any, op: str, kind: str, debug: bool) -> tuple[str, str, Any]:
    """An object collective where the last rank's input is refused or its list is longer."""
    ctx = dataclasses.replace(state.dist, debug=debug)
    objects: Any = ["a", 1]
    if ctx.is_last_process:
        if kind == "not-a-list":
            objects = torch.arange(2)
        elif kind == "unpicklable":
            objects = ["a", lambda: None]
        else:  # length
            objects = ["a", 1, 2]
    try:
        if op == "gather_object":
            out = fa.ops.gather_object(ctx, objects)
        else:
            out = fa.ops.broadcast_object_list(ctx, objects, from_process=ctx.num_processes - 1)
    except Exception as exc:
        return type(exc).__name__, str(exc), fa.ops.gather(ctx, torch.tensor([ctx.rank]))
    return "none", repr(out), fa.ops.gather(ctx, torch.tensor([ctx.rank]))


def reduce_extremes(state: Any, reduction: str) -> Any:
    """max / min over ranks of values that rise with the rank in one leaf and fall in another."""
    rank, n = state.dist.rank, state.dist.num_processes
    tree = {
        "up": leaf(rank, (2, 3), torch.float32),
        "down": Pair(x=leaf(n - 1 - rank, (2,), torch.int64) * -1, y=[leaf(rank, (), torch.bfloat16)]),
    }
    return fa.ops.reduce(state, tree, reduction), tree  # type: ignore[arg-type]


def pad_nested(state: Any) -> tuple[bool, torch.Tensor, list[str]]:
    """A nested tensor beside a plain one: the plain one is padded, the nested one
    comes back unchanged with a CannotPadNestedTensorWarning."""
    import warnings

    rank = state.dist.rank
    nested = torch.nested.nested_tensor([torch.ones(rank + 1, 2), torch.zeros(2, 2)])
    tree = {"nested": nested, "plain": torch.ones(rank + 1)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fa.ops.pad_across_processes(state, tree)
    names = [type(w.message).__name__ for w in caught]
    return out["nested"] is nested, out["plain"], names


def refused_on_last_rank(state: Any, op: str) -> tuple[str, str]:
    """The last rank's tree holds a string (gather, broadcast) or a bool (reduce): it
    raises its TypeError, every other rank a CollectiveMismatchError, none waits."""
    ctx = state.dist
    tree: Any = {"x": torch.ones(2)}
    if ctx.is_last_process:
        tree = {"x": torch.ones(2, dtype=torch.bool)} if op == "reduce" else {"x": "a string"}
    try:
        if op == "gather":
            fa.ops.gather(ctx, tree)
        elif op == "reduce":
            fa.ops.reduce(ctx, tree, "sum")
        else:
            fa.ops.broadcast(ctx, tree)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "none", ""
