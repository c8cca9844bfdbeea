"""Twilio Media Streams inbound messages: one text frame in, one typed value or one protocol error out.

Twilio sends JSON text frames: ``connected``, ``start``, ``media`` (20 ms of 8 kHz mu-law every 20 ms),
``dtmf``, ``mark`` (the echo of a mark we sent) and ``stop``. Counters (``sequenceNumber``, ``chunk``,
``timestamp``) arrive as decimal strings; plain JSON integers are accepted too. Unknown extra fields
are ignored (Twilio may add some); a known field with the wrong type is an error.

``parse_twilio_message`` never raises on client input: it returns a frozen message or a
``TwilioProtocolError``. Twilio cannot receive error events, so the server's only recourse is to close
the socket (``close_code`` set) or to ignore the frame with a log line (``close_code`` None). The
per-connection checks (order, streamSid) are ``TwilioStreamGuard``'s, in ``stream.py``.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from voice_server.audio import b64decode, ulaw_decode

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
MAX_SID_CHARS = 64  # NOTE: Twilio sids are 34 characters; the cap keeps log lines bounded
MAX_COUNTER_DIGITS = 18  # NOTE: fits int64 and stays far below int()'s 4300-digit guard
TWILIO_ENCODING = "audio/x-mulaw"
TWILIO_SAMPLE_RATE = 8000
TWILIO_NUM_CHANNELS = 1
TRACKS = ("inbound", "outbound")
DTMF_TRACKS = ("inbound_track", "outbound_track")
DTMF_DIGITS = frozenset("0123456789*#ABCD")


def _check_sid(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_SID_CHARS or not value.isprintable():
        raise ValueError(f"{name} must be a non-empty printable string of at most {MAX_SID_CHARS} characters")


def _check_count(name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class TwilioConnected:
    """The first frame of a socket: ``protocol`` is "Call", ``version`` e.g. "1.0.0" (informational)."""

    event: ClassVar[str] = "connected"

    protocol: str
    version: str

    def __post_init__(self) -> None:
        if not isinstance(self.protocol, str) or not isinstance(self.version, str):
            raise ValueError("protocol and version must be strings")


@dataclass(frozen=True)
class TwilioMediaFormat:
    """The stream's audio format; only mu-law 8 kHz mono exists on Twilio, so only it is accepted."""

    encoding: str
    sample_rate: int
    num_channels: int

    def __post_init__(self) -> None:
        got = (self.encoding, self.sample_rate, self.num_channels)
        if got != (TWILIO_ENCODING, TWILIO_SAMPLE_RATE, TWILIO_NUM_CHANNELS) or isinstance(self.sample_rate, bool):
            raise ValueError(f"media format must be {TWILIO_ENCODING} {TWILIO_SAMPLE_RATE} Hz mono, got {got!r}")


@dataclass(frozen=True)
class TwilioStart:
    """Stream metadata; ``custom_parameters`` are the TwiML ``<Parameter>`` values (read-only)."""

    event: ClassVar[str] = "start"

    sequence_number: int
    stream_sid: str
    account_sid: str
    call_sid: str
    tracks: tuple[str, ...]
    custom_parameters: Mapping[str, str]
    media_format: TwilioMediaFormat

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        for name in ("stream_sid", "account_sid", "call_sid"):
            _check_sid(name, getattr(self, name))
        if not isinstance(self.tracks, tuple) or not self.tracks or not set(self.tracks) <= set(TRACKS):
            raise ValueError(f"tracks must be a non-empty tuple of {TRACKS}, got {self.tracks!r}")
        params = dict(self.custom_parameters)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise ValueError("custom parameters must map strings to strings")
        # NOTE: a private copy behind a read-only view: the message stays immutable as a whole.
        object.__setattr__(self, "custom_parameters", MappingProxyType(params))
        if not isinstance(self.media_format, TwilioMediaFormat):
            raise ValueError("media_format must be a TwilioMediaFormat")


@dataclass(frozen=True)
class TwilioMedia:
    """One chunk of audio: ``payload`` is raw mu-law at 8 kHz (one byte a sample, no header)."""

    event: ClassVar[str] = "media"

    sequence_number: int
    stream_sid: str
    track: str
    chunk: int
    timestamp_ms: int
    payload: bytes

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        _check_sid("stream_sid", self.stream_sid)
        if self.track not in TRACKS:
            raise ValueError(f"track must be one of {TRACKS}, got {self.track!r}")
        _check_count("chunk", self.chunk, minimum=1)
        _check_count("timestamp_ms", self.timestamp_ms)
        if not isinstance(self.payload, bytes):
            raise ValueError("payload must be bytes")

    @property
    def num_samples(self) -> int:
        return len(self.payload)

    @property
    def duration_ms(self) -> float:
        return len(self.payload) * 1000 / TWILIO_SAMPLE_RATE

    def pcm16(self) -> npt.NDArray[np.int16]:
        """The payload decoded to 16-bit linear PCM at 8 kHz."""
        return ulaw_decode(np.frombuffer(self.payload, dtype=np.uint8))


@dataclass(frozen=True)
class TwilioDtmf:
    """A key press on the caller's keypad (bidirectional streams only)."""

    event: ClassVar[str] = "dtmf"

    sequence_number: int
    stream_sid: str
    track: str
    digit: str

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        _check_sid("stream_sid", self.stream_sid)
        if not isinstance(self.track, str) or not isinstance(self.digit, str):
            raise ValueError("track and digit must be strings")


@dataclass(frozen=True)
class TwilioMark:
    """The echo of a mark we sent: the audio queued before it has played (or was cleared)."""

    event: ClassVar[str] = "mark"

    sequence_number: int
    stream_sid: str
    name: str

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        _check_sid("stream_sid", self.stream_sid)
        if not isinstance(self.name, str):
            raise ValueError("mark name must be a string")


@dataclass(frozen=True)
class TwilioStop:
    """The stream has ended (the call hung up or the stream was stopped)."""

    event: ClassVar[str] = "stop"

    sequence_number: int
    stream_sid: str
    account_sid: str
    call_sid: str

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        for name in ("stream_sid", "account_sid", "call_sid"):
            _check_sid(name, getattr(self, name))


TwilioMessage = TwilioConnected | TwilioStart | TwilioMedia | TwilioDtmf | TwilioMark | TwilioStop


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
