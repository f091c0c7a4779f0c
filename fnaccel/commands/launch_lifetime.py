"""The life of an ``fnaccel launch`` once its command line is resolved: from taking over
the signals to the line that says what ended the run.

`fnaccel.commands.launch` turns the flags into torchrun's arguments and the
workers' environment; `supervise` runs torchrun's agent on them in this
process and keeps the promises torchrun alone does not (docs/cli.md, "The
launcher's own life"): the machines of a multi-machine launch meet on the
launcher's own store first, with a line every 30 s, Ctrl-C honoured at once
and one line when the wait times out (a port in use is refused before any
worker starts); SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 reach the
workers and end the launch with one line and status 128 + the signal's
number. (Every worker starts through `fnaccel.commands.launch_worker`,
which ends it when the launcher dies, even by SIGKILL.)

Two more, which need the workers' word (docs/cli.md, "Exit status"): the
launcher hands them a private directory (`LAUNCH_DIR_ENV`) where each worker
records its global rank, and where a run with `fa.PreemptionKwargs` records
that it was preempted or that it finished. A preempted run ends the launch
with `PREEMPTED_EXIT_CODE` wherever the signal arrived; a run that finished
ends it with 0 whatever signal arrives after. And the launchers of a
multi-machine launch keep each other in sight on the rendezvous store
(`_Machines`), so that a machine that vanishes is named by the survivors
instead of their own ranks, which only saw a connection close.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType, MappingProxyType

import torch.distributed.run as torchrun
from torch.distributed import DistNetworkError, TCPStore
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from fnaccel.commands.main import CommandError
from fnaccel.config.environment import patch_environment as _patched_environment
from fnaccel.config.launch import LaunchConfig
from fnaccel.constants import FINISHED_MARK, LAUNCH_DIR_ENV, PREEMPTED_EXIT_CODE, PREEMPTED_MARK, RANK_MARK
from fnaccel.resources import FAILED_AT_KEY

__all__ = [
    "first_failure",
    "rendezvous_timeout",
    "supervise",
    "supervise_dry_run",
]

# Seconds between the lines a launcher prints while it waits for the other machines;
# FNACCEL_LAUNCH_REPORT_INTERVAL overrides it (the tests wait seconds, not minutes).
REPORT_INTERVAL_S = 30.0

# torchrun's rendezvous timeouts when --rdzv_conf names none: static's (LaunchConfig's
# default "timeout") and c10d's ("join_timeout").
_RDZV_TIMEOUT_S = MappingProxyType({"static": 900.0, "c10d": 600.0})

# The signals torchrun's agent forwards to the workers, and SIGUSR1 (Slurm's early warning,
# `--signal=USR1@90`, whose default action ended the launcher and so every worker, unsaved);
# the launcher handles them the same way from its start, so one arriving before the workers
# exist ends it as cleanly.
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

# A launcher of a multi-machine launch adds to its counter on the rendezvous store every
# HEARTBEAT_S; a machine whose counter stays still for LOST_AFTER_S, its end unmarked, is lost.
HEARTBEAT_S = 0.5
LOST_AFTER_S = 5.0

# A machine whose counter stays still this long while no worker here has failed is lost too:
# its ranks may have vanished before this machine's could notice (inside `fa.init`, or the
# agents' own rendezvous), where they would wait for it until a timeout of many minutes. The
# launcher then stops its own workers as torchrun stops them on SIGTERM and names the machine.
# Longer than LOST_AFTER_S, which only confirms a loss a failure already points to: a launcher
# that merely stalls (a loaded host) must not end a healthy run. Detection plus torchrun's
# shutdown grace (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s) stays within a minute (DESIGN.md,
# principle 10). FNACCEL_LAUNCH_LOST_AFTER overrides it (the tests wait seconds).
WATCH_LOST_AFTER_S = 20.0


class _Ended(Exception):
    """The launch ends before or instead of the agent's result: ``status``, and the one line why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def supervise(
    torchrun_args: argparse.Namespace,
    config: LaunchConfig,
    environment: Mapping[str, str],
    *,
    script: str,
    num_local: int,
    rdzv_conf: str | None,
    debug: bool,
) -> int:
    """Run torchrun's agent on ``torchrun_args`` in this process, with ``environment`` set
    and the forwarded signals handled, and return the launch's exit status.

    Args:
        torchrun_args: `torch.distributed.run`'s parsed arguments for this launch.
        config: the resolved launch: its machines and rendezvous.
        environment: the variables every worker gets (`LAUNCH_DIR_ENV` is added here).
        script: the training script, as its failure line names it.
        num_local: the workers this machine starts.
        rdzv_conf: ``--rdzv_conf``, read for how long the machines may take to meet.
        debug: let a failed run's `ChildFailedError` propagate (the launcher's traceback).

    Returns:
        0, 128 + a signal's number, `PREEMPTED_EXIT_CODE`, or the status of the rank that
        failed first; each but 0 after one line on stderr saying why.
    """
    launch_dir = Path(tempfile.mkdtemp(prefix="fnaccel-launch-"))
    machines: _Machines | None = None
    try:
        with (
            _patched_environment(**environment, **{LAUNCH_DIR_ENV: str(launch_dir)}),
            _signals_raise(SignalException),
        ):
            try:
                with _machines_met(config, rdzv_conf) as store:
                    if store is not None and config.num_machines > 1:
                        machines = _Machines(store, config, launch_dir, num_local)
                    try:
                        torchrun.run(torchrun_args)
                    finally:
                        if machines is not None:  # a loss found from here on is the failure path's
                            machines.stop_watching()
            except _Ended as exc:
                print(exc, file=sys.stderr)
                return exc.status
            except SignalException as exc:
                if machines is not None and machines.seen_lost:
                    print(machines.lost_line(machines.seen_lost, watched=True), file=sys.stderr)
                    return 1
                outcome = _Outcome.read(launch_dir, num_local)
                if outcome.preempted is not None:
                    return _preempted(outcome.preempted)
                if outcome.finished:
                    print(
                        f"fnaccel launch: got {exc.sigval.name} after the run had finished (every rank's "
                        "fa.shutdown came first): exit 0",
                        file=sys.stderr,
                    )
                    return 0
                grace = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")
                print(
                    f"fnaccel launch: stopped by {exc.sigval.name}: the workers got it and had {grace} s "
                    "to end (torchrun's shutdown timeout)",
                    file=sys.stderr,
                )
                return 128 + int(exc.sigval)
            except ChildFailedError as exc:
                if debug:
                    raise
                lost = machines.lost() if machines is not None else []
                if lost:
                    print(machines.lost_line(lost), file=sys.stderr)  # type: ignore[union-attr]
                    return 1
                outcome = _Outcome.read(launch_dir, num_local)
                if outcome.preempted is not None and all(
                    _by_signal(f.exitcode) for f in exc.failures.values()
                ):
                    return _preempted(outcome.preempted)
                rank, first = first_failure(exc)
                elsewhere = (
                    machines.failed_first(_failed_at_ns(first), rank) if machines is not None else None
                )
                if elsewhere is not None:
                    machine, rank = elsewhere
                    print(
                        f"fnaccel launch: {script} failed: rank {rank} (machine {machine}) "
                        f"failed first (its traceback is in that machine's output); the ranks of this "
                        f"machine failed after it (their errors are above)",
                        file=sys.stderr,
                    )
                    return first.exitcode if first.exitcode > 0 else 1
                print(
                    f"fnaccel launch: {script} failed: rank {rank} exited with code "
                    f"{first.exitcode} (its traceback is above; --debug shows the launcher's)",
                    file=sys.stderr,
                )
                return first.exitcode if first.exitcode > 0 else 1
        outcome = _Outcome.read(launch_dir, num_local)
        return 0 if outcome.preempted is None else _preempted(outcome.preempted)
    finally:
        if machines is not None:
            machines.close()
        shutil.rmtree(launch_dir, ignore_errors=True)


def supervise_dry_run(dry_run: Callable[[], int]) -> int:
    """Run ``dry_run`` (`fnaccel.commands.dry_run.dry_run`, bound to its launch) with the
    forwarded signals handled, and return its status: a signal ends it with one line and
    128 + the signal's number (its simulated ranks are ended on the way out, by dry_run's own)."""
    try:
        with _signals_raise(SignalException):
            return dry_run()
    except SignalException as exc:
        print(
            f"fnaccel launch --dry_run: stopped by {exc.sigval.name}; its simulated ranks were ended",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)


def _failed_at_ns(failure: ProcessFailure) -> int:
    """When a worker failed: its own record (ns) where it wrote one, else torchrun's (seconds)."""
    recorded = _recorded_ns(failure)
    return recorded if recorded is not None else int(failure.timestamp) * 1_000_000_000


def _by_signal(exitcode: int) -> bool:
    """Whether a worker's exit status says a signal ended it (killed: negative; or a
    script that exited 128 + the signal's number, as the docs suggest without the launcher)."""
    return exitcode < 0 or exitcode > 128


def _preempted(reason: str) -> int:
    print(
        f"fnaccel launch: preempted by {reason}: every rank stopped at the same step (fa.PreemptionKwargs); "
        f"exit {PREEMPTED_EXIT_CODE}, requeue the job to resume from its checkpoint",
        file=sys.stderr,
    )
    return PREEMPTED_EXIT_CODE


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    """What this machine's workers recorded in the launch directory (fnaccel.preemption).

    Attributes:
        preempted: the signal a rank's run stopped on, or None.
        finished: every local rank's run ended through `fa.shutdown` (or the exit's) unpreempted.
    """

    preempted: str | None
    finished: bool

    @classmethod
    def read(cls, launch_dir: Path, local: int) -> _Outcome:
        reasons = sorted(
            path.read_text(encoding="utf-8")[:40] for path in launch_dir.glob(f"{PREEMPTED_MARK}.*")
        )
        finished = len(list(launch_dir.glob(f"{FINISHED_MARK}.*")))
        return cls(preempted=reasons[-1] if reasons else None, finished=finished >= local)


def _ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 2-3`` or ``ranks 1, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


class _Machines:
    """The launchers of a multi-machine launch keep each other in sight on the rendezvous store.

    Each launcher adds one to its own counter every `HEARTBEAT_S` (a thread: the main
    thread is torchrun's) and publishes the global ranks its workers got (each worker
    records its rank in the launch directory first thing). A launcher that ends through
    Python marks its end before it stops. When a worker fails, its launcher asks who is
    gone: a machine whose counter did not move for `LOST_AFTER_S` and that marked no end
    vanished (SIGKILL, power, network), and the errors of this machine's ranks (a closed
    connection) follow from it. One whose store stopped answering lost the machine of rank
    0, which holds the store. Only the failure path waits; a launch that runs pays one
    store operation every `HEARTBEAT_S` per machine.
    """

    def __init__(self, store: TCPStore, config: LaunchConfig, launch_dir: Path, local: int) -> None:
        self._store = store
        self._rank = config.machine_rank
        self._total = config.num_machines
        self._where = f"{config.main_process_ip}:{config.main_process_port}"
        self._local = local
        self._launch_dir = launch_dir
        self._published = False
        self._broken: str | None = None  # why the store stopped answering this launcher
        self._watch_after = float(os.environ.get("FNACCEL_LAUNCH_LOST_AFTER", WATCH_LOST_AFTER_S))
        self._seen: dict[int, tuple[int, float]] = {}  # machine -> (its counter, when it last moved)
        self.seen_lost: list[int] = []  # the machines the watch found lost; this launch then ends
        self._watching = True
        self._watch_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fnaccel-launch-heartbeat", daemon=True)
        self._thread.start()

    @staticmethod
    def _key(what: str, machine: int) -> str:
        return f"fnaccel/launch/{what}_{machine}"

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key("alive", self._rank), 1)
                if not self._published:
                    ranks = sorted(
                        int(path.name.split(".", 1)[1]) for path in self._launch_dir.glob(f"{RANK_MARK}.*")
                    )
                    if len(ranks) >= self._local:
                        self._store.set(self._key("ranks", self._rank), ",".join(map(str, ranks)))
                        self._published = True
                with self._watch_lock:
                    if self._watching and not self.seen_lost:
                        self._watch()
            except Exception as exc:  # the store's server (the machine of rank 0) is gone
                self._broken = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                return
            self._stop.wait(HEARTBEAT_S)

    def _watch(self) -> None:
        """Note the other machines' counters; one that stood still for the watch's time and
        marked no end is lost: end this launch (`supervise` names the machine)."""
        now = time.monotonic()
        for machine in range(self._total):
            if machine == self._rank:
                continue
            counter = self._counter(machine)
            if self._seen.get(machine, (None, 0.0))[0] != counter:
                self._seen[machine] = (counter, now)
            elif now - self._seen[machine][1] >= self._watch_after and not self._ended(machine):
                self.seen_lost.append(machine)
        if self.seen_lost:
            # torchrun's agent stops the workers on SIGTERM (its grace, then SIGKILL) and
            # raises SignalException in the main thread, where supervise() reads seen_lost
            os.kill(os.getpid(), signal.SIGTERM)

    def stop_watching(self) -> None:
        """End the watch (the agent returned or raised): a SIGTERM it sends after this would
        reach a launcher no longer in torchrun's hands."""
        with self._watch_lock:
            self._watching = False

    def _counter(self, machine: int) -> int:
        return int(self._store.add(self._key("alive", machine), 0))

    def _ended(self, machine: int) -> bool:
        return bool(self._store.check([self._key("ended", machine)]))

    def lost(self) -> list[int]:
        """The machines that vanished, waiting up to `LOST_AFTER_S` for the others to show life."""
        others = [machine for machine in range(self._total) if machine != self._rank]
        try:
            if self._broken is None:
                start = {machine: self._counter(machine) for machine in others}
                deadline = time.monotonic() + LOST_AFTER_S
                while others and time.monotonic() < deadline and self._broken is None:
                    others = [
                        machine
                        for machine in others
                        if not self._ended(machine) and self._counter(machine) == start[machine]
                    ]
                    if others:
                        time.sleep(HEARTBEAT_S / 2)
                if self._broken is None:
                    return others
        except Exception as exc:
            self._broken = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return [0] if self._rank != 0 else []

    def _ranks_of(self, machine: int) -> list[int]:
        try:
            if self._broken is None and self._store.check([self._key("ranks", machine)]):
                return [
                    int(rank) for rank in self._store.get(self._key("ranks", machine)).decode().split(",")
                ]
        except Exception:
            pass
        # the machine vanished before publishing, or with the store: torchrun's static
        # rendezvous numbers a machine's ranks after the machines before it
        return list(range(machine * self._local, (machine + 1) * self._local))

    def lost_line(self, lost: Sequence[int], *, watched: bool = False) -> str:
        """The launch's last line when ``lost`` machines vanished (``watched``: found by the
        watch while this machine's ranks still waited, which this launcher then stopped)."""
        named = ", ".join(f"machine {machine} ({_ranks_text(self._ranks_of(machine))})" for machine in lost)
        if self._broken is not None:
            why = (
                f"connection closed: its launcher's store at {self._where} stopped answering ({self._broken})"
            )
        elif watched:
            why = (
                f"its launcher stopped answering on the store at {self._where} for {self._watch_after:g} s "
                "while this machine's ranks waited for it, and this launcher stopped them"
            )
        else:
            why = (
                f"connection closed: its launcher stopped answering on the store at {self._where} "
                f"for {LOST_AFTER_S:g} s"
            )
        follows = "" if watched else "; the errors of this machine's ranks above follow from it"
        return (
            f"fnaccel launch: {named} was lost: {why}{follows}. Check that machine, then start the launch "
            "again on every machine (fa.load resumes from the last checkpoint)"
        )

    def failed_first(self, failed_at_ns: int, rank: int) -> tuple[int, int] | None:
        """Publish this machine's first failure and wait (at most `LOST_AFTER_S`) for the other
        machines' (or their end); ``(machine, rank)`` of another machine's that came first, else
        None. A rank whose peer on another machine failed fails too, on a closed connection,
        moments later: without this, its launcher named it."""
        try:
            self._store.set(self._key("failed", self._rank), f"{failed_at_ns} {rank}")
            pending = [machine for machine in range(self._total) if machine != self._rank]
            earliest: tuple[int, int, int] | None = None
            deadline = time.monotonic() + LOST_AFTER_S
            while pending and time.monotonic() < deadline:
                for machine in list(pending):
                    if self._store.check([self._key("failed", machine)]):
                        at, other = map(int, self._store.get(self._key("failed", machine)).decode().split())
                        earliest = min(earliest or (at, machine, other), (at, machine, other))
                        pending.remove(machine)
                    elif self._ended(machine):
                        pending.remove(machine)
                if pending:
                    time.sleep(HEARTBEAT_S / 2)
        except Exception:
            return None  # the store is gone: this machine's own failure is all it knows
        if earliest is None or earliest[0] >= failed_at_ns:
            return None
        return earliest[1], earliest[2]

    def close(self) -> None:
        """Mark this launcher's end; the machine of rank 0, whose store the others read, waits
        (at most `LOST_AFTER_S`) until they have ended too, or vanished."""
        self._stop.set()
        self._thread.join()
        if self._broken is not None:
            return
        try:
            self._store.set(self._key("ended", self._rank), "1")
            if self._rank == 0:
                others = list(range(1, self._total))
                deadline = time.monotonic() + LOST_AFTER_S
                while others and time.monotonic() < deadline:
                    others = [machine for machine in others if not self._ended(machine)]
                    if others:
                        time.sleep(HEARTBEAT_S / 2)
        except Exception:
            pass  # the store's server went first: nothing is waiting to read it


@contextlib.contextmanager
def _signals_raise(exception: type[SignalException]) -> Iterator[None]:
    """While the launch runs, each forwarded signal raises ``exception(message, signal)``
    (torch's `SignalException`) in the main thread, as torchrun's agent makes it do once
    the workers run: one path ends the launch whenever the signal comes."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise exception(f"fnaccel launch got {signal.Signals(signum).name}", signal.Signals(signum))

    previous = {sig: signal.signal(sig, handler) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, action in previous.items():
            signal.signal(sig, action)


def rendezvous_timeout(rdzv_conf: str | None, rdzv_backend: str) -> float:
    """Seconds the machines may take to meet: ``timeout=S`` in ``rdzv_conf`` (``--rdzv_conf``,
    Accelerate's and torchrun's spelling; c10d's ``join_timeout`` too), else torchrun's
    default for ``rdzv_backend``."""
    settings = dict(item.split("=", 1) for item in (rdzv_conf or "").split(",") if "=" in item)
    raw = settings.get("timeout") or settings.get("join_timeout")
    if raw is None:
        return _RDZV_TIMEOUT_S.get(rdzv_backend, _RDZV_TIMEOUT_S["static"])
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise CommandError(f"--rdzv_conf: timeout must be a positive number of seconds, got {raw[:40]!r}")
    return value


@contextlib.contextmanager
def _machines_met(config: LaunchConfig, rdzv_conf: str | None) -> Iterator[TCPStore | None]:
    """Before the agent starts: the machine of rank 0 holds the rendezvous port (a port in
    use is refused here, before any worker starts) and, with several machines, every
    launcher waits until all have joined, on fnaccel's own keys in that same store; yields
    that store (None where torchrun keeps its own).

    The store is created multi-tenant, as torchrun's static and c10d rendezvous create
    theirs, so the agent's store in this process shares its server; waiting here, in
    Python, keeps Ctrl-C and the progress lines alive where torchrun's wait blocks in C++.
    """
    port = config.main_process_port
    if port is None or (config.num_machines > 1 and config.rdzv_backend not in _RDZV_TIMEOUT_S):
        yield None  # one machine on a port torchrun picks, or an etcd rendezvous: torchrun's own
        return
    host = config.main_process_ip or "127.0.0.1"
    timeout = rendezvous_timeout(rdzv_conf, config.rdzv_backend)
    store: TCPStore | None = None
    if config.machine_rank == 0:
        try:
            store = TCPStore(
                host, port, None, True, timedelta(seconds=timeout), wait_for_workers=False, multi_tenant=True
            )
        except DistNetworkError as exc:
            if "EADDRINUSE" not in str(exc):
                raise
            raise CommandError(
                f"--main_process_port {port} is already in use on this machine; pass a free "
                "port (or end what holds it)"
            ) from None
    if config.num_machines > 1:
        store = _join(store, host, port, config, timeout)
    try:
        yield store
    finally:
        del store  # the agent's store (multi-tenant) keeps the server while the run needs it


def _join(store: TCPStore | None, host: str, port: int, config: LaunchConfig, timeout: float) -> TCPStore:
    """Announce this machine on the rendezvous store and wait until every machine has;
    return the store (the server's owner must keep it). Prints a line at the start and
    every `REPORT_INTERVAL_S`; a timeout or a forwarded signal raises `_Ended`."""
    rank, total = config.machine_rank, config.num_machines
    where = f"{host}:{port}"
    interval = float(os.environ.get("FNACCEL_LAUNCH_REPORT_INTERVAL", REPORT_INTERVAL_S))
    keys = [f"fnaccel/launch/machine_{other}" for other in range(total)]
    start = time.monotonic()
    next_report = start
    lead = f"waiting up to {timeout:g} s for the machines"
    joined: list[int] = []

    def missing() -> str:
        return ", ".join(str(other) for other in range(total) if other not in joined)

    def report(lead: str) -> str:
        reached = (
            f"{len(joined)} of {total} machines joined, missing machine_rank {missing()}"
            if store is not None
            else "the machine of rank 0 does not answer"
        )
        return f"fnaccel launch: machine {rank}: {lead} at {where}: {reached}"

    try:
        while True:
            if store is None and _answers(host, port):
                store = _client_store(host, port, timeout - (time.monotonic() - start))
            if store is not None:
                store.set(keys[rank], socket.gethostname())
                joined = [other for other, key in enumerate(keys) if store.check([key])]
                if len(joined) == total:
                    return store
            now = time.monotonic()
            if now - start >= timeout:
                absent = missing() if store is not None else "0"
                raise _Ended(
                    1,
                    report(f"gave up after {timeout:g} s waiting for the machines")
                    + f"; start fnaccel launch --machine_rank {absent} there, or wait longer with "
                    "--rdzv_conf timeout=SECONDS",
                )
            if now >= next_report:
                print(report(lead), file=sys.stderr, flush=True)
                next_report += interval
                lead = f"still waiting ({next_report - start:.0f} s of {timeout:g} s)"
            time.sleep(0.2)
    except SignalException as exc:
        raise _Ended(
            128 + int(exc.sigval), report(f"stopped by {exc.sigval.name} while waiting for the machines")
        ) from None


def _answers(host: str, port: int) -> bool:
    """Whether something listens at ``host:port`` (a plain connect: interruptible, where
    a store's client blocks in C++ until its timeout)."""
    try:
        socket.create_connection((host, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _client_store(host: str, port: int, timeout: float) -> TCPStore:
    return TCPStore(host, port, None, False, timedelta(seconds=max(timeout, 1.0)), wait_for_workers=False)


def first_failure(exc: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank of a failed launch that failed first, and its failure.

    torchrun orders failures by whole seconds, so a rank whose collective broke
    because the first one exited often ties with it and is blamed instead.
    fnaccel's workers record when they failed to the nanosecond (see
    `fnaccel.resources`); torchrun's order decides only where none did.
    """
    timed = {rank: at for rank, failure in exc.failures.items() if (at := _recorded_ns(failure)) is not None}
    if not timed:
        first: tuple[int, ProcessFailure] = exc.get_first_failure()
        return first
    rank = min(timed, key=timed.__getitem__)
    return rank, exc.failures[rank]


def _recorded_ns(failure: ProcessFailure) -> int | None:
    """When a worker recorded it failed (ns, `fnaccel.resources`), if it did."""
    message = failure.error_file_data.get("message")
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    recorded = str(extra.get(FAILED_AT_KEY, ""))
    return int(recorded) if recorded.isdigit() else None
