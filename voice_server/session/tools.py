"""Function calling, on the session's side: the tools a response may call, and the calls it made, checked.

The thinker's stage cuts each `<tool_call>...</tool_call>` out of what it streams (nothing of a call is
spoken) and sends its raw text under `tool_calls` (`voice_server/scheduling/tool_calls.py`). Here each
raw call is parsed and checked before the client hears of it: JSON of the form `{"name", "arguments"}`,
a function the response offered, arguments that validate against its JSON schema. What fails is a
`ToolCallError` with a code the protocols send as an error event (fail closed: no call, nothing spoken,
the session goes on).

The tools travel to the pipeline in the request params (`params["tools"]`, `params["tool_choice"]`), where
the thinker renders them into its prompt in the model's own chat form; a response reads them back from
its params (`ToolSet.from_params`), so a per-response override checks its calls against its own tools.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

from voice_server.scheduling.tool_calls import CLOSE_TAG, OPEN_TAG

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_CHOICES = ("auto", "none", "required")

MALFORMED = "tool_call_malformed"
"""The call is not JSON of the form {"name": str, "arguments": object}."""
UNKNOWN_FUNCTION = "tool_call_unknown_function"
INVALID_ARGUMENTS = "tool_call_invalid_arguments"
"""The arguments do not validate against the function's `parameters` schema."""
REQUIRED_MISSING = "tool_call_required_missing"
"""`tool_choice` required a call (or a named function) and the response made none."""


class ToolCallError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@functools.lru_cache(maxsize=256)
def _schema_error(schema_text: str) -> str | None:
    """Why a JSON schema (as sorted JSON text) is not valid, or None.

    NOTE: cached: a session's tools are rebuilt from the request params at every response and turn start
    (`ToolSet.from_params`), and checking ten schemas costs ~7 ms of the session loop each time."""
    try:
        jsonschema.Draft202012Validator.check_schema(json.loads(schema_text))
    except jsonschema.SchemaError as exc:
        return str(exc.message)
    return None


@dataclass(frozen=True)
class Tool:
    """One function the model may call (OpenAI's `{"type": "function", name, description, parameters}`)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None
    """A JSON schema for the arguments object (None: any object)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"name: must be 1-64 letters, digits, '_' or '-', got {self.name!r}")
        if not isinstance(self.description, str) or len(self.description) > 10_000:
            raise ValueError("description: must be a string of at most 10000 characters")
        if self.parameters is not None:
            if not isinstance(self.parameters, Mapping):
                raise ValueError(f"parameters: must be a JSON schema object, got {type(self.parameters).__name__}")
            try:
                schema_text = json.dumps(self.parameters, sort_keys=True)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"parameters: not a JSON object: {exc}") from exc
            error = _schema_error(schema_text)
            if error is not None:
                raise ValueError(f"parameters: not a valid JSON schema: {error}")

    def to_param(self) -> dict[str, Any]:
        """What the pipeline renders into the prompt (`params["tools"]` items)."""
        return {"name": self.name, "description": self.description,
                "parameters": dict(self.parameters) if self.parameters is not None else {"type": "object"}}


@dataclass(frozen=True)
class ToolCall:
    call_id: str
    name: str
    arguments: str
    """The arguments object as JSON text (what OpenAI's `function_call` items carry)."""


@dataclass(frozen=True)
class ToolSet:
    """The tools one response offers and how it must use them."""

    tools: tuple[Tool, ...] = ()
    choice: str = "auto"
    """`auto`, `required`, or a function's name (it must call that one). `none` never reaches a ToolSet:
    a response offered no tools sends none (`to_params` gives nothing)."""

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"tools: at most {MAX_TOOLS} tools, got {len(self.tools)}")
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if self.choice not in ("auto", "required") and self.choice not in names:
            raise ValueError(f"tool_choice: names no function of tools ({', '.join(names) or 'none'}): {self.choice!r}")

    @classmethod
    def create(cls, tools: Sequence[Tool], choice: str | None) -> ToolSet | None:
        """None when the response offers nothing: no tools, or tool_choice `none`."""
        if not tools or choice == "none":
            return None
        return cls(tuple(tools), choice or "auto")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ToolSet | None:
        raw = params.get("tools")
        if not raw:
            return None
        choice = params.get("tool_choice") or "auto"
        return cls(tuple(Tool(**dict(t)) for t in raw), choice["name"] if isinstance(choice, Mapping) else choice)

    def to_params(self) -> dict[str, Any]:
        choice: str | dict[str, str] = self.choice if self.choice in ("auto", "required") else {"name": self.choice}
        return {"tools": [tool.to_param() for tool in self.tools], "tool_choice": choice}

    def check(self, raw: str, call_id: str) -> ToolCall:
        """A raw call (the text between the tags) -> a checked `ToolCall`, or ToolCallError."""
        if raw.startswith(OPEN_TAG):
            raise ToolCallError(MALFORMED, f"the model's tool call was not closed with {CLOSE_TAG}")
        try:
            call = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ToolCallError(MALFORMED, f"the model's tool call is not JSON ({exc.msg})") from exc
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolCallError(MALFORMED, 'the model\'s tool call is not {"name": ..., "arguments": {...}}')
        name, arguments = call["name"], call.get("arguments", {})
        if isinstance(arguments, str):  # NOTE: some templates show arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ToolCallError(MALFORMED, f"the arguments of {name!r} are not JSON ({exc.msg})") from exc
        if not isinstance(arguments, dict):
            raise ToolCallError(MALFORMED, f"the arguments of {name!r} are not a JSON object")
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            offered = ", ".join(t.name for t in self.tools)
            raise ToolCallError(UNKNOWN_FUNCTION, f"the model called {name!r}, which is not offered ({offered})")
        if self.choice not in ("auto", "required") and name != self.choice:
            raise ToolCallError(UNKNOWN_FUNCTION, f"the model called {name!r}; tool_choice requires {self.choice!r}")
        if tool.parameters is not None:
            error = jsonschema.exceptions.best_match(
                jsonschema.Draft202012Validator(dict(tool.parameters)).iter_errors(arguments))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(the object)"
                raise ToolCallError(INVALID_ARGUMENTS,
                                    f"the arguments of {name!r} do not match its schema at {where}: {error.message}")
        return ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False))

    def check_done(self, num_calls: int) -> None:
        """At the end of a response: `required` (or a named choice) wanted at least one call."""
        if self.choice != "auto" and num_calls == 0:
            wanted = "a tool call" if self.choice == "required" else f"a call of {self.choice!r}"
            raise ToolCallError(REQUIRED_MISSING, f"tool_choice required {wanted}; the model made none")
