"""Seeding and synchronising the run's generators, and running code under them.

None of these touch a generator another run could see: they return a new
`RunState` whose `rng` field holds the new values, and `with_rng` installs
the state's generators only for the duration of one call. The one exception
is asked for by name: ``set_seed(seed)`` (an int first, Accelerate's call)
seeds the process's own generators, for the code outside the run.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any, ParamSpec, TypeVar, overload

import torch

from fnaccel.checks import is_int
from fnaccel.constants import RNGType
from fnaccel.ops.collectives import broadcast_object_list
from fnaccel.rng import RNGState, installed
from fnaccel.state import RunState

__all__ = ["set_seed", "synchronize_rng_states", "with_rng"]

R = TypeVar("R")
P = ParamSpec("P")

# RNGType member -> RNGState field it synchronises
_FIELDS = MappingProxyType(
    {
        RNGType.PYTHON: "python",
        RNGType.TORCH: "torch",
        RNGType.CUDA: "cuda",
        RNGType.NUMPY: "numpy",
    }
)


@overload
def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None: ...
@overload
def set_seed(state: RunState, seed: int, device_specific: bool = False) -> RunState: ...
def set_seed(*args: Any, **kwargs: Any) -> RunState | None:
    """Seed the process's generators (Accelerate's call), or return a run's state reseeded.

    Two forms, told apart by the first argument:

    - ``set_seed(seed, device_specific=False, deterministic=False)``, as
      Accelerate's: seeds the *process's* generators (Python's ``random``,
      NumPy's, torch's CPU one and every CUDA device's), which code outside a
      run draws from: building the model, splitting the data. No run sees it:
      a run draws from its own generators, seeded by ``fa.init(seed=...)``, or
      copied from the process's at ``fa.init()`` without a seed.
      ``device_specific`` adds the process's global rank (``RANK``, as the
      launcher sets it; 0 without one); ``deterministic`` also calls
      ``torch.use_deterministic_algorithms(True)``, for the whole process.
    - ``set_seed(state, seed, device_specific=False)``: the *run's* generators
      (dropout in its steps) as if seeded with ``seed``, in a new state (the
      old one is not consumed); the process's generators are left alone.
      ``device_specific`` adds the run's rank, so each rank draws differently;
      ``state.seed`` stays ``seed`` on every rank, so a loader prepared after it
      keeps one global order (``fa.init(seed=..., device_specific=True)`` is the
      same from the start).

    >>> import random, fnaccel as fa
    >>> fa.set_seed(3); first = random.random()
    >>> fa.set_seed(3); first == random.random()
    True
    >>> state = fa.set_seed(fa.init(cpu=True), 42)
    >>> state.seed
    42
    """
    first = args[0] if args else kwargs.get("state", kwargs.get("seed"))
    if isinstance(first, RunState):
        return _seed_run(*args, **kwargs)
    if is_int(first):
        _seed_process(*args, **kwargs)
        return None
    raise TypeError(
        f"set_seed: got a {type(first).__name__} first; set_seed(seed) seeds the process's "
        "generators (as Accelerate's), set_seed(state, seed) the run's (seed an int)"
    )


def _seed_process(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    if device_specific:
        rank = os.environ.get("RANK", "0")
        if not rank.isdigit():
            raise ValueError(
                f"set_seed: device_specific adds the process's rank, but RANK={rank!r} is not one; "
                "unset it or launch with fnaccel launch / torchrun"
            )
        seed += int(rank)
    seeded = RNGState.seeded(seed)
    seeded.install()
    if deterministic:
        torch.use_deterministic_algorithms(True)


def _seed_run(state: RunState, seed: int, device_specific: bool = False) -> RunState:
    if not is_int(seed):
        raise TypeError(
            f"set_seed: seed must be an int, got {type(seed).__name__}; set_seed(seed) seeds the "
            "process's generators, set_seed(state, seed) the run's"
        )
    # state.seed stays the run's seed on every rank: the loader's order is shuffled with it
    return state.replace(rng=RNGState.seeded(seed + state.dist.rank if device_specific else seed), seed=seed)


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
    state: RunState, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs
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
