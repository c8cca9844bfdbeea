"""A tool conversation with the official `openai` SDK, unmodified, over `WS /v1/realtime`, on the streaming
Qwen3-Omni pipeline (audio encoder -> thinker -> talker -> code2wav, one process each, the tiny config with the
weights of `omni_reference.save_reference`): the thinker's picks are forced (`omni_stages.create_scripted_thinker`,
replies in the order requests come, in the toy tokenizer where Qwen's tool tags are single tokens), since random
weights never write a call.

The first reply says "Hi." and calls `get_time`; the client returns the time as a `function_call_output` and asks
for a response; the second reply is spoken. Every server event validates strictly against the SDK's models, and
the call's text is never spoken (the transcript; that the talker's audio is the same with and without the call is
shown at the stages, `tests/runners/test_omni_tool_calls.py`, where equal prompts give equal audio).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from harness import Pipeline
from omni_reference import save_reference
from omni_stages import TOOL_CLOSE, TOOL_OPEN, write_toy_tokenizer
from realtime_client import sdk_events, text_item
from session_server import SessionServer, serve

from voice_server.config import pipeline_from_dict
from voice_server.models.qwen3_omni.presets import TINY_IDS

EOS = TINY_IDS["im_end"]
NL, HI, DOT = 10, 40, 41
CALL_IDS = [TOOL_OPEN, NL, 42, 43, 44, 45, NL, TOOL_CLOSE]
"""`<tool_call>\\n{"name": "get_time", "arguments": {}}\\n</tool_call>` in the toy tokenizer."""
SCRIPTS = [[HI, DOT, *CALL_IDS, EOS], [HI, DOT, EOS]]
"""The thinker's replies, in turn: text then a call, then the answer after the tool's output."""
GET_TIME = {"type": "function", "name": "get_time", "description": "The time now.",
            "parameters": {"type": "object", "properties": {}}}
BOOK = {"type": "function", "name": "book_table", "description": "Book a table.",
        "parameters": {"type": "object", "properties": {"people": {"type": "integer"}}, "required": ["people"]}}


@pytest.fixture(scope="module")
def omni(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionServer]:
    ckpt: Path = tmp_path_factory.mktemp("tiny_qwen3_omni_tool_session")
    save_reference(ckpt)
    write_toy_tokenizer(ckpt)
    common = {"checkpoint": str(ckpt), "num_threads": 1}
    ar = {"scheduler": "ar", "max_batch_size": 4, "max_step_tokens": 64}
    yield from serve(Pipeline(pipeline_from_dict({
        "name": "omni-tool-session",
        "stages": [
            {"name": "encoder", "factory": "voice_server.stages.audio_encoder:create_audio_encoder", "next": "thinker",
             "max_batch_size": 4, "factory_args": common},
            {"name": "thinker", "factory": "omni_stages:create_scripted_thinker", **ar, "terminal": True,
             "stream_to": ["talker"], "factory_args": {**common, "scripts": SCRIPTS}},
            {"name": "talker", "factory": "voice_server.stages.talker:create_talker", **ar, "stream_to": ["code2wav"],
             "factory_args": {**common, "max_frames": 9}},
            {"name": "code2wav", "factory": "voice_server.stages.code2wav:create_code2wav", "scheduler": "code2wav",
             "terminal": True, "max_batch_size": 4, "factory_args": common},
        ],
    })), stage="talker")


async def until_done(conn: Any) -> list[Any]:
    return await sdk_events(conn, timeout_s=120)


async def conversation(port: int) -> tuple[list[Any], list[Any]]:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="qwen3-omni") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [GET_TIME, BOOK]})
        await conn.conversation.item.create(item=text_item("What time is it?"))  # type: ignore[arg-type]
        await conn.response.create()
        first = await until_done(conn)
        done = next(e for e in first if e.type == "response.function_call_arguments.done")
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": done.call_id,
                                                  "output": json.dumps({"time": "12:00"})})
        await conn.response.create()
        return first, await until_done(conn)


def audio(events: list[Any]) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


def spoken(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")


def test_the_model_calls_a_tool_the_client_answers_and_the_reply_is_spoken(omni: SessionServer) -> None:
    first, second = asyncio.run(conversation(omni.port))
    assert not [e for e in first + second if e.type == "error"]
    done = next(e for e in first if e.type == "response.function_call_arguments.done")
    assert (done.name, json.loads(done.arguments)) == ("get_time", {})
    response = first[-1].response
    assert response.status == "completed" and [item.type for item in response.output] == ["message",
                                                                                          "function_call"]
    assert spoken(first) == "Hi." and audio(first)
    assert second[-1].response.status == "completed" and spoken(second) == "Hi." and audio(second)
    assert [item.type for item in second[-1].response.output] == ["message"]
    omni.wait_idle(timeout=30)
