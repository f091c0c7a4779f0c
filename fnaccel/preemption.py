"""Preemption-aware loops: a signal ends `fa.batches` at an update boundary on every rank.

Slurm and Kubernetes send SIGTERM (Slurm, with ``--signal=USR1@90``, SIGUSR1
earlier) and kill a grace period later. With `PreemptionKwargs` passed to
`fa.init`, the run's state installs a handler for those signals that only
records the signal (async-signal-safe: one attribute store, run by Python in the
main thread). `fa.batches` asks the run's `SignalWatch` before each fetch;
once any rank has received a signal, every rank's `fa.batches` ends at the same
micro-step, the first update boundary (a multiple of the accumulation window)
after they agreed, and ``state.preempted`` names the signal. The loop then saves
and exits.

Agreement costs one all-reduce of one integer every ``check_every`` micro-steps,
started asynchronously and read ``check_every`` micro-steps later (when it has
long completed), so it adds no wait and no host sync with the step's work (on
CUDA the result is copied to pinned memory behind an event). Every rank checks
at the same micro-steps, so every rank decides alike. One process needs no
collective and checks before every batch.

A signal is heard wherever it lands: each `fa.batches` loop starts with one
blocking agreement (a signal during `fa.prepare`, a warm-up or an evaluation
between epochs stops the run before its first batch), `fa.evaluate` agrees
every ``check_every`` batches and stops at a batch boundary, and a save in
flight runs to its end (the handler only records; a save is atomic anyway).

Under `fnaccel launch`, the watch tells the launcher how the run ended, in the
launch directory (`fnaccel.constants.LAUNCH_DIR_ENV`): ``preempted.<rank>`` once
the ranks agreed, ``finished.<rank>`` when the run ends unpreempted and without
an exception. The launcher's exit status follows (docs/cli.md, "Exit status").

The handlers belong to the run: `fa.shutdown` puts back the handlers that were
there before, so none outlives the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import TypeVar

import torch
import torch.distributed as dist

from fnaccel.checks import check_value, is_int
from fnaccel.constants import FINISHED_MARK, LAUNCH_DIR_ENV, PREEMPTED_MARK
from fnaccel.dist import DistContext
from fnaccel.kwargs.mixin import KwargsHandler
from fnaccel.resources import Resources, exception_in_flight

__all__ = ["PreemptionKwargs", "SignalWatch", "install"]

# a batch, passed through as the loop reads it
T = TypeVar("T")

# The resource name under which a run holds its watch (`state.resources`).
RESOURCE = "preemption"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PreemptionKwargs(KwargsHandler):
    """Opt-in to preemption-aware loops: pass it to ``fa.init(kwargs_handlers=[...])``.

    Args:
        signals: the signals that ask the run to stop, by name or number
            (SIGKILL and SIGSTOP cannot be caught).
        check_every: micro-steps between two agreements of the ranks; the run
            stops at most ``2 * check_every`` micro-steps plus one accumulation
            window after the first signal. One process checks every micro-step.

    >>> PreemptionKwargs(signals=("SIGTERM",), check_every=4).signals
    ('SIGTERM',)
    >>> PreemptionKwargs(signals=("SIGKILL",))  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ValueError: signals must be names or numbers of signals that ask a job to stop, got ('SIGKILL',):
    SIGKILL and SIGSTOP cannot be caught; use e.g. ('SIGTERM', 'SIGUSR1')
    """

    signals: tuple[str | int, ...] = ("SIGTERM", "SIGUSR1")
    check_every: int = 8

    def _validate(self) -> None:
        single = isinstance(self.signals, (str, bytes, int))  # a name, not a tuple of names
        check_value(
            "signals",
            self.signals,
            not single,
            "a tuple of signal names or numbers",
            f"write signals=({self.signals!r},)",
        )
        object.__setattr__(self, "signals", tuple(self.signals))
        problems = list(dict.fromkeys(p for p in map(_signal_problem, self.signals) if p is not None))
        check_value(
            "signals",
            self.signals,
            bool(self.signals) and not problems,
            "names or numbers of signals that ask a job to stop",
            "; ".join(problems or ["give at least one"]) + "; use e.g. ('SIGTERM', 'SIGUSR1')",
        )
        check_value(
            "check_every", self.check_every, is_int(self.check_every) and self.check_every >= 1, "an int >= 1"
        )

    @property
    def signal_numbers(self) -> tuple[signal.Signals, ...]:
        """The signals as `signal.Signals`, each once."""
        return tuple(dict.fromkeys(_to_signal(s) for s in self.signals))


def _to_signal(value: str | int) -> signal.Signals:
    return signal.Signals[value] if isinstance(value, str) else signal.Signals(value)


# What a scheduler or a person sends to ask a job to stop: Slurm's --signal and scancel, Kubernetes'
# and most schedulers' SIGTERM, Ctrl-C, a hang-up, a CPU-time or power limit, the real-time range.
_STOP_SIGNALS = frozenset(
    getattr(signal, name)
    for name in (
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGXCPU",
        "SIGALRM",
        "SIGPWR",
        "SIGRTMIN",
        "SIGRTMAX",
    )
    if hasattr(signal, name)
)
# A fault in the process: its handler cannot make the run go on (for SIGSEGV, returning from the
# handler runs the faulting instruction again, and the process hangs)
_FAULTS = frozenset(
    getattr(signal, name)
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")
    if hasattr(signal, name)
)


def _signal_problem(value: object) -> str | None:
    """Why ``value`` cannot be one of `PreemptionKwargs`' signals, or None."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return f"{value!r} is not a signal name or number" + (
            " (a bool would be read as signal 1, SIGHUP)" if isinstance(value, bool) else ""
        )
    try:
        sig = _to_signal(value)
    except (KeyError, ValueError):
        return f"{value!r} is not a signal of this system"
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        return "SIGKILL and SIGSTOP cannot be caught"
    if sig in _FAULTS:
        return f"{sig.name} reports a fault in this process, which a handler cannot let the run survive"
    if sig == getattr(signal, "SIGCHLD", None):
        return "SIGCHLD arrives whenever a child process ends (every DataLoader worker's exit)"
    if sig not in _STOP_SIGNALS:
        return f"{sig.name} does not ask a job to stop (those are {', '.join(sorted(s.name for s in _STOP_SIGNALS))})"
    return None


def check_main_thread() -> None:
    """Raise unless called from the main thread, the only one that may set signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "fa.init(kwargs_handlers=[PreemptionKwargs(...)]) installs signal handlers, which Python "
            f"allows only in the main thread, but it was called from thread "
            f"{threading.current_thread().name!r}; call fa.init from the main thread, or leave "
            "PreemptionKwargs out in this thread"
        )


class SignalWatch:
    """The run's signal handlers and the ranks' agreement on stopping (a run resource).

    Attributes:
        received: the first watched signal this process received, or None.
        reason: the agreed signal's name (the highest-numbered one any rank
            received), set on every rank at the same micro-step; None until then.
    """

    def __init__(self, handler: PreemptionKwargs, ctx: DistContext) -> None:
        self.received: int | None = None
        self.reason: str | None = None
        self._check_every = handler.check_every if ctx.num_processes > 1 else 1
        self._ctx = ctx
        self._checked_at: int | None = None
        self._pending: tuple[dist.Work, torch.Tensor, torch.cuda.Event | None] | None = None
        # each signal's handler before ours, put back by `close`
        self._previous: dict[signal.Signals, Callable[[int, FrameType | None], object] | int | None] = {}
        self._launch_dir = os.environ.get(LAUNCH_DIR_ENV)  # under fnaccel launch: how the run ended
        for sig in handler.signal_numbers:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only a store: Python runs this between two bytecodes of the main thread.
        if self.received is None:
            self.received = signum

    def guard(self, batches: Iterable[T], micro_step: int, window: int) -> Iterator[T]:
        """``batches`` until the ranks agree to stop, ending at an update boundary.

        Args:
            batches: the loader's batches.
            micro_step: the micro-step the first batch will be stepped at.
            window: micro-steps per update (the accumulation window).
        """
        self._agree_now()
        self._checked_at = micro_step  # the exchange it left in flight is read at the next check
        iterator = iter(batches)
        while not self._stops_before(micro_step, window):
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
            micro_step += 1

    def _stops_before(self, micro_step: int, window: int) -> bool:
        if self.reason is None and micro_step % self._check_every == 0 and micro_step != self._checked_at:
            self._checked_at = micro_step
            self._agree()
        return self.reason is not None and micro_step % window == 0

    def evaluation_stops(self, index: int) -> bool:
        """Whether `fa.evaluate` stops before its batch ``index`` (every rank alike): it agrees
        every ``check_every`` batches, as the training loop does, and never before batch 1."""
        if self.reason is None and index % self._check_every == 0:
            self._agree()
        return self.reason is not None and index > 0

    def _agree_now(self) -> None:
        """One blocking agreement, at the start of a loop: a signal that came while the run
        prepared or evaluated stops it before the loop's first batch."""
        if self.reason is not None:
            return
        self._agree()  # reads the exchange in flight, if any: the ranks' collectives stay in one order
        if self.reason is None and self._pending is not None:
            self._agree()

    def _agreed(self, signum: int) -> None:
        self.reason = signal.Signals(signum).name
        self._mark(PREEMPTED_MARK, self.reason)

    def _mark(self, name: str, text: str = "") -> None:
        """Tell `fnaccel launch` (if it started this process) how the run ended."""
        if self._launch_dir is not None:
            path = os.path.join(self._launch_dir, f"{name}.{self._ctx.rank}")
            # only the launcher's exit status depends on it
            with contextlib.suppress(OSError), open(path, "w", encoding="utf-8") as file:
                file.write(text)

    def _agree(self) -> None:
        """Read the exchange started ``check_every`` micro-steps ago, start the next one."""
        ctx = self._ctx
        if ctx.num_processes == 1:
            if self.received is not None:
                self._agreed(self.received)
            return
        if self._pending is not None:
            work, result, event = self._pending
            self._pending = None
            work.wait()
            if event is not None:
                event.synchronize()
            agreed = int(result.item())
            if agreed:
                self._agreed(agreed)
                return
        flag = torch.tensor([self.received or 0], dtype=torch.int32, device=ctx.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.process_group, async_op=True)
        event = None
        if flag.device.type == "cuda":
            # The stream waits for the all-reduce, then copies behind an event: reading it
            # later waits for this point only, not for the steps enqueued since.
            work.wait()
            result = torch.empty(1, dtype=torch.int32, pin_memory=True)
            result.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            result = flag
        self._pending = (work, result, event)

    def close(self) -> None:
        """Put back the handlers that were installed before; may be called twice."""
        if not self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "fa.shutdown restores the signal handlers PreemptionKwargs installed, which "
                "Python allows only in the main thread; call fa.shutdown from the main thread"
            )
        for sig, previous in self._previous.items():
            # None: the previous handler was not set from Python; the default is the closest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}
        if self.reason is None and not exception_in_flight():
            self._mark(FINISHED_MARK)  # a signal from now on finds a finished run
        pending, self._pending = self._pending, None
        if pending is not None and not exception_in_flight():
            pending[0].wait()  # every rank started it: let it finish before the group ends


def install(resources: Resources, handler: PreemptionKwargs, ctx: DistContext) -> SignalWatch:
    """Install ``handler``'s signal handlers for the run owning ``resources``; `fa.init` calls it.

    Raises:
        RuntimeError: called outside the main thread.

    >>> import signal, fnaccel as fa
    >>> state = fa.init(cpu=True, kwargs_handlers=[fa.PreemptionKwargs(signals=("SIGUSR2",))])
    >>> signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL, state.preempted
    (False, None)
    >>> fa.shutdown(state)
    >>> signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
    True
    """
    check_main_thread()
    return resources.register(RESOURCE, SignalWatch(handler, ctx))
