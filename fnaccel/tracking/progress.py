"""`progress`: progress over a long loop, shown by the main process only.

On a terminal, with tqdm installed (``pip install fnaccel[progress]``), a tqdm
bar. Otherwise (output to a file or a pipe, as in a job scheduler's log, or
tqdm missing) plain lines such as ``epochs: 3/30 (10%) 0.5 it/s, 0:06
elapsed, 0:54 left``, never a carriage return, so logs stay readable. The other
processes iterate silently: one display per run, not one per rank.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Sized
from typing import TextIO, TypeVar

from fnaccel.dist import DistLike, as_dist

__all__ = ["progress"]

T = TypeVar("T")


def progress(
    state: DistLike,
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str | None = None,
    every: float = 10.0,
    file: TextIO | None = None,
) -> Iterator[T]:
    """Iterates ``iterable`` while the main process shows progress; consumes nothing.

    Only ``state.dist`` is read, so the state given once before the loop is
    enough while the loop rebinds ``state``.

    Args:
        state: a `RunState`, or its `DistContext`.
        iterable: what to iterate.
        total: how many items to expect; default ``len(iterable)`` when it has one.
        desc: a label before the count.
        every: for plain lines, the most seconds between two lines while
            items arrive; a line is also printed at each tenth of ``total``
            and at the end, or where the loop stopped when it is left early
            (a ``break``, an exception).
        file: where to write; default ``sys.stderr``. A tqdm bar is used
            when ``file.isatty()`` and tqdm is installed.

    Returns:
        An iterator over ``iterable``'s items.

    Raises:
        ValueError: ``every`` is not positive, or ``total`` is negative.

    >>> import io, fnaccel as fa
    >>> from fnaccel.tracking.progress import progress
    >>> state, out = fa.init(cpu=True), io.StringIO()
    >>> sum(progress(state, range(4), desc="demo", file=out))
    6
    >>> print(out.getvalue())  # doctest: +ELLIPSIS
    demo: 1/4 (25%) ... it/s, 0:00 elapsed, 0:00 left
    demo: 2/4 (50%) ...
    demo: 3/4 (75%) ...
    demo: 4/4 (100%) ... it/s, 0:00 elapsed
    <BLANKLINE>
    """
    if not every > 0:
        raise ValueError(f"progress: every must be a positive number of seconds, got {every!r}")
    if total is not None and total < 0:
        raise ValueError(f"progress: total must be None or >= 0, got {total!r}")
    if not as_dist(state).is_main_process:
        return iter(iterable)
    stream = sys.stderr if file is None else file
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    if stream.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass  # a terminal without tqdm gets the plain lines (documented)
        else:
            return iter(tqdm(iterable, total=total, desc=desc, file=stream))
    return _lines(iterable, total, desc, every, stream)


def _lines(
    iterable: Iterable[T], total: int | None, desc: str | None, every: float, stream: TextIO
) -> Iterator[T]:
    start = last = time.monotonic()
    count = printed = 0
    next_tenth = 1  # the next tenth of total that earns a line
    try:
        for item in iterable:
            yield item  # counted once the loop body is done with it, as tqdm does
            count += 1
            now = time.monotonic()
            tenth_reached = total is not None and total > 0 and count * 10 >= next_tenth * total
            if tenth_reached or now - last >= every:
                _write(stream, desc, count, total, now - start)
                last, printed = now, count
                if total:
                    next_tenth = count * 10 // total + 1
    finally:  # at the end, and where the loop was left early (break, an exception), as tqdm closes its bar
        if count != printed or count == 0:
            _write(stream, desc, count, total, time.monotonic() - start)


def _write(stream: TextIO, desc: str | None, count: int, total: int | None, elapsed: float) -> None:
    parts = [f"{desc}: " if desc else "", str(count)]
    if total:
        parts.append(f"/{total} ({100 * count // total}%)")
    rate = count / elapsed if elapsed > 0 else 0.0
    if rate >= 1 or rate == 0:
        parts.append(f" {rate:.1f} it/s")
    else:
        parts.append(f" {1 / rate:.1f} s/it")
    parts.append(f", {_clock(elapsed)} elapsed")
    if total and rate > 0 and count < total:
        parts.append(f", {_clock((total - count) / rate)} left")
    stream.write("".join(parts) + "\n")
    stream.flush()


def _clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
