"""`ProfileKwargs`: the `torch.profiler.profile` settings, and the profiler they build.

A kwargs handler like those of `fnaccel.kwargs` (importable from there too),
kept apart for its own helpers: the activity table and the Chrome trace writer.

>>> ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2}).to_kwargs()
{'schedule_option': {'wait': 1, 'warmup': 1, 'active': 2}}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from fnaccel.constants import PROFILE_PATTERN_NAME
from fnaccel.kwargs_handler import KwargsHandler, check_value, is_int, require

__all__ = ["ProfileKwargs"]

_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first", "skip_first_wait")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileKwargs(KwargsHandler):
    """Arguments for `torch.profiler.profile`; `build()` makes the profiler.

    Args:
        activities: Names of the activities to profile ("cpu", "cuda", "xpu", ...);
            None profiles every activity torch supports here. Stored as a tuple.
        schedule_option: Keyword arguments of `torch.profiler.schedule`: `wait`,
            `warmup` and `active` are required; `repeat`, `skip_first` optional.
        on_trace_ready: Called with the profiler each time a trace is ready.
        record_shapes: Record operator input shapes.
        profile_memory: Track tensor memory allocation and release.
        with_stack: Record source file and line of each operator.
        with_flops: Estimate the FLOPs of some operators.
        with_modules: Record the module hierarchy of each operator.
        output_trace_dir: A directory where a Chrome trace `profile_<rank>.json`
            is written each time a trace is ready (so it holds the last one).

    >>> kw = ProfileKwargs(activities=["cpu"], record_shapes=True)
    >>> kw.to_kwargs()
    {'activities': ('cpu',), 'record_shapes': True}
    >>> with kw.build() as prof:
    ...     _ = torch.ones(8) * 2
    >>> len(prof.key_averages()) > 0
    True
    """

    activities: Sequence[str] | None = None
    schedule_option: Mapping[str, int] | None = None
    on_trace_ready: Callable[[torch.profiler.profile], Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | os.PathLike[str] | None = None

    def _validate(self) -> None:
        if self.activities is not None:
            known = list(_profiler_activities())
            check_value("activities", self.activities, isinstance(self.activities, Sequence)
                   and not isinstance(self.activities, str), "a list of names", "e.g. ['cpu', 'cuda']")
            names = tuple(str(a).lower() for a in self.activities)
            unknown = [a for a in names if a not in known]
            require(not unknown, f"unknown profiler activities {unknown}: use among {', '.join(known)}")
            object.__setattr__(self, "activities", names)
        if self.schedule_option is not None:
            check_value("schedule_option", self.schedule_option, isinstance(self.schedule_option, Mapping), "a dict")
            options = dict(self.schedule_option)
            unknown = sorted(set(options) - set(_SCHEDULE_KEYS))
            require(not unknown, f"unknown schedule_option keys {unknown}: use among {', '.join(_SCHEDULE_KEYS)}")
            missing = [k for k in ("wait", "warmup", "active") if k not in options]
            require(not missing, f"schedule_option lacks {missing}: give wait, warmup and active")
            bad = {k: v for k, v in options.items() if not (is_int(v) and v >= 0)}
            require(not bad, f"schedule_option values must be ints >= 0, got {bad}")
            require(options["active"] >= 1, "schedule_option active must be >= 1: profile at least one step")
            object.__setattr__(self, "schedule_option", MappingProxyType(options))
        check_value("on_trace_ready", self.on_trace_ready, self.on_trace_ready is None or callable(self.on_trace_ready),
               "callable")
        out = self.output_trace_dir
        if out is not None:
            check_value("output_trace_dir", out, isinstance(out, (str, os.PathLike)) and os.fspath(out) != "",
                   "a directory path")
            object.__setattr__(self, "output_trace_dir", os.fspath(out))

    def build(self, *, process_index: int = 0) -> torch.profiler.profile:
        """Builds a `torch.profiler.profile` from these settings.

        Args:
            process_index: The rank, naming the trace file `profile_<process_index>.json`.

        Returns:
            The profiler, to be used as a context manager.
        """
        activities = None
        if self.activities is not None:
            table = _profiler_activities()
            activities = [table[name] for name in self.activities]
        schedule = None if self.schedule_option is None else torch.profiler.schedule(**self.schedule_option)
        on_trace_ready = self.on_trace_ready
        if self.output_trace_dir is not None:
            path = os.path.join(self.output_trace_dir, PROFILE_PATTERN_NAME.format(suffix=process_index))
            on_trace_ready = _chrome_trace_writer(path, then=on_trace_ready)
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


def _profiler_activities() -> dict[str, torch.profiler.ProfilerActivity]:
    return {name.lower(): act for name, act in torch.profiler.ProfilerActivity.__members__.items()}


def _chrome_trace_writer(
    path: str, *, then: Callable[[torch.profiler.profile], Any] | None
) -> Callable[[torch.profiler.profile], None]:
    def on_trace_ready(prof: torch.profiler.profile) -> None:
        if then is not None:
            then(prof)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prof.export_chrome_trace(path)

    return on_trace_ready
