"""`configs/default-whisper.yaml` (the CPU default with a Whisper tiny.en asr) through a real server over
`/ws`: a spoken question, streamed at real-time pace, is transcribed once the user stops (no partial
transcripts), and gets an on-topic spoken answer, heard as its transcript says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Pipeline
from session_server import SessionServer, serve
from speech_text import word_error_rate
from test_default_pipeline import (  # NOTE: one spoken-turn driver for both profiles
    MAX_WER,
    QUESTION,
    heard,
    open_session,
    speak,
)

from voice_server.config.loading import load_pipeline

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default-whisper.yaml"


@pytest.fixture(scope="module")
def whisper() -> Iterator[SessionServer]:
    yield from serve(Pipeline(load_pipeline(CONFIG)), stage="thinker")


def test_a_spoken_question_is_transcribed_at_its_end_and_answered(whisper: SessionServer) -> None:
    ws = open_session(whisper.port)
    turn = speak(ws, QUESTION)
    kinds = [e["type"] for e in turn.events]
    done = turn.events[-1]
    assert done["type"] == "response_done" and done["status"] == "completed", turn.events
    assert turn.of("input_transcript_delta") == []  # Whisper gives no partials
    transcript = turn.of("input_transcript_done")[0]["transcript"]
    assert word_error_rate(QUESTION, transcript) <= MAX_WER, transcript
    assert kinds.index("speech_stopped") < kinds.index("input_transcript_done") < kinds.index("text_delta")
    reply = done["text"]
    assert "paris" in reply.lower(), reply
    spoken = heard(bytes(turn.audio), 24000)
    print(f"asked {transcript!r}; replied {reply!r}; heard {spoken!r}; timings {done['timings_ms']}")
    assert word_error_rate(reply, spoken) <= MAX_WER, (reply, spoken)
    assert done["timings_ms"]["transcript"] <= done["timings_ms"]["thinker"] <= done["timings_ms"]["talker"]
    ws.close()
    whisper.wait_idle(timeout=20)
