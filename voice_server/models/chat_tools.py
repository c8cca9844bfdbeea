"""Function calling in a ChatML prompt: the tools offered, an assistant's calls and the results, written the
Hermes way the Qwen2.5/Qwen3 family (Qwen3-Omni too) was trained on. The one place for both hand-written
templates: SmolLM2's (`models/llama/tokenizer.py`; its GGUF template has no tools section, so this is the
documented fallback for ChatML templates without one) and Qwen3-Omni's (`models/qwen3_omni/chat.py`).

What Qwen3's chat template writes, byte for byte (tests/models/test_chat_tools.py renders it with jinja):

- tools: the system turn's text, then `\\n\\n` (with a system message; without one, the turn is the section
  alone, after SmolLM2's default system prompt where the template has one), then `tools_section`:
  `# Tools ... <tools>\\n{"type": "function", "function": {"name", "description", "parameters"}}` (one line
  per tool, `json.dumps` as the template's `tojson`) `\\n</tools>\\n\\nFor each function call, ...</tool_call>`;
- an assistant message with calls: its content, then each call as
  `<tool_call>\\n{"name": "f", "arguments": <its JSON text>}\\n</tool_call>`, newline-separated;
- consecutive tool results: one user turn, `<tool_response>\\n{content}\\n</tool_response>` each,
  newline-separated.

The model answers in the same form (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`), which the
thinker's scheduler cuts out of its text. `tool_choice` ("auto", "required", {"name": f}) is checked here and
never written into the prompt: "required" and a named function are enforced by the session, which refuses a
response without the call it required.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_TOOLS = 128
MAX_TOOL_CALLS = 128
"""Calls one assistant message may carry (a guard on the work of checking it)."""
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_KEYS = ("tool_calls", "tool_call_id")
"""Message fields beyond `role` and `content`: an assistant's calls, a tool result's call id."""
_CALL_KEYS = {"id", "name", "arguments"}
_TOOL_PARAM_KEYS = {"name", "description", "parameters"}
_SECTION_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_SECTION_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


@dataclass(frozen=True)
class Tool:
    """One function the model may call (an item of `params["tools"]`)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """A JSON schema object for the arguments."""

    def signature(self) -> str:
        # NOTE: the template's `tool | tojson` of OpenAI's nesting; transformers' tojson is json.dumps with
        # non-ASCII kept and the keys in their given order.
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return json.dumps({"type": "function", "function": function}, ensure_ascii=False)


@dataclass(frozen=True)
class Turn:
    """One `<|im_start|>{role}\\n{text}<|im_end|>\\n` of the prompt."""

    role: str
    """system, user or assistant (tool results are a user turn)."""
    text: str
    message: int | None
    """Index of the (first) message it renders; None for a system turn the template adds."""


def request_tools(params: Mapping[str, Any]) -> tuple[Tool, ...]:
    """`params["tools"]` checked, and `params["tool_choice"]` against them; ValueError naming the field."""
    raw = params.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list | tuple) or len(raw) > MAX_TOOLS:
        raise ValueError(f"params.tools: must be a list of at most {MAX_TOOLS} {{name, description, parameters}}")
    tools = tuple(_tool(f"params.tools[{i}]", value) for i, value in enumerate(raw))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"params.tools: function names must be unique, got {', '.join(names)}"[:300])
    choice = params.get("tool_choice", "auto")
    if choice == "required" and not tools:
        raise ValueError("params.tool_choice: 'required' needs params.tools")
    if isinstance(choice, dict) and set(choice) == {"name"}:
        if choice["name"] not in names:
            raise ValueError(f"params.tool_choice.name: names no function of params.tools: {choice['name']!r}"[:300])
    elif choice not in ("auto", "required"):
        raise ValueError(f"params.tool_choice: must be 'auto', 'required' or {{'name': str}}, got {choice!r}"[:300])
    return tools


def _tool(where: str, value: Any) -> Tool:
    if not isinstance(value, dict) or set(value) != _TOOL_PARAM_KEYS:
        raise ValueError(f"{where}: must be a mapping with exactly 'name', 'description' and 'parameters'")
    name, description, parameters = value["name"], value["description"], value["parameters"]
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ValueError(f"{where}.name: must match {TOOL_NAME.pattern}, got {name!r}"[:300])
    if not isinstance(description, str):
        raise ValueError(f"{where}.description: must be a string, got {type(description).__name__}")
    if not isinstance(parameters, dict):
        raise ValueError(f"{where}.parameters: must be a JSON schema object, got {type(parameters).__name__}")
    tool = Tool(name, description, parameters)
    try:
        tool.signature()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}.parameters: must be JSON ({exc})"[:300]) from exc
    return tool


def tool_fields(where: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """The checked tool fields of one message (whose `role` is checked already): an assistant's `tool_calls`
    (each {id, name, arguments}: the arguments object as JSON text), a tool result's `tool_call_id`; {} for a
    message with neither. ValueError naming the field."""
    role = message["role"]
    if role == "tool":
        if "tool_calls" in message:
            raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(f"{where}.tool_call_id: a tool result needs the id of its call, a non-empty string")
        return {"tool_call_id": call_id}
    if "tool_call_id" in message:
        raise ValueError(f"{where}.tool_call_id: only tool messages carry a tool_call_id")
    if "tool_calls" not in message:
        return {}
    if role != "assistant":
        raise ValueError(f"{where}.tool_calls: only assistant messages carry tool calls")
    calls = message["tool_calls"]
    if not isinstance(calls, list | tuple) or len(calls) > MAX_TOOL_CALLS:
        raise ValueError(f"{where}.tool_calls: must be a list of at most {MAX_TOOL_CALLS} {{id, name, arguments}}")
    return {"tool_calls": [_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]}


def _call(where: str, call: Any) -> dict[str, str]:
    if not isinstance(call, dict) or set(call) != _CALL_KEYS:
        raise ValueError(f"{where}: must be a mapping with exactly 'id', 'name' and 'arguments'")
    for key in ("id", "name"):
        if not isinstance(call[key], str) or not call[key]:
            raise ValueError(f"{where}.{key}: must be a non-empty string")
    arguments = call["arguments"]
    try:
        is_object = isinstance(arguments, str) and isinstance(json.loads(arguments), dict)
    except ValueError:
        is_object = False
    if not is_object:
        raise ValueError(f"{where}.arguments: must be a JSON object as text, got {arguments!r}"[:300])
    return {"id": call["id"], "name": call["name"], "arguments": arguments}


def tools_section(tools: Sequence[Tool]) -> str:
    return _SECTION_HEAD + "".join("\n" + tool.signature() for tool in tools) + _SECTION_TAIL


def system_text(system: str | None, tools: Sequence[Tool]) -> str | None:
    """A system turn's text: the system prompt (None: none), then the tools section when tools are offered."""
    if not tools:
        return system
    return (system + "\n\n" if system is not None else "") + tools_section(tools)


def call_text(call: Mapping[str, str]) -> str:
    # NOTE: the template writes the name bare between quotes and the arguments string as it is; dumping
    # the name is the same text for every valid name and keeps a stray quote from breaking the JSON.
    name = json.dumps(call["name"], ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {call["arguments"]}}}\n</tool_call>'


def chat_turns(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool] = (), default_system: str | None = None
) -> list[Turn]:
    """The turns of a checked conversation. `default_system`: the system prompt the template writes when the
    conversation has none (SmolLM2's); without tools and without a default, no system turn is added."""
    turns: list[Turn] = []
    if messages and messages[0]["role"] != "system":
        text = system_text(default_system, tools)
        if text is not None:
            turns.append(Turn("system", text, None))
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content", "")
        if role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if i > 0 and messages[i - 1]["role"] == "tool":
                turns[-1] = dataclasses.replace(turns[-1], text=turns[-1].text + "\n" + response)
            else:
                turns.append(Turn("user", response, i))
        elif role == "assistant" and message.get("tool_calls"):
            calls = [call_text(call) for call in message["tool_calls"]]
            turns.append(Turn(role, "\n".join([content, *calls] if content else calls), i))
        elif role == "system" and i == 0:
            turns.append(Turn(role, system_text(content, tools) or "", i))
        else:
            turns.append(Turn(role, content, i))
    return turns
