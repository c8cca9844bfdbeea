"""Log rate limiting: an attack (or a crash loop) must not turn the log into the bottleneck.

`install_rate_limit()` puts a `RateLimitFilter` on each handler of the root logger. Identical
records (same logger, level and formatted message) pass `num_per_window` times per `window_s`
window; later repeats are dropped and counted, and when the window ends one line says
`suppressed K repeats of: <message>`. Records that differ (another client address, another
request id) are never suppressed, unless the call says what makes them alike: a record logged
with `extra=rate_key(KEY)` is limited with every other record of its logger, level and KEY, and
its window's summary says `suppressed K more of: KEY (in Ns; the first: <message>)`. That is for
a flood of one failure per request (a full relay): each line names its request, so none would
repeat another, yet they are one event.

The summary of a window is written by the next record that reaches the handler after the window
ended, or by `flush_rate_limits()`: a long-lived process should call it now and then (`serve`
does, every second) and once with `is_final=True` before it exits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

_IS_SUMMARY = "vs_rate_limit_summary"
_RATE_KEY = "vs_rate_key"
_SUMMARY_MESSAGE_LEN = 200


@dataclass(frozen=True)
class RateLimit:
    num_per_window: int = 5
    """Identical records let through per window."""
    window_s: float = 10.0
    max_keys: int = 1024
    """Distinct messages tracked at once; the oldest window is closed early beyond it."""

    def __post_init__(self) -> None:
        for name in ("num_per_window", "max_keys"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"rate limit '{name}' must be an integer >= 1, got {value!r}")
        if isinstance(self.window_s, bool) or not isinstance(self.window_s, (int, float)) or not self.window_s > 0:
            raise ValueError(f"rate limit 'window_s' must be a number of seconds > 0, got {self.window_s!r}")


@dataclass
class _Window:
    start: float
    # NOTE: where the record came from, not the record: its args may hold an exception whose
    # traceback holds frames, arrays and (through them) shared-memory mappings.
    pathname: str
    lineno: int
    num_seen: int = 0
    first: str | None = None
    """The first record's message, in a keyed window (`rate_key`): an example of what was suppressed."""


def rate_key(key: str) -> dict[str, str]:
    """`extra=` for a log call whose records are alike by `key`, whatever their message says (request ids).

        log.error("stage %s: cannot send output of %s: %s", stage, rid, exc, extra=rate_key(f"{stage}: relay full"))
    """
    return {_RATE_KEY: key}


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # NOTE: a bad format is the handler's to report (handleError), not ours
        return str(record.msg)


class RateLimitFilter(logging.Filter):
    """A handler filter; it writes its summaries through `handler`."""

    def __init__(self, handler: logging.Handler, limit: RateLimit) -> None:
        super().__init__()
        self.handler = handler
        self.limit = limit
        self._windows: OrderedDict[tuple[str, int, str, bool], _Window] = OrderedDict()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, _IS_SUMMARY, False):
            return True
        now = time.monotonic()
        rate_key = getattr(record, _RATE_KEY, None)
        is_keyed = isinstance(rate_key, str)
        # NOTE: `is_keyed` in the key keeps a keyed window apart from a message that reads like its key.
        key = (record.name, record.levelno, rate_key if isinstance(rate_key, str) else _message(record), is_keyed)
        with self._lock:
            summaries = self._expire(now)
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= self.limit.max_keys:
                    summaries += self._close(next(iter(self._windows)))
                window = self._windows[key] = _Window(
                    now, record.pathname, record.lineno, first=_message(record) if is_keyed else None
                )
            window.num_seen += 1
            is_passed = window.num_seen <= self.limit.num_per_window
        # NOTE: outside the lock: the handler runs this filter again for each summary.
        for summary in summaries:
            self.handler.handle(summary)
        return is_passed

    def flush(self, is_final: bool = False) -> None:
        """Write the summaries of the windows that have ended (all of them if `is_final`: at exit)."""
        with self._lock:
            summaries = self._expire(float("inf") if is_final else time.monotonic())
        for summary in summaries:
            self.handler.handle(summary)

    def _expire(self, now: float) -> list[logging.LogRecord]:
        # NOTE: windows are kept in start order, so the expired ones are at the front.
        summaries: list[logging.LogRecord] = []
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if now - window.start < self.limit.window_s:
                break
            summaries += self._close(key)
        return summaries

    def _close(self, key: tuple[str, int, str, bool]) -> list[logging.LogRecord]:
        window = self._windows.pop(key)
        num_suppressed = window.num_seen - self.limit.num_per_window
        if num_suppressed <= 0:
            return []
        name, levelno, text, _ = key
        args: tuple[object, ...] = (num_suppressed, _shorten(text), self.limit.window_s)
        msg = "suppressed %d repeats of: %s (in %gs)"
        if window.first is not None:
            msg, args = "suppressed %d more of: %s (in %gs; the first: %s)", (*args, _shorten(window.first))
        summary = logging.LogRecord(name, levelno, window.pathname, window.lineno, msg, args, None)
        setattr(summary, _IS_SUMMARY, True)
        return [summary]


def _shorten(text: str) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= _SUMMARY_MESSAGE_LEN else line[:_SUMMARY_MESSAGE_LEN] + "..."


def install_rate_limit(limit: RateLimit | None = None, logger: logging.Logger | None = None) -> list[RateLimitFilter]:
    """Rate-limit identical records on every handler of `logger` (the root logger by default).

    Idempotent: a handler that already has a `RateLimitFilter` keeps it. Install it after the
    handlers exist (after `logging.basicConfig`); records of loggers with handlers of their own
    that do not propagate to this logger are not covered.
    """
    limit = limit or RateLimit()
    target = logger or logging.getLogger()
    filters: list[RateLimitFilter] = []
    for handler in target.handlers:
        existing = [f for f in handler.filters if isinstance(f, RateLimitFilter)]
        if existing:
            filters += existing
            continue
        rate_filter = RateLimitFilter(handler, limit)
        handler.addFilter(rate_filter)
        filters.append(rate_filter)
    return filters


def flush_rate_limits(logger: logging.Logger | None = None, is_final: bool = False) -> None:
    """Write the summaries of every `RateLimitFilter` on `logger`'s handlers whose window has
    ended; with `is_final` (at exit) of all windows, so no count is lost."""
    for handler in (logger or logging.getLogger()).handlers:
        for rate_filter in handler.filters:
            if isinstance(rate_filter, RateLimitFilter):
                rate_filter.flush(is_final)
