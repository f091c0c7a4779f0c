"""Random-number-generator states as values.

A `RNGState` holds the states of every generator a training step can draw
from: Python's `random`, torch's CPU generator, one per CUDA device, and
NumPy's legacy global generator when NumPy is installed. `installed(rng)`
puts them into the process's generators for the duration of a block, captures
what they became, and gives the process its own generators back afterwards,
so code outside the block never sees the run's random streams and two runs
interleaved in one process draw exactly what each draws alone.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

__all__ = ["ALL_KINDS", "STEP_KINDS", "RNGState", "installed", "put_back", "swap_in", "swap_out"]

ALL_KINDS = ("python", "torch", "cuda", "numpy")
# What a training step swaps in and out: the generators tensors draw from
# (dropout, random init). Python's and NumPy's cost 12 us and 80 us per
# get+set, a third of a small model's step, so runs that draw from them inside
# their steps opt in (RunState.step_rng_types).
STEP_KINDS = ("torch", "cuda")


def _numpy() -> ModuleType | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RNGState:
    """The states of the process's generators, as an immutable value.

    Attributes:
        python: `random.getstate()`.
        torch: torch's CPU generator state (a uint8 tensor).
        cuda: one generator state per visible CUDA device.
        numpy: NumPy's legacy global state, or None without NumPy.
    """

    python: tuple[Any, ...] = field(repr=False)
    torch: Tensor = field(repr=False)
    cuda: tuple[Tensor, ...] = field(default=(), repr=False)
    numpy: tuple[Any, ...] | None = field(default=None, repr=False)

    @classmethod
    def seeded(cls, seed: int) -> RNGState:
        """States that every generator would have after being seeded with ``seed``.

        No process generator is touched.

        >>> a, b = RNGState.seeded(3), RNGState.seeded(3)
        >>> bool(torch.equal(a.torch, b.torch)) and a.python == b.python
        True
        """
        seed = int(seed)
        cuda = tuple(
            torch.Generator(device=f"cuda:{i}").manual_seed(seed).get_state() for i in range(_cuda_count())
        )
        np = _numpy()
        return cls(
            python=random.Random(seed).getstate(),
            torch=torch.Generator().manual_seed(seed).get_state(),
            cuda=cuda,
            numpy=np.random.RandomState(seed % 2**32).get_state() if np else None,
        )

    @classmethod
    def capture(cls) -> RNGState:
        """The process generators' current states (nothing is reseeded)."""
        np = _numpy()
        return cls(
            python=random.getstate(),
            torch=torch.get_rng_state(),
            cuda=tuple(torch.cuda.get_rng_state_all()) if _cuda_count() else (),
            numpy=np.random.get_state() if np else None,
        )

    def recapture(self, kinds: Collection[str]) -> RNGState:
        """These states with ``kinds`` replaced by the process generators' current ones.

        Every training step calls this (and `install`): the new value is written
        slot by slot (the frozen ``__init__`` costs as much as reading torch's
        state), and the cheap tests come first, so that a step that swaps torch's
        generator alone pays for little else.
        """
        new = object.__new__(RNGState)
        _set(new, "torch", _CPU.get_state() if "torch" in kinds else self.torch)
        cuda = self.cuda
        _set(new, "cuda", tuple(torch.cuda.get_rng_state_all()) if cuda and "cuda" in kinds else cuda)
        _set(new, "python", random.getstate() if "python" in kinds else self.python)
        numpy = self.numpy
        _set(new, "numpy", _numpy_state() if numpy is not None and "numpy" in kinds else numpy)
        return new

    def install(self, kinds: Collection[str] = ALL_KINDS) -> None:
        """Put these states (those of ``kinds``) into the process's generators."""
        if "torch" in kinds:
            _CPU.set_state(self.torch)
        if self.cuda and "cuda" in kinds:
            torch.cuda.set_rng_state_all(list(self.cuda))
        if "python" in kinds:
            random.setstate(self.python)
        if self.numpy is not None and "numpy" in kinds:
            np = _numpy()
            if np is not None:
                np.random.set_state(self.numpy)


def swap_in(rng: RNGState, kinds: Collection[str]) -> Tensor | RNGState:
    """Put ``rng``'s generators of ``kinds`` into the process's; return what those held,
    for `swap_out` (or `put_back` when the block between raised).

    A step's default (torch's CPU generator, no CUDA device) is one read and one
    write of the 5 KB state, without building a record around it.
    """
    if kinds is STEP_KINDS and not rng.cuda:
        cpu = _CPU.get_state()
        _CPU.set_state(rng.torch)
        return cpu
    held = rng.recapture(kinds)
    rng.install(kinds)
    return held


def swap_out(rng: RNGState, kinds: Collection[str], held: Tensor | RNGState) -> RNGState:
    """``rng`` with ``kinds`` replaced by the process generators' current states, and the
    process's own (``held``, from `swap_in`) put back.

    >>> run = RNGState.seeded(0)
    >>> before = torch.get_rng_state()
    >>> held = swap_in(run, STEP_KINDS); x = torch.rand(2); run = swap_out(run, STEP_KINDS, held)
    >>> bool(torch.equal(torch.get_rng_state(), before)), bool(torch.equal(run.torch, RNGState.seeded(0).torch))
    (True, False)
    """
    if type(held) is Tensor:
        new = object.__new__(RNGState)
        _set(new, "torch", _CPU.get_state())
        _set(new, "cuda", rng.cuda)
        _set(new, "python", rng.python)
        _set(new, "numpy", rng.numpy)
        _CPU.set_state(held)
        return new
    new = rng.recapture(kinds)
    assert isinstance(held, RNGState)  # swap_in's record (only torch's CPU state comes back bare)
    held.install(kinds)
    return new


def put_back(kinds: Collection[str], held: Tensor | RNGState) -> None:
    """The process's own states (``held``, from `swap_in`) back, the run's discarded."""
    if isinstance(held, RNGState):
        held.install(kinds)
    else:
        _CPU.set_state(held)


def _numpy_state() -> tuple[Any, ...] | None:
    np = _numpy()
    return np.random.get_state() if np else None


# The process's CPU generator (torch.get_rng_state and torch.set_rng_state use it too).
_CPU = torch.default_generator
_set = object.__setattr__  # writes a frozen slot (RNGState.recapture)


class _Captured:
    """The value `installed` yields: ``after`` is set when the block ends."""

    __slots__ = ("after",)

    def __init__(self) -> None:
        self.after: RNGState | None = None


@contextmanager
def installed(rng: RNGState) -> Iterator[_Captured]:
    """Run a block with every generator of ``rng`` installed; capture the states
    it leaves behind, and give the process its own states back when the block
    ends (normally or by an exception). A training step swaps only
    ``state.step_rng_types``, the same way but inline (see fnaccel/train.py).

    >>> with installed(RNGState.seeded(0)) as cap:
    ...     first = torch.rand(1)
    >>> with installed(RNGState.seeded(0)):
    ...     again = torch.rand(1)
    >>> bool(torch.equal(first, again)) and cap.after is not None
    True
    """
    outer = RNGState.capture()
    rng.install()
    captured = _Captured()
    try:
        yield captured
        captured.after = RNGState.capture()
    finally:
        outer.install()
