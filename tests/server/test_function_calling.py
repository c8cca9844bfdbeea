"""Function calling over `WS /v1/realtime` with the official `openai` SDK, unmodified, and over `/ws`, against a
real server:
a scripted thinker (tests/text_stages.py: it "generates" the user's typed text, so a test writes exactly what
the model says, tool calls included, split into many deltas as tokens come) streams into the hibari talker.

What is checked at the audio: a reply that says "Let me check." and then calls a tool sends the same audio as a
reply that says only "Let me check.": nothing of the call is spoken, whether the call is good or refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from realtime_client import sdk_events, text_item
from session_server import SessionServer, serve
from talker_checks import talker_pipeline
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
BOOK = {"type": "function", "name": "book_table", "description": "Book a table.",
        "parameters": {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1}},
                       "required": ["people"]}}
SAID = "Let me check."


def call(name: str, arguments: dict[str, Any] | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    yield from serve(talker_pipeline("tools"), stage="thinker")


async def turn(port: int, text: str, tools: list[dict[str, Any]], **response: Any) -> list[Any]:
    """One typed turn in a new session: every server event up to `response.done` (errors included)."""
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="anything") as conn:
        await conn.session.update(session={"type": "realtime", "tools": tools})
        await conn.conversation.item.create(item=text_item(text))  # type: ignore[arg-type]
        await conn.response.create(response=response or None)  # type: ignore[arg-type]
        return await until_done(conn)


async def until_done(conn: Any) -> list[Any]:
    """Every server event up to `response.done`, or up to an error that refused `response.create`."""
    return await sdk_events(conn, stop_at_refusal=True)


def run(port: int, text: str, tools: list[dict[str, Any]] | None = None, **response: Any) -> list[Any]:
    return asyncio.run(turn(port, text, [WEATHER, BOOK] if tools is None else tools, **response))


def audio(events: list[Any]) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


def spoken(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta")


@pytest.fixture(scope="module")
def plain(server: SessionServer) -> bytes:
    """The audio of the reply "Let me check." with no call after it."""
    events = run(server.port, SAID)
    assert spoken(events) == SAID and audio(events)
    return audio(events)


def test_a_call_after_text_is_a_function_call_item_and_only_the_text_is_spoken(
        server: SessionServer, plain: bytes) -> None:
    events = run(server.port, SAID + call("get_weather", {"city": "Paris"}))
    kinds = [e.type for e in events]
    assert "error" not in kinds, [e for e in events if e.type == "error"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert (done.name, json.loads(done.arguments)) == ("get_weather", {"city": "Paris"})
    assert [json.loads(e.delta) for e in events if e.type == "response.function_call_arguments.delta"] == [
        {"city": "Paris"}]
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    assert added.output_index == 1 and added.item.call_id == done.call_id
    response = events[-1].response
    assert response.status == "completed"
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output[1].call_id == done.call_id and response.output[0].content[0].transcript == SAID
    assert spoken(events) == SAID and audio(events) == plain


@pytest.mark.parametrize("raw, code", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', "tool_call_malformed"),
    (call("order_pizza", {"size": "large"}), "tool_call_unknown_function"),
    (call("get_weather", {"city": 7}), "tool_call_invalid_arguments"),
    (call("book_table", {"people": 0}), "tool_call_invalid_arguments"),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', "tool_call_malformed"),
], ids=["malformed-json", "unknown-function", "wrong-type", "below-minimum", "unclosed"])
def test_a_bad_call_is_an_error_event_and_nothing_of_it_is_spoken(
        server: SessionServer, plain: bytes, raw: str, code: str) -> None:
    events = run(server.port, SAID + raw)
    errors = [e.error for e in events if e.type == "error"]
    assert [error.code for error in errors] == [code], errors
    assert not any(e.type.startswith("response.function_call") for e in events)
    assert [item.type for item in events[-1].response.output] == ["message"]
    assert spoken(events) == SAID and audio(events) == plain


def test_two_calls_in_one_response_and_the_result_is_spoken(server: SessionServer) -> None:
    text = "Sure." + call("get_weather", {"city": "Oslo"}) + call("book_table", {"people": 2})
    events = run(server.port, text)
    calls = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"}),
                                                                  ("book_table", {"people": 2})]
    assert [item.type for item in events[-1].response.output] == ["message", "function_call", "function_call"]
    assert spoken(events) == "Sure."


async def call_and_answer(port: int) -> tuple[list[Any], list[Any]]:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="anything") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER, BOOK]})
        await conn.conversation.item.create(item=text_item(call("get_weather", {"city": "Rome"})))  # type: ignore[arg-type]
        await conn.response.create()
        first = await until_done(conn)
        done = next(e for e in first if e.type == "response.function_call_arguments.done")
        await conn.conversation.item.create(item={  # type: ignore[arg-type]
            "type": "function_call_output", "call_id": done.call_id, "output": "sunny and 21 degrees"})
        await conn.response.create()
        return first, await until_done(conn)


def test_the_clients_function_call_output_goes_into_the_conversation_and_is_spoken(server: SessionServer) -> None:
    first, second = asyncio.run(call_and_answer(server.port))
    assert not audio(first) and spoken(first) == "", "a reply that is only a call says nothing"
    added = [e.item for e in second if e.type == "conversation.item.added"]
    assert added[0].type == "function_call_output" and added[0].output == "sunny and 21 degrees"
    assert spoken(second) == "The tool says: sunny and 21 degrees" and audio(second)
    assert not any(e.type == "error" for e in first + second)


def test_tool_choice_none_required_and_a_named_function(server: SessionServer) -> None:
    # none: the request carries no tools, so nothing is cut (the scripted model says its call text; a real
    # model, shown no tools, would not write one).
    events = run(server.port, "Hi." + call("get_weather", {"city": "Oslo"}), tool_choice="none")
    assert not any(e.type == "error" or e.type.startswith("response.function_call") for e in events)
    assert "tool_call" in spoken(events)
    events = run(server.port, "Hello there.", tool_choice="required")
    assert [e.error.code for e in events if e.type == "error"] == ["tool_call_required_missing"]
    named = {"type": "function", "name": "book_table"}
    events = run(server.port, call("get_weather", {"city": "Oslo"}), tool_choice=named)
    assert [e.error.code for e in events if e.type == "error"] == ["tool_call_unknown_function",
                                                                   "tool_call_required_missing"]
    events = run(server.port, "Hi.", tool_choice={"type": "function", "name": "no_such_tool"})
    assert [(e.error.code, e.error.param) for e in events if e.type == "error"] == [
        ("invalid_value", "response.tool_choice")]


def ws_turn(ws: Any, message: dict[str, Any]) -> tuple[list[dict[str, Any]], bytes]:
    """Send one `/ws` message; the events and audio up to `response_done`."""
    ws.send(json.dumps(message))
    events, audio = [], bytearray()
    while True:
        frame = ws.recv(60)
        if isinstance(frame, bytes):
            audio += frame
            continue
        events.append(json.loads(frame))
        if events[-1]["type"] == "response_done":
            return events, bytes(audio)


def test_ws_tool_call_then_tool_result(server: SessionServer, plain: bytes) -> None:
    with connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5, max_size=None) as ws:
        ws.send(json.dumps({"type": "session.start", "output_rate": 24000, "tools": [WEATHER, BOOK]}))
        assert json.loads(ws.recv(5))["type"] == "session.started"
        events, audio = ws_turn(ws, {"type": "text", "text": SAID + call("get_weather", {"city": "Lima"})})
        [tool_call] = [e for e in events if e["type"] == "tool_call"]
        assert (tool_call["name"], json.loads(tool_call["arguments"])) == ("get_weather", {"city": "Lima"})
        assert events[-1]["text"] == SAID and audio == plain
        events, audio = ws_turn(ws, {"type": "text", "text": SAID + call("book_table", {"people": "two"})})
        assert [e["code"] for e in events if e["type"] == "error"] == ["tool_call_invalid_arguments"]
        assert not any(e["type"] == "tool_call" for e in events) and audio == plain
        events, audio = ws_turn(ws, {"type": "tool_result", "call_id": tool_call["call_id"], "output": "rain"})
        assert events[-1]["text"] == "The tool says: rain" and audio
        # NOTE: the output is committed with the call it answers, so a client tells it from a typed turn.
        committed = next(e for e in events if e["type"] == "input_committed")
        assert (committed["call_id"], committed["text"]) == (tool_call["call_id"], "rain")
        ws.send(json.dumps({"type": "tool_result", "call_id": "call_nope", "output": "x"}))
        assert json.loads(ws.recv(5))["code"] == "invalid_value"
    with connect(f"ws://127.0.0.1:{server.port}/ws", open_timeout=5) as ws:
        ws.send(json.dumps({"type": "session.start", "tools": [{"type": "function", "name": "a b"}]}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert "tools[0].name" in closed.value.rcvd.reason
