"""Seeding and synchronising the run's generators, and running code under them.

None of these touch a generator another run could see: they return a new
`RunState` whose `rng` field holds the new values, and `with_rng` installs
the state's generators only for the duration of one call.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from fnaccel.ops.collectives import broadcast_object_list
from fnaccel.rng import RNGState, installed
from fnaccel.constants import RNGType

if TYPE_CHECKING:
    from fnaccel.state import RunState

__all__ = ["set_seed", "synchronize_rng_states", "with_rng"]

R = TypeVar("R")

# RNGType member -> RNGState field it synchronises
_FIELDS = MappingProxyType({
    RNGType.PYTHON: "python",
    RNGType.TORCH: "torch",
    RNGType.CUDA: "cuda",
    RNGType.NUMPY: "numpy",
})


def set_seed(state: RunState, seed: int, device_specific: bool = False) -> RunState:
    """The state with its generators set as if seeded with ``seed``.

    Python's, NumPy's and torch's process generators are left alone: the new
    values live in the returned state and are installed around its steps.

    Args:
        state: the run's state (it is not consumed).
        seed: the seed.
        device_specific: add the process's rank to the seed, so each rank
            draws differently (dropout masks differ across data-parallel ranks).

    >>> import fnaccel as fa
    >>> state = fa.utils.set_seed(fa.init(cpu=True), 42)
    >>> state.seed
    42
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed: seed must be an int, got {type(seed).__name__}")
    if device_specific:
        seed += state.dist.rank
    return state.replace(rng=RNGState.seeded(seed), seed=seed)


def synchronize_rng_states(
    state: RunState,
    rng_types: Iterable[str | RNGType] | None = None,
    generator: torch.Generator | None = None,
) -> RunState:
    """The state with the main process's generator values on every rank.

    Args:
        state: the run's state (it is not consumed).
        rng_types: which of the state's generators to synchronise: "python",
            "torch", "cuda", "numpy"; default all of them. "generator" syncs
            ``generator``.
        generator: a `torch.Generator` (a sampler's, say) whose state is set,
            in place, to the main process's.
    """
    types = set(_FIELDS) if rng_types is None else {RNGType(str(t)) for t in rng_types}
    if generator is not None:
        types.add(RNGType.GENERATOR)
    unknown = types - set(_FIELDS) - {RNGType.GENERATOR}
    if unknown:
        raise ValueError(
            f"synchronize_rng_states: cannot synchronise {sorted(map(str, unknown))}; "
            f"use {sorted(map(str, _FIELDS))} or 'generator'"
        )
    if RNGType.GENERATOR in types and generator is None:
        raise ValueError("synchronize_rng_states: 'generator' was asked for but no generator given")
    if state.dist.num_processes == 1:
        return state
    names = sorted(_FIELDS[t] for t in types if t in _FIELDS)
    payload: list[Any] = [{name: getattr(state.rng, name) for name in names}]
    if generator is not None:
        payload.append(generator.get_state())
    received = broadcast_object_list(state, payload, from_process=0)
    if generator is not None:
        generator.set_state(received[1])
    changes: dict[str, Any] = received[0]
    return state.replace(rng=dataclasses.replace(state.rng, **changes))


def with_rng(
    state: RunState, function: Callable[..., R], *args: Any, **kwargs: Any
) -> tuple[RunState, R]:
    """Consumes ``state``: run ``function`` with the run's generators installed.

    The generators' values after the call go into the returned state; the
    process's own generators are restored, so code outside never sees the
    run's random streams, and two runs interleaved in one process each draw
    exactly what they would draw alone.

    Returns:
        ``(new_state, function(*args, **kwargs))``.

    >>> import fnaccel as fa
    >>> state = fa.init(seed=0, cpu=True)
    >>> state, x = fa.with_rng(state, torch.rand, 2)
    >>> x.shape
    torch.Size([2])
    """
    by = "fa.with_rng"
    state.check_fresh(by)
    with installed(state.rng) as captured:
        result = function(*args, **kwargs)
    assert captured.after is not None
    return state.advance(by, rng=captured.after), result
