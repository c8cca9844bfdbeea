"""Payloads of the richer client events: the message of ``conversation.item.create`` and the overrides of
``response.create``, with their parsers (which raise FieldError naming the ``param``).

Decisions: messages (typed, spoken as ``input_audio`` parts, with ``input_image`` parts: `content_parts.py`)
and the function-calling items (``function_call``, ``function_call_output``: `tool_fields.py`) are taken;
other items (MCP) are ``unsupported``. ``response.create``
accepts ``instructions``, ``tools``, ``tool_choice``, ``output_modalities`` (beta
``modalities``), the voice and output format (GA ``audio.output.*``, beta ``voice`` /
``output_audio_format``), ``max_output_tokens`` (beta ``max_response_output_tokens``), ``temperature``,
``metadata`` and ``conversation`` (``auto`` or ``none``); a custom ``input`` context is ``unsupported``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from voice_server.session.realtime.content_parts import AudioMessageItem, MessageItem, Role, parse_message
from voice_server.session.realtime.errors import (
    UNSUPPORTED,
    FieldError,
    as_choice,
    as_float,
    as_object,
    as_str,
    check_keys,
    invalid_value,
    join,
    require,
)
from voice_server.session.realtime.session_fields import (
    AudioFormat,
    check_unserved,
    parse_audio_format,
    parse_beta_format,
    parse_max_output_tokens,
    parse_modalities,
    parse_voice,
)
from voice_server.session.realtime.tool_fields import (
    FunctionCallItem,
    FunctionCallOutputItem,
    parse_function_call_item,
    parse_function_call_output_item,
    parse_tool_choice,
    parse_tools,
)
from voice_server.session.tools import Tool

MAX_ID_CHARS = 64
MAX_METADATA_KEYS = 16


@dataclass(frozen=True)
class ResponseOverrides:
    """``response.create``'s ``response``: every field None means "the session's"."""

    instructions: str | None = None
    output_modalities: tuple[str, ...] | None = None
    voice: str | None = None
    output_format: AudioFormat | None = None
    max_output_tokens: int | Literal["inf"] | None = None
    temperature: float | None = None
    metadata: Mapping[str, str] | None = None
    tools: tuple[Tool, ...] | None = None
    tool_choice: str | None = None
    is_out_of_band: bool = False  # conversation: "none": the response is not added to the conversation


ClientItem = MessageItem | AudioMessageItem | FunctionCallItem | FunctionCallOutputItem


def parse_item(raw: object, path: str) -> ClientItem:
    item = as_object(raw, path)
    kind = as_str(require(item, "type", path), join(path, "type"))
    item_id = None if item.get("id") is None else parse_id(item["id"], join(path, "id"))
    if kind == "function_call":
        return parse_function_call_item(dict(item), path, item_id)
    if kind == "function_call_output":
        return parse_function_call_output_item(dict(item), path, item_id)
    if kind != "message":
        raise FieldError(UNSUPPORTED, f"Items of type '{kind}' are not supported; only 'message', "
                                      "'function_call' and 'function_call_output' are.", join(path, "type"))
    check_keys(item, path, {"type", "role", "content", "id", "object", "status"})
    role = as_choice(require(item, "role", path), join(path, "role"), ("user", "system", "assistant"))
    return parse_message(cast(Role, role), require(item, "content", path), join(path, "content"), item_id)


def parse_response_overrides(raw: object, path: str) -> ResponseOverrides:
    spec = as_object(raw, path)
    check_keys(spec, path, {"instructions", "output_modalities", "modalities", "audio", "voice",
                            "output_audio_format", "max_output_tokens", "max_response_output_tokens",
                            "temperature", "metadata", "conversation", "input", "tools", "tool_choice",
                            "prompt", "reasoning", "parallel_tool_calls"})
    check_unserved(spec, path)
    if spec.get("input") is not None:
        raise FieldError(UNSUPPORTED, "A custom 'input' context is not supported; the response uses the "
                                      "conversation.", join(path, "input"))
    conversation = as_str(spec.get("conversation", "auto"), join(path, "conversation"))
    if conversation not in ("auto", "none"):
        raise FieldError(UNSUPPORTED, "Only the 'auto' and 'none' conversations exist on this server.",
                         join(path, "conversation"))
    audio_out = _audio_output(spec.get("audio"), join(path, "audio"))
    voice_raw = audio_out.get("voice", spec.get("voice"))
    voice_path = join(path, "audio.output.voice" if "voice" in audio_out else "voice")
    output_format = None
    if "format" in audio_out:
        output_format = parse_audio_format(audio_out["format"], join(path, "audio.output.format"))
    elif spec.get("output_audio_format") is not None:
        output_format = parse_beta_format(spec["output_audio_format"], join(path, "output_audio_format"))
    modalities_key = "output_modalities" if "output_modalities" in spec else "modalities"
    tokens_key = "max_output_tokens" if "max_output_tokens" in spec else "max_response_output_tokens"
    tokens = spec.get(tokens_key)
    max_tokens = None if tokens is None else parse_max_output_tokens(tokens, join(path, tokens_key))
    return ResponseOverrides(
        instructions=None if spec.get("instructions") is None else as_str(spec["instructions"],
                                                                           join(path, "instructions")),
        output_modalities=None if spec.get(modalities_key) is None else parse_modalities(
            spec[modalities_key], join(path, modalities_key)),
        voice=None if voice_raw is None else parse_voice(voice_raw, voice_path),
        output_format=output_format,
        max_output_tokens="inf" if tokens == "inf" else max_tokens,
        temperature=None if spec.get("temperature") is None else as_float(
            spec["temperature"], join(path, "temperature"), minimum=0.0, maximum=2.0),
        metadata=None if spec.get("metadata") is None else _parse_metadata(spec["metadata"], join(path, "metadata")),
        tools=None if spec.get("tools") is None else parse_tools(spec["tools"], join(path, "tools")),
        tool_choice=None if spec.get("tool_choice") is None else parse_tool_choice(spec["tool_choice"],
                                                                                   join(path, "tool_choice")),
        is_out_of_band=conversation == "none",
    )


def _audio_output(raw: object, path: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    audio = as_object(raw, path)
    check_keys(audio, path, {"output"})
    if audio.get("output") is None:
        return {}
    output = as_object(audio["output"], join(path, "output"))
    check_keys(output, join(path, "output"), {"format", "voice"})
    return output


def _parse_metadata(raw: object, path: str) -> Mapping[str, str]:
    metadata = as_object(raw, path)
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid_value(path, f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}.")
    for key, value in metadata.items():
        if len(key) > 64:
            raise invalid_value(join(path, key), "metadata keys are at most 64 characters.")
        if len(as_str(value, join(path, key))) > 512:
            raise invalid_value(join(path, key), "metadata values are at most 512 characters.")
    return dict(metadata)


def parse_id(value: object, param: str) -> str:
    text = as_str(value, param, is_nonempty=True)
    if len(text) > MAX_ID_CHARS:
        raise invalid_value(param, f"ids are at most {MAX_ID_CHARS} characters, got {len(text)}.")
    return text
