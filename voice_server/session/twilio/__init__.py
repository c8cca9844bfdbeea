"""Twilio Media Streams protocol layer (no server wiring): inbound parsing, outbound frames, playback.

- ``inbound``: the typed inbound messages (frozen, validated on construction);
- ``messages``: ``parse_twilio_message``, client frames -> those messages (the error-handling table);
- ``stream``: ``TwilioStreamGuard``, the per-socket order and identity checks on top of the parser;
- ``outbound``: ``media``/``mark``/``clear`` frames and ``TwilioAudioEncoder`` (PCM -> 20 ms mu-law);
- ``auth``: the bearer token carried in ``start.customParameters``;
- ``playback``: ``PlaybackTracker``, what the caller has heard (from echoed marks) for truncation.

Numpy only, like ``voice_server.audio``: the process serving sessions never imports torch.
"""

from __future__ import annotations

from voice_server.session.twilio.auth import TOKEN_PARAMETER_NAMES, is_authorized, start_token
from voice_server.session.twilio.messages import (
    CLOSE_MESSAGE_TOO_BIG,
    CLOSE_POLICY_VIOLATION,
    CLOSE_UNSUPPORTED_DATA,
    TwilioConnected,
    TwilioDtmf,
    TwilioMark,
    TwilioMedia,
    TwilioMediaFormat,
    TwilioMessage,
    TwilioProtocolError,
    TwilioStart,
    TwilioStop,
    parse_twilio_message,
)
from voice_server.session.twilio.outbound import (
    FRAME_MS,
    NUM_FRAME_SAMPLES,
    TwilioAudioEncoder,
    build_clear_message,
    build_mark_message,
    build_media_message,
)
from voice_server.session.twilio.playback import PlaybackTracker
from voice_server.session.twilio.stream import TwilioStreamGuard

__all__ = [
    "CLOSE_MESSAGE_TOO_BIG",
    "CLOSE_POLICY_VIOLATION",
    "CLOSE_UNSUPPORTED_DATA",
    "FRAME_MS",
    "NUM_FRAME_SAMPLES",
    "TOKEN_PARAMETER_NAMES",
    "PlaybackTracker",
    "TwilioAudioEncoder",
    "TwilioConnected",
    "TwilioDtmf",
    "TwilioMark",
    "TwilioMedia",
    "TwilioMediaFormat",
    "TwilioMessage",
    "TwilioProtocolError",
    "TwilioStart",
    "TwilioStop",
    "TwilioStreamGuard",
    "build_clear_message",
    "build_mark_message",
    "build_media_message",
    "is_authorized",
    "parse_twilio_message",
    "start_token",
]
