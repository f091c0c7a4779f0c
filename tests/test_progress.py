"""The progress display: plain lines off a terminal, tqdm on one, silence off the main process."""

from __future__ import annotations

import dataclasses
import io
import re
import sys
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

import fnaccel as fa
from fnaccel.tracking.progress import progress

_LINE = re.compile(r"^train: (\d+)/20 \((\d+)%\) \d+\.\d (it/s|s/it), \d+:\d\d elapsed(, \d+:\d\d left)?$")


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_plain_lines_at_each_tenth_when_not_a_terminal() -> None:
    out = io.StringIO()
    assert list(progress(fa.init(cpu=True), range(20), desc="train", file=out)) == list(range(20))
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    matches = [_LINE.match(line) for line in lines]
    assert all(matches), lines
    assert [(int(m[1]), int(m[2])) for m in matches if m] == [(2 * k, 10 * k) for k in range(1, 11)]
    assert "left" not in lines[-1]


def _ticking(clock: list[float], count: int, seconds: float) -> Iterator[int]:
    for item in range(count):
        clock[0] += seconds
        yield item


def test_without_a_total_a_line_comes_every_few_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr("fnaccel.tracking.progress.time", SimpleNamespace(monotonic=lambda: clock[0]))
    out = io.StringIO()
    for _ in progress(fa.init(cpu=True), _ticking(clock, 7, 4.0), every=10, file=out):
        pass
    # items take 4 s each: a line once 10 s have passed since the last one, and one at the end
    assert out.getvalue().splitlines() == [
        "3 4.0 s/it, 0:12 elapsed",
        "6 4.0 s/it, 0:24 elapsed",
        "7 4.0 s/it, 0:28 elapsed",
    ]


def test_an_explicit_total_counts_a_generator() -> None:
    out = io.StringIO()
    list(progress(fa.init(cpu=True), iter(range(4)), total=4, desc="x", file=out))
    assert out.getvalue().splitlines()[-1].startswith("x: 4/4 (100%) ")


def test_a_terminal_gets_a_tqdm_bar() -> None:
    out = Terminal()
    assert sum(progress(fa.init(cpu=True), range(20), desc="train", file=out)) == sum(range(20))
    text = out.getvalue()
    assert "\r" in text and "train: 100%|" in text and "20/20" in text


def test_a_terminal_without_tqdm_gets_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    out = Terminal()
    list(progress(fa.init(cpu=True), range(20), desc="train", file=out))
    lines = out.getvalue().splitlines()
    assert len(lines) == 10 and all(_LINE.match(line) for line in lines)


def test_a_loop_left_early_reports_where_it_stopped() -> None:
    out = io.StringIO()
    for item in progress(fa.init(cpu=True), range(20), desc="train", file=out):
        if item == 5:
            break  # items 0 to 4 done, as tqdm counts
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["train: 2/20", "train: 4/20", "train: 5/20"]
    out = io.StringIO()
    with pytest.raises(RuntimeError, match="boom"):
        for item in progress(fa.init(cpu=True), range(20), desc="train", file=out):
            if item == 3:
                raise RuntimeError("boom")
    assert out.getvalue().splitlines()[-1].startswith("train: 3/20 (15%)")


def test_a_loop_left_early_closes_the_tqdm_bar() -> None:
    out = Terminal()
    for item in progress(fa.init(cpu=True), range(20), desc="train", file=out):
        if item == 5:
            break
    text = out.getvalue()
    assert text.endswith("\n") and "5/20" in text.rsplit("\r", 1)[-1]  # the bar's last state, closed


@pytest.mark.parametrize("file", [io.StringIO(), Terminal()], ids=["plain", "terminal"])
def test_other_processes_iterate_silently(file: io.StringIO, capsys: pytest.CaptureFixture[str]) -> None:
    state = fa.init(cpu=True)
    other = dataclasses.replace(state.dist, rank=1, num_processes=2)
    assert list(progress(other, range(5), desc="train", file=file)) == list(range(5))
    assert list(progress(other, range(5))) == list(range(5))
    assert file.getvalue() == "" and capsys.readouterr().err == ""


def test_the_default_stream_is_stderr_at_call_time(capsys: pytest.CaptureFixture[str]) -> None:
    list(progress(fa.init(cpu=True), range(3), desc="d"))
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[-1].startswith("d: 3/3 (100%)")


def test_bad_arguments_are_reported() -> None:
    state = fa.init(cpu=True)
    with pytest.raises(ValueError, match="every must be a positive number of seconds"):
        progress(state, range(3), every=0)
    with pytest.raises(ValueError, match="total must be None or >= 0"):
        progress(state, range(3), total=-1)
    with pytest.raises(TypeError, match="expected a RunState or a DistContext"):
        progress(object(), range(3))
