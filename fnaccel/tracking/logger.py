"""`get_logger` (`fnaccel.utils.get_logger`): Accelerate's multi-process logger.

Accelerate's ``accelerate.logging.get_logger`` returns a `logging.LoggerAdapter`
whose records are emitted on the main process only unless the call says
otherwise. It asks its process-wide ``PartialState`` for the rank, and so needs
an ``Accelerator`` (or ``PartialState()``) first. Here the adapter reads the
rank from the launch environment at each call (``RANK``, as torchrun and
`fnaccel launch` set it; 0 without one), so it works before `fa.init`, in
any number of runs, and keeps nothing process-wide: ``warning_once``
remembers its messages on the adapter itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

__all__ = ["MultiProcessAdapter", "get_logger"]

_LOG_LEVEL_VARIABLE = "FNACCEL_LOG_LEVEL"


def _launch_rank(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise ValueError(
            f"get_logger: {name}={value!r} is not a rank; launch with fnaccel launch or torchrun, "
            f"or unset {name}"
        )
    return int(value)


class MultiProcessAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger whose calls take ``main_process_only=True`` (log on the process of
    global rank 0 only) and ``in_order=False`` (``True``: log on every process, one
    after the other, rank 0 first, with a barrier per rank; ``main_process_only`` is
    then ignored, as in Accelerate). Each message starts ``[RANK r]``, as Accelerate's."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})
        self._warned: set[tuple[object, ...]] = set()  # warning_once's, per adapter

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` at ``level`` on the main process (``main_process_only=True``),
        on every process (``main_process_only=False``), or on every process in rank
        order (``in_order=True``, which every process must call)."""
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        rank = _launch_rank("RANK", 0)
        msg, processed = self.process(f"[RANK {rank}] {msg}", kwargs)
        kwargs = dict(processed)
        kwargs.setdefault("stacklevel", 2)  # the record names the caller, not this method
        if not in_order:
            if not main_process_only or rank == 0:
                self.logger.log(level, msg, *args, **kwargs)
            return
        num_processes = _launch_rank("WORLD_SIZE", 1)
        if num_processes > 1 and not dist.is_initialized():
            raise RuntimeError(
                "get_logger: in_order=True waits for each rank in turn, which needs the process "
                "group: call fa.init() before logging in order"
            )
        for turn in range(num_processes):
            if turn == rank:
                self.logger.log(level, msg, *args, **kwargs)
            if num_processes > 1:
                dist.barrier()

    def warning_once(self, *args: Any, **kwargs: Any) -> None:
        """`warning` the first time these arguments are given to this adapter, never again."""
        key = (args, tuple(sorted(kwargs.items(), key=lambda item: item[0])))
        if key not in self._warned:
            self._warned.add(key)
            kwargs.setdefault("stacklevel", 3)
            self.warning(*args, **kwargs)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    """A `logging` logger for multi-process scripts, as Accelerate's ``get_logger``.

    Each call takes ``main_process_only=True`` (emit on the process of global
    rank 0 only) and ``in_order=False``; ``logger.info("...", main_process_only=False)``
    emits on every process, and with ``in_order=True`` one process after the
    other (every process must make that call). The rank is read from the launch
    environment (``RANK``) at each call: no run or ``fa.init`` is needed, except
    for ``in_order`` on several processes, which waits on the process group.

    Args:
        name: the logger's name (``__name__``).
        log_level: the logger's level (``"INFO"``, ``"DEBUG"``, ...); default the
            ``FNACCEL_LOG_LEVEL`` variable (Accelerate's ``ACCELERATE_LOG_LEVEL``),
            else the logger's level is left as it is.

    Returns:
        A `logging.LoggerAdapter` over ``logging.getLogger(name)``.

    Raises:
        ValueError: ``log_level`` (or ``FNACCEL_LOG_LEVEL``) is not a logging level.

    >>> from fnaccel.utils import get_logger
    >>> logger = get_logger("demo", log_level="INFO")
    >>> logger.logger.level == logging.INFO
    True
    >>> logger.info("on the main process only")
    >>> logger.info("on every process", main_process_only=False)
    """
    logger = logging.getLogger(name)
    level = log_level if log_level is not None else os.environ.get(_LOG_LEVEL_VARIABLE)
    if level is not None:
        source = "log_level" if log_level is not None else _LOG_LEVEL_VARIABLE
        if not isinstance(level, str) or not isinstance(logging.getLevelName(level.upper()), int):
            raise ValueError(
                f"get_logger: {source}={level!r} is not a logging level; use DEBUG, INFO, WARNING, "
                "ERROR or CRITICAL"
            )
        logger.setLevel(level.upper())
    return MultiProcessAdapter(logger)
