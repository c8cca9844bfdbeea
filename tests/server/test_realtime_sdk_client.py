"""The official `openai` SDK, unmodified, as the client of `WS /v1/realtime`: `AsyncOpenAI(base_url=.../v1)`
and `client.realtime.connect(model=...)` against a real uvicorn server over the stand-in speech stage
(`session_server`). A spoken turn with audio and transcript deltas, then a barge-in and the truncate a
player sends, all through the SDK's typed events."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import openai
from openai.resources.realtime.realtime import AsyncRealtimeConnection
from realtime_client import encode, text_item
from session_server import SessionServer
from speech_signals import signal_of

from voice_server.session.conversation import cut_text

RATE = 24000
PCM_BYTES_PER_MS = RATE // 1000 * 2


class Events:
    """The connection's typed events, read by a task as they come (stamped with their arrival time)."""

    def __init__(self, conn: AsyncRealtimeConnection) -> None:
        self.queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        self.task = asyncio.create_task(self._read(conn))

    async def _read(self, conn: AsyncRealtimeConnection) -> None:
        async for event in conn:
            await self.queue.put((time.monotonic(), event))

    async def until(self, kind: str, timeout: float = 10.0) -> list[tuple[float, Any]]:
        events: list[tuple[float, Any]] = []
        while not events or events[-1][1].type != kind:
            events.append(await asyncio.wait_for(self.queue.get(), timeout))
            assert events[-1][1].type != "error", events[-1][1]
        return events


async def stream(conn: AsyncRealtimeConnection, audio: bytes, pace: float = 1.0) -> None:
    step = PCM_BYTES_PER_MS * 20
    start = time.monotonic()
    for i in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + step]).decode())
        await asyncio.sleep(max(0.0, start + (i + step) / PCM_BYTES_PER_MS / 1000 / pace - time.monotonic()))


def audio_ms(events: list[tuple[float, Any]]) -> float:
    return sum(len(base64.b64decode(e.delta)) for _, e in events
               if e.type == "response.output_audio.delta") / PCM_BYTES_PER_MS


def transcript(events: list[tuple[float, Any]]) -> str:
    return "".join(e.delta for _, e in events if e.type == "response.output_audio_transcript.delta")


async def converse(port: int) -> None:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="anything") as conn:
        events = Events(conn)
        created = (await events.until("session.created"))[-1][1]
        assert created.session.audio.input.turn_detection.type == "server_vad"
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 12, "instructions": "Be brief."})
        updated = (await events.until("session.updated"))[-1][1]
        assert updated.session.max_output_tokens == 12 and updated.session.instructions == "Be brief."
        # A spoken turn: speech events, the user's item, a reply with audio and its transcript.
        await stream(conn, encode(signal_of(RATE, ("noise", 300), ("voice", 900), ("noise", 700))), pace=1.8)
        turn = await events.until("response.done")
        kinds = [e.type for _, e in turn]
        assert kinds[:3] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                             "input_audio_buffer.committed"], kinds
        done = turn[-1][1].response
        assert done.status == "completed" and audio_ms(turn) == 12 * 80
        assert done.output[0].content[0].transcript == transcript(turn)
        assert transcript(turn).split()[:2] == ["m2a1", "p0"], "the instructions, then the spoken turn"
        # A long reply, interrupted: audio stops at once, the reply is cancelled (turn_detected).
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 200})
        await events.until("session.updated")
        await conn.conversation.item.create(item=text_item("tell me a long story"))  # type: ignore[arg-type]
        await conn.response.create()
        reply = await events.until("response.content_part.added")
        reply_id = reply[-1][1].item_id
        while audio_ms(reply) < 400:
            reply.append(await asyncio.wait_for(events.queue.get(), 10))
        await stream(conn, encode(signal_of(RATE, ("voice", 600))))
        barge = await events.until("response.done")
        started_at = next(i for i, (_, e) in enumerate(barge) if e.type == "input_audio_buffer.speech_started")
        assert audio_ms(barge[started_at:]) <= 80 and barge[-1][0] - barge[started_at][0] < 0.1
        cancelled = barge[-1][1].response
        assert cancelled.status == "cancelled" and cancelled.status_details.reason == "turn_detected"
        sent_ms = next(e for _, e in barge if e.type == "conversation.item.truncated").audio_end_ms
        said = cancelled.output[0].content[0].transcript
        # The player heard 240 ms: truncate, then the new turn's reply sees only what was heard.
        await conn.conversation.item.truncate(item_id=reply_id, content_index=0, audio_end_ms=240)
        truncated = (await events.until("conversation.item.truncated"))[-1][1]
        assert (truncated.item_id, truncated.audio_end_ms) == (reply_id, 240)
        await stream(conn, encode(signal_of(RATE, ("noise", 700))))
        after = await events.until("response.done")
        heard = cut_text(said, 240 / sent_ms)
        # NOTE: instructions, spoken turn, reply, typed turn, cut reply, spoken interruption: 6, 2 spoken.
        assert transcript(after).split()[:2] == ["m6a2", f"p{len(heard.split())}"]
        events.task.cancel()


def test_the_openai_sdk_holds_a_spoken_conversation_with_barge_in(server: SessionServer) -> None:
    asyncio.run(asyncio.wait_for(converse(server.port), 60))
