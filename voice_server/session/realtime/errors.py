"""Protocol errors of the Realtime layer and the typed readers that produce them.

Every problem with client input becomes a ``ProtocolError`` value (never an exception out of
``parse_client_event``); ``ProtocolError.to_event()`` gives OpenAI's error event shape::

    {"type": "error", "event_id": "event_<hex>",
     "error": {"type": "invalid_request_error", "code": ..., "message": ..., "param": ..., "event_id": ...}}

``param`` is the dotted path of the offending field (``session.audio.input.format.rate``,
``item.content[0].type``); ``error.event_id`` is the client's ``event_id`` when it could be read.

Error codes (OpenAI's own codes where its public errors show one, ours otherwise):

=============================  ======  ==============================================================
code                           origin  when
=============================  ======  ==============================================================
``invalid_json``               ours    a text frame that is not JSON
``invalid_event``              ours    JSON that is not an object
``binary_frame``               ours    a binary WebSocket frame: this protocol is JSON text only
``event_too_large``            ours    a frame over ``MAX_EVENT_CHARS``
``missing_required_parameter`` OpenAI  no ``type``, or a required field is absent
``invalid_type``               OpenAI  a field has the wrong JSON type
``invalid_value``              OpenAI  a value out of range or not among the allowed ones; an
                                       unknown event ``type`` (``param: "type"``)
``unknown_parameter``          OpenAI  a field the schema does not have
``unsupported``                ours    valid in OpenAI's schema but not served here (``semantic_vad``,
                                       tools, audio content parts, ``conversation.item.retrieve``...)
``invalid_base64``             ours    ``audio`` that is not strict base64
``audio_too_large``            ours    one ``input_audio_buffer.append`` over 15 MiB of audio
=============================  ======  ==============================================================

Errors of the session state (raised by the endpoint, ``endpoint``/``bridge``, not by the parsers):

=========================================  ======  ===================================================
code                                       origin  when
=========================================  ======  ===================================================
``input_audio_too_fast``                   ours    appended audio runs ahead of 2x real time (the
                                                   append is dropped)
``input_audio_buffer_commit_empty``        OpenAI  a commit with no audio buffered
``conversation_already_has_active_response`` OpenAI  ``response.create`` while a response runs
``response_cancel_not_active``             OpenAI  ``response.cancel`` with no (such) response running
=========================================  ======  ===================================================

An unknown ``item_id`` (truncate, delete, ``previous_item_id``) and an ``audio_end_ms`` past the audio
sent are ``invalid_value`` with that ``param``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from voice_server.session.realtime.server_events import error_event

INVALID_JSON = "invalid_json"
INVALID_EVENT = "invalid_event"
BINARY_FRAME = "binary_frame"
EVENT_TOO_LARGE = "event_too_large"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
UNKNOWN_PARAMETER = "unknown_parameter"
UNSUPPORTED = "unsupported"
INVALID_BASE64 = "invalid_base64"
AUDIO_TOO_LARGE = "audio_too_large"
INPUT_AUDIO_TOO_FAST = "input_audio_too_fast"
COMMIT_EMPTY = "input_audio_buffer_commit_empty"
ACTIVE_RESPONSE = "conversation_already_has_active_response"
CANCEL_NOT_ACTIVE = "response_cancel_not_active"

ERROR_CODES = frozenset({
    INVALID_JSON, INVALID_EVENT, BINARY_FRAME, EVENT_TOO_LARGE, MISSING_REQUIRED_PARAMETER, INVALID_TYPE,
    INVALID_VALUE, UNKNOWN_PARAMETER, UNSUPPORTED, INVALID_BASE64, AUDIO_TOO_LARGE, INPUT_AUDIO_TOO_FAST,
    COMMIT_EMPTY, ACTIVE_RESPONSE, CANCEL_NOT_ACTIVE,
})
ERROR_TYPES = frozenset({"invalid_request_error", "server_error"})


@dataclass(frozen=True)
class ProtocolError:
    """One client-input problem, ready to be sent back as an ``error`` server event."""

    code: str
    message: str
    param: str | None = None
    event_id: str | None = None  # the client's event_id, echoed as error.event_id
    error_type: str = "invalid_request_error"

    def __post_init__(self) -> None:
        if self.code not in ERROR_CODES:
            raise ValueError(f"unknown protocol error code {self.code!r}; known: {sorted(ERROR_CODES)}")
        if self.error_type not in ERROR_TYPES:
            raise ValueError(f"error_type must be one of {sorted(ERROR_TYPES)}, got {self.error_type!r}")
        if not self.message:
            raise ValueError("a protocol error needs a message")

    def to_event(self) -> dict[str, Any]:
        """The ``error`` server event (with a fresh server event_id)."""
        return error_event(self.code, self.message, param=self.param, client_event_id=self.event_id,
                           error_type=self.error_type)


class FieldError(Exception):
    """Raised inside the parsers for a bad field; ``parse_client_event`` turns it into a ProtocolError."""

    def __init__(self, code: str, message: str, param: str | None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def to_protocol_error(self, event_id: str | None) -> ProtocolError:
        return ProtocolError(self.code, self.message, self.param, event_id)


_JSON_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
                    dict: "an object", type(None): "null"}


def json_type_name(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def invalid_type(param: str, expected: str, value: object) -> FieldError:
    return FieldError(INVALID_TYPE, f"Invalid type for '{param}': expected {expected}, but got "
                                    f"{json_type_name(value)} instead.", param)


def invalid_value(param: str, message: str) -> FieldError:
    return FieldError(INVALID_VALUE, f"Invalid value for '{param}': {message}", param)


def check_keys(obj: Mapping[str, Any], path: str, allowed: frozenset[str] | set[str]) -> None:
    """Refuse keys the schema does not have (sorted, so the reported one is deterministic)."""
    for key in sorted(set(obj) - set(allowed)):
        param = f"{path}.{key}" if path else key
        raise FieldError(UNKNOWN_PARAMETER, f"Unknown parameter: '{param}'.", param)


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def require(obj: Mapping[str, Any], key: str, path: str) -> Any:
    if key not in obj:
        param = join(path, key)
        raise FieldError(MISSING_REQUIRED_PARAMETER, f"Missing required parameter: '{param}'.", param)
    return obj[key]


def as_object(value: object, param: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise invalid_type(param, "an object", value)
    return value


def as_str(value: object, param: str, *, is_nonempty: bool = False) -> str:
    if not isinstance(value, str):
        raise invalid_type(param, "a string", value)
    if is_nonempty and not value:
        raise invalid_value(param, "must not be empty.")
    return value


def as_bool(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid_type(param, "a boolean", value)
    return value


def as_int(value: object, param: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    # NOTE: JSON has one number type; 300.0 is accepted as 300 (JS clients serialise whole floats that
    # way), 300.5 is not. bool is an int subclass in Python and is refused explicitly.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_type(param, "an integer", value)
    _check_range(value, param, minimum, maximum)
    return value


def as_float(value: object, param: str, *, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise invalid_type(param, "a number", value)
    # NOTE: JSON integers are unbounded and math.isfinite/float() overflow past ~1e308: such an
    # integer is out of any range a float field has, so it is refused here rather than raised.
    try:
        number = float(value)
    except OverflowError:
        raise invalid_value(param, "is too large.") from None
    if not math.isfinite(number):
        raise invalid_value(param, "must be finite.")
    _check_range(value, param, minimum, maximum)
    return number


def as_choice(value: object, param: str, choices: tuple[str, ...]) -> str:
    text = as_str(value, param)
    if text not in choices:
        supported = ", ".join(f"'{c}'" for c in choices)
        raise FieldError(INVALID_VALUE, f"Invalid value: '{text}'. Supported values are: {supported}.", param)
    return text


def _check_range(value: float, param: str, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and value < minimum:
        raise invalid_value(param, f"{value} is below the minimum of {minimum}.")
    if maximum is not None and value > maximum:
        raise invalid_value(param, f"{value} is above the maximum of {maximum}.")
