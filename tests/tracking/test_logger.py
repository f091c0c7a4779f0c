"""fnaccel.utils.get_logger against Accelerate's `accelerate.logging.get_logger`: which records
reach a handler on rank 0 and rank 1, the level from FNACCEL_LOG_LEVEL, and in_order on a
real 2-process world."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fnaccel as fa
from fnaccel.utils import get_logger


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger(name) for name in ("fnaccel_test_ours", "fnaccel_test_theirs")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def _calls(logger: Any) -> None:
    logger.info("main only")
    logger.info("everywhere", main_process_only=False)
    logger.debug("below the level", main_process_only=False)
    logger.warning("warned", main_process_only=True)


@pytest.mark.parametrize("rank", [0, 1])
def test_the_records_that_reach_a_handler_are_accelerates(
    rank: int, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    from accelerate.logging import get_logger as accelerate_get_logger
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    _calls(get_logger("fnaccel_test_ours", log_level="INFO"))
    ours, records.messages = records.messages, []
    # Accelerate asks its process-wide PartialState for the rank: set as a launch would make it
    PartialState._shared_state.update(
        process_index=rank,
        local_process_index=rank,
        num_processes=2,
        distributed_type=DistributedType.MULTI_CPU,
    )
    try:
        _calls(accelerate_get_logger("fnaccel_test_theirs", log_level="INFO"))
    finally:
        PartialState._reset_state()
    assert ours == records.messages
    expected = [f"[RANK {rank}] everywhere"]
    assert ours == (["[RANK 0] main only", *expected, "[RANK 0] warned"] if rank == 0 else expected)


def test_no_rank_in_the_environment_is_rank_zero(records: Records) -> None:
    logger = get_logger("fnaccel_test_ours", log_level="DEBUG")
    logger.debug("one")
    logger.warning_once("twice")
    logger.warning_once("twice")
    assert records.messages == ["[RANK 0] one", "[RANK 0] twice"]


def test_the_level_comes_from_fnaccel_log_level(records: Records, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FNACCEL_LOG_LEVEL", "warning")
    logger = get_logger("fnaccel_test_ours")
    logger.info("dropped")
    logger.warning("kept")
    assert records.messages == ["[RANK 0] kept"]
    assert (
        get_logger("fnaccel_test_ours", log_level="DEBUG").logger.level == logging.DEBUG
    )  # the argument wins
    monkeypatch.setenv("FNACCEL_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="FNACCEL_LOG_LEVEL='LOUD' is not a logging level; use DEBUG, INFO"):
        get_logger("fnaccel_test_ours")
    with pytest.raises(ValueError, match="log_level=5 is not a logging level"):
        get_logger("fnaccel_test_ours", log_level=5)  # type: ignore[arg-type]


def _log_in_order(state: fa.RunState, path: str) -> None:
    logger = logging.getLogger("fnaccel_test_in_order")
    handler = logging.FileHandler(path)  # appended to by both ranks: the file's order is the emit order
    logger.addHandler(handler)
    try:
        adapter = get_logger("fnaccel_test_in_order", log_level="INFO")
        for i in range(3):
            adapter.info(f"line {i}", in_order=True)
        adapter.info("main only")
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_in_order_logs_rank_by_rank_on_a_real_world(world2: Any, tmp_path: Path) -> None:
    path = tmp_path / "log.txt"
    world2.run(_log_in_order, str(path))
    assert path.read_text().splitlines() == [
        f"[RANK {rank}] line {i}" for i in range(3) for rank in (0, 1)
    ] + ["[RANK 0] main only"]
