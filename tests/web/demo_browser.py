"""Headless Debian chromium for the browser demo's tests, through Playwright's sync API: launched with a
fake microphone that plays a WAV (chromium loops it) and a fake camera (chromium's moving test pattern), and
`DemoPage`, which waits on the page's `window.demo` state rather than on pixels and collects its console
errors (a CSP violation or a failed module is one). Screenshots go to $VOICE_SERVER_ARTIFACTS (default:
test-artifacts/ at the top of the repository)."""

from __future__ import annotations

import os
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from voice_server.audio import float32_to_pcm16

try:
    from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError as exc:
    PLAYWRIGHT_ERROR: ImportError | None = exc
else:
    PLAYWRIGHT_ERROR = None

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("VOICE_SERVER_CHROMIUM", "/usr/bin/chromium"))
# NOTE: generous: a busy 2-core machine runs chromium, uvicorn and the stage processes.
EVENT_TIMEOUT_MS = 60_000


def require_browser() -> None:
    """Skip the calling test module without Playwright or chromium (`make test` turns that into a failure)."""
    if PLAYWRIGHT_ERROR is not None:
        pytest.skip(f"playwright is not installed ({PLAYWRIGHT_ERROR}): pip install -e '.[dev]'",
                    allow_module_level=True)
    if not CHROMIUM.is_file():
        pytest.skip(f"no chromium at {CHROMIUM}: apt-get install -y chromium (or set VOICE_SERVER_CHROMIUM)",
                    allow_module_level=True)


def artifacts_dir() -> Path:
    path = Path(os.environ.get("VOICE_SERVER_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_wav(path: Path, signal: np.ndarray, rate: int) -> Path:
    """A 16-bit PCM mono WAV (what chromium's fake capture device reads) of float32 `signal`."""
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(float32_to_pcm16(signal).astype("<i2").tobytes())
    return path


@contextmanager
def chromium(microphone_wav: Path) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
            "--no-sandbox",  # NOTE: CI runs as root, where chromium's sandbox cannot start
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={microphone_wav}", "--autoplay-policy=no-user-gesture-required",
        ])
        try:
            yield browser
        finally:
            browser.close()


class DemoPage:
    """The demo in a fresh browser context, with the console errors it logged."""

    def __init__(self, browser: Browser, url: str, init_script: str | None = None) -> None:
        self.context = browser.new_context(viewport={"width": 1200, "height": 800})
        if init_script:  # NOTE: runs before the page's own scripts, in every page of the context
            self.context.add_init_script(init_script)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        self.page.goto(url)

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    def start(self) -> None:
        """Click Start (a user gesture, as audio contexts need) and wait for the session."""
        self.page.click("#start")
        self.wait("demo.state === 'connected'")

    def wait(self, condition: str, timeout_ms: int = EVENT_TIMEOUT_MS) -> None:
        """Until the JavaScript expression over `demo` (window.demo) is true.

        NOTE: a function, not an expression: Playwright evaluates a bare expression with `eval`, which
        the page's CSP (rightly) refuses; a function is compiled by the devtools protocol instead."""
        try:
            self.page.wait_for_function(f"() => {{ const demo = window.demo; return {condition}; }}",
                                        timeout=timeout_ms)
        except PlaywrightTimeout:
            raise AssertionError(f"never true: {condition}\npage state: {self.state()}\n"
                                 f"console errors: {self.errors}") from None

    def state(self) -> dict[str, Any]:
        return dict(self.page.evaluate("JSON.parse(JSON.stringify(window.demo))"))

    def screenshot(self, name: str) -> Path:
        path = artifacts_dir() / name
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.context.close()
