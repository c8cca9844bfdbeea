"""A pipeline's voices end to end: a real uvicorn server over real stage processes running the stand-in speech
stage (`tests/speech_stages.py`, whose third word says the `params.talker.speaker` its request got), in a
pipeline that declares two voices. `/v1/realtime` through the official `openai` SDK and a raw client (every
event checked against the SDK's models): `session.created` lists the voices, `session.update` and
`response.create` choose one by its name or an OpenAI name, an unknown one is `invalid_value` listing them.
`/ws`: `session.start` `voice`, and an unknown one closes 1008."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from live_server import events_until, speech_pipeline
from realtime_client import RealtimeClient, text_item, transcript
from session_server import STEP_DELAY_MS, SessionServer, serve
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

VOICES = {"ethan": {"params": {"talker": {"speaker": "ethan"}}, "openai": ["alloy", "ash"]},
          "chelsie": {"params": {"talker": {"speaker": "chelsie"}}, "openai": ["coral"]}}
LISTED = "ethan (alloy, ash), chelsie (coral)"


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    yield from serve(speech_pipeline(STEP_DELAY_MS, voices=VOICES))


def speaker_of(words: str) -> str:
    """The speaker the stand-in stage saw: its third word is `s<speaker>`."""
    return words.split()[2]


def reply(client: RealtimeClient, text: str = "hi", **response: Any) -> str:
    client.send("conversation.item.create", item=text_item(text))
    client.send("response.create", **({"response": response} if response else {}))
    return transcript(client.until("response.done"))


def test_realtime_voices_are_listed_and_chosen_per_session_and_per_response(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    assert client.session["audio"]["output"]["voice"] == "ethan"
    vendor = client.session["x_voice_server"]
    assert vendor["voices"] == [{"name": "ethan", "openai": ["alloy", "ash"], "is_default": True},
                                {"name": "chelsie", "openai": ["coral"], "is_default": False}]
    assert "session.audio.output.voice" in vendor["served"]
    client.update(max_output_tokens=4)
    assert speaker_of(reply(client)) == "sethan"
    assert client.update(audio={"output": {"voice": "coral"}})["audio"]["output"]["voice"] == "coral"
    assert speaker_of(reply(client)) == "schelsie"
    # One response in another voice (GA, then beta spelling); the session's voice stays.
    assert speaker_of(reply(client, audio={"output": {"voice": "ash"}})) == "sethan"
    assert speaker_of(reply(client, voice="Ethan")) == "sethan"
    assert speaker_of(reply(client)) == "schelsie"
    # The beta session.update spelling.
    client.send("session.update", session={"voice": "alloy"})
    assert client.until("session.updated")[-1]["session"]["audio"]["output"]["voice"] == "alloy"
    assert speaker_of(reply(client)) == "sethan"
    client.close()


def test_an_unknown_realtime_voice_is_invalid_value_listing_the_voices(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=4, audio={"output": {"voice": "chelsie"}})
    client.send("session.update", session={"type": "realtime", "audio": {"output": {"voice": "shimmer"}}},
                event_id="evt_1")
    error = client.until("error")[-1]
    assert error["event_id"] != "evt_1" and error["error"]["event_id"] == "evt_1"
    assert error["error"]["type"] == "invalid_request_error" and error["error"]["code"] == "invalid_value"
    assert error["error"]["param"] == "session.audio.output.voice"
    assert error["error"]["message"] == ("Invalid value for 'session.audio.output.voice': Unknown voice 'shimmer'; "
                                         f"this server's voices are {LISTED}.")
    client.send("conversation.item.create", item=text_item("hi"))
    client.until("conversation.item.done")
    client.send("response.create", response={"voice": "nova"})
    error = client.until("error")[-1]["error"]
    assert (error["code"], error["param"]) == ("invalid_value", "response.audio.output.voice")
    assert error["message"].endswith(f"Unknown voice 'nova'; this server's voices are {LISTED}.")
    # Neither refusal changed the session, and no response started for the refused one.
    client.send("response.create")
    events = client.until("response.done")
    assert [e["type"] for e in events].count("response.created") == 1
    assert speaker_of(transcript(events)) == "schelsie"
    client.close()


async def sdk_voice(port: int) -> tuple[str, list[dict[str, Any]], str]:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="anything") as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        voices = (created.session.model_extra or {})["x_voice_server"]["voices"]
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 4,
                                           "audio": {"output": {"voice": "coral"}}})
        updated = await conn.recv()
        assert updated.type == "session.updated" and updated.session.audio.output.voice == "coral"
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "hi"}]})
        await conn.response.create()
        words = ""
        async for event in conn:
            if event.type == "response.output_audio_transcript.delta":
                words += event.delta
            if event.type == "response.done":
                break
        return str(created.session.audio.output.voice), voices, words


def test_the_openai_sdk_chooses_a_voice(server: SessionServer) -> None:
    voice, voices, words = asyncio.run(asyncio.wait_for(sdk_voice(server.port), 30))
    assert voice == "ethan" and [v["name"] for v in voices] == ["ethan", "chelsie"]
    assert speaker_of(words) == "schelsie"


def test_ws_session_start_chooses_a_voice_or_the_default(server: SessionServer) -> None:
    url = f"ws://127.0.0.1:{server.port}/ws"
    for voice, speaker in ((None, "sethan"), ("coral", "schelsie"), ("CHELSIE", "schelsie")):
        ws = connect(url, open_timeout=5)
        ws.send(json.dumps({"type": "session.start", "params": {"sampling": {"max_tokens": 4}},
                            **({"voice": voice} if voice else {})}))
        started = json.loads(ws.recv(5))
        assert started["type"] == "session.started" and started["voices"] == ["ethan", "chelsie"]
        assert started["voice"] == (voice or "ethan")
        ws.send(json.dumps({"type": "text", "text": "hi"}))
        events, _ = events_until(ws, "response_done")
        assert speaker_of(events[-1]["text"]) == speaker
        ws.close()


@pytest.mark.parametrize(("start", "reason"), [
    ({"voice": "nova"}, f"voice: Unknown voice 'nova'; this server's voices are {LISTED}."),
    ({"params": {"talker": {"speaker": "chelsie"}}}, "params.talker.speaker: set by the voice"),
])
def test_ws_a_bad_voice_closes_1008_with_the_reason(server: SessionServer, start: dict[str, Any],
                                                     reason: str) -> None:
    ws = connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5)
    ws.send(json.dumps({"type": "session.start", **start}))
    with pytest.raises(ConnectionClosed) as info:
        ws.recv(5)
    assert info.value.rcvd is not None and info.value.rcvd.code == 1008
    assert info.value.rcvd.reason.startswith(reason[:100])

