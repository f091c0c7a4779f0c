"""Run functions on N real gloo processes on localhost, without a launcher.

`World` starts N processes once (the expensive part: each imports torch and
joins a process group) and then runs any number of functions on all of them
(not a doctest: the workers must import the function from a module)::

    def total(state, x):
        return fa.ops.reduce(state, torch.tensor(x), "sum").item()

    with World(2) as world:
        assert world.run(total, 1.0) == [2.0, 2.0]

Each call gets, on every rank, a fresh `RunState` (seed 0, CPU) over the
world's process group, plus the arguments. Return values come back in rank
order. An exception on any rank is re-raised here as the same exception type,
with the rank and its remote traceback attached as a note; a rank that hangs
past ``timeout`` or dies gets the world torn down and a clear error. The
functions must be importable by the workers (defined at module level).

Debugging helpers live here too: `verify_resume` (does a user's setup
resume bit for bit, resume after resume, and on one process?) and `find_divergence` (where do two runs part?), see
docs/debugging.md.

The rendezvous follows torchrun: this process hosts the TCP store and the
workers join it as clients (``TORCHELASTIC_USE_AGENT_STORE``), so no port is
guessed.

Each rank is a new interpreter (``spawn``) unless ``preload`` names modules: then
the ranks are forked from multiprocessing's forkserver, one process per caller
that imports this module and the preloaded ones once, so a suite that starts
many worlds pays for importing torch once, not once a rank. A forked rank gets
the caller's environment and thread count of the moment, as a spawned one does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from fnaccel._errors import FnaccelError
from fnaccel.calls import calls_of
from fnaccel.debug.divergence import Divergence, StepDivergence, find_divergence
from fnaccel.debug.resume import verify_resume
from fnaccel.resources import Resources
from fnaccel.rng import RNGState
from fnaccel.runtime import init, shutdown
from fnaccel.state import Lease

__all__ = [
    "Divergence",
    "DistributedTestError",
    "StepDivergence",
    "World",
    "find_divergence",
    "run_distributed",
    "verify_resume",
]

_GRACE_SECONDS = 5.0  # how long the other ranks get to fail too once one failed


class DistributedTestError(FnaccelError):
    """A world's rank died, hung past its timeout, or failed to start."""


class _BorrowedGroup:
    """The world's process group as a task sees it: usable, but the World owns it,
    so a task's `fa.shutdown` does not end it for the tasks after. Each task starts
    with no agreed collective call (``agreed``, see `fnaccel.resources.GroupOwner`):
    a task that failed on one rank leaves nothing behind for the next."""

    __slots__ = ("_owner", "agreed", "calls")

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self.agreed: Any = None
        # the process's record of its fnaccel calls, counted afresh for each task (fnaccel.calls)
        self.calls = owner.calls
        if self.calls is not None:
            self.calls.renew()

    @property
    def group(self) -> Any:
        return self._owner.group

    def mesh(self, name: str) -> Any:
        return self._owner.mesh(name)

    def close(self) -> None:
        """Nothing: the World closes the group when it stops."""


def _preloaded_context(preload: Sequence[str]) -> mp.context.ForkServerContext:
    """multiprocessing's forkserver, importing this module and ``preload`` once for every
    process it forks (`World`'s ranks with ``preload``; a test's own processes). The
    preload takes effect when the server starts: the first caller's in a process."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([__name__, *preload])
    return context


def _worker(rank: int, num_processes: int, port: int, conn: Connection, env: Mapping[str, str]) -> None:
    # the caller's whole environment: a rank forked from the forkserver starts with the server's
    # (the caller's when the server started), which a test may have changed since
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # OpenMP read it when torch was imported: in the forkserver, perhaps unset
        import torch

        torch.set_num_threads(int(threads))
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(num_processes),
        LOCAL_WORLD_SIZE=str(num_processes),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    try:
        base = init(cpu=True, seed=0)
    except BaseException as exc:  # report why this rank could not start
        _report(conn, exc)
        return
    conn.send(("ready", None))
    while True:
        message = conn.recv()
        if message is None:
            break
        function, args, kwargs = message
        owner = base.dist._owner  # None in a world of one: no group to lend
        borrowed = (
            base.dist if owner is None else dataclasses.replace(base.dist, _owner=_BorrowedGroup(owner))
        )
        state = dataclasses.replace(
            base, dist=borrowed, rng=RNGState.seeded(0), _lease=Lease(), resources=Resources()
        )
        try:
            conn.send(("ok", function(state, *args, **kwargs)))
        except BaseException as exc:
            _report(conn, exc)
    # The world's own end is agreed afresh too, as each task's calls are: the last task may
    # have left the ranks' records apart (fa.shutdown on rank 0 and an exit on rank 1), and
    # agreeing from there matched one rank with an old call while the other waited.
    calls = calls_of(base.dist.group_owner)
    if calls is not None:
        calls.renew()
    shutdown(base)
    conn.close()


def _report(conn: Connection, exc: BaseException) -> None:
    """Send a rank's exception to the caller: the exception itself when it can
    cross the pipe (send serialises it whole before writing), else its traceback."""
    text = "".join(traceback.format_exception(exc))
    try:
        conn.send(("error", (exc, type(exc).__name__, text)))
    except Exception:
        conn.send(("error", (None, type(exc).__name__, text)))


class World:
    """N worker processes in one gloo process group; see the module docstring.

    Args:
        num_processes: how many ranks.
        timeout: seconds each `run` may take before the world is torn down.
        start_timeout: seconds the workers may take to start and join the group.
        env: extra environment variables for the workers (e.g.
            ``{"FNACCEL_DEBUG_MODE": "1"}``).
        preload: modules the ranks start with imported (e.g. ``("torch._dynamo",)``,
            which every optimizer imports): given, the ranks are forked from
            multiprocessing's forkserver, which imports them and this module once
            (a spawned rank spends about 3 s of CPU importing torch, fnaccel and
            ``torch._dynamo``). The first world with a preload in a process starts
            the server with its modules; it serves the later ones too.
    """

    def __init__(
        self,
        num_processes: int = 2,
        *,
        timeout: float = 120.0,
        start_timeout: float = 120.0,
        env: Mapping[str, str] | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        import torch.distributed as dist

        if num_processes < 1:
            raise ValueError(f"World needs at least one process, got {num_processes}")
        self.num_processes = num_processes
        self.timeout = timeout
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=start_timeout),
        )
        worker_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        context = _preloaded_context(preload) if preload else mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(num_processes):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker,
                args=(rank, num_processes, self._store.port, child, worker_env),
                name=f"fnaccel-world-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start", start_timeout)

    @property
    def alive(self) -> bool:
        """True while every worker is running and usable."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``function(state, *args, **kwargs)`` on every rank; return the results
        in rank order. Re-raises the lowest failing rank's exception."""
        if not self.alive:
            raise DistributedTestError("this World was closed or broke; create a new one")
        for conn in self._conns:
            conn.send((function, args, kwargs))
        return self._collect(getattr(function, "__name__", repr(function)), self.timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {self._procs[rank].sentinel: rank for rank in range(self.num_processes)}
        while waiting:
            now = time.monotonic()
            if now >= deadline:
                break
            ready = wait([*waiting, *sentinels], timeout=deadline - now)
            for item in ready:
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        replies[rank] = item.recv()
                    except EOFError:
                        replies[rank] = ("died", None)
                elif item in sentinels:
                    rank = sentinels.pop(item)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():
                        waiting.pop(conn)
                        replies[rank] = ("died", None)
            if any(kind != "ok" and kind != "ready" for kind, _ in replies.values()):
                deadline = min(deadline, time.monotonic() + _GRACE_SECONDS)
        failed = {r: reply for r, reply in replies.items() if reply[0] not in ("ok", "ready")}
        if not failed and not waiting:
            return [replies[r][1] for r in range(self.num_processes)]
        error = self._error(what, failed, sorted(waiting.values()), timeout)
        if waiting or any(kind == "died" for kind, _ in failed.values()):
            self.close(force=True)
        raise error

    def _error(
        self, what: str, failed: dict[int, tuple[str, Any]], hung: list[int], timeout: float
    ) -> BaseException:
        notes = []
        first: BaseException | None = None
        for rank in sorted(failed):
            kind, detail = failed[rank]
            if kind == "died":
                self._procs[rank].join(timeout=5)  # the pipe closes before the exit is reaped
                code = self._procs[rank].exitcode
                notes.append(f"rank {rank} died (exit code {code}) while running {what}")
                continue
            exc, name, text = detail
            notes.append(f"rank {rank} raised {name} in {what}:\n{text}")
            if first is None and exc is not None:
                first = exc
        if hung:
            notes.append(
                f"rank(s) {hung} did not finish {what} within {timeout:.0f}s; the world was torn down"
            )
        if first is None:
            return DistributedTestError("\n".join(notes))
        for note in notes:
            first.add_note(note)
        return first

    def close(self, force: bool = False) -> list[int | None]:
        """Stop the workers (politely unless ``force``); idempotent.

        Returns:
            The workers' exit codes in rank order (0: the rank shut its run down
            cleanly; negative: killed, as one still running 30 s after the
            request is); empty once closed.
        """
        procs = self._procs
        for conn, proc in zip(self._conns, self._procs, strict=False):
            if not force and proc.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(None)
        for proc in self._procs:
            proc.join(timeout=0 if force else 30)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        return [proc.exitcode for proc in procs]

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_distributed(
    function: Callable[..., Any],
    num_processes: int = 2,
    *args: Any,
    timeout: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Start a `World`, run ``function(state, *args, **kwargs)`` on every rank, stop it.

    Returns:
        Each rank's return value, in rank order.
    """
    with World(num_processes, timeout=timeout) as world:
        return world.run(function, *args, **kwargs)
