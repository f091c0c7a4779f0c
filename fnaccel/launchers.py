"""`notebook_launcher` and `debug_launcher`: a function on N processes from a notebook or a REPL.

``fnaccel launch`` runs a script; in a notebook the training code is a
function defined in a cell. Both go through torchrun's elastic agent
(`torch.distributed.launcher.api.elastic_launch`): it forks the workers (a
function defined in a notebook cannot be pickled for a spawned process), sets
the variables `fa.init` reads, and watches them. When one worker raises, the
agent ends the others at once (principle 10), and the launcher raises
`ProcessFailedError` naming the rank that failed first and its exception.

A failing worker records its error where the agent reads it and leaves with
``os._exit``: nothing at exit (no finalizer closing the process group, which
waits for the other ranks) stands between the exception and the agent seeing
it. The workers take SIGTERM's default action back from the agent they were
forked from, so one blocked in a collective ends at once when told to.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from fnaccel._errors import FnaccelError
from fnaccel.checks import is_int
from fnaccel.config.environment import patch_environment
from fnaccel.constants import PrecisionType

__all__ = ["ProcessFailedError", "debug_launcher", "notebook_launcher"]

# what the launched function returns, on each rank
R = TypeVar("R")


class ProcessFailedError(FnaccelError):
    """A process started by `notebook_launcher` or `debug_launcher` failed; the others were ended.

    Attributes:
        rank: the global rank that failed first.
        reason: its exception as ``"Type: message"`` (or how it ended, when it
            died without raising).
        traceback: its traceback, when it raised.
    """

    def __init__(self, message: str, *, rank: int, reason: str, traceback: str) -> None:
        super().__init__(message)
        self.rank, self.reason, self.traceback = rank, reason, traceback


def notebook_launcher(
    function: Callable[..., R],
    args: Sequence[object] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = "29500",
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, object] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> list[R]:
    """Runs ``function(*args)`` on ``num_processes`` processes of this machine (Accelerate's arguments).

    Each process calls ``function``, which calls `fa.init()` itself; the
    launcher sets what `fa.init` reads (ranks, the rendezvous, the precision).
    With one process the function runs here, in this process.

    Args:
        function: the training function; it must be defined before the call
            (the workers are forked, so a notebook cell's function works).
        args: its positional arguments.
        num_processes: processes on this machine; default one per CUDA
            device, else 1.
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``, for `fa.init`.
        use_port, master_addr: where the static rendezvous meets.
        node_rank, num_nodes: this machine's rank and the number of machines.
        rdzv_backend: ``"static"`` or ``"c10d"`` (torchrun's backends);
            ``rdzv_endpoint="127.0.0.1:0"`` with ``"c10d"`` picks a free port.
        rdzv_endpoint: ``host:port``; default ``master_addr:use_port``.
        rdzv_conf: more rendezvous options.
        rdzv_id: the run's id, the same on every machine.
        max_restarts: restarts of all workers after a failure before giving up.
        monitor_interval: seconds between two checks of the workers.
        log_line_prefix_template: torchrun's prefix for each worker's output
            lines (e.g. ``"[rank${rank}]:"``).

    Returns:
        ``function``'s return values on this machine's processes, in local rank order.

    Raises:
        ValueError: bad counts, an unknown precision or backend, or CUDA
            already initialised in this process (forked workers could not use it).
        ProcessFailedError: a worker failed; every other worker was ended.

    >>> from fnaccel.launchers import notebook_launcher
    >>> notebook_launcher(pow, (2, 10), num_processes=1)  # one process: runs here
    [1024]
    """
    if num_processes is None:
        num_processes = max(torch.cuda.device_count(), 1)
    _check_count("num_processes", num_processes)
    _check_count("num_nodes", num_nodes)
    try:
        precision = PrecisionType(str(mixed_precision).lower())
    except ValueError:
        raise ValueError(
            f"notebook_launcher: unknown mixed_precision {mixed_precision!r}; use "
            f"one of {[p.value for p in PrecisionType]}"
        ) from None
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"notebook_launcher: node_rank {node_rank} is outside 0..{num_nodes - 1}")
    if rdzv_backend not in ("static", "c10d"):
        raise ValueError(f"notebook_launcher: rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}")
    env = {"FNACCEL_MIXED_PRECISION": precision.value}
    if num_processes * num_nodes == 1:
        with patch_environment(**env):
            return [function(*args)]
    if torch.cuda.is_initialized():
        raise ValueError(
            "notebook_launcher: CUDA was initialised in this process before the launch, and forked "
            "workers cannot use it; restart the kernel and keep every CUDA call (models .cuda(), "
            "fa.init) inside the launched function"
        )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        conf["rank"] = node_rank
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=rdzv_id,
        rdzv_endpoint=rdzv_endpoint or f"{master_addr}:{use_port}",
        rdzv_backend=rdzv_backend,
        rdzv_configs=conf,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="fork",
        log_line_prefix_template=log_line_prefix_template,
    )
    gc.collect()  # the launcher's own garbage (an earlier launch's store) is not forked into the workers
    with tempfile.TemporaryDirectory(prefix="fnaccel-launch-") as errors:
        return _launch(elastic_launch(config, _fail_fast(function, Path(errors))), args, env, Path(errors))


def debug_launcher(
    function: Callable[..., R], args: Sequence[object] = (), num_processes: int = 2
) -> list[R]:
    """Runs ``function(*args)`` on ``num_processes`` CPU processes, to debug distributed code on a laptop.

    Like `notebook_launcher` but always on the CPU (gloo), with the
    rendezvous on a free local port.

    Returns:
        ``function``'s return values, in rank order.

    Raises:
        ProcessFailedError: a worker failed; every other worker was ended.
    """
    _check_count("num_processes", num_processes)
    with patch_environment(FNACCEL_USE_CPU="true"):
        return notebook_launcher(
            function, args, num_processes=num_processes, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0"
        )


def _fail_fast(function: Callable[..., R], errors: Path) -> Callable[..., R]:
    """``function`` as a forked worker runs it: failing fast, ending at once on SIGTERM, and
    leaving in ``errors`` when and why it failed (the agent reports the rank it noticed first,
    which may be a rank that only lost its connection to the one that failed)."""

    @functools.wraps(function)  # the agent logs the function's name
    def worker(*args: object) -> R:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # OpenMP's thread pool does not survive a fork: once the launching process has run a
        # parallel operation, a worker entering one hangs. One intra-op thread never enters one.
        torch.set_num_threads(1)
        # The objects this worker inherited belong to the launching process: collecting them
        # here would run destructors of C++ objects (a TCP store, its thread) that do not
        # exist in the fork, which crashes it.
        gc.freeze()
        try:
            return function(*args)
        except BaseException as exc:
            when = time.time()
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            rank = os.environ.get("RANK", "0")
            record = {
                "rank": int(rank),
                "time": when,
                "reason": f"{type(exc).__name__}: {exc}",
                "traceback": trace,
            }
            (errors / f"rank{rank}.json.partial").write_text(json.dumps(record))
            (errors / f"rank{rank}.json.partial").rename(errors / f"rank{rank}.json")
            ErrorHandler().record_exception(exc)  # for the agent's own report
            os._exit(1)

    return worker


def _first_failure(errors: Path) -> dict[str, Any] | None:
    records = [json.loads(path.read_text()) for path in errors.glob("rank*.json")]
    return min(records, key=lambda r: r["time"]) if records else None


def _check_count(name: str, value: object) -> None:
    if not is_int(value) or value < 1:
        raise ValueError(f"notebook_launcher: {name} must be an int >= 1, got {value!r}")


def _launch(
    launched: Callable[..., dict[int, R]], args: Sequence[object], env: dict[str, str], errors: Path
) -> list[R]:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with patch_environment(**env):
            results = launched(*args)
    except ChildFailedError as exc:
        first = _first_failure(errors)
        if first is None:  # no worker raised: one died (a signal, os._exit, the OOM killer)
            rank, failure = exc.get_first_failure()
            how = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
            first = {"rank": rank, "reason": f"exited with code {failure.exitcode}{how}", "traceback": ""}
        message = f"rank {first['rank']} failed first: {first['reason']}; the other processes were ended."
        if first["traceback"]:
            message += f"\nIts traceback:\n{first['traceback']}"
        raise ProcessFailedError(
            message, rank=first["rank"], reason=first["reason"], traceback=first["traceback"]
        ) from None
    return [results[rank] for rank in sorted(results)]
