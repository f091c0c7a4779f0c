"""`Resources`: the run's live resources, closed in reverse order by `fa.shutdown`."""

from __future__ import annotations

import pytest

import fnaccel as fa
from fnaccel.resources import Resources, exception_in_flight


class Recorder:
    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def close(self) -> None:
        self.log.append(self.name)
        if self.fail:
            raise OSError(f"{self.name} could not close")


def test_closed_in_reverse_order_and_the_first_error_after_all() -> None:
    log: list[str] = []
    resources = Resources()
    for name in ("group", "saves", "trackers"):
        resources.register(name, Recorder(name, log, fail=name != "group"))
    with pytest.raises(OSError, match="trackers could not close"):
        resources.close()
    assert log == ["trackers", "saves", "group"]
    resources.close()  # a second time closes nothing
    assert log == ["trackers", "saves", "group"]


def test_registering_again_closes_the_old_one() -> None:
    log: list[str] = []
    resources = Resources()
    resources.register("trackers", Recorder("old", log))
    resources.register("trackers", Recorder("new", log))
    assert log == ["old"] and resources.get("trackers").name == "new"


def test_a_run_shares_its_resources_and_shutdown_closes_them(tmp_path) -> None:
    from fnaccel.tracking import init_trackers

    state = init_trackers(fa.init(cpu=True, project_dir=tmp_path), "demo")
    successor = state.advance("a test")
    assert successor.resources is state.resources and successor.trackers is state.trackers
    tracker = state.trackers[0]
    fa.shutdown(successor)
    assert tracker.tracker.closed and state.trackers == ()
    assert fa.init(cpu=True).resources is not state.resources  # two runs never share


def test_an_exception_in_flight_is_seen() -> None:
    assert not exception_in_flight()
    try:
        raise ValueError("x")
    except ValueError:
        assert exception_in_flight()
    seen = []
    with pytest.raises(ValueError):
        try:
            raise ValueError("y")
        finally:
            seen.append(exception_in_flight())
    assert seen == [True]


def test_the_runtime_and_resources_import_neither_checkpoint_nor_tracking() -> None:
    """Every import statement, module level or inside a function."""
    import ast
    from pathlib import Path

    import fnaccel.resources
    import fnaccel.runtime

    for module in (fnaccel.runtime, fnaccel.resources):
        tree = ast.parse(Path(module.__file__).read_text())
        names = [
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        ]
        names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [n for n in names if n.startswith(("fnaccel.checkpoint", "fnaccel.tracking"))]
        if module is fnaccel.resources:  # a leaf
            assert not [n for n in names if n.startswith("fnaccel")]
