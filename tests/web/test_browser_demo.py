"""The browser demo end to end: headless Debian chromium (Playwright) opens `/`, clicks Start and talks
through a fake microphone that plays a speech-like WAV (chromium loops it), to a real uvicorn on
127.0.0.1 over the stand-in speech stage (`tests/speech_stages.py`), which answers every turn with
words and a tone.

What the page must do, read from its `window.demo` state rather than from pixels: connect, have a
spoken turn committed by the server's VAD (a user bubble), receive and play the reply's audio through
the playback worklet, show the reply's words, chart its first-audio latency, take a typed turn, and on
barge-in (the looped voice speaking over a long reply) flush playback and report what was played.

Screenshots: `browser-demo.png` and `browser-demo-barge-in.png` in $VOICE_SERVER_ARTIFACTS (default:
test-artifacts/ at the top of the repository).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest
from demo_browser import DemoPage, chromium, require_browser, write_wav
from session_server import SessionServer
from speech_signals import signal_of

if TYPE_CHECKING:
    from playwright.sync_api import Browser

require_browser()

OpenDemo = Callable[[str], DemoPage]

WAV_RATE = 48000
# NOTE: one spoken turn per loop: silence, then 1.5 s of voice, then enough silence for the VAD to end
# the turn (500 ms) and for a short reply to play out before the loop speaks again.
LOOP = (("noise", 1000), ("voice", 1500), ("noise", 5500))


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    wav = write_wav(tmp_path_factory.mktemp("mic") / "speech.wav", signal_of(WAV_RATE, *LOOP), WAV_RATE)
    with chromium(wav) as browser:
        yield browser


@pytest.fixture
def open_demo(browser: Browser, server: SessionServer) -> Iterator[OpenDemo]:
    pages: list[DemoPage] = []

    def open_(query: str) -> DemoPage:
        pages.append(demo := DemoPage(browser, f"http://127.0.0.1:{server.port}/{query}"))
        demo.start()
        return demo

    yield open_
    for demo in pages:
        demo.close()


def test_a_spoken_turn_gets_a_spoken_reply_in_the_browser(open_demo: OpenDemo) -> None:
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


def test_speaking_over_a_reply_stops_its_playback_and_reports_what_was_played(open_demo: OpenDemo) -> None:
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
