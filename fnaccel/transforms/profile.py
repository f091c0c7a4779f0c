"""`profile(...)`: torch.profiler around the steps, with `ProfileKwargs`' options.

The profiler starts at `fa.prepare`, advances after every micro-step (so a
``schedule_option`` counts batches), and stops at `fa.shutdown`; chrome
traces go to ``output_trace_dir`` as ``profile_<rank>.json``.
"""

from __future__ import annotations

from typing import Any

import torch

from fnaccel.dist import DistContext
from fnaccel.kwargs import ProfileKwargs
from fnaccel.transforms.kinds import Transform, options
from fnaccel.transforms.phases import Phase

__all__ = ["profile"]


class ProfilerRun:
    """The transform's state: the running profiler; `close` (from `fa.shutdown`)
    stops it once, which writes the trace."""

    __slots__ = ("profiler", "running")

    def __init__(self, profiler: torch.profiler.profile) -> None:
        self.profiler, self.running = profiler, True

    def close(self) -> None:
        if self.running:
            self.running = False
            self.profiler.stop()


def profile(**kwargs: Any) -> Transform:
    """Profile the training steps (`ProfileKwargs` fields as keyword arguments).

    >>> import fnaccel as fa
    >>> fa.profile(record_shapes=True)
    profile(record_shapes=True)
    """
    handler = ProfileKwargs(**kwargs)

    def init(ctx: DistContext) -> ProfilerRun:
        profiler = handler.build(process_index=ctx.rank)
        profiler.start()
        return ProfilerRun(profiler)

    def after_step(run: ProfilerRun) -> None:
        run.profiler.step()

    return Transform(
        name="profile",
        options=options(**handler.to_kwargs()),
        phase=Phase.PROFILE,
        init=init,
        after_step=after_step,
    )
