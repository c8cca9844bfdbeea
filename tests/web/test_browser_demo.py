"""The browser demo end to end: headless Debian chromium (Playwright) opens `/`, clicks Start and talks
through a fake microphone that plays a speech-like WAV (chromium loops it), to a real uvicorn on
127.0.0.1 over the stand-in speech stage (`tests/speech_stages.py`), which answers every turn with
words and a tone.

What the page must do, read from its `window.demo` state rather than from pixels: connect, have a
spoken turn committed by the server's VAD (a user bubble), receive and play the reply's audio through
the playback worklet, show the reply's words, chart its first-audio latency, take a typed turn, and on
barge-in (the looped voice speaking over a long reply) flush playback and report what was played.

A screenshot of each run goes to $VOICE_SERVER_ARTIFACTS (default: test-artifacts/ at the top of the
repository).
"""

from __future__ import annotations

import os
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from session_server import SessionServer
from speech_signals import signal_of

from voice_server.audio import float32_to_pcm16

try:
    from playwright.sync_api import Browser, ConsoleMessage, Page, sync_playwright
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:
    pytest.skip("playwright is not installed: pip install -e '.[dev]'", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("VOICE_SERVER_CHROMIUM", "/usr/bin/chromium"))
if not CHROMIUM.is_file():
    pytest.skip(f"no chromium at {CHROMIUM}: apt-get install -y chromium (or set VOICE_SERVER_CHROMIUM)",
                allow_module_level=True)

WAV_RATE = 48000
# NOTE: one spoken turn per loop: silence, then 1.5 s of voice, then enough silence for the VAD to end
# the turn (500 ms) and for a short reply to play out before the loop speaks again.
LOOP = (("noise", 1000), ("voice", 1500), ("noise", 5500))
# NOTE: generous: a busy 2-core machine runs chromium and the stage processes.
EVENT_TIMEOUT_MS = 60_000


def artifacts_dir() -> Path:
    path = Path(os.environ.get("VOICE_SERVER_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_wav(path: Path) -> Path:
    """A 16-bit PCM mono WAV of the loop (what chromium's fake capture device reads)."""
    pcm = float32_to_pcm16(signal_of(WAV_RATE, *LOOP))
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(WAV_RATE)
        f.writeframes(pcm.astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    wav = write_wav(tmp_path_factory.mktemp("mic") / "speech.wav")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
            "--no-sandbox",  # NOTE: CI runs as root, where chromium's sandbox cannot start
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}", "--autoplay-policy=no-user-gesture-required",
        ])
        yield browser
        browser.close()


class DemoPage:
    """The page, with the console errors it logged (a CSP violation or a failed module is one)."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(message.text)

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


@pytest.fixture
def open_demo(browser: Browser, server: SessionServer) -> Iterator[Any]:
    contexts = []

    def open_(query: str) -> DemoPage:
        context = browser.new_context(viewport={"width": 1200, "height": 800})
        contexts.append(context)
        demo = DemoPage(context.new_page())
        demo.page.goto(f"http://127.0.0.1:{server.port}/{query}")
        demo.page.click("#start")
        demo.wait("demo.state === 'connected'")
        return demo

    yield open_
    for context in contexts:
        context.close()


def test_a_spoken_turn_gets_a_spoken_reply_in_the_browser(open_demo: Any) -> None:
    demo = open_demo("?max_tokens=12")
    assert demo.state()["microphone"], "the fake microphone was not opened"
    # The server's VAD ends the looped voice's turn: a committed user bubble.
    demo.wait("demo.transcripts.some((e) => e.role === 'user' && e.committed)")
    demo.wait("demo.turns.some((t) => t.status === 'completed') && demo.chartPoints.length >= 1")
    demo.wait("demo.numAudioSamplesPlayed > 0")
    state = demo.state()
    first = next(t for t in state["turns"] if t["status"] == "completed")
    # The stand-in stage's first word tells what it got: one message, with audio (the spoken turn).
    assert first["text"].split()[0] == "m1a1", first
    assert first["audioMs"] == 12 * 80 and state["numAudioSamplesReceived"] >= 12 * 80 * 24
    assert {"speech", "first_audio_sent"} <= set(first["timingsMs"]) and first["firstAudioMs"] is not None
    assistant = next(e for e in state["transcripts"] if e["role"] == "assistant")
    assert assistant["text"].split()[:2] == ["m1a1", "p0"]
    # What the page shows, beyond its state object.
    assert demo.page.locator(".bubble.user").count() >= 1
    assert demo.page.locator(".bubble.assistant .text").first.inner_text().startswith("m1a1")
    assert demo.page.inner_text("#latency-summary").startswith("last first-audio latency:")
    # The reply plays out and the page reports it (the server keeps what was heard on a barge-in).
    demo.wait(f"demo.lastPlayedMs !== null && demo.numAudioSamplesPlayed >= {12 * 80 * 24}")

    # A typed turn: the server echoes it as a committed user item, and it gets a reply of its own.
    num_turns = len(state["turns"])
    demo.page.fill("#text-input", "hello from the keyboard")
    demo.page.press("#text-input", "Enter")
    demo.wait("demo.transcripts.some((e) => e.role === 'user' && e.text === 'hello from the keyboard')")
    demo.wait(f"demo.turns.length > {num_turns}")
    demo.screenshot("browser-demo.png")

    demo.page.click("#start")  # Stop
    demo.wait("demo.state === 'closed'")
    assert demo.errors == [] and demo.state()["errors"] == []


def test_speaking_over_a_reply_stops_its_playback_and_reports_what_was_played(open_demo: Any) -> None:
    # A long reply (400 words of 80 ms, generated at 30 ms a word): the loop's next voice lands while it
    # is still playing, and most likely while it is still being generated. Either way the server cuts
    # the reply to what the page reported playing.
    demo = open_demo("?max_tokens=400")
    demo.wait("demo.numBargeIns >= 1 && demo.interruptions.length >= 1 && demo.truncations.length >= 1"
              " && demo.turns.length >= 1")
    state = demo.state()
    flush = state["interruptions"][0]
    assert flush["why"] == "interrupted" and flush["responseId"] == state["turns"][0]["responseId"]
    # Playback stopped at once: less was played than had arrived (the rest was flushed) ...
    assert 0 < flush["playedMs"] < flush["receivedMs"] and flush["playedMs"] < 400 * 80
    # ... and the report sent at the flush is what the player had played (this page's first reply, so
    # all the player ever played; the report is in whole ms).
    assert flush["playedMs"] == flush["totalPlayedSamples"] * 1000 // 24000, flush
    # The server cut the reply to the last report it had when the speech started: a periodic one, up to
    # 250 ms behind the player (the report at the flush comes after the cut).
    truncated = state["truncations"][0]
    assert truncated["itemId"] == state["turns"][0]["itemId"]
    assert 0 < truncated["audioEndMs"] <= flush["playedMs"], (truncated, flush)
    assert demo.page.locator(".bubble.assistant.interrupted").count() >= 1
    # The interruption is a turn of its own, and its reply sees the history: 3 messages, 2 with audio.
    demo.wait("demo.turns.some((t) => t.text.trim().startsWith('m3a2'))")
    demo.screenshot("browser-demo-barge-in.png")
    assert demo.errors == [] and demo.state()["errors"] == []
