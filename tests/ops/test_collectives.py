"""The collectives, in one process (N = 1) and on real 2- and 3-rank gloo worlds.

Each rank's input is a function of its rank, so every rank's result is
checked against a value computed here by hand (a `torch.cat` of what each rank
contributed, a sum over ranks, the source rank's tree). The worker functions
live in ``_dist_fns.py`` (see its docstring for why).
"""

from __future__ import annotations

import copy
import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa
from tests.ops import _dist_fns as fns
from tests.ops._dist_fns import FrozenBox, Pair, assert_tree_equal, leaf


@pytest.fixture
def state() -> fa.RunState:
    return fa.init(cpu=True)


def _pad_ref(t: torch.Tensor, axis: int, size: int, value: int, first: bool) -> torch.Tensor:
    """``t`` padded along ``axis`` to ``size`` with ``value``, written out by hand."""
    shape = list(t.shape)
    shape[axis] = size - t.shape[axis]
    filler = torch.full(shape, value, dtype=t.dtype)
    return torch.cat([filler, t] if first else [t, filler], dim=axis)


def _cat_over_ranks(num_processes: int) -> fns.Make:
    """A `mixed_tree` leaf maker for the expected gather: all ranks' leaves, concatenated
    (0-d leaves stacked into 1-d)."""

    def make(shape: tuple[int, ...], dtype: torch.dtype, transpose: bool = False) -> torch.Tensor:
        parts = [leaf(r, shape, dtype, transpose=transpose) for r in range(num_processes)]
        return torch.stack(parts) if not shape else torch.cat(parts)

    return make


def _snapshot(tree: Any) -> Any:
    return copy.deepcopy(tree)


# ------------------------------------------------------------- one process: N = 1


def test_gather_single_process_keeps_values_and_makes_0d_1d(state: fa.RunState) -> None:
    tree = fns.mixed_tree(fns.rank_leaf(0))
    before = _snapshot(tree)
    out = fa.ops.gather(state, tree)
    assert_tree_equal(out, fns.mixed_tree(_cat_over_ranks(1)))
    assert out["pair"].x.shape == (1,)
    assert_tree_equal(tree, before)


def test_gather_accepts_the_dist_context(state: fa.RunState) -> None:
    assert_tree_equal(fa.ops.gather(state.dist, [torch.tensor(2.0)]), [torch.tensor([2.0])])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_reduce_single_process(state: fa.RunState, reduction: str, scale: float) -> None:
    tree = fns.float_tree(fns.rank_leaf(0), with_int=False)
    before = _snapshot(tree)
    out = fa.ops.reduce(state, tree, reduction, scale=scale)  # type: ignore[arg-type]
    expected = fns.float_tree(
        lambda shape, dtype, transpose=False: leaf(0, shape, dtype, transpose=transpose) * scale,
        with_int=False,
    )
    assert_tree_equal(out, expected)
    assert_tree_equal(tree, before)
    out["f32"].add_(1)  # the result is a new tensor, not the input
    assert_tree_equal(tree, before)


def test_reduce_integers(state: fa.RunState) -> None:
    x = torch.tensor([1, 2], dtype=torch.int64)
    assert_tree_equal(fa.ops.reduce(state, {"n": x}, "sum"), {"n": x})
    with pytest.raises(TypeError, match="mean of a torch.int64"):
        fa.ops.reduce(state, x, "mean")
    with pytest.raises(TypeError, match="torch.bool"):
        fa.ops.reduce(state, x.bool(), "sum")
    for reduction in ("sum", "none"):
        with pytest.raises(TypeError, match="cannot scale a torch.int64 tensor by 0.5"):
            fa.ops.reduce(state, {"n": x}, reduction, scale=0.5)


def test_reduce_rejects_an_unknown_reduction(state: fa.RunState) -> None:
    with pytest.raises(ValueError, match="'median'.*'max', 'min'"):
        fa.ops.reduce(state, torch.ones(1), "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'median'"):
        fa.reduce("median")  # type: ignore[arg-type]


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_reduce_max_min_single_process(state: fa.RunState, reduction: str) -> None:
    tree = {"f": torch.tensor([1.0, -2.0]), "i": [torch.tensor([3, 4])]}
    out = fa.ops.reduce(state, tree, reduction)  # type: ignore[arg-type]
    assert_tree_equal(out, tree)
    assert out["f"] is not tree["f"]
    with pytest.raises(TypeError, match=f"{reduction} of a torch.complex64"):
        fa.ops.reduce(state, torch.ones(1, dtype=torch.complex64), reduction)  # type: ignore[arg-type]
    assert_tree_equal(
        fa.ops.reduce(state, torch.tensor([1.0]), reduction, scale=2.0),  # type: ignore[arg-type]
        torch.tensor([2.0]),
    )


def test_pad_nested_tensor_single_process_warns_and_keeps_it(state: fa.RunState) -> None:
    nested = torch.nested.nested_tensor([torch.ones(1, 2), torch.zeros(2, 2)])
    with pytest.warns(fa.ops.CannotPadNestedTensorWarning, match="nested tensor"):
        out = fa.ops.pad_across_processes(state, {"n": nested})
    assert out["n"] is nested


def test_broadcast_single_process(state: fa.RunState) -> None:
    tree = fns.mixed_tree(fns.rank_leaf(0))
    before = _snapshot(tree)
    assert_tree_equal(fa.ops.broadcast(state, tree), before)
    assert_tree_equal(fa.ops.broadcast(state, tree, from_process=state.dist.num_processes - 1), before)
    assert_tree_equal(tree, before)


@pytest.mark.parametrize("from_process", [1, -1])
def test_broadcast_rejects_a_rank_outside_the_run(state: fa.RunState, from_process: int) -> None:
    with pytest.raises(ValueError, match=f"from_process={from_process}"):
        fa.ops.broadcast(state, torch.ones(1), from_process=from_process)


def test_object_collectives_single_process(state: fa.RunState) -> None:
    items = ["a", {"b": 1}]
    out = fa.ops.broadcast_object_list(state, items)
    assert out == ["a", {"b": 1}] and out is not items
    assert fa.ops.broadcast_object_list(state, ("x", 2)) == ["x", 2]
    gathered = fa.ops.gather_object(state, items)
    assert gathered == ["a", {"b": 1}] and gathered is not items
    assert fa.ops.gather_object(state, ("t",)) == ["t"]
    assert items == ["a", {"b": 1}]


def test_object_collectives_need_a_list(state: fa.RunState) -> None:
    with pytest.raises(TypeError, match=r"broadcast_object_list\(state, \[obj\]\)"):
        fa.ops.broadcast_object_list(state, "abc")
    with pytest.raises(TypeError, match=r"gather_object\(state, \[obj\]\)"):
        fa.ops.gather_object(state, {"a": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("dim", [0, 1, -1, -2, 5])
@pytest.mark.parametrize("pad_first", [False, True])
def test_pad_across_processes_single_process_is_identity(
    state: fa.RunState, dim: int, pad_first: bool
) -> None:
    tree = fns.ragged_tree(0, 1)
    before = _snapshot(tree)
    out = fa.ops.pad_across_processes(state, tree, dim=dim, pad_index=-1, pad_first=pad_first)
    assert_tree_equal(out, before)
    assert_tree_equal(tree, before)


@pytest.mark.parametrize(
    ("name", "call"),
    [
        ("gather", lambda s, t: fa.ops.gather(s, t)),
        ("reduce", lambda s, t: fa.ops.reduce(s, t)),
        ("broadcast", lambda s, t: fa.ops.broadcast(s, t)),
        ("pad_across_processes", lambda s, t: fa.ops.pad_across_processes(s, t)),
    ],
    ids=["gather", "reduce", "broadcast", "pad_across_processes"],
)
def test_a_string_leaf_is_a_type_error_naming_the_op(state: fa.RunState, name: str, call: Any) -> None:
    with pytest.raises(TypeError, match=rf"^{name}: .*\bstr\b"):
        call(state, {"x": torch.ones(1), "name": "a string"})


def test_ops_need_a_state_or_context() -> None:
    with pytest.raises(TypeError, match="RunState or a DistContext"):
        fa.ops.gather(None, torch.ones(1))


def test_composed_forms_single_process(state: fa.RunState) -> None:
    labels = {"labels": torch.tensor([[1, 2]]), "n": torch.tensor(3)}
    collect = fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    assert_tree_equal(collect(state, labels), {"labels": torch.tensor([[1, 2]]), "n": torch.tensor([3])})
    assert_tree_equal(fa.reduce("sum")(state, [torch.tensor([1.0])]), [torch.tensor([1.0])])
    assert_tree_equal(fa.reduce("mean", scale=3.0)(state, torch.tensor([1.0])), torch.tensor([3.0]))
    assert_tree_equal(fa.broadcast(0)(state, (torch.ones(2),)), (torch.ones(2),))
    assert_tree_equal(
        fa.gather_for_metrics()(state, {"p": torch.arange(4)}, num_valid=3), {"p": torch.arange(3)}
    )
    assert fa.gather_object()(state, ["a"]) == ["a"]
    assert fa.broadcast_object_list()(state, ["a"]) == ["a"]


def test_composed_forms_print_and_compare() -> None:
    collect = fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    assert repr(collect) == "compose(pad_across_processes(dim=1, pad_index=-100), gather())"
    assert collect == fa.compose(fa.pad_across_processes(dim=1, pad_index=-100), fa.gather())
    assert collect != fa.compose(fa.pad_across_processes(dim=0), fa.gather())
    assert repr(fa.reduce("sum")) == "reduce(reduction='sum')"
    assert repr(fa.broadcast(0)) == "broadcast(from_process=0)"


def test_compose_rejects_two_communicating_steps_and_wrong_order() -> None:
    with pytest.raises(ValueError, match=r"gather\(\) and reduce\(reduction='sum'\)"):
        fa.compose(fa.gather(), fa.reduce("sum"))
    with pytest.raises(ValueError, match="must come before"):
        fa.compose(fa.gather(), fa.pad_across_processes(dim=1))


# ------------------------------------------------------------- 2 and 3 ranks


def test_gather_nested_tree_every_dtype(world: Any) -> None:
    n = world.num_processes
    expected = fns.mixed_tree(_cat_over_ranks(n))
    for rank, (outs, input_after) in enumerate(world.run(fns.gather_mixed)):
        for i, out in enumerate(outs):
            assert_tree_equal(out, expected, f"rank {rank} call {i}")
        assert_tree_equal(input_after, fns.mixed_tree(fns.rank_leaf(rank)), f"rank {rank} input")


def test_repeated_gather_of_leaves_too_small_for_a_mark(world: Any) -> None:
    expected = fns.tiny_tree(_cat_over_ranks(world.num_processes))
    for rank, outs in enumerate(world.run(fns.gather_tiny)):
        for i, out in enumerate(outs):
            assert_tree_equal(out, expected, f"rank {rank} call {i}")


def test_data_that_looks_like_a_mismatch_mark_is_still_gathered(world: Any) -> None:
    """A repeated gather whose data begins with the mark a differing rank sends:
    the full check finds the calls agree and the data comes back right."""
    expected = torch.cat([fns.marked_bytes(r) for r in range(world.num_processes)])
    for rank, outs in enumerate(world.run(fns.gather_marked_data)):
        for out in outs:
            assert_tree_equal(out, expected, f"rank {rank}")


def test_data_that_looks_like_a_reduce_flag_is_still_reduced(world: Any) -> None:
    """Repeated reduces with inf or NaN where a differing rank puts its flag: the
    full check finds the calls agree and the plain answer comes back."""
    n = world.num_processes
    rest = [2.0 + r for r in range(n)]
    expected = {
        "sum": {"x": torch.tensor([math.inf, sum(rest)]), "nan": torch.tensor([math.nan, float(n)])},
        "max": {"x": torch.tensor([math.inf, max(rest)])},
        "min": {"x": torch.tensor([1.0 if n > 1 else math.inf, min(rest)])},
    }
    for rank, results in enumerate(world.run(fns.reduce_non_finite_data)):
        for reduction, calls in results.items():
            for out in calls:
                if reduction == "ints":
                    assert_tree_equal(out, torch.tensor([sum(range(n)), n]))
                    continue
                assert_tree_equal(out["x"], expected[reduction]["x"], f"rank {rank} {reduction}")
                assert out["nan"][0].isnan(), (rank, reduction, out)
                if reduction == "sum":
                    assert out["nan"][1] == n


@pytest.mark.parametrize("source", ["first", "last"])
def test_broadcast_nested_tree_every_dtype(world: Any, source: str) -> None:
    n = world.num_processes
    src = 0 if source == "first" else n - 1
    expected = fns.mixed_tree(fns.rank_leaf(src))
    for rank, (out, input_after) in enumerate(world.run(fns.broadcast_mixed, src)):
        assert_tree_equal(out, expected, f"rank {rank}")
        assert_tree_equal(input_after, fns.mixed_tree(fns.rank_leaf(rank)), f"rank {rank} input")


def test_gather_and_broadcast_per_dtype(world: Any) -> None:
    n = world.num_processes
    for rank, results in enumerate(world.run(fns.per_dtype)):
        for name, dtype in fns.DTYPES.items():
            gathered, gathered_scalar, broadcast, broadcast_scalar = results[name]
            where = f"rank {rank} {name}"
            assert_tree_equal(gathered, torch.cat([leaf(r, (2, 3), dtype) for r in range(n)]), where)
            scalars = torch.stack([leaf(r, (), dtype) for r in range(n)])
            assert_tree_equal(gathered_scalar, scalars, where)
            assert_tree_equal(broadcast, leaf(n - 1, (2, 3), dtype), where)
            assert_tree_equal(broadcast_scalar, leaf(n - 1, (), dtype), where)


@pytest.mark.parametrize(
    ("reduction", "scale"),
    [("sum", 1.0), ("sum", 2.0), ("mean", 1.0), ("mean", 0.5), ("none", 1.0), ("none", 3.0)],
)
def test_reduce_nested_tree(world: Any, reduction: str, scale: float) -> None:
    n = world.num_processes

    def expected_for(rank: int) -> Any:
        def make(shape: tuple[int, ...], dtype: torch.dtype, transpose: bool = False) -> torch.Tensor:
            if reduction == "none":
                value = leaf(rank, shape, dtype, transpose=transpose)
            else:
                value = leaf(0, shape, dtype, transpose=transpose)
                for r in range(1, n):
                    value = value + leaf(r, shape, dtype, transpose=transpose)
            if reduction == "mean":
                value = value / n
            return value * scale if scale != 1.0 else value

        return fns.float_tree(make, with_int=with_int)

    with_int = reduction != "mean" and scale == 1.0
    for rank, (out, input_after) in enumerate(world.run(fns.reduce_floats, reduction, scale)):
        assert_tree_equal(out, expected_for(rank), f"rank {rank}", exact=reduction != "mean")
        assert_tree_equal(input_after, fns.float_tree(fns.rank_leaf(rank), with_int), f"rank {rank}")


def test_object_collectives(world: Any) -> None:
    n = world.num_processes
    everyone = [item for r in range(n) for item in [f"r{r}-{i}" for i in range(r + 1)] + [{"rank": r}]]
    for rank, out in enumerate(world.run(fns.objects)):
        assert out["gathered"] == everyone
        assert out["from_first"] == [0, "from 0", {"nested": (0,)}]
        assert out["from_last"] == [n - 1, f"from {n - 1}", {"nested": (n - 1,)}]
        assert out["offered_after"] == [rank, f"from {rank}", {"nested": (rank,)}]


@pytest.mark.parametrize(
    ("dim", "pad_index", "pad_first"),
    [(0, 0, False), (1, -100, False), (-1, 7, True), (-2, 0, True), (1, 1, True)],
)
def test_pad_across_processes_ragged_tree(world: Any, dim: int, pad_index: int, pad_first: bool) -> None:
    n = world.num_processes
    # every rank's leaf shapes, in the order ragged_tree builds its leaves
    shapes: list[list[tuple[int, ...]]] = [[] for _ in range(n)]

    def record(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        shapes[rank].append(shape)
        return torch.empty(0)

    for r in range(n):
        fns.ragged_tree(r, n, make=record)

    def expected_for(rank: int) -> Any:
        index = iter(range(len(shapes[0])))

        def make(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            k = next(index)
            t = leaf(rank, shape, dtype)
            if not -len(shape) <= dim < len(shape):
                return t  # no such dimension: left alone
            axis = dim % len(shape)
            return _pad_ref(t, axis, max(s[k][axis] for s in shapes), pad_index, pad_first)

        return fns.ragged_tree(rank, n, make=make)

    for rank, (out, input_after) in enumerate(world.run(fns.pad_ragged, dim, pad_index, pad_first)):
        assert_tree_equal(out, expected_for(rank), f"rank {rank}")
        assert_tree_equal(input_after, fns.ragged_tree(rank, n), f"rank {rank} input")
        assert out["mask"].value.dtype == torch.bool


def test_pad_across_processes_bool_pad_value(world: Any) -> None:
    n = world.num_processes
    # dim 1 of "mask" has rank + 1 columns: pad_index=0 pads with False, others with True
    for pad_index, fill in [(0, False), (1, True)]:
        for rank, (out, _) in enumerate(world.run(fns.pad_ragged, 1, pad_index, False)):
            mask = out["mask"].value
            assert mask.dtype == torch.bool and mask.shape == (n - rank, n)
            assert bool((mask[:, rank + 1 :] == fill).all())


def test_composed_forms(world: Any) -> None:
    n = world.num_processes
    labels = torch.cat([_pad_ref(leaf(r, (2, r + 1), torch.int64), 1, n, -100, False) for r in range(n)])
    flags = torch.cat([_pad_ref(leaf(r, (1, n - r), torch.bool), 1, n, -100, False) for r in range(n)])
    scalars = torch.stack([leaf(r, (), torch.float32) for r in range(n)])
    for rank, out in enumerate(world.run(fns.composed)):
        assert_tree_equal(
            out["pad_gather"],
            {"labels": labels, "extra": Pair(x=flags, y=scalars)},
            f"rank {rank}",
        )
        assert_tree_equal(out["sum"], {"x": sum(leaf(r, (2,), torch.float32) for r in range(n))})
        assert_tree_equal(
            out["mean_scaled"],
            [sum(leaf(r, (2,), torch.float32) for r in range(n)) / n * 2.0],
            exact=False,
        )
        assert_tree_equal(out["broadcast_first"], FrozenBox(value=leaf(0, (3,), torch.float32)))
        assert_tree_equal(out["broadcast_last"], (leaf(n - 1, (3,), torch.int64),))
        assert_tree_equal(
            out["metrics"], torch.cat([leaf(r, (3, 2), torch.int64)[: r % 3] for r in range(n)])
        )
        assert out["objects"] == [r for r in range(n) for _ in range(r + 1)]
        assert out["object_list"] == [n - 1, "x"]
        assert_tree_equal(
            out["labels_after"],
            {
                "labels": leaf(rank, (2, rank + 1), torch.int64),
                "extra": Pair(x=leaf(rank, (1, n - rank), torch.bool), y=leaf(rank, (), torch.float32)),
            },
        )


def test_pad_then_gather_with_another_dim_differing_raises(world: Any) -> None:
    with pytest.raises(fa.CollectiveMismatchError, match="pad the other differing dimensions"):
        world.run(fns.pad_then_gather_other_dim_differs)
    assert_tree_equal(world.run(fns.gather_rank)[0], torch.arange(world.num_processes))


@pytest.mark.parametrize("kind", ["leaves", "dtype", "ndim"])
def test_pad_across_processes_detects_different_trees_without_debug_mode(world: Any, kind: str) -> None:
    with pytest.raises(fa.CollectiveMismatchError) as info:
        world.run(fns.pad_mismatched, kind)
    message = str(info.value)
    for rank in range(world.num_processes):
        assert f"rank {rank}:" in message
    if kind == "dtype":
        assert "float32" in message and "float64" in message
    assert_tree_equal(world.run(fns.gather_rank)[0], torch.arange(world.num_processes))


@pytest.mark.parametrize("op", ["gather", "reduce", "broadcast"])
@pytest.mark.parametrize("same_ndim", [True, False], ids=["sizes", "ndim"])
def test_debug_mode_detects_mismatched_shapes(world2: Any, op: str, same_ndim: bool) -> None:
    shapes = {0: "(2, 3)", 1: "(3, 3)"} if same_ndim else {0: "(2,)", 1: "(2, 2)"}
    for rank, (message, elapsed, after) in enumerate(world2.run(fns.debug_mismatch, op, same_ndim)):
        assert message.startswith(f"{op}:"), message
        for r, shape in shapes.items():
            assert re.search(rf"rank {r}: \[\['x'\]: {re.escape(shape)} float32\]", message), message
        # found by the check, not by the process group's 1800 s timeout
        assert elapsed < 30, f"rank {rank} took {elapsed:.1f}s to fail"
        assert_tree_equal(after, torch.tensor([0, 1]))
    assert world2.alive
    assert_tree_equal(world2.run(fns.gather_rank)[1], torch.tensor([0, 1]))


def test_debug_mode_passes_matching_shapes(world: Any) -> None:
    n = world.num_processes
    for gathered, summed, broadcast in world.run(fns.debug_matching):
        assert_tree_equal(gathered, {"x": torch.cat([leaf(r, (2, 3), torch.float32) for r in range(n)])})
        assert_tree_equal(summed, {"x": sum(leaf(r, (2, 3), torch.float32) for r in range(n))})
        assert_tree_equal(broadcast, {"x": leaf(n - 1, (2, 3), torch.float32)})


def test_string_leaf_in_distributed_gather(world2: Any) -> None:
    with pytest.raises(TypeError, match=r"^gather: .*str"):
        world2.run(fns.gather_with_str_leaf)
    assert_tree_equal(world2.run(fns.gather_rank)[0], torch.tensor([0, 1]))


@pytest.mark.parametrize("reduction", ["max", "min"])
def test_reduce_max_min(world: Any, reduction: str) -> None:
    n = world.num_processes
    pick = torch.maximum if reduction == "max" else torch.minimum

    def over_ranks(make: Any) -> torch.Tensor:
        values = [make(r) for r in range(n)]
        out = values[0]
        for v in values[1:]:
            out = pick(out, v)
        return out

    expected = {
        "up": over_ranks(lambda r: leaf(r, (2, 3), torch.float32)),
        "down": Pair(
            x=over_ranks(lambda r: leaf(n - 1 - r, (2,), torch.int64) * -1),
            y=[over_ranks(lambda r: leaf(r, (), torch.bfloat16))],
        ),
    }
    for rank, (out, tree) in enumerate(world.run(fns.reduce_extremes, reduction)):
        assert_tree_equal(out, expected, f"rank {rank}")
        assert_tree_equal(tree["up"], leaf(rank, (2, 3), torch.float32))


_WHAT_DIFFERED = {
    "dtype": "dtype",
    "keys": "tree structure",
    "ndim": "ndim",
    "length": "shape",
}


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("kind", list(_WHAT_DIFFERED))
@pytest.mark.parametrize("op", ["gather", "reduce", "reduce_max", "broadcast"])
def test_mismatch_raises_on_every_rank_in_every_mode(world2: Any, op: str, kind: str, debug: bool) -> None:
    """float32 vs int32, other keys, another ndim, another length: never a result."""
    name = "reduce" if op == "reduce_max" else op
    for rank, (kind_raised, message, after) in enumerate(
        world2.run(fns.mismatch_everywhere, op, kind, debug)
    ):
        assert kind_raised == "CollectiveMismatchError", (rank, kind_raised, message)
        assert message.startswith(f"{name}: "), message
        assert _WHAT_DIFFERED[kind] in message.split("(")[0], message
        assert "rank 0: " in message and "rank 1: " in message, message
        assert_tree_equal(after, torch.tensor([0, 1]))


@pytest.mark.parametrize("agreed_first", ["same", "other"])
@pytest.mark.parametrize("kind", list(_WHAT_DIFFERED))
@pytest.mark.parametrize("op", ["gather", "reduce", "reduce_max", "reduce_min", "broadcast"])
def test_mismatch_after_an_agreed_call_raises_on_every_rank(
    world2: Any, op: str, kind: str, agreed_first: str
) -> None:
    """A repeated call sends its check beside the data (shaped as the agreed call):
    a rank whose call differs from it still makes every rank raise, never return."""
    first = op if agreed_first == "same" else ("broadcast" if op != "broadcast" else "gather")
    name = "reduce" if op.startswith("reduce") else op
    for rank, (kind_raised, message, after) in enumerate(
        world2.run(fns.mismatch_everywhere, op, kind, False, first)
    ):
        assert kind_raised == "CollectiveMismatchError", (rank, kind_raised, message)
        assert message.startswith(f"{name}: "), message
        assert _WHAT_DIFFERED[kind] in message.split("(")[0], message
        assert_tree_equal(after, torch.tensor([0, 1]))


def test_a_layout_every_rank_changes_alike_is_agreed_again(world: Any) -> None:
    """Calls alternating between layouts and ops: each result is the plain answer."""
    n = world.num_processes
    for results in world.run(fns.changing_layouts):
        for i, (gathered, summed, received, low) in enumerate(results):
            rows = 1 + i % 3
            expected = torch.cat([torch.full((rows, 2), float(r + i)) for r in range(n)])
            assert_tree_equal(gathered, {"x": expected})
            assert_tree_equal(summed, torch.full((rows,), float(sum(range(n)) + n * i)))
            assert_tree_equal(received, [torch.full((rows,), float(n - 1 + i))])
            assert_tree_equal(low, {"v": torch.full((rows,), float(i)), "n": torch.full((rows,), i)})


def test_mismatch_message_names_each_rank_tree(world: Any) -> None:
    for kind_raised, message, _ in world.run(fns.mismatch_everywhere, "gather", "dtype", False):
        assert kind_raised == "CollectiveMismatchError"
        assert "rank 0: [['x']: (4,) float32]" in message, message
        assert "rank 1: [['x']: (4,) int32]" in message, message
    for _, message, _ in world.run(fns.mismatch_everywhere, "broadcast", "keys", False):
        assert "rank 0: [['a']: (4,) float32]" in message and "rank 1: [['b']: (4,) float32]" in message


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("kind", ["not-a-list", "unpicklable", "length"])
@pytest.mark.parametrize("op", ["gather_object", "broadcast_object_list"])
def test_object_collectives_raise_on_every_rank(world: Any, op: str, kind: str, debug: bool) -> None:
    """One rank's refused input, or (broadcast_object_list) a list of another length:
    every rank raises, none waits; gather_object takes lists of any lengths."""
    n = world.num_processes
    results = world.run(fns.object_problem_everywhere, op, kind, debug)
    if op == "gather_object" and kind == "length":
        for raised, out, _ in results:
            assert raised == "none" and out == repr(["a", 1] * (n - 1) + ["a", 1, 2])
        return
    for rank, (raised, message, after) in enumerate(results):
        if rank == n - 1 and kind != "length":
            assert raised == "TypeError", (rank, raised, message)
        else:
            assert raised == "CollectiveMismatchError", (rank, raised, message)
            assert f"rank {n - 1}" in message, message
        assert message.startswith(f"{op}"), message
        assert_tree_equal(after, torch.arange(n))


def test_pad_nested_tensor_over_processes_warns_and_keeps_it(world2: Any) -> None:
    for rank, (same, plain, warned) in enumerate(world2.run(fns.pad_nested)):
        assert same, f"rank {rank}: the nested tensor was replaced"
        assert warned == ["CannotPadNestedTensorWarning"], warned
        assert_tree_equal(plain, torch.cat([torch.ones(rank + 1), torch.zeros(1 - rank)]))


@pytest.mark.parametrize("op", ["gather", "reduce", "broadcast"])
def test_one_rank_refusing_its_input_raises_on_every_rank(world: Any, op: str) -> None:
    n = world.num_processes
    for rank, (raised, message) in enumerate(world.run(fns.refused_on_last_rank, op)):
        if rank == n - 1:
            assert raised == "TypeError" and message.startswith(f"{op}: "), message
        else:
            assert raised == "CollectiveMismatchError", (rank, raised, message)
            assert message.startswith(f"{op}: rank {n - 1} rejected its input"), message
    assert_tree_equal(world.run(fns.gather_rank)[0], torch.arange(n))


@pytest.mark.parametrize("op", ["gather", "reduce", "broadcast"])
def test_a_nested_tensor_is_refused_with_the_fix(state: fa.RunState, op: str) -> None:
    nested = torch.nested.nested_tensor([torch.ones(1, 2), torch.zeros(2, 2)])
    with pytest.raises(TypeError, match=rf"^{op}: nested .*unbind"):
        getattr(fa.ops, op)(state, {"n": nested})


def _wait_past_the_timeout(rank: int, rendezvous: str, results: Any, gone: Any, scenario: str) -> None:
    """Rank 0 gathers. ``absent``: rank 1 never joins (it waits until rank 0 has
    given up). ``out_of_step``: rank 1 pads instead, while rank 0 repeats an agreed
    gather exactly the size of a header exchange (so gloo moves the bytes)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    handler = fa.InitProcessGroupKwargs(backend="gloo", init_method=rendezvous, timeout=timedelta(seconds=2))
    state = fa.init(cpu=True, kwargs_handlers=[handler])
    value = (
        torch.arange(66) if scenario == "out_of_step" else torch.ones(2)
    )  # 528 bytes: 16 of mark, 64 slots
    for _ in range(2):  # together: the group works, and has an agreed call
        fa.ops.gather(state, value)
    outcome: tuple[str, ...] = ("returned",)
    start = time.perf_counter()
    try:
        if rank == 0:
            fa.ops.gather(state, value)
        elif scenario == "out_of_step":
            fa.ops.pad_across_processes(state, torch.ones(2))
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc), str(isinstance(exc, RuntimeError)))
    if rank == 0:
        results.put((time.perf_counter() - start, outcome))
        gone.set()
    else:
        if scenario == "out_of_step":
            results.put((0.0, outcome))
        gone.wait(60)
    results.close()
    results.join_thread()
    os._exit(0)  # the group is broken after a timeout: no shutdown handshake to wait for


def _two_ranks(context: Any, tmp_path: Path, scenario: str) -> list[tuple[float, tuple[str, ...]]]:
    """Runs `_wait_past_the_timeout` on 2 fresh processes (forked from ``context``, the
    `forked_context` fixture's); what rank 0 (and, when out of step, rank 1) reported, in the
    order they reported it."""
    results, gone = context.Queue(), context.Event()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        context.Process(target=_wait_past_the_timeout, args=(rank, rendezvous, results, gone, scenario))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        return [results.get(timeout=120) for _ in range(2 if scenario == "out_of_step" else 1)]
    finally:
        gone.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
                proc.join()


@pytest.mark.multiprocess
def test_a_collective_timeout_names_the_collective_and_the_setting(
    forked_context: Any, tmp_path: Path
) -> None:
    """InitProcessGroupKwargs(timeout=2 s) bounds the wait for a rank that never comes."""
    [(elapsed, outcome)] = _two_ranks(forked_context, tmp_path, "absent")
    assert outcome[0] == "CollectiveTimeoutError", outcome
    assert outcome[1].startswith("gather: timed out waiting for the other ranks"), outcome
    assert "InitProcessGroupKwargs(timeout=...)" in outcome[1] and outcome[2] == "True"
    assert 1.5 < elapsed < 60, elapsed  # the 2 s given, not fnaccel's 10 min default


@pytest.mark.multiprocess
def test_ranks_out_of_step_get_errors_never_a_result(forked_context: Any, tmp_path: Path) -> None:
    """A repeated gather meeting another rank's header exchange of the same size:
    gloo moves the bytes, the padding rank finds no mark in the gather's row and
    raises, the gathering rank takes the header's mark for a differing call and
    waits in the full check until the timeout. Neither returns."""
    outcomes = dict((o[0], o) for _, o in _two_ranks(forked_context, tmp_path, "out_of_step"))
    assert set(outcomes) == {"CollectiveMismatchError", "CollectiveTimeoutError"}, outcomes
    assert outcomes["CollectiveMismatchError"][1].startswith(
        "pad_across_processes: rank 0 is in another collective"
    ), outcomes
    assert outcomes["CollectiveTimeoutError"][1].startswith("gather: timed out"), outcomes
