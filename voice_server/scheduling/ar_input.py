"""What an AR request's input items say, read into its `Request`: the NEW item, each CHUNK and DONE.

- NEW: `payload.token_ids` (the prompt; empty for a stream whose prompt comes in chunks),
  `num_cacheable_tokens` (leading tokens the prefix cache may serve and fill; null: all) and
  `max_num_outputs` (the output limit of a feedback stage; null: none), `turn_end_pos` (the prompt position
  of the user's last word, scored for the end of the user's turn; null: none), `params.sampling`, and
  `params.tools` (a list of {name, description, parameters}; non-empty: tool calls are cut out of the
  stream, `tool_calls.py`; `params.tool_choice` is the prompt's business, not read here).
- CHUNK: prompt `token_ids` (before any output), `is_input_done` (the prompt is whole; DONE says the
  same), and a raised `max_num_outputs` (never lowered; null lifts it).
- DONE: the prompt is whole (once, and not empty).

Malformed input, or a prompt that could never run in the stage's KV cache (`extend_prompt`), raises
ValueError naming the field or the limit; the shell then refuses the request alone.
"""

from __future__ import annotations

from typing import Any

from voice_server.scheduling.ar_request import Request
from voice_server.scheduling.ar_stop import StopChecker
from voice_server.scheduling.base import WorkItem
from voice_server.scheduling.contract import ARSpec, SamplingParams
from voice_server.scheduling.tool_calls import ToolCallGate

_MAX_TOKEN_ID = 2**63
_TOOL_FIELDS = ("name", "description", "parameters")


def new_request(item: WorkItem, spec: ARSpec) -> Request:
    """The `Request` of a NEW item (its prompt added through `extend_prompt`, which checks the limits)."""
    sampling = SamplingParams.from_params(item.params)
    token_ids = read_token_ids(item.payload, is_required=not item.is_stream)
    if not item.is_stream and not token_ids:
        raise ValueError("payload.token_ids: the prompt is empty")
    has_tools = read_tools(item.params)
    stop = StopChecker(sampling, spec.eos_token_ids, spec.max_model_len, skips_tool_calls=has_tools)
    request = Request(item.request_id, sampling, stop, [], is_input_done=not item.is_stream)
    request.tools = ToolCallGate() if has_tools else None
    request.num_cacheable_tokens = read_count(item.payload, "num_cacheable_tokens")
    request.max_num_outputs = read_count(item.payload, "max_num_outputs")
    extend_prompt(request, token_ids, spec)
    request.turn_end_pos = read_count(item.payload, "turn_end_pos")
    if request.turn_end_pos is not None and request.turn_end_pos >= len(token_ids):
        raise ValueError(f"payload.turn_end_pos: {request.turn_end_pos} is not a position of the "
                         f"{len(token_ids)}-token prompt")
    return request


def apply_chunk(request: Request, payload: dict[str, Any], spec: ARSpec) -> None:
    """Prompt tokens (`token_ids`, before any output), the end of the prompt (`is_input_done`),
    and a raised output limit (`max_num_outputs`: an int that never decreases, or None = off)."""
    token_ids = read_token_ids(payload, is_required=False)
    if token_ids or payload.get("is_input_done"):
        if request.is_input_done:
            raise ValueError(f"request {request.request_id}: prompt input after its input ended")
        extend_prompt(request, token_ids, spec)
    if payload.get("is_input_done"):
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id}: input ended with no prompt tokens")
        request.is_input_done = True
    if "max_num_outputs" in payload:
        limit = read_count(payload, "max_num_outputs")
        if limit is not None and request.max_num_outputs is not None and limit < request.max_num_outputs:
            raise ValueError(f"payload.max_num_outputs: lowered from {request.max_num_outputs} to {limit}")
        if request.max_num_outputs is not None:
            request.max_num_outputs = limit
    if not {"token_ids", "is_input_done", "max_num_outputs"} & payload.keys():
        raise ValueError("payload.token_ids: must be a list of token ids (integers >= 0)")


def apply_done(request: Request) -> None:
    """A DONE item: the prompt is whole."""
    if request.is_input_done:
        raise ValueError(f"request {request.request_id}: done after its input ended")
    if request.num_tokens == 0:
        raise ValueError(f"request {request.request_id}: input ended with no prompt tokens")
    request.is_input_done = True


def extend_prompt(request: Request, token_ids: list[int], spec: ARSpec) -> None:
    """Add prompt tokens, refusing a prompt that could never run: one that leaves no position to
    generate into, or that outgrows the whole KV cache (no preemption could ever make room for it)."""
    num_tokens = request.num_tokens + len(token_ids)
    if num_tokens > spec.max_model_len - 1:
        raise ValueError(f"prompt of {num_tokens} tokens leaves no room to generate "
                         f"(max_model_len {spec.max_model_len})")
    if num_tokens > spec.num_pages * spec.page_size:
        raise ValueError(f"prompt of {num_tokens} tokens can never fit in the KV cache "
                         f"({spec.num_pages} pages of {spec.page_size} tokens)")
    request.extend_prompt(token_ids)


def read_count(payload: dict[str, Any], key: str) -> int | None:
    value = payload.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"payload.{key}: must be null or an integer >= 0, got {value!r}")
    return value


def read_token_ids(payload: dict[str, Any], is_required: bool) -> list[int]:
    raw = payload.get("token_ids")
    if raw is None and not is_required:
        return []
    if not isinstance(raw, (list, tuple)) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _MAX_TOKEN_ID for t in raw
    ):
        raise ValueError("payload.token_ids: must be a list of token ids (integers >= 0)")
    return list(raw)


def read_tools(params: dict[str, Any]) -> bool:
    """Whether `params.tools` offers any tool (null or an empty list: none), refusing a malformed value."""
    raw = params.get("tools")
    if raw is None:
        return False
    where = "params.tools: must be a list of {name, description, parameters}"
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}, got {type(raw).__name__}")
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"{where}; params.tools[{i}] has no name (a non-empty string)")
        unknown = sorted(str(k) for k in tool if k not in _TOOL_FIELDS)
        if unknown:
            raise ValueError(f"{where}; params.tools[{i}] has unknown field(s) {', '.join(unknown)}")
        if not isinstance(tool.get("description", ""), str):
            raise ValueError(f"{where}; params.tools[{i}].description is not a string")
        if not isinstance(tool.get("parameters", {}), dict):
            raise ValueError(f"{where}; params.tools[{i}].parameters is not a mapping (a JSON schema)")
    return bool(raw)
