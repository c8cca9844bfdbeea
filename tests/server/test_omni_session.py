"""A voice session over the real streaming Qwen3-Omni pipeline (`configs/qwen3-omni-tiny.yaml`: audio
encoder -> thinker -> talker -> code2wav, one process each, the tiny config's dummy weights) through
`WS /ws`: a spoken turn is encoded, answered and spoken back, with every stage's first-output time in
the response's summary; a typed turn after it carries the history; barge-in frees both AR stages; and over
`/v1/realtime` with the official `openai` SDK, an image item reaches the thinker's prompt."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from harness import Pipeline
from image_inputs import data_url, flat
from live_server import RATE, events_until, open_session, stream_audio
from realtime_client import sdk_events
from session_server import SessionServer, serve
from speech_signals import signal_of

from voice_server.config import pipeline_from_dict
from voice_server.config.loading import read_yaml
from voice_server.session.realtime.capabilities import IMAGES

pytestmark = pytest.mark.long_running

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3-omni-tiny.yaml"
# NOTE: random weights may end the reply at once; a fixed length keeps the talker fed.
PARAMS = {"sampling": {"max_tokens": 8, "ignore_eos": True}, "talker": {"max_frames": 16}}


@pytest.fixture(scope="module")
def omni() -> Iterator[SessionServer]:
    yield from serve(Pipeline(pipeline_from_dict(read_yaml(CONFIG))), stage="talker")


def test_a_spoken_turn_is_answered_in_speech_by_the_omni_pipeline(omni: SessionServer) -> None:
    ws = open_session(f"ws://127.0.0.1:{omni.port}/ws", params=PARAMS)
    stream_audio(ws, signal_of(RATE, ("noise", 200), ("voice", 800), ("noise", 700)), pace=4.0)
    events, audio = events_until(ws, "response_done", timeout=30)
    done = events[-1]
    assert [e["type"] for e in events][:4] == ["speech_started", "speech_stopped", "input_committed",
                                               "response_started"]
    assert done["status"] == "completed", done
    # `tiny-full-rate` makes 1,920 samples (80 ms) per frame at 24 kHz, like the released vocoder.
    assert audio >= 16 * 1920 * 2 and done["audio_ms"] >= 16 * 80
    timings = done["timings_ms"]
    assert set(timings) >= {"encoder", "thinker", "talker", "code2wav", "first_audio_sent"}
    assert timings["encoder"] <= timings["thinker"] <= timings["talker"] <= timings["code2wav"]
    ws.send(json.dumps({"type": "text", "text": "and then?"}))
    events, audio = events_until(ws, "response_done", timeout=30)
    assert events[-1]["status"] == "completed" and audio > 0
    ws.close()


def test_barge_in_aborts_the_reply_in_both_ar_stages(omni: SessionServer) -> None:
    long_reply = {"sampling": {"max_tokens": 400, "ignore_eos": True}, "talker": {"max_frames": 4000}}
    ws = open_session(f"ws://127.0.0.1:{omni.port}/ws", params=long_reply)
    ws.send(json.dumps({"type": "text", "text": "talk for a long time"}))
    events_until(ws, "response_started", timeout=30)
    deadline = time.monotonic() + 30
    while not isinstance(ws.recv(max(0.01, deadline - time.monotonic())), bytes):
        pass  # NOTE: the reply is speaking
    stream_audio(ws, signal_of(RATE, ("voice", 600), ("noise", 600)), pace=1.0)
    events, _ = events_until(ws, "response_done", timeout=30)
    assert events[-1]["status"] == "cancelled"
    ws.close()
    for stage in ("thinker", "talker"):
        omni.wait_idle(stage=stage)


async def image_turn(port: int, content: list[dict[str, object]]) -> list[object]:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="qwen3-omni") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 4})
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": content})  # type: ignore[misc]
        await conn.response.create()
        return await sdk_events(conn)


def test_an_image_over_the_openai_sdk_reaches_the_thinker(omni: SessionServer) -> None:
    # The tiny pipeline sees (`vision: true` on its encoder stage): a 64x64 PNG becomes 4 x 4 patches, 16
    # placeholder tokens in the thinker's prompt (merge 1) between vision_start and vision_end. The thinker's
    # prompt count (`usage.input_tokens`) grows by exactly those 18 over the same text alone.
    image = {"type": "input_image", "image_url": data_url(flat("PNG", (64, 64)))}
    text = {"type": "input_text", "text": "What is this?"}
    plain = asyncio.run(image_turn(omni.port, [text]))
    seen = asyncio.run(image_turn(omni.port, [image, text]))
    created = next(e for e in seen if e.type == "session.created")  # type: ignore[attr-defined]
    assert IMAGES in created.to_dict()["session"]["x_voice_server"]["served"]  # type: ignore[attr-defined]
    plain_done, seen_done = plain[-1].response, seen[-1].response  # type: ignore[attr-defined]
    assert plain_done.status == seen_done.status == "completed", (plain_done, seen_done)
    assert seen_done.usage.input_tokens - plain_done.usage.input_tokens == 16 + 2
    omni.wait_idle()
