"""The log rate limiter (`voice_server.logs`)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
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


def test_keyed_records_fold_across_request_ids_with_the_first_as_an_example(
    clock: Clock, logger: tuple[logging.Logger, ListHandler]
) -> None:
    log, handler = logger
    for i in range(17_000):  # issue #20: a full relay failed ~17k requests, each logged with its own id
        log.error("stage %s: cannot send output of %s: relay full", "thinker", f"req-{i}",
                  extra=logs.rate_key("thinker: relay full"))
    log.error("stage %s: cannot send output of %s: relay full", "talker", "req-x",
              extra=logs.rate_key("talker: relay full"))  # another key: its own window
    log.error("stage %s: cannot send output of %s: relay full", "thinker", "req-y")  # not keyed: its own message
    assert handler.lines == [
        *(f"ERROR stage thinker: cannot send output of req-{i}: relay full" for i in range(3)),
        "ERROR stage talker: cannot send output of req-x: relay full",
        "ERROR stage thinker: cannot send output of req-y: relay full",
    ]
    clock.now += 10.0
    flush_rate_limits(log)
    assert handler.lines[5:] == [
        "ERROR suppressed 16997 more of: thinker: relay full "
        "(in 10s; the first: stage thinker: cannot send output of req-0: relay full)",
    ]


def test_a_keyed_record_and_a_message_equal_to_its_key_are_apart(
    clock: Clock, logger: tuple[logging.Logger, ListHandler]
) -> None:
    log, handler = logger
    for _ in range(4):
        log.warning("relay full", extra=logs.rate_key("relay full"))
        log.warning("relay full")
    flush_rate_limits(log, is_final=True)
    assert handler.lines[6:] == [
        "WARNING suppressed 1 more of: relay full (in 10s; the first: relay full)",
        "WARNING suppressed 1 repeats of: relay full (in 10s)",
    ]


_FLOOD = """
import logging, sys
from voice_server.logs import flush_rate_limits, rate_key
from voice_server.server.runner import configure_logging
configure_logging("info")
log = logging.getLogger("voice_server.stage")
for i in range(17_000):
    extra = rate_key("thinker: relay full") if sys.argv[1] == "keyed" else None
    log.error("stage thinker: cannot send output of %s: relay full, still after 5 s", f"resp_{i:08x}", extra=extra)
flush_rate_limits(is_final=True)
"""


def test_a_flood_of_keyed_failures_is_a_few_lines_on_serves_log_handler() -> None:
    sizes = {}
    for mode in ("keyed", "plain"):
        out = subprocess.run([sys.executable, "-c", _FLOOD, mode], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0, out.stderr
        sizes[mode] = len(out.stderr.encode())
        lines = out.stderr.splitlines()
        if mode == "keyed":
            assert len(lines) == 6, out.stderr  # 5 per window, then the count
            assert "suppressed 16995 more of: thinker: relay full (in 10s; the first: stage thinker: cannot send " \
                   "output of resp_00000000: relay full, still after 5 s)" in lines[-1]
    print(f"log bytes for 17k failed requests: {sizes}")
    assert sizes["plain"] > 1_000_000 and sizes["keyed"] < 2_000
