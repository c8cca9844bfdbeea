"""Shared test setup.

NOTE: one intra-op thread everywhere: on a 2-core box tiny torch ops are ~100x slower with two.
The variable is set before torch is imported so spawned stage processes inherit it too.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import settings

os.environ.setdefault("OMP_NUM_THREADS", "1")

# NOTE: property tests draw the same examples on every run unless asked to explore
# (VOICE_SERVER_HYPOTHESIS=explore, which `make fuzz-long` sets): a CI run must not fail on an input
# no earlier run drew; finding new ones is the long runs' job, and each becomes an `@example`.
settings.register_profile("fixed", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("VOICE_SERVER_HYPOTHESIS", "fixed"))
os.environ.setdefault("MKL_NUM_THREADS", "1")

# A test never skips silently under `make test`: with VOICE_SERVER_NO_SKIP=1 (the Makefile's `unit`
# target sets it) a skip is a failure, unless the test is marked `environment`: it needs something of
# the machine that no install can provide (root, a CUDA device) and says so in its skip reason.
# A missing dev dependency or model package is an import error, never a skip.
NO_SKIP = os.environ.get("VOICE_SERVER_NO_SKIP") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "environment: the test may skip because the machine lacks something (root, CUDA); "
        "the only skips VOICE_SERVER_NO_SKIP=1 allows",
    )
    config.addinivalue_line(
        "markers", "long_running: a module whose tests take a minute or more in all; collected first",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # NOTE: `make test`'s xdist workers take whole files in collection order: a file of minutes that came
    # last would leave one worker running it alone at the end. A stable sort keeps every other order.
    items.sort(key=lambda item: item.get_closest_marker("long_running") is None)


def _skip_reason(longrepr: object) -> str:
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail") and not item.get_closest_marker("environment"):
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under VOICE_SERVER_NO_SKIP=1 ({_skip_reason(report.longrepr)}); a skip is allowed only "
            "for a test marked @pytest.mark.environment"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if NO_SKIP and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at collection under VOICE_SERVER_NO_SKIP=1: " + _skip_reason(
            report.longrepr
        )
