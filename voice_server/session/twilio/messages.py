"""Twilio Media Streams inbound messages: one text frame in, one typed value or one protocol error out.

Twilio sends JSON text frames: ``connected``, ``start``, ``media`` (20 ms of 8 kHz mu-law every 20 ms),
``dtmf``, ``mark`` (the echo of a mark we sent) and ``stop``. Counters (``sequenceNumber``, ``chunk``,
``timestamp``) arrive as decimal strings; plain JSON integers are accepted too. Unknown extra fields
are ignored (Twilio may add some); a known field with the wrong type is an error.

``parse_twilio_message`` never raises on client input: it returns a frozen message or a
``TwilioProtocolError``. Twilio cannot receive error events, so the server's only recourse is to close
the socket (``close_code`` set) or to ignore the frame with a log line (``close_code`` None). The
per-connection checks (order, streamSid) are ``TwilioStreamGuard``'s, in ``stream.py``; the message
types themselves live in ``inbound.py`` (re-exported here).

==========================================  ============  ================================================
Input                                       Action        Why
==========================================  ============  ================================================
binary frame                                close 1003    Twilio only sends text (a binary frame is its
                                                          warning 31950); not Twilio
text frame over 64 KiB                      close 1009    a real frame is ~300 bytes; bounds the parse
invalid JSON, JSON too deeply nested,       close 1008    not Twilio, or a corrupted stream
not an object, ``event`` missing/not str
unknown ``event`` value                     ignore, log   forward compatibility: Twilio may add events
known event, field missing or wrong type,   close 1008    we cannot act on it safely (e.g. audio of
counter not a canonical decimal, empty                    unknown position or bytes)
or oversized sid, bad base64 payload,
unknown track, top-level streamSid !=
``start.streamSid``
``mediaFormat`` not mu-law/8000/mono        close 1003    valid but unsupported audio: decoding it as
                                                          mu-law would feed noise to the model
``start`` without the inbound track         close 1003    the caller's audio would never arrive
dtmf ``digit`` not one of 0-9 * # A-D       ignore, log   harmless: the call can go on
media/mark/dtmf/stop before ``start``       close 1008    no stream yet: nothing to attribute it to
a second ``start``                          close 1008    a socket carries one stream; switching call
                                                          identity mid-session is an injection risk
streamSid != the started stream's           close 1008    same: frames of another stream
``sequenceNumber`` <= the previous one      ignore, log   a replay/duplicate: dropping it is safe
``connected`` after ``connected``/start     ignore, log   harmless
media on the ``outbound`` track             ignore, log   not the caller's voice (one-way
                                                          ``both_tracks`` streams only)
anything after ``stop``                     ignore, log   the stream is over; the socket is closing
==========================================  ============  ================================================
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voice_server.audio import b64decode
from voice_server.session.twilio.inbound import (
    TWILIO_ENCODING,
    TWILIO_NUM_CHANNELS,
    TWILIO_SAMPLE_RATE,
    TwilioConnected,
    TwilioDtmf,
    TwilioMark,
    TwilioMedia,
    TwilioMediaFormat,
    TwilioMessage,
    TwilioStart,
    TwilioStop,
)

__all__ = [
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_UNSUPPORTED_DATA",
    "TwilioConnected",
    "TwilioDtmf",
    "TwilioMark",
    "TwilioMedia",
    "TwilioMediaFormat",
    "TwilioMessage",
    "TwilioProtocolError",
    "TwilioStart",
    "TwilioStop",
    "parse_twilio_message",
]

CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
MAX_FRAME_CHARS = 65536
MAX_COUNTER_DIGITS = 18  # NOTE: fits int64 and stays far below int()'s 4300-digit guard
DTMF_DIGITS = frozenset("0123456789*#ABCD")


@dataclass(frozen=True)
class TwilioProtocolError:
    """Why a frame was refused; ``close_code`` None means ignore the frame (log it), else close with it."""

    reason: str
    close_code: int | None
    event: str | None = None

    def __post_init__(self) -> None:
        if self.close_code not in (None, CLOSE_UNSUPPORTED_DATA, CLOSE_POLICY_VIOLATION, CLOSE_MESSAGE_TOO_BIG):
            raise ValueError(f"close_code must be None, 1003, 1008 or 1009, got {self.close_code!r}")

    @property
    def is_fatal(self) -> bool:
        return self.close_code is not None


class _Invalid(Exception):
    """Internal: a frame is refused; converted to a TwilioProtocolError at the parse boundary."""

    def __init__(self, reason: str, close_code: int | None = CLOSE_POLICY_VIOLATION, event: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.close_code = close_code
        self.event = event


def _get(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    # NOTE: bool is an int subclass; a JSON true is never a valid counter.
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "missing" if key not in obj else f"a {type(value).__name__}"
        raise _Invalid(f"{where}.{key} must be a {kind.__name__}, got {got}")
    return value


def _counter(obj: dict[str, Any], key: str, where: str) -> int:
    """A non-negative count given as a canonical decimal string (Twilio's form) or a JSON integer."""
    value = obj.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    # NOTE: str.isdigit accepts non-ASCII digits ("٣") and int() strips whitespace; neither is Twilio.
    if isinstance(value, str) and 0 < len(value) <= MAX_COUNTER_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    raise _Invalid(f"{where}.{key} must be a decimal counter string, got {value!r:.40}")


def _parse_start(msg: dict[str, Any], seq: int, stream_sid: str) -> TwilioStart:
    start = _get(msg, "start", dict, "start")
    if _get(start, "streamSid", str, "start.start") != stream_sid:
        raise _Invalid("start.streamSid differs from start.start.streamSid")
    fmt = _get(start, "mediaFormat", dict, "start.start")
    encoding = _get(fmt, "encoding", str, "start.mediaFormat")
    media_format = (encoding, _counter(fmt, "sampleRate", "mediaFormat"), _counter(fmt, "channels", "mediaFormat"))
    if media_format != (TWILIO_ENCODING, TWILIO_SAMPLE_RATE, TWILIO_NUM_CHANNELS):
        raise _Invalid(f"unsupported media format {media_format!r:.80}", CLOSE_UNSUPPORTED_DATA)
    tracks = tuple(_get(start, "tracks", list, "start.start"))
    # NOTE: before the set below: a JSON object or array among the tracks is unhashable (TypeError).
    if not all(isinstance(track, str) for track in tracks):
        raise _Invalid("start.tracks must be a list of strings")
    if len(set(tracks)) != len(tracks):
        raise _Invalid("start.tracks lists a track twice")
    return TwilioStart(
        seq, stream_sid, _get(start, "accountSid", str, "start.start"), _get(start, "callSid", str, "start.start"),
        tracks, _get(start, "customParameters", dict, "start.start") if "customParameters" in start else {},
        TwilioMediaFormat(*media_format),
    )


def _parse_media(msg: dict[str, Any], seq: int, stream_sid: str) -> TwilioMedia:
    media = _get(msg, "media", dict, "media")
    try:
        payload = b64decode(_get(media, "payload", str, "media.media"))
    except ValueError:
        raise _Invalid("media.payload is not valid base64") from None
    chunk, timestamp_ms = _counter(media, "chunk", "media.media"), _counter(media, "timestamp", "media.media")
    return TwilioMedia(seq, stream_sid, _get(media, "track", str, "media.media"), chunk, timestamp_ms, payload)


def _parse_dtmf(msg: dict[str, Any], seq: int, stream_sid: str) -> TwilioDtmf:
    dtmf = _get(msg, "dtmf", dict, "dtmf")
    digit = _get(dtmf, "digit", str, "dtmf.dtmf")
    if digit not in DTMF_DIGITS:
        raise _Invalid(f"dtmf.digit {digit!r:.20} is not a DTMF key", close_code=None)
    return TwilioDtmf(seq, stream_sid, _get(dtmf, "track", str, "dtmf.dtmf"), digit)


def _parse_stop(msg: dict[str, Any], seq: int, stream_sid: str) -> TwilioStop:
    stop = _get(msg, "stop", dict, "stop")
    return TwilioStop(seq, stream_sid, _get(stop, "accountSid", str, "stop.stop"), _get(stop, "callSid", str, "stop"))


def _parse_mark(msg: dict[str, Any], seq: int, stream_sid: str) -> TwilioMark:
    return TwilioMark(seq, stream_sid, _get(_get(msg, "mark", dict, "mark"), "name", str, "mark.mark"))


_PARSERS: dict[str, Callable[[dict[str, Any], int, str], TwilioMessage]] = {
    "start": _parse_start, "media": _parse_media, "dtmf": _parse_dtmf, "mark": _parse_mark, "stop": _parse_stop,
}


def _parse(frame: object) -> TwilioMessage:
    if isinstance(frame, bytes | bytearray | memoryview) or not isinstance(frame, str):
        raise _Invalid("binary frame: Twilio Media Streams send JSON text only", CLOSE_UNSUPPORTED_DATA)
    if len(frame) > MAX_FRAME_CHARS:
        raise _Invalid(f"text frame of {len(frame)} characters (max {MAX_FRAME_CHARS})", CLOSE_MESSAGE_TOO_BIG)
    try:
        msg = json.loads(frame)
    except (ValueError, RecursionError) as exc:  # NOTE: "[[[[..." exhausts the recursion limit
        raise _Invalid(f"invalid JSON ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise _Invalid(f"a message must be a JSON object, got a {type(msg).__name__}")
    event = _get(msg, "event", str, "message")
    try:
        if event == "connected":
            return TwilioConnected(_get(msg, "protocol", str, "connected"), _get(msg, "version", str, "connected"))
        parser = _PARSERS.get(event)
        if parser is None:
            raise _Invalid(f"unknown event {event!r:.40}", close_code=None)
        return parser(msg, _counter(msg, "sequenceNumber", event), _get(msg, "streamSid", str, event))
    except _Invalid as exc:
        exc.event = event[:40]
        raise
    except ValueError as exc:  # NOTE: the messages validate values on construction; a bad value is a 1008
        raise _Invalid(str(exc), event=event[:40]) from None


def parse_twilio_message(frame: str | bytes) -> TwilioMessage | TwilioProtocolError:
    """The typed message in one WebSocket frame, or why it is refused (never raises on client input)."""
    try:
        return _parse(frame)
    except _Invalid as exc:
        return TwilioProtocolError(exc.reason, exc.close_code, exc.event)
