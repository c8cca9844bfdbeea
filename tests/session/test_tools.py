"""The session's side of function calling: a response's tools, checking the model's raw calls (fail closed),
the conversation's call items as the pipeline reads them, and the Realtime fields that carry them."""

from __future__ import annotations

import json

import pytest

from voice_server.session.conversation import Conversation, Item
from voice_server.session.realtime.errors import FieldError
from voice_server.session.realtime.session_config import DEFAULT_SESSION, normalize_session_patch
from voice_server.session.realtime.tool_fields import parse_tool_choice, parse_tools
from voice_server.session.tools import (
    INVALID_ARGUMENTS,
    MALFORMED,
    REQUIRED_MISSING,
    UNKNOWN_FUNCTION,
    Tool,
    ToolCall,
    ToolCallError,
    ToolSet,
)

WEATHER = Tool("get_weather", "The weather now.", {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"], "additionalProperties": False})
ANY = Tool("note")


def test_a_good_call_is_checked_and_its_arguments_kept_as_json() -> None:
    tools = ToolSet((WEATHER, ANY))
    call = tools.check('{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}', "call_1")
    assert (call.call_id, call.name) == ("call_1", "get_weather")
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    # Some templates write the arguments as a JSON string: the same call.
    same = tools.check(json.dumps({"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}), "c")
    assert json.loads(same.arguments) == json.loads(call.arguments)
    assert json.loads(tools.check('{"name": "note"}', "c").arguments) == {}


@pytest.mark.parametrize("raw, code, words", [
    ('{"name": "get_weather", "arguments": {"city": "Paris"', MALFORMED, "not JSON"),
    ('["get_weather", {"city": "Paris"}]', MALFORMED, "not {"),
    ('{"name": "get_weather", "arguments": "{city: Paris}"}', MALFORMED, "not JSON"),
    ('{"name": "get_weather", "arguments": [1]}', MALFORMED, "not a JSON object"),
    ('{"name": "order_pizza", "arguments": {}}', UNKNOWN_FUNCTION, "get_weather, note"),
    ('{"name": "get_weather", "arguments": {"city": 3}}', INVALID_ARGUMENTS, "city"),
    ('{"name": "get_weather", "arguments": {"city": "x", "days": 0}}', INVALID_ARGUMENTS, "days"),
    ('{"name": "get_weather", "arguments": {}}', INVALID_ARGUMENTS, "required"),
    ('{"name": "get_weather", "arguments": {"city": "x", "when": "now"}}', INVALID_ARGUMENTS, "when"),
    # The thinker's stage reports a call the model never closed with its opening tag: refused, whole JSON or not.
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "x"}}', MALFORMED, "not closed"),
])
def test_a_bad_call_is_refused_with_its_code(raw: str, code: str, words: str) -> None:
    with pytest.raises(ToolCallError) as caught:
        ToolSet((WEATHER, ANY)).check(raw, "call_1")
    assert caught.value.code == code and words in str(caught.value), str(caught.value)


def test_tool_choice_rules() -> None:
    assert ToolSet.create((WEATHER,), "none") is None and ToolSet.create((), "auto") is None
    named = ToolSet((WEATHER, ANY), "note")
    with pytest.raises(ToolCallError, match="requires 'note'"):
        named.check('{"name": "get_weather", "arguments": {"city": "x"}}', "c")
    with pytest.raises(ToolCallError) as caught:
        named.check_done(0)
    assert caught.value.code == REQUIRED_MISSING
    ToolSet((WEATHER,), "required").check_done(1)
    ToolSet((WEATHER,)).check_done(0)
    with pytest.raises(ValueError, match="tool_choice"):
        ToolSet((WEATHER,), "note")
    with pytest.raises(ValueError, match="unique"):
        ToolSet((WEATHER, WEATHER))
    # What travels in the request params reads back as the same set.
    back = ToolSet.from_params(named.to_params())
    assert back is not None and back.choice == "note" and back.tools[0] == WEATHER
    assert back.tools[1].parameters == {"type": "object"}, "a tool without a schema takes any object"


@pytest.mark.parametrize("kwargs, words", [
    ({"name": "has space"}, "name"),
    ({"name": "x" * 65}, "name"),
    ({"name": "f", "parameters": {"type": "objekt"}}, "not a valid JSON schema"),
    ({"name": "f", "parameters": [1]}, "JSON schema object"),
])
def test_a_bad_tool_is_refused(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Tool(**kwargs)  # type: ignore[arg-type]


def test_call_items_become_the_messages_the_thinker_renders() -> None:
    conversation = Conversation()
    conversation.add(Item("u1", "user", "Weather in Paris?"))
    conversation.add(Item("a1", "assistant", "Let me check."))
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    conversation.add(Item("f1", "assistant", kind="function_call", call=call))
    conversation.add(Item("f2", "assistant", kind="function_call", call=ToolCall("call_2", "note", "{}")))
    conversation.add(Item("o1", "tool", "sunny", kind="function_call_output", call=ToolCall("call_1", "", "")))
    assert conversation.to_messages("Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"id": "call_2", "name": "note", "arguments": "{}"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    with pytest.raises(ValueError):
        Item("x", "tool", "out")  # a tool message needs its call
    with pytest.raises(ValueError):
        Item("x", "user", kind="function_call", call=call)


def test_realtime_fields() -> None:
    raw = [{"type": "function", "name": "get_weather", "parameters": WEATHER.parameters}]
    tools = parse_tools(raw, "session.tools")
    assert tools == (Tool("get_weather", "", WEATHER.parameters),)
    assert parse_tool_choice({"type": "function", "name": "get_weather"}, "tool_choice") == "get_weather"
    for raw, param in ((["x"], "session.tools[0]"), ([{"type": "mcp"}], "session.tools[0].type"),
                       ([{"type": "function", "name": "a b"}], "session.tools[0].name")):
        with pytest.raises(FieldError) as caught:
            parse_tools(raw, "session.tools")
        assert caught.value.param == param
    patch = normalize_session_patch({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"})
    session = DEFAULT_SESSION.updated(patch)
    assert session.to_ga_dict()["tools"] == [{"type": "function", "name": "f", "description": ""}]
    assert session.tool_choice == "required"
    with pytest.raises(FieldError) as caught:
        normalize_session_patch({"tools": [], "tool_choice": {"type": "function", "name": "f"}})
    assert caught.value.param == "session.tool_choice"
