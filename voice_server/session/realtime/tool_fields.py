"""The Realtime protocol's function-calling fields: ``tools``, ``tool_choice`` and the two item types a
client sends about calls (``function_call``, ``function_call_output``), parsed into the session's types
(`voice_server/session/tools.py`); each parser raises FieldError naming the ``param``.

Decisions: only ``function`` tools are served (``mcp`` is ``unsupported``). ``tool_choice`` is ``auto``,
``none``, ``required`` or ``{"type": "function", "name": ...}`` naming one of the tools.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from voice_server.session.realtime.errors import (
    UNSUPPORTED,
    FieldError,
    as_object,
    as_str,
    check_keys,
    invalid_type,
    invalid_value,
    join,
    require,
)
from voice_server.session.tools import MAX_TOOLS, TOOL_CHOICES, Tool, ToolCall

MAX_OUTPUT_CHARS = 100_000
"""A function call's output (what the client's tool returned) kept in the conversation at most."""


@dataclass(frozen=True)
class FunctionCallItem:
    """A ``function_call`` item a client adds (e.g. a call history replayed into a new session)."""

    call: ToolCall
    item_id: str | None = None


@dataclass(frozen=True)
class FunctionCallOutputItem:
    """A ``function_call_output`` item: the client's result for the model's call ``call_id``."""

    call_id: str
    output: str
    item_id: str | None = None


def parse_tools(raw: object, path: str) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise invalid_type(path, "an array", raw)
    if len(raw) > MAX_TOOLS:
        raise invalid_value(path, f"at most {MAX_TOOLS} tools, got {len(raw)}.")
    tools: list[Tool] = []
    for index, tool_raw in enumerate(raw):
        tool_path = f"{path}[{index}]"
        spec = as_object(tool_raw, tool_path)
        kind = as_str(require(spec, "type", tool_path), join(tool_path, "type"))
        if kind != "function":
            raise FieldError(UNSUPPORTED, f"Tools of type '{kind}' are not supported; only 'function' is.",
                             join(tool_path, "type"))
        check_keys(spec, tool_path, {"type", "name", "description", "parameters"})
        name = as_str(require(spec, "name", tool_path), join(tool_path, "name"))
        if any(tool.name == name for tool in tools):
            raise invalid_value(join(tool_path, "name"), f"function names must be unique; {name!r} is repeated.")
        parameters = spec.get("parameters")
        try:
            tools.append(Tool(name, as_str(spec.get("description", ""), join(tool_path, "description")),
                              None if parameters is None else as_object(parameters, join(tool_path, "parameters"))))
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            raise invalid_value(join(tool_path, field), message + ".") from exc
    return tuple(tools)


def parse_tool_choice(raw: object, path: str) -> str:
    """``auto`` | ``none`` | ``required`` | a function's name (from ``{"type": "function", "name"}``)."""
    if isinstance(raw, str):
        if raw not in TOOL_CHOICES:
            raise invalid_value(path, f"must be one of {', '.join(TOOL_CHOICES)} or a function, got {raw!r}.")
        return raw
    spec = as_object(raw, path)
    kind = as_str(require(spec, "type", path), join(path, "type"))
    if kind != "function":
        raise FieldError(UNSUPPORTED, f"tool_choice of type '{kind}' is not supported; only 'function' is.",
                         join(path, "type"))
    check_keys(spec, path, {"type", "name"})
    return as_str(require(spec, "name", path), join(path, "name"), is_nonempty=True)


def check_choice(choice: str, tools: tuple[Tool, ...], path: str) -> None:
    if choice not in TOOL_CHOICES and all(tool.name != choice for tool in tools):
        names = ", ".join(tool.name for tool in tools) or "none"
        raise invalid_value(path, f"names no function of the tools ({names}): {choice!r}.")


def tool_choice_to_ga(choice: str) -> str | dict[str, str]:
    return choice if choice in TOOL_CHOICES else {"type": "function", "name": choice}


def tool_to_ga(tool: Tool) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "function", "name": tool.name, "description": tool.description}
    if tool.parameters is not None:
        spec["parameters"] = dict(tool.parameters)
    return spec


def parse_function_call_item(item: dict[str, Any], path: str, item_id: str | None) -> FunctionCallItem:
    check_keys(item, path, {"type", "id", "object", "status", "call_id", "name", "arguments"})
    call_id = as_str(require(item, "call_id", path), join(path, "call_id"), is_nonempty=True)
    name = as_str(require(item, "name", path), join(path, "name"), is_nonempty=True)
    arguments = as_str(item.get("arguments", "{}"), join(path, "arguments"))
    try:
        is_object = isinstance(json.loads(arguments), dict)
    except (ValueError, RecursionError):
        is_object = False
    if not is_object:
        # NOTE: the thinker renders it into every later prompt: a bad one would fail each response after it.
        raise invalid_value(join(path, "arguments"), "must be a JSON object as text.")
    return FunctionCallItem(ToolCall(call_id, name, arguments), item_id)


def parse_function_call_output_item(item: dict[str, Any], path: str, item_id: str | None) -> FunctionCallOutputItem:
    check_keys(item, path, {"type", "id", "object", "status", "call_id", "output"})
    call_id = as_str(require(item, "call_id", path), join(path, "call_id"), is_nonempty=True)
    output = as_str(require(item, "output", path), join(path, "output"))
    if len(output) > MAX_OUTPUT_CHARS:
        raise invalid_value(join(path, "output"), f"at most {MAX_OUTPUT_CHARS} characters, got {len(output)}.")
    return FunctionCallOutputItem(call_id, output, item_id)
