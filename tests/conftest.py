"""Shared fixtures: isolated launch environment, and reusable gloo worlds.

Starting a world (processes that import torch and join a process group) is
the expensive part of a distributed test, so one 2-rank and one 3-rank world
serve the whole session; a test that breaks a world gets it rebuilt for the
next one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fnaccel.testing import World

_LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "FNACCEL_CONFIG_FILE", "FNACCEL_MIXED_PRECISION",
    "FNACCEL_USE_CPU", "FNACCEL_DEBUG_MODE", "TORCHELASTIC_USE_AGENT_STORE",
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


class Worlds:
    """Lazily started worlds, one per size, rebuilt when a test broke one."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def get(self, num_processes: int) -> World:
        world = self._worlds.get(num_processes)
        if world is None or not world.alive:
            world = World(num_processes, timeout=90)
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
