"""The browser demo on the embedded CPU default (`configs/default.yaml`: pocketsphinx -> SmolLM2 ->
hibari, real stage processes): headless chromium's fake microphone asks a question (speech synthesised at
test time), the page shows the user's words as the server transcribes them, plays the spoken answer and
charts its first-audio latency with the per-stage breakdown.

Screenshot: `browser-demo-default.png` in $VOICE_SERVER_ARTIFACTS (default: test-artifacts/)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from demo_browser import DemoPage, chromium, require_browser, write_wav
from harness import Pipeline
from session_server import SessionServer, serve
from speech_text import ASR_RATE, speech, word_error_rate

from voice_server.config.loading import load_pipeline

require_browser()

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def default_server() -> Iterator[SessionServer]:
    yield from serve(Pipeline(load_pipeline(CONFIG)), stage="thinker")


def test_the_page_talks_with_the_default_pipeline(default_server: SessionServer, tmp_path: Path) -> None:
    # NOTE: chromium loops the file: the question, then silence long enough for the answer to play out.
    loop = np.concatenate([np.zeros(ASR_RATE, np.float32), speech(QUESTION, silence_s=0.0),
                           np.zeros(8 * ASR_RATE, np.float32)])
    with chromium(write_wav(tmp_path / "question.wav", loop, ASR_RATE)) as browser:
        demo = DemoPage(browser, f"http://127.0.0.1:{default_server.port}/")
        try:
            demo.start()
            demo.wait("demo.turns.some((t) => t.status === 'completed') && demo.chartPoints.length >= 1")
            demo.wait("demo.numAudioSamplesPlayed > 24000")
            state = demo.state()
            user = next(e for e in state["transcripts"] if e["role"] == "user")
            assert word_error_rate(QUESTION, user["text"]) <= 0.35, user
            turn = next(t for t in state["turns"] if t["status"] == "completed")
            assert "paris" in turn["text"].lower(), turn
            assert {"transcript", "thinker", "talker", "first_audio_sent"} <= set(turn["timingsMs"]), turn
            assert demo.page.locator(".bubble.user .text").first.inner_text().lower().startswith("what")
            demo.screenshot("browser-demo-default.png")
            assert demo.errors == [] and state["errors"] == []
        finally:
            demo.close()
