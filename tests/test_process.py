"""Process helpers that take the state: barriers, ordering, splitting, printing."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fnaccel as fa


def test_single_process_helpers_run_inline(capsys: pytest.CaptureFixture[str]) -> None:
    state = fa.init(cpu=True)
    fa.wait_for_everyone(state)
    with fa.main_process_first(state), fa.local_main_process_first(state.dist):
        pass
    assert fa.on_main_process(state, lambda x: x + 1)(1) == 2
    assert fa.utils.on_local_main_process(state, lambda: "local")() == "local"
    fa.print_on_main(state, "hello", end="!")
    assert capsys.readouterr().out == "hello!"
    with fa.split_between_processes(state, [1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    with pytest.raises(ValueError, match="process_index=1 is not a rank"):
        fa.utils.on_process(state, print, 1)


def _split_everything(state: fa.RunState, length: int) -> dict[str, Any]:
    items = list(range(length))
    out: dict[str, Any] = {}
    with fa.split_between_processes(state, items) as mine:
        out["list"] = mine
    with fa.split_between_processes(state, items, apply_padding=True) as mine:
        out["padded"] = mine
    with fa.split_between_processes(state, torch.arange(length)) as mine:
        out["tensor"] = mine.tolist()
    with fa.split_between_processes(state, {"a": items, "b": tuple(items)}) as mine:
        out["dict"] = mine
    return out


@pytest.mark.parametrize("length", [2, 7])
def test_split_between_processes_covers_every_input_once(world: Any, length: int) -> None:
    results = world.run(_split_everything, length)
    parts = [r["list"] for r in results]
    assert [x for part in parts for x in part] == list(range(length))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert [r["tensor"] for r in results] == parts
    assert [r["dict"] for r in results] == [{"a": p, "b": tuple(p)} for p in parts]
    padded = [r["padded"] for r in results]
    assert {len(p) for p in padded} == {max(sizes)}
    assert all(p[: len(q)] == q for p, q in zip(padded, parts, strict=False))


def _main_first(state: fa.RunState, marker: str, local: bool) -> bool:
    path = Path(marker)
    first = fa.local_main_process_first if local else fa.main_process_first
    with first(state):
        if state.dist.is_main_process:
            time.sleep(0.2)  # the others would run ahead here if the barrier were missing
            path.write_text("ready")
        seen = path.exists()
    fa.wait_for_everyone(state)
    return seen


@pytest.mark.parametrize("local", [False, True], ids=["global", "local"])
def test_main_process_first_lets_the_main_process_finish_first(
    world: Any, tmp_path: Path, local: bool
) -> None:
    # one machine: the local main process is the global one
    marker = tmp_path / f"marker{world.num_processes}"
    assert world.run(_main_first, str(marker), local) == [True] * world.num_processes


def _on_main_and_print(state: fa.RunState) -> tuple[Any, Any, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        fa.print_on_main(state, "only once")
    last = fa.utils.on_process(state, lambda: state.dist.rank, state.dist.num_processes - 1)()
    return fa.on_main_process(state, lambda: "main")(), last, buffer.getvalue()


def test_on_main_process_and_printing(world: Any) -> None:
    n = world.num_processes
    results = world.run(_on_main_and_print)
    assert [r[0] for r in results] == ["main"] + [None] * (n - 1)
    assert [r[1] for r in results] == [None] * (n - 1) + [n - 1]
    assert [r[2] for r in results] == ["only once\n"] + [""] * (n - 1)
