"""The log rate limiter (`voice_server.logs`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from voice_server import logs
from voice_server.logs import RateLimit, flush_rate_limits, install_rate_limit


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(logs.time, "monotonic", clock)
    return clock


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, ListHandler]]:
    log = logging.getLogger("test_logs.limited")
    handler = ListHandler()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    install_rate_limit(RateLimit(num_per_window=3, window_s=10.0, max_keys=4), logger=log)
    yield log, handler
    log.removeHandler(handler)


def test_identical_records_pass_n_times_per_window_then_one_summary(
    clock: Clock, logger: tuple[logging.Logger, ListHandler]
) -> None:
    log, handler = logger
    for _ in range(100):
        log.warning("Invalid HTTP request received.")
    assert handler.lines == ["WARNING Invalid HTTP request received."] * 3
    clock.now += 10.0
    log.warning("Invalid HTTP request received.")  # a new window: the summary first, then the record
    assert handler.lines[3:] == [
        "WARNING suppressed 97 repeats of: Invalid HTTP request received. (in 10s)",
        "WARNING Invalid HTTP request received.",
    ]


def test_records_that_differ_are_not_suppressed(clock: Clock, logger: tuple[logging.Logger, ListHandler]) -> None:
    log, handler = logger
    for i in range(5):
        log.info("client %d connected", i)
    log.error("client %d connected", 0)  # another level is another key
    assert len(handler.lines) == 6


def test_flush_writes_the_summary_of_an_ended_window(clock: Clock, logger: tuple[logging.Logger, ListHandler]) -> None:
    log, handler = logger
    for _ in range(5):
        log.error("stage process '%s' died", "sink")
    flush_rate_limits(log)
    assert len(handler.lines) == 3  # the window has not ended
    clock.now += 11.0
    flush_rate_limits(log)
    assert handler.lines[-1] == "ERROR suppressed 2 repeats of: stage process 'sink' died (in 10s)"
    flush_rate_limits(log)
    assert len(handler.lines) == 4
    for _ in range(4):
        log.error("stage process '%s' died", "sink")
    flush_rate_limits(log, is_final=True)  # at exit: every pending count, ended or not
    assert handler.lines[-1] == "ERROR suppressed 1 repeats of: stage process 'sink' died (in 10s)"


def test_the_number_of_windows_is_bounded(clock: Clock, logger: tuple[logging.Logger, ListHandler]) -> None:
    log, handler = logger
    for _ in range(4):
        log.warning("flood")
    for i in range(4):  # max_keys=4: the oldest window ("flood") closes early
        log.warning("other %d", i)
    assert "WARNING suppressed 1 repeats of: flood (in 10s)" in handler.lines
    (rate_filter,) = [f for f in handler.filters if isinstance(f, logs.RateLimitFilter)]
    assert len(rate_filter._windows) == 4


def test_install_is_idempotent_and_a_bad_format_still_reaches_the_handler(
    clock: Clock, logger: tuple[logging.Logger, ListHandler]
) -> None:
    log, handler = logger
    first = install_rate_limit(logger=log)
    assert install_rate_limit(logger=log) == first
    assert sum(isinstance(f, logs.RateLimitFilter) for f in handler.filters) == 1
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "%d items", ("not a number",), None)
    assert handler.filter(record)


def test_a_bad_rate_limit_names_the_field() -> None:
    with pytest.raises(ValueError, match="'window_s'"):
        RateLimit(window_s=0)
    with pytest.raises(ValueError, match="'num_per_window'"):
        RateLimit(num_per_window=0)
