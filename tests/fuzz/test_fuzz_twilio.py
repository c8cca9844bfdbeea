"""Fuzz: Twilio Media Streams frames parse to a message or a ``TwilioProtocolError``, never an exception.

Documented outcomes (the table in ``voice_server/session/twilio/messages.py``): a refused frame is
ignored (``close_code`` None) or closes the socket with 1003, 1008 or 1009. ``TwilioStreamGuard`` applies
the per-socket rules to a random sequence of frames without raising.
"""

from __future__ import annotations

import json

from fuzz_values import FUZZ, frames, json_values, numbers, objects, scalars, shaped
from hypothesis import example, given
from hypothesis import strategies as st

from voice_server.session.twilio.messages import TwilioProtocolError, parse_twilio_message
from voice_server.session.twilio.stream import TwilioStreamGuard

EVENTS = ["connected", "start", "media", "dtmf", "mark", "stop", "other"]
WORDS = [*EVENTS, "event", "sequenceNumber", "streamSid", "MZ1", "MZ2", "accountSid", "callSid", "tracks",
         "inbound", "outbound", "customParameters", "mediaFormat", "encoding", "audio/x-mulaw", "sampleRate",
         "channels", "payload", "track", "chunk", "timestamp", "digit", "name", "protocol", "version", "Call",
         "1.0.0", "1", "2", "00", "/w==", "////", "#"]
ANY = st.one_of(numbers(), scalars(WORDS))
COUNTER = st.one_of(st.integers(0, 50).map(str), st.integers(-2, 50), ANY)
SID = st.one_of(st.sampled_from(["MZ1", "MZ2"]), ANY)
START = shaped({"accountSid": SID, "callSid": SID, "customParameters": json_values(WORDS),
                "tracks": st.one_of(st.lists(st.one_of(st.sampled_from(["inbound", "outbound"]), ANY,
                                                       json_values(WORDS)), max_size=3), ANY),
                "mediaFormat": shaped({"encoding": st.one_of(st.just("audio/x-mulaw"), ANY),
                                       "sampleRate": st.one_of(st.just(8000), COUNTER),
                                       "channels": st.one_of(st.just(1), COUNTER)}, WORDS)},
               WORDS, {"streamSid": SID})
BODIES = {"start": START,
          "media": shaped({"payload": st.one_of(st.sampled_from(["/w==", "////", "", "=="]), ANY),
                           "track": st.one_of(st.sampled_from(["inbound", "outbound"]), ANY), "chunk": COUNTER,
                           "timestamp": COUNTER}, WORDS),
          "dtmf": shaped({"digit": ANY, "track": ANY}, WORDS), "mark": shaped({"name": ANY}, WORDS),
          "stop": shaped({"accountSid": SID, "callSid": SID}, WORDS)}
MESSAGES = st.one_of(
    st.sampled_from(EVENTS).flatmap(lambda event: shaped(
        {"sequenceNumber": COUNTER, "streamSid": SID, "protocol": ANY, "version": ANY,
         **({event: BODIES[event]} if event in BODIES else {})}, WORDS, {"event": st.just(event)})),
    objects(WORDS, {"event": st.one_of(st.sampled_from(EVENTS), ANY)}), json_values(WORDS))
TRACKS_OF_OBJECTS = json.dumps({  # was a TypeError (unhashable) out of the parser
    "event": "start", "sequenceNumber": "1", "streamSid": "MZ1",
    "start": {"streamSid": "MZ1", "accountSid": "AC", "callSid": "CA", "tracks": [{}, []],
              "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})


def check(result: object) -> None:
    if isinstance(result, TwilioProtocolError):
        assert result.close_code in (None, 1003, 1008, 1009) and result.reason


@FUZZ
@given(frames(MESSAGES))
@example(TRACKS_OF_OBJECTS)
def test_any_frame_is_a_message_or_a_protocol_error(frame: str | bytes) -> None:
    result = parse_twilio_message(frame)
    check(result)
    if isinstance(frame, bytes):
        assert isinstance(result, TwilioProtocolError) and result.close_code == 1003


@FUZZ
@given(st.lists(frames(MESSAGES), max_size=12))
def test_the_stream_guard_takes_any_frame_sequence(sequence: list[str | bytes]) -> None:
    guard = TwilioStreamGuard()
    for frame in sequence:
        result = guard.receive(frame)
        check(result)
        if isinstance(result, TwilioProtocolError) and result.is_fatal:
            break  # NOTE: the endpoint closes the socket here
