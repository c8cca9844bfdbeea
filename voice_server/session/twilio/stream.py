"""Per-connection checks of a Twilio Media Stream: message order, stream identity, replays.

``TwilioStreamGuard.receive`` is the session's single entry point for inbound frames: it parses one frame
(``parse_twilio_message``) and then applies the rules of the table in ``messages.py`` that need the
history of the socket (before/after ``start``, a second ``start``, streamSid, sequenceNumber, tracks,
after ``stop``). It logs every refused frame once, at WARNING when the socket must close and at INFO
when the frame is only ignored, so the session just closes on ``error.is_fatal`` and drops the rest.
"""

from __future__ import annotations

import logging

from voice_server.session.twilio.messages import (
    CLOSE_POLICY_VIOLATION,
    CLOSE_UNSUPPORTED_DATA,
    TwilioConnected,
    TwilioMedia,
    TwilioMessage,
    TwilioProtocolError,
    TwilioStart,
    TwilioStop,
    parse_twilio_message,
)

__all__ = ["TwilioStreamGuard"]

log = logging.getLogger("voice_server.session.twilio")


class TwilioStreamGuard:
    """Validates the frames of one socket in order; one guard per WebSocket connection."""

    def __init__(self) -> None:
        self._start: TwilioStart | None = None
        self._is_connected = False
        self._is_stopped = False
        self._last_sequence_number = -1
        self._latest_media_timestamp_ms: int | None = None
        self.num_ignored = 0

    @property
    def start(self) -> TwilioStart | None:
        """The accepted ``start`` message (stream and call identity, custom parameters), once seen."""
        return self._start

    @property
    def stream_sid(self) -> str | None:
        return None if self._start is None else self._start.stream_sid

    @property
    def is_stopped(self) -> bool:
        return self._is_stopped

    @property
    def latest_media_timestamp_ms(self) -> int | None:
        """The newest inbound ``media.timestamp``: Twilio's stream clock (ms since the stream started)."""
        return self._latest_media_timestamp_ms

    def receive(self, frame: str | bytes) -> TwilioMessage | TwilioProtocolError:
        """The message in ``frame`` if the session should act on it, else why not (logged here)."""
        parsed = parse_twilio_message(frame)
        error = parsed if isinstance(parsed, TwilioProtocolError) else self._check(parsed)
        if error is None:
            assert not isinstance(parsed, TwilioProtocolError)
            self._accept(parsed)
            return parsed
        if error.is_fatal:
            log.warning("twilio stream %s: closing (%s): %s", self.stream_sid, error.close_code, error.reason)
        else:
            self.num_ignored += 1
            log.info("twilio stream %s: ignored a frame: %s", self.stream_sid, error.reason)
        return error

    def _check(self, message: TwilioMessage) -> TwilioProtocolError | None:
        event = message.event
        if self._is_stopped:
            return TwilioProtocolError(f"{event} after stop", None, event)
        if isinstance(message, TwilioConnected):
            if self._is_connected or self._start is not None:
                return TwilioProtocolError("connected repeated or after start", None, event)
            return None
        if isinstance(message, TwilioStart):
            if self._start is not None:
                return TwilioProtocolError("a second start on one socket", CLOSE_POLICY_VIOLATION, event)
            if "inbound" not in message.tracks:
                return TwilioProtocolError("start without the inbound track", CLOSE_UNSUPPORTED_DATA, event)
            return None
        if self._start is None:
            return TwilioProtocolError(f"{event} before start", CLOSE_POLICY_VIOLATION, event)
        if message.stream_sid != self._start.stream_sid:
            return TwilioProtocolError(f"{event} for another streamSid", CLOSE_POLICY_VIOLATION, event)
        if message.sequence_number <= self._last_sequence_number:
            # NOTE: Twilio numbers every message after connected from 1 on one TCP stream, so a repeat
            # is a replay; the copy already acted on stays the only one.
            reason = f"{event} sequenceNumber {message.sequence_number} <= {self._last_sequence_number}"
            return TwilioProtocolError(reason, None, event)
        if isinstance(message, TwilioMedia) and message.track != "inbound":
            self._last_sequence_number = message.sequence_number
            return TwilioProtocolError(f"media on the {message.track} track", None, event)
        return None

    def _accept(self, message: TwilioMessage) -> None:
        if isinstance(message, TwilioConnected):
            self._is_connected = True
            return
        if isinstance(message, TwilioStart):
            self._start = message
        elif isinstance(message, TwilioStop):
            self._is_stopped = True
        elif isinstance(message, TwilioMedia):
            previous = self._latest_media_timestamp_ms
            # NOTE: the max, so the clock never runs backwards even if a chunk's timestamp does.
            self._latest_media_timestamp_ms = message.timestamp_ms if previous is None else max(
                previous, message.timestamp_ms
            )
        self._last_sequence_number = message.sequence_number

