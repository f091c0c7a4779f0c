"""Collective fnaccel calls agree, or every rank ends naming what each was doing.

Code such as ``if master_process: fa.save(state, ...)`` makes one rank enter a
collective call that the others never reach: they go on into ``fa.step``, whose
gradient all-reduce waits for the saving rank, which waits for them. Without a
check both wait for the process group's timeout (10 minutes) and end with
gloo's raw text. Here (principle 10):

- Each rank keeps a plain record of the fnaccel call it is in (`Calls.call`,
  and its micro-step and update counts): attribute writes, no communication,
  so ``fa.step``'s success path pays a few nanoseconds.
- A daemon thread per run (`Calls.start`, ended by ``fa.shutdown``) waits on
  the run's store, on its own connection (the C++ wait releases the GIL), for
  questions from other ranks and answers them with that record.
- The collective calls that start with no data moving yet (``fa.save``,
  ``fa.load``, ``fa.evaluate``, ``fa.shutdown``) first agree through the store
  (`Calls.agree`): each rank writes the call's name under the call's sequence
  number and waits, for ``FNACCEL_COLLECTIVE_TIMEOUT`` seconds at a time
  (default 30), for every other rank's. All there and equal: the call goes on.
  Different names: every rank raises the same `CollectiveCallError` at once.
  A rank still missing after the wait is asked what it is doing: one that is
  behind (an earlier micro-step) is waited for again; one that went past this
  point (a later micro-step, or another collective at it) never comes, and
  every rank is told why.
- The rank that found it writes one message (first writer wins) under the
  store's abort key and in every other rank's mailbox, then raises. A rank
  blocked in a collective (DDP's all-reduce inside ``fa.step``, an ``fa.ops``
  call) is released when the detecting process exits and closes its
  connections; its ``fa.step`` or ``fa.ops`` boundary then raises the same
  message instead of gloo's text (`failure_of`). If nothing releases it within
  `RELEASE_SECONDS` (the detecting process caught the error and lives on), its
  watcher prints the message and ends the process: a known dead run never
  waits for the process group's timeout.

Nothing here waits on the error path: the message is read from what the
watcher already received, or with one non-blocking check of the store.

A leaf module: it imports nothing from fnaccel above the leaves.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import MappingProxyType
from typing import Any, ParamSpec, TypeVar

from fnaccel._errors import CollectiveCallError, ConfigError
from fnaccel.resources import exception_in_flight

__all__ = ["COLLECTIVE_TIMEOUT_ENV", "Calls", "calls_of", "collective", "collective_timeout", "failure_of"]

P = ParamSpec("P")
T = TypeVar("T")

COLLECTIVE_TIMEOUT_ENV = "FNACCEL_COLLECTIVE_TIMEOUT"

# Seconds a rank waits in a collective call for the others before asking them
# where they are: a mismatch is found within this, and every rank has ended
# within it plus RELEASE_SECONDS (60 s in all by default).
DEFAULT_COLLECTIVE_TIMEOUT = 30.0

# How long a rank told of a mismatch gives its main thread to raise it (released
# by the detecting process's exit) before its watcher ends the process.
RELEASE_SECONDS = 10.0

# How long a question to another rank's watcher waits for the answer.
_ANSWER_SECONDS = 5.0

# What to do, by call; others get the generic sentence.
_FIXES = MappingProxyType(
    {
        "fa.save": "fa.save is collective; call it on every rank, and guard only your own files "
        "with state.dist.is_main_process",
        "fa.load": "fa.load is collective; call it on every rank (each reads its own part)",
        "fa.evaluate": "fa.evaluate is collective (each rank evaluates its share of the loader); call it "
        "on every rank and print its result on the main process only",
        "fa.shutdown": "fa.shutdown is collective on a clean end; call it on every rank after its last "
        "collective call",
    }
)


def collective_timeout() -> float:
    """``FNACCEL_COLLECTIVE_TIMEOUT`` in seconds (default 30), checked.

    >>> collective_timeout()
    30.0
    """
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    if raw == "":
        return DEFAULT_COLLECTIVE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ConfigError(
            f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} must be a positive number of seconds (how long a rank "
            f"waits in a collective call before asking the others where they are); unset it for "
            f"the default, {DEFAULT_COLLECTIVE_TIMEOUT:g}"
        )
    return value


def _fix(call: str) -> str:
    return _FIXES.get(call, f"{call} is collective; call it on every rank")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _doing(record: dict[str, Any]) -> str:
    """What a rank's record says it is doing, in the message's words."""
    call, step = record.get("call"), record.get("step")
    if call is None:
        return f"is in your code after {record.get('last') or 'its last fnaccel call'} at step {step}"
    return f"is in {call} at step {step}"


class Calls:
    """This rank's record of its current fnaccel call, the run's agreement on
    collective calls, and the watcher that answers the other ranks.

    The main thread writes ``call`` (the fnaccel call in progress, None in the
    user's code), ``last`` (the last one), ``micro_step`` and ``step`` (counts
    done before it); the watcher reads them. Built by `start`, held by the
    group's owner (``owner.calls``) and registered with the run's resources,
    which close it before the group.
    """

    __slots__ = (
        "_closed",
        "_generation",
        "_picked",
        "_rank",
        "_size",
        "_store",
        "_thread",
        "abort",
        "call",
        "last",
        "limit",
        "micro_step",
        "seq",
        "step",
        "timeout",
    )

    def __init__(
        self, store: Any, watcher_store: Any, rank: int, size: int, timeout: float, limit: float
    ) -> None:
        self.call: str | None = None
        self.last: str | None = None
        self.micro_step = 0
        self.step = 0
        self.seq = 0
        self.abort: str | None = None
        self.timeout = timeout
        self.limit = limit
        self._rank, self._size = rank, size
        self._store = store
        self._generation = 0
        self._picked = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=_watch, args=(self, watcher_store), name=f"fnaccel-calls-rank{rank}", daemon=True
        )
        self._thread.start()
        atexit.register(self._exiting)

    @classmethod
    def start(cls, group: Any, rank: int, size: int, timeout: float, limit: timedelta) -> Calls | None:
        """The record and watcher of a run over ``group``; None when the group's store
        cannot be shared with a thread (then no mismatch is named, as before).

        Args:
            group: the run's process group.
            rank, size: this rank and the group's size.
            timeout: `collective_timeout`.
            limit: the process group's timeout, which bounds every wait here too.
        """
        import torch.distributed as dist

        try:
            store = dist.PrefixStore("fnaccel_calls/", group.get_group_store())
            watcher_store = store.clone()  # type: ignore[attr-defined]  # torch's stub lacks it
        except (AttributeError, RuntimeError, NotImplementedError):
            return None  # a store without clone (hash, file, fake): nothing to answer with
        return cls(store, watcher_store, rank, size, timeout, limit.total_seconds())

    def renew(self) -> None:
        """Forget the calls so far (every rank alike): `fnaccel.testing.World` runs each
        task on the same group as if it were a new run."""
        self._generation += 1
        self.call = self.last = self.abort = None
        self.seq = self.micro_step = self.step = 0
        self._picked.clear()

    def _key(self, name: str) -> str:
        return f"g{self._generation}/{name}"

    # -- the main thread ------------------------------------------------------------------

    def agree(self, call: str, micro_step: int, step: int) -> None:
        """Enter the collective ``call``: wait until every rank entered it too.

        Raises:
            CollectiveCallError: the ranks are in different calls, or one went
                past this one; or another rank found a mismatch first.
        """
        if self.abort is not None:
            self._raise(self.abort)
        self.seq += 1
        self.call, self.micro_step, self.step = call, micro_step, step
        store, seq = self._store, self.seq
        keys = [self._key(f"enter/{seq}/{r}") for r in range(self._size)]
        store.set(keys[self._rank], call)
        others = [key for r, key in enumerate(keys) if r != self._rank]
        waited = 0.0
        silent: set[int] = set()
        while True:
            if _poll(store, others, self.timeout):
                break
            waited += self.timeout
            if store.check([self._key("abort")]):
                self._raise(store.get(self._key("abort")).decode())
            missing = [r for r, key in enumerate(keys) if r != self._rank and not store.check([key])]
            if not missing:
                break
            message, silent = self._verdict(call, missing, silent)
            if message is not None:
                self._raise(self._publish(message))
            if waited >= self.limit:
                self._raise(
                    self._publish(
                        f"{call} was called on every rank but {_ranks(missing)}, which did not reach it within "
                        f"the process group's timeout ({self.limit:g} s): {_fix(call)}"
                    )
                )
        names = [value.decode() for value in store.multi_get(keys)]
        if len(set(names)) > 1:
            table = ", ".join(f"rank {r}: {name}" for r, name in enumerate(names))
            self._raise(
                f"the ranks made different collective calls at the same point ({table}): every "
                "rank must make the same collective fnaccel calls in the same order"
            )

    def done(self) -> None:
        """Leave the current call (back in the user's code)."""
        self.last, self.call = self.call, None

    def _verdict(self, call: str, missing: list[int], silent: set[int]) -> tuple[str | None, set[int]]:
        """Ask the missing ranks what they are doing: the message if some went past
        this call (or stayed silent twice), else None (they are behind: wait on)."""
        records = self._ask(missing)
        past = []
        now_silent = {r for r in missing if records.get(r) is None}
        for rank in missing:
            record = records.get(rank)
            if record is None:
                continue
            if self._is_past(record):
                past.append(f"rank {rank} {_doing(record)}")
        if past:
            inside = [r for r in range(self._size) if r not in missing]
            return (
                f"{call} was called on {_ranks(inside)} only ({', '.join(past)}): {_fix(call)}",
                now_silent,
            )
        gone = sorted(now_silent & silent)
        if gone:
            return (
                f"{call}: {_ranks(gone)} did not reach it and did not answer (exited, or stuck "
                f"outside fnaccel) for {self.timeout * 2:g} s: {_fix(call)}",
                now_silent,
            )
        return None, now_silent

    def _is_past(self, record: dict[str, Any]) -> bool:
        """Whether a rank that has not entered this call went past the point where this
        rank entered it: at a later sequence, or at a later micro-step, or in a step or
        another collective call at this one."""
        if record.get("generation") != self._generation:
            return False  # an answer about an earlier task of the same processes
        seq, micro = record["seq"], record["micro_step"]
        if seq != self.seq - 1:
            return bool(seq > self.seq)  # == : it is entering this call now; < : behind
        if record["call"] is None:
            return bool(micro > self.micro_step)
        return bool(micro >= self.micro_step)

    def _ask(self, ranks: Sequence[int]) -> dict[int, dict[str, Any] | None]:
        """Each rank's record, from its watcher; None for one that did not answer."""
        store = self._store
        replies = {}
        for rank in ranks:
            reply = self._key(f"reply/{self._rank}/{self.seq}/{rank}")
            store.delete_key(reply)
            self._post(rank, "?" + reply)
            replies[rank] = reply
        records: dict[int, dict[str, Any] | None] = {}
        for rank, reply in replies.items():
            answered = _poll(store, [reply], _ANSWER_SECONDS)
            records[rank] = json.loads(store.get(reply)) if answered else None
        return records

    def _post(self, rank: int, payload: str) -> None:
        count = self._store.add(f"box/{rank}/count", 1)
        self._store.set(f"box/{rank}/{count - 1}", payload)

    def _publish(self, message: str) -> str:
        """Make ``message`` the run's one cause (unless another rank's was first) and
        hand it to every other rank's watcher; returns the cause."""
        store, key = self._store, self._key("abort")
        first: str = store.compare_set(key, "", message).decode()
        if first == message:
            for rank in range(self._size):
                if rank != self._rank:
                    self._post(rank, f"!{self._generation}|{message}")
        return first

    def _raise(self, message: str) -> None:
        self.abort = message
        self._picked.set()
        raise CollectiveCallError(message)

    def failure(self) -> CollectiveCallError | None:
        """The named cause of a collective that just failed here, if a rank found a
        mismatch: from the watcher, or one non-blocking look at the store."""
        message = self.abort
        if message is None:
            key = self._key("abort")
            try:
                if self._store.check([key]):
                    message = self._store.get(key).decode()
            except RuntimeError:
                return None  # the store is gone too: nothing to name
        if message is None:
            return None
        self.abort = message
        self._picked.set()
        return CollectiveCallError(message)

    def _exiting(self) -> None:
        """At a clean interpreter exit without ``fa.shutdown``: enter its agreement without
        waiting, as the group's exit handler ends the run too, so that a rank that did
        call ``fa.shutdown`` agrees with this one instead of asking where it is."""
        if self._closed or exception_in_flight():
            return
        with contextlib.suppress(RuntimeError):  # the store is gone: the others learn it from their own waits
            self._store.set(self._key(f"enter/{self.seq + 1}/{self._rank}"), "fa.shutdown")

    # -- the watcher ----------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        return {
            "call": self.call,
            "last": self.last,
            "micro_step": self.micro_step,
            "step": self.step,
            "seq": self.seq,
            "generation": self._generation,
        }

    def close(self) -> None:
        """Stop the watcher (on a clean end; while an exception propagates it is left
        to the process's exit, as nothing on that path may wait)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._exiting)
        if exception_in_flight():
            return
        try:
            self._post(self._rank, "stop")
        except RuntimeError:
            return  # the store is gone: the daemon thread ends with the process
        self._thread.join(timeout=_ANSWER_SECONDS)


def _poll(store: Any, keys: list[str], seconds: float) -> bool:
    """Whether all ``keys`` are set within ``seconds``: looked at every few milliseconds
    (the store's own timed wait logs two warnings each time it expires)."""
    deadline = time.monotonic() + seconds
    pause = 0.0005
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


def _watch(calls: Calls, store: Any) -> None:
    """The watcher thread: answer questions, take a mismatch's message, and end a
    process that cannot raise it (see the module docstring)."""
    rank = calls._rank
    count = 0
    forever = timedelta(days=365)
    while True:
        key = f"box/{rank}/{count}"
        try:
            store.wait([key], forever)
            payload = store.get(key).decode()
            store.delete_key(key)
        except RuntimeError:
            return  # the store went away: the run is over
        count += 1
        if payload == "stop":
            return
        if payload.startswith("?"):
            try:
                store.set(payload[1:], json.dumps(calls.record()))
            except RuntimeError:
                return
            continue
        generation, _, message = payload[1:].partition("|")
        if int(generation) != calls._generation:
            continue
        calls.abort = message
        if calls._picked.wait(RELEASE_SECONDS):
            continue
        # nothing released the main thread (its peer lives on): end the run here
        print(f"fnaccel: rank {rank}: {CollectiveCallError.__name__}: {message}", file=sys.stderr, flush=True)
        os._exit(1)


def failure_of(owner: Any, error: BaseException) -> CollectiveCallError | None:
    """The `CollectiveCallError` to raise instead of ``error`` (torch's, from a
    collective that broke) when a rank named a mismatch; None otherwise."""
    calls: Calls | None = getattr(owner, "calls", None)
    if calls is None or not isinstance(error, RuntimeError) or isinstance(error, CollectiveCallError):
        return None
    return calls.failure()


def calls_of(owner: Any) -> Calls | None:
    """The `Calls` of a group's owner (a `DistContext.group_owner`); None in a world of
    one, or where the group's store could not be shared."""
    return None if owner is None else owner.calls


def collective(call: str) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """Make a function that takes a `RunState` first a collective fnaccel call named
    ``call``: on a distributed run every rank agrees on it first (`Calls.agree`).

    Not while an exception propagates (``fa.shutdown`` in a ``finally``): nothing
    on the error path waits for another rank.
    """

    def wrap(function: Callable[P, T]) -> Callable[P, T]:
        @functools.wraps(function)
        def agreed(*args: P.args, **kwargs: P.kwargs) -> T:
            state: Any = args[0]
            calls = calls_of(state.dist.group_owner)
            if calls is None or calls._closed or sys.exc_info()[1] is not None:
                return function(*args, **kwargs)
            calls.agree(call, state.micro_step, state.step)
            try:
                return function(*args, **kwargs)
            finally:
                calls.done()

        return agreed

    return wrap
