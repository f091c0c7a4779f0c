"""Shared fixtures: isolated launch environment, and reusable gloo worlds.

Starting a world (processes that import torch and join a process group) is
the expensive part of a distributed test, so one 2-rank and one 3-rank world
(and a 4-rank one where asked) serve the whole session; a test that breaks a
world gets it rebuilt for the next one. Their ranks are forked from a server
that imported torch once (`PRELOAD`), so a rebuild, or a `World` a test starts
itself, costs a fraction of a second, and a rank's end skips the interpreter's
teardown. Under pytest-xdist (`make test` and `make check` run 2 workers, each
file's tests in one worker) each worker has its own worlds and server, started
when its first test asks.

Every test that starts a process group carries the ``multiprocess`` marker, so
that ``pytest -m "not multiprocess"`` is the fast loop (`make check` also leaves
out the ``slow`` tests: a script or a new interpreter for seconds; README, "Contributing"):
tests using the world fixtures get it here; any other test that starts one
(a `World` of its own, ``fnaccel launch``/torchrun, `notebook_launcher`) marks
itself, and `multiprocess_marker_is_set` fails a test that starts one unmarked.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.process
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fnaccel.testing import World, _preloaded_context

# The tests in this process run with one intra-op thread, as every World rank and launched worker
# here does (OMP_NUM_THREADS=1): `make test` runs 2 pytest workers on 2 cores, and torch's default
# pool (a thread per core) in each made them spin against each other and against the worlds.
# tests/test_train.py with tests/debug/test_diff.py: 23.3 s of CPU before, 16.2 s after.
torch.set_num_threads(1)

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FNACCEL_CONFIG_FILE",
    "FNACCEL_MIXED_PRECISION",
    "FNACCEL_USE_CPU",
    "FNACCEL_DEBUG_MODE",
    "TORCHELASTIC_USE_AGENT_STORE",
)


WORLD_FIXTURES = frozenset({"world", "world2", "worlds"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if WORLD_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.multiprocess)


def group_command(argv: Any) -> bool:
    """True when a command line starts a process group (a launcher, or `fnaccel test` which launches)."""
    words = [Path(str(a)).name for a in ([argv] if isinstance(argv, (str, bytes, Path)) else argv)]
    words = [w for word in words for w in word.split()]  # a shell command is one string
    return any(
        w in ("torchrun", "torch.distributed.run")
        or (w in ("fnaccel", "accelerate") and words[i + 1 : i + 2] in (["launch"], ["test"]))
        for i, w in enumerate(words)
    )


@pytest.fixture(autouse=True)
def multiprocess_marker_is_set(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Fail an unmarked test that started a process group: it would slow the fast loop.

    Seen here: a `multiprocessing` process other than a DataLoader worker (`World`, `mp.spawn`,
    `notebook_launcher`, torchrun's agent in this process) and a subprocess whose command line is
    a launcher. Not seen: a group started by a script that a test runs as a plain subprocess, or
    by a module- or session-scoped fixture (set up before this one).
    """
    if request.node.get_closest_marker("multiprocess") is not None:
        yield
        return
    started: list[str] = []
    start, popen_init = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def checked_start(process: Any) -> None:
        target = getattr(process, "_target", None)
        where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"
        if not where.startswith(("torch.utils.data.", "torchdata.")):  # DataLoader workers (torchdata's too)
            started.append(f"a process running {where}")
        start(process)

    def checked_popen(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        if group_command(args):
            started.append(f"the command {args!r}")
        popen_init(popen, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", checked_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    yield
    if started:
        pytest.fail(
            f"this test started {started[0]} but is not marked: add @pytest.mark.multiprocess "
            "(or pytestmark = pytest.mark.multiprocess for the module)",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def isolated_launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """No test sees the developer's config file or a launcher's variables."""
    import os

    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):  # everything fnaccel launch or torchrun may have set
        if name.startswith(("FNACCEL_", "TORCHELASTIC_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))


# What a world's ranks would otherwise import first, each (torch and fnaccel at start, torch._dynamo
# with the first optimizer): imported once in the forkserver the ranks are forked from (`World`'s
# preload), for every world, rebuild and `World` of its own a test starts in this process. A 2-rank
# world and its first ddp task: about 8.8 s of CPU spawned (3.1 s a rank to start, 1.3 s for the
# task's imports), 0.1 s forked; the server's imports, once: about 3.7 s.
PRELOAD = (
    "torch._dynamo",
    "torch.distributed.tensor",
    "fnaccel.preparation",
    "fnaccel.train",
    "fnaccel.data",
)


@pytest.fixture(scope="session")
def preload() -> tuple[str, ...]:
    """`PRELOAD`, for a test that starts a `World` of its own (``World(2, preload=preload)``)."""
    return PRELOAD


@pytest.fixture(scope="session")
def forked_context(preload: tuple[str, ...]) -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver with the worlds' preload, for a test's processes of its own
    (a group it forms itself): each starts without importing torch. A process gets the server's
    environment (a test's of this session, launch variables removed), not the test's of the
    moment: its target sets what it reads."""
    return _preloaded_context(preload)


@pytest.fixture(scope="session", autouse=True)
def forkserver_reaped() -> Iterator[None]:
    """End the forkserver that `World(preload=...)` started, if any, once the session's worlds
    are closed, and reap it: it would end with this process anyway, but unreaped (a process left
    behind until then, whose CPU, its ranks' included, no measurement of the run would count)."""
    yield
    from multiprocessing import forkserver

    forkserver._forkserver._stop()  # type: ignore[attr-defined]  # the stdlib's own way, private


class Worlds:
    """Lazily started worlds, one per size, rebuilt when a test broke one."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def get(self, num_processes: int) -> World:
        world = self._worlds.get(num_processes)
        if world is None or not world.alive:
            world = World(num_processes, timeout=90, preload=PRELOAD)
            self._worlds[num_processes] = world
        return world

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    pool = Worlds()
    yield pool
    pool.close()


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def world(request: pytest.FixtureRequest, worlds: Worlds) -> World:
    """A 2-rank and a 3-rank world (3 catches even/odd assumptions)."""
    return worlds.get(request.param)


@pytest.fixture
def world2(worlds: Worlds) -> World:
    return worlds.get(2)
