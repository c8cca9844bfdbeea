"""Twilio Media Streams inbound message types: frozen, validated on construction (ValueError).

``messages.parse_twilio_message`` builds them from client frames and turns a ValueError into a 1008
close; constructing one directly with bad values is a server bug.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from voice_server.audio import ulaw_decode

__all__ = [
    "TWILIO_ENCODING",
    "TWILIO_NUM_CHANNELS",
    "TWILIO_SAMPLE_RATE",
    "TwilioConnected",
    "TwilioDtmf",
    "TwilioMark",
    "TwilioMedia",
    "TwilioMediaFormat",
    "TwilioMessage",
    "TwilioStart",
    "TwilioStop",
]

MAX_SID_CHARS = 64  # NOTE: Twilio sids are 34 characters; the cap keeps log lines bounded
TWILIO_ENCODING = "audio/x-mulaw"
TWILIO_SAMPLE_RATE = 8000
TWILIO_NUM_CHANNELS = 1
TRACKS = ("inbound", "outbound")


def _check_sid(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_SID_CHARS or not value.isprintable():
        raise ValueError(f"{name} must be a non-empty printable string of at most {MAX_SID_CHARS} characters")


def _check_count(name: str, value: object, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class _StreamMessage:
    """Every message after ``connected`` is numbered and names its stream."""

    sequence_number: int
    stream_sid: str

    def __post_init__(self) -> None:
        _check_count("sequence_number", self.sequence_number)
        _check_sid("stream_sid", self.stream_sid)


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
class TwilioStart(_StreamMessage):
    """Stream metadata; ``custom_parameters`` are the TwiML ``<Parameter>`` values (read-only)."""

    event: ClassVar[str] = "start"

    account_sid: str
    call_sid: str
    tracks: tuple[str, ...]
    custom_parameters: Mapping[str, str]
    media_format: TwilioMediaFormat

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("account_sid", "call_sid"):
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
class TwilioMedia(_StreamMessage):
    """One chunk of audio: ``payload`` is raw mu-law at 8 kHz (one byte a sample, no header)."""

    event: ClassVar[str] = "media"

    track: str
    chunk: int
    timestamp_ms: int
    payload: bytes

    def __post_init__(self) -> None:
        super().__post_init__()
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
class TwilioDtmf(_StreamMessage):
    """A key press on the caller's keypad (bidirectional streams only)."""

    event: ClassVar[str] = "dtmf"

    track: str
    digit: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.track, str) or not isinstance(self.digit, str):
            raise ValueError("track and digit must be strings")


@dataclass(frozen=True)
class TwilioMark(_StreamMessage):
    """The echo of a mark we sent: the audio queued before it has played (or was cleared)."""

    event: ClassVar[str] = "mark"

    name: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.name, str):
            raise ValueError("mark name must be a string")


@dataclass(frozen=True)
class TwilioStop(_StreamMessage):
    """The stream has ended (the call hung up or the stream was stopped)."""

    event: ClassVar[str] = "stop"

    account_sid: str
    call_sid: str

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("account_sid", "call_sid"):
            _check_sid(name, getattr(self, name))


TwilioMessage = TwilioConnected | TwilioStart | TwilioMedia | TwilioDtmf | TwilioMark | TwilioStop
