"""`fa.diff`: every way two runs differ, live or saved, as one value.

Both sides become the same table of named items (`fnaccel.debug.items`),
which are compared name by name: tensors elementwise under a tolerance
(``|a - b| <= atol + rtol * |b|``, NaN equal to NaN), everything else by
value (numbers under the same tolerance). Tensors are read one at a time,
so comparing two 600 MB checkpoints holds two tensors, not two checkpoints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fnaccel.checks import is_number
from fnaccel.debug.items import TensorItem, items_of_directory, items_of_state
from fnaccel.state import RunState

__all__ = ["Diff", "Difference", "compare_tensors", "diff"]

_CHUNK = 1 << 22  # elements compared at a time, in float64: 32 MiB of scratch per side


@dataclass(frozen=True, slots=True, kw_only=True)
class Difference:
    """One item that differs.

    Attributes:
        item: its name (``model/0.weight``, ``rank0/rng/torch``, ``scheduler/last_epoch``).
        a, b: each side's value in short (for tensors, their shape and dtype).
        max_abs, max_rel: for tensors and numbers, the largest absolute and
            relative (``|a - b| / max(|a|, |b|)``) difference; None otherwise.
        index: for tensors, the first element over the tolerance.
        count: for tensors, how many elements are over it.
    """

    item: str
    a: str
    b: str
    max_abs: float | None = None
    max_rel: float | None = None
    index: tuple[int, ...] | None = None
    count: int | None = None

    def __str__(self) -> str:
        if self.count is not None:
            return (
                f"{self.item}: {self.count} element(s) differ, first at {list(self.index or ())}, "
                f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}"
            )
        numbers = "" if self.max_abs is None else f" (abs {self.max_abs:.3g}, rel {self.max_rel:.3g})"
        return f"{self.item}: {self.a} != {self.b}{numbers}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Diff:
    """What `diff` found: empty (falsy) when the two sides are equal.

    ``str(d)`` is a report, one line per difference; ``d.first`` the first;
    ``d.names`` every differing item; ``"model/0.weight" in d`` asks for one.
    """

    a: str
    b: str
    differences: tuple[Difference, ...] = ()
    atol: float = 0.0
    rtol: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.differences)

    def __len__(self) -> int:
        return len(self.differences)

    def __contains__(self, item: object) -> bool:
        return item in self.names

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.item for d in self.differences)

    @property
    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    def __str__(self) -> str:
        tolerance = f" (atol={self.atol:g}, rtol={self.rtol:g})"
        if not self.differences:
            return f"{self.a} and {self.b} are equal{tolerance}"
        lines = [f"{len(self.differences)} difference(s) between {self.a} and {self.b}{tolerance}:"]
        return "\n".join([*lines, *(f"  {d}" for d in self.differences)])


def compare_tensors(
    item: str, x: torch.Tensor, y: torch.Tensor, *, atol: float = 0.0, rtol: float = 0.0
) -> Difference | None:
    """How ``x`` and ``y`` differ beyond the tolerance, or None.

    >>> str(compare_tensors("w", torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])))
    'w: 1 element(s) differ, first at [1], max abs 0.5, max rel 0.2'
    >>> compare_tensors("w", torch.tensor([1.0]), torch.tensor([1.1]), atol=0.2) is None
    True
    """

    def short(t: torch.Tensor) -> str:
        return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    if x.shape != y.shape:
        return Difference(item=item, a=short(x), b=short(y))
    if x.dtype == y.dtype and atol == 0 and rtol == 0 and torch.equal(x, y):
        return None
    a, b = x.detach().reshape(-1), y.detach().reshape(-1)
    count, first, max_abs, max_rel = 0, -1, 0.0, 0.0
    for start in range(0, a.numel(), _CHUNK):
        p, q = a[start : start + _CHUNK].double(), b[start : start + _CHUNK].double()
        both_nan = p.isnan() & q.isnan()
        delta = (p - q).abs().nan_to_num(nan=math.inf).masked_fill(both_nan, 0.0)
        over = delta > atol + rtol * q.abs()
        if over.any():
            if first < 0:
                first = start + int(over.nonzero()[0, 0])
            count += int(over.sum())
        scale = torch.maximum(p.abs(), q.abs())
        rel = torch.where(delta == 0, torch.zeros_like(delta), delta / scale)
        max_abs = max(max_abs, float(delta.max()) if delta.numel() else 0.0)
        max_rel = max(max_rel, float(rel.max()) if rel.numel() else 0.0)
    if count == 0 and x.dtype == y.dtype:
        return None
    index = (
        tuple(int(i) for i in torch.unravel_index(torch.tensor(max(first, 0)), x.shape)) if x.dim() else ()
    )
    if count == 0:  # values within tolerance, stored in another dtype
        return Difference(item=item, a=short(x), b=short(y), max_abs=max_abs, max_rel=max_rel)
    return Difference(
        item=item, a=short(x), b=short(y), max_abs=max_abs, max_rel=max_rel, index=index, count=count
    )


def _short(value: object) -> str:
    text = "absent" if value is _ABSENT else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_ABSENT = object()


def _compare_values(item: str, x: Any, y: Any, atol: float, rtol: float) -> Difference | None:
    numbers = all(is_number(v) for v in (x, y))
    if numbers:
        if (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=rtol, abs_tol=atol):
            return None
        delta = abs(x - y)
        scale = max(abs(x), abs(y))
        return Difference(item=item, a=_short(x), b=_short(y), max_abs=delta, max_rel=delta / scale)
    if x == y and type(x) is type(y):
        return None
    return Difference(item=item, a=_short(x), b=_short(y))


def _describe(source: object) -> str:
    if isinstance(source, RunState):
        return f"the RunState at step {source.step} (micro step {source.micro_step})"
    return str(source)


def diff(
    a: RunState | str | os.PathLike[str],
    b: RunState | str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Diff:
    """Every difference between two runs: two `RunState` s, two checkpoint directories, or one of each.

    Reads both; consumes neither. Items are named as in the checkpoint
    (``model/<param>``, ``optimizer/<param>/<slot>``, ``scheduler/<field>``,
    ``step``, ``epoch``, ``rank<r>/rng/torch``, ``rank<r>/data/num_batches``,
    ``pipeline/<transform>/<option>``, ``precision``, ``config/<key>``; see
    docs/debugging.md). A live state holds this rank's generators and data
    position only, so against a directory only that rank's files are
    compared. A sharded (``fsdp()``) checkpoint is compared one tensor at a
    time, assembled from its chunks; a sharded live state gathers one tensor
    at a time, so every rank must call `diff`.

    Args:
        a, b: what to compare.
        atol, rtol: elements (and numbers) with ``|a - b| <= atol + rtol * |b|``
            count as equal; the default is bit-exact.

    Returns:
        A `Diff`: empty and falsy when nothing differs.

    Raises:
        CheckpointError: a directory is not a readable checkpoint (named).
        StaleStateError: a state was already consumed (its live objects have moved on).
        ValueError: a negative tolerance.

    >>> import fnaccel as fa, torch, tempfile, pathlib
    >>> state = fa.prepare(fa.init(seed=0, cpu=True), torch.nn.Linear(2, 1))
    >>> folder = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    >>> _ = fa.save(state, folder)
    >>> bool(fa.diff(state, folder))
    False
    >>> with torch.no_grad():
    ...     state.model.bias += 1
    >>> print(fa.diff(folder, state).names)
    ('model/bias',)
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"fa.diff: atol and rtol must be >= 0, got atol={atol}, rtol={rtol}")
    states = [s for s in (a, b) if isinstance(s, RunState)]
    ranks = {states[0].dist.rank} if states else None

    def items(source: object) -> dict[str, object]:
        if isinstance(source, RunState):
            return items_of_state(source)
        if isinstance(source, (str, os.PathLike)):
            return items_of_directory(Path(source).absolute(), ranks)
        raise TypeError(f"fa.diff compares RunStates and checkpoint directories, not {type(source).__name__}")

    left, right = items(a), items(b)
    found: list[Difference] = []
    for name in [*left, *(n for n in right if n not in left)]:
        x, y = left.get(name, _ABSENT), right.get(name, _ABSENT)
        if isinstance(x, TensorItem) and isinstance(y, TensorItem):
            difference = compare_tensors(name, x.load(), y.load(), atol=atol, rtol=rtol)
            if (
                difference is not None and "/rng/" in name
            ):  # a generator's bytes: only "differs" means anything
                difference = Difference(item=name, a="a generator state", b="another")
        elif isinstance(x, TensorItem) or isinstance(y, TensorItem):
            difference = Difference(item=name, a=_tensor_or(x), b=_tensor_or(y))
        else:
            difference = _compare_values(name, x, y, atol, rtol)
        if difference is not None:
            found.append(difference)
    return Diff(a=_describe(a), b=_describe(b), differences=tuple(found), atol=atol, rtol=rtol)


def _tensor_or(value: object) -> str:
    if isinstance(value, TensorItem):
        return f"{value.shape} {str(value.dtype).removeprefix('torch.')}"
    return _short(value)
