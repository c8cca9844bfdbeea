"""Checking and converting the asr stage's input (the runner's `admit`): chat messages and 16 kHz audio.

Audio is float32 1-D PCM at 16 kHz, finite, nominally in [-1, 1] (louder samples are clipped); it
is converted to the 16-bit samples PocketSphinx takes here, at admission, so that `execute` only
decodes. Every refusal is an `AdmissionError` naming the offending field (`payload.audio`,
`payload.messages[2].content`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from voice_server.audio.pcm import float32_to_pcm16
from voice_server.models.chat_tools import TOOL_KEYS, tool_fields
from voice_server.scheduling import AdmissionError

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 256
MAX_CHARS = 1 << 20
"""Text of one request's history, all messages together (the thinker bounds it in tokens)."""


def pcm16(where: str, value: Any, max_num_samples: int) -> bytes:
    """16-bit native-order PCM bytes of a 1-D array of at most `max_num_samples` samples: int16 (what a session
    streams, taken as it is) or float32 in [-1, 1]."""
    if not isinstance(value, np.ndarray):
        raise AdmissionError(f"{where}: must be an int16 or float32 numpy array, got {type(value).__name__}")
    if value.dtype not in (np.int16, np.float32) or value.ndim != 1:
        raise AdmissionError(f"{where}: must be 1-D int16 or float32 (16 kHz mono), got {value.dtype} of shape "
                             f"{list(value.shape)}")
    if value.shape[0] > max_num_samples:
        raise AdmissionError(f"{where}: {value.shape[0]} samples is too long (at most {max_num_samples})")
    if value.dtype == np.int16:
        return value.tobytes()
    if not bool(np.isfinite(value).all()):
        raise AdmissionError(f"{where}: has non-finite values")
    return float32_to_pcm16(value).tobytes()


def messages_with_audio(value: Any, max_num_samples: int, is_empty_allowed: bool) -> list[dict[str, Any]]:
    """`payload.messages`: user messages may carry `audio` (at most `max_num_samples` in all) instead of
    `content` (a whole request's turn, or an earlier turn of a streamed one that was never transcribed).

    Returns the messages as `{role, content}` (with an assistant's `tool_calls` or a tool result's
    `tool_call_id`, checked as the thinker checks them: `models/chat_tools.py`), or `{role, pcm}` (bytes) for
    those with audio.
    """
    messages = _message_list(value, is_empty_allowed)
    checked: list[dict[str, Any]] = []
    total_chars = total_samples = 0
    for i, message in enumerate(messages):
        where = f"payload.messages[{i}]"
        if not isinstance(message, dict) or "role" not in message \
                or not set(message) <= {"role", "content", "audio", *TOOL_KEYS}:
            raise AdmissionError(f"{where}: must be a mapping with 'role' and 'content' or (user) 'audio'")
        role = _role(where, message["role"])
        content = _content(where, message.get("content", ""))
        try:
            fields = tool_fields(where, message)
        except ValueError as exc:
            raise AdmissionError(str(exc)) from exc
        total_chars += len(content) + sum(len(call["arguments"]) for call in fields.get("tool_calls", ()))
        if "audio" not in message:
            if "content" not in message:
                raise AdmissionError(f"{where}: needs 'content' or (user) 'audio'")
            checked.append({"role": role, "content": content, **fields})
            continue
        if role != "user":
            raise AdmissionError(f"{where}.audio: only user messages may carry audio, this one is {role!r}")
        if content:
            raise AdmissionError(f"{where}: give either audio or content, not both (the transcript becomes "
                                 "the content)")
        pcm = pcm16(f"{where}.audio", message["audio"], max_num_samples - total_samples)
        total_samples += len(pcm) // 2
        checked.append({"role": role, "pcm": pcm})
    _check_chars(total_chars)
    return checked


def _message_list(value: Any, is_empty_allowed: bool) -> list[Any]:
    if not isinstance(value, list | tuple) or (not value and not is_empty_allowed):
        raise AdmissionError(f"payload.messages: must be a {'' if is_empty_allowed else 'non-empty '}list of "
                             f"messages, got {type(value).__name__}")
    if len(value) > MAX_MESSAGES:
        raise AdmissionError(f"payload.messages: {len(value)} messages, at most {MAX_MESSAGES}")
    return list(value)


def _role(where: str, value: Any) -> str:
    if value not in ROLES:
        raise AdmissionError(f"{where}.role: must be one of {', '.join(ROLES)}, got {value!r}"[:300])
    return str(value)


def _content(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise AdmissionError(f"{where}.content: must be a string, got {type(value).__name__}")
    return value


def _check_chars(total: int) -> None:
    if total > MAX_CHARS:
        raise AdmissionError(f"payload.messages: {total} characters is too long (at most {MAX_CHARS})")
