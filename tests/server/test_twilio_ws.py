"""`WS /twilio/media` end to end: a real uvicorn server (`session_server.SessionServer`) over the stand-in speech
stage, and `twilio_phone.Phone`s that speak Twilio's wire format at real-time pace and play the reply
like a phone (marks echoed as their audio plays). What the server's session did is read through the
endpoint's call listener (`TwilioSettings.listener`), called on the server's loop in this process, so
its times are on the same monotonic clock as the phone's."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
from session_server import SessionServer
from speech_signals import signal_of
from twilio_phone import Calls, Phone, ulaw_of

from voice_server.audio import ResamplerSpec, ulaw_decode
from voice_server.session.conversation import cut_text
from voice_server.session.events import ItemTruncated, ResponseDone, ResponseStarted, SpeechStarted, TextDelta
from voice_server.session.twilio import TwilioDtmf, TwilioMediaFormat, TwilioStart
from voice_server.session.twilio.settings import TwilioSettings

TURN = ulaw_of(signal_of(16000, ("noise", 300), ("voice", 900)))
WORD_SAMPLES = 640  # NOTE: the stand-in stage speaks 80 ms per word: 640 samples at 8 kHz


@pytest.fixture
def calls(server: SessionServer) -> Calls:
    calls = Calls()
    configure(server, calls)
    return calls


def configure(server: SessionServer, calls: Calls, max_tokens: int = 12, token: str | None = None) -> None:
    server.app.state.twilio = TwilioSettings(token=token, listener=calls,
                                             params=(("sampling", {"max_tokens": max_tokens}),))


def wait_until_free(server: SessionServer, timeout_s: float = 10.0) -> float:
    start = time.monotonic()
    deadline = start + timeout_s
    while (stats := server.counters())["num_running"] or stats["num_used_pages"]:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_spoken_turn_gets_audio_and_marks_back(server: SessionServer, calls: Calls) -> None:
    configure(server, calls, token="s3cret")
    phone = Phone(server.port)
    phone.start(authorization="Bearer s3cret", instructions="be brief")
    phone.send("dtmf", dtmf={"track": "inbound_track", "digit": "5"})
    # NOTE: the caller stays on the line (silence) until the reply has been sent and has played.
    phone.talk(TURN, until=lambda: calls.of(phone, ResponseDone) and not phone.is_playing)
    [(_, done)] = calls.of(phone, ResponseDone)
    # The instructions came from customParameters: system + the spoken turn.
    assert done.status == "completed" and done.text.split()[:2] == ["m2a1", "p0"], done
    # 12 words of 80 ms, resampled 24 -> 8 kHz by the session (its filter's tail included).
    num_expected = 12 * WORD_SAMPLES + ResamplerSpec.for_rates(24000, 8000).delay_out
    assert phone.num_received_samples == num_expected and done.num_audio_ms == num_expected // 8
    sizes = [len(payload) for _, payload in phone.media]
    assert set(sizes[:-1]) == {160} and 0 < sizes[-1] <= 160, "20 ms frames, a short one last"
    pcm = ulaw_decode(np.frombuffer(b"".join(p for _, p in phone.media), np.uint8)).astype(np.float64)
    assert np.sqrt(np.mean(pcm[:12 * WORD_SAMPLES] ** 2)) > 3000, "the stage's tones (0.2 full scale), not silence"
    assert len(phone.marks) == len(phone.media) == len(set(phone.marks)), "a mark after every frame"
    assert phone.num_played_samples == num_expected and phone.clears == []
    assert [e.digit for _, e in calls.of(phone, TwilioDtmf)] == ["5"]
    phone.stop()
    assert phone.closed_with() == 1000


def test_a_greeting_makes_the_agent_speak_before_the_caller(server: SessionServer, calls: Calls) -> None:
    server.app.state.twilio = TwilioSettings(listener=calls, greeting="Greet the caller.",
                                             params=(("sampling", {"max_tokens": 4}),))
    phone = Phone(server.port)
    phone.start(instructions="be brief")
    # NOTE: the caller says nothing (silence on the line) while the greeting is sent and played.
    phone.talk(ulaw_of(signal_of(16000, ("noise", 200))), until=lambda: calls.of(phone, ResponseDone)
               and not phone.is_playing)
    [(_, done)] = calls.of(phone, ResponseDone)
    # One system message (the call's instructions, then the greeting's), no user turn, spoken to the caller.
    assert done.status == "completed" and done.text.split()[:2] == ["m1a0", "p0"], done
    assert phone.num_received_samples > 0 and phone.num_played_samples == phone.num_received_samples
    phone.stop()
    assert phone.closed_with() == 1000
    # A call's customParameters override it; a bad one closes the call with 1008 before anything is said.
    phone = Phone(server.port, name="2")
    phone.start(greeting="x" * 3000)
    assert phone.closed_with() == 1008 and phone.num_received_samples == 0


@pytest.mark.parametrize("custom", [{}, {"token": "wrong"}, {"authorization": "Bearer s3cre"},
                                    {"token": "s3cret", "authorization": "Bearer s3cret"}])
def test_a_call_without_the_right_token_is_closed_with_1008(server: SessionServer, calls: Calls,
                                                             custom: dict[str, str]) -> None:
    configure(server, calls, token="s3cret")
    phone = Phone(server.port)
    phone.start(**custom)
    assert phone.closed_with() == 1008
    assert calls.events[phone.call_sid] == [], "no session started"


@pytest.mark.parametrize(("max_tokens", "barge_at_ms", "is_generating"), [(200, 600, True), (24, 1400, False)],
                         ids=["while-generating", "after-generation"])
def test_speaking_over_the_reply_clears_it_and_keeps_only_what_was_played(
        server: SessionServer, calls: Calls, max_tokens: int, barge_at_ms: int, is_generating: bool) -> None:
    configure(server, calls, max_tokens=max_tokens)
    phone = Phone(server.port)
    phone.start()
    phone.talk(TURN, until=lambda: phone.played_ms >= barge_at_ms)
    onset = phone.talk(ulaw_of(signal_of(16000, ("voice", 600))),
                       until=lambda: len(calls.of(phone, TextDelta)) >= max_tokens + 2)
    [(_, first), (second_at, second)] = [e for e in calls.of(phone, ResponseStarted)]
    # The generation had (or had not) finished when the caller spoke over the reply.
    [(first_done_at, first_done)] = [(at, e) for at, e in calls.of(phone, ResponseDone)
                                     if e.response_id == first.response_id]
    assert (first_done_at > onset) == is_generating
    assert first_done.status == ("cancelled" if is_generating else "completed")

    # NOTE: measured from the server's speech_started (the listener's time: the event the clear
    # reacts to) to the clear's arrival at the phone: the endpoint's reaction plus the socket. The
    # caller's own view adds the VAD's documented start latency (200 ms) to that.
    speech_started_at = calls.of(phone, SpeechStarted)[1][0]
    [(clear_at, played_at_clear)] = phone.clears
    # NOTE: the listener hears of an event after the endpoint handled it (the clear is already on the
    # wire), so the clear may even arrive first: within 100 ms either way.
    assert abs(clear_at - speech_started_at) < 0.1, clear_at - speech_started_at
    assert clear_at - onset < 0.2 + 0.2, clear_at - onset
    assert not [at for at, _ in phone.media if clear_at < at < second_at], "no audio of the cleared reply"

    # The reply is cut to what the phone had echoed as played (an echo may be in flight at the clear).
    [(_, truncated)] = calls.of(phone, ItemTruncated)
    assert truncated.item_id == first.item_id
    assert played_at_clear / 8 - 100 <= truncated.audio_end_ms <= played_at_clear / 8, (truncated, played_at_clear)
    heard = first_done.text if is_generating else cut_text(first_done.text,
                                                           truncated.audio_end_ms / first_done.num_audio_ms)
    if is_generating:
        assert first_done.num_audio_ms == truncated.audio_end_ms
    num_heard = len(heard.split())
    assert abs(num_heard - truncated.audio_end_ms / 80) <= 1.5, (heard, truncated)
    # The next reply's history: the two spoken turns and only the words that were heard.
    deltas = [e.delta for _, e in calls.of(phone, TextDelta) if e.response_id == second.response_id]
    assert deltas[:2] == [" m3a2", f" p{num_heard}"], deltas[:2]
    phone.stop()
    wait_until_free(server)


def test_malformed_input_closes_with_the_guards_codes_while_another_call_goes_on(
        server: SessionServer, calls: Calls) -> None:
    good = Phone(server.port, "good")
    good.start()
    media = {"track": "inbound", "chunk": "1", "timestamp": "0", "payload": "f39/"}
    cases: list[tuple[str, Any, int]] = [
        ("a binary frame", lambda p: p.ws.send(b"\x7f\x7f"), 1003),
        ("invalid JSON", lambda p: p.ws.send("{not json"), 1008),
        ("media before start", lambda p: p.send("media", media=media), 1008),
        ("a text frame over 64 KiB", lambda p: p.ws.send(json.dumps({"event": "media", "x": "a" * 70_000})), 1009),
        ("16-bit linear audio", lambda p: p.start(encoding="audio/l16"), 1003),
        ("a second start", lambda p: (p.start(), p.start()), 1008),
        ("a counter that is not decimal", lambda p: (p.start(), p.send("media", media={**media, "chunk": "0x1"})),
         1008),
    ]
    for i, (name, act, code) in enumerate(cases):
        bad = Phone(server.port, f"bad{i}")
        act(bad)
        assert bad.closed_with() == code, name
    good.talk(TURN, until=lambda: calls.of(good, ResponseDone))
    # NOTE: the server paces the reply at real time (a 0.12 s lead): its last frames follow the done by up to
    # the reply's length.
    good.pump(until=time.monotonic() + 1.5)
    [(_, done)] = calls.of(good, ResponseDone)
    assert done.status == "completed" and good.num_received_samples >= 12 * WORD_SAMPLES
    good.stop()


@pytest.mark.parametrize("how", ["stop", "socket dropped"])
def test_a_caller_who_hangs_up_mid_reply_frees_the_stage(server: SessionServer, calls: Calls, how: str) -> None:
    configure(server, calls, max_tokens=400)
    phone = Phone(server.port)
    phone.start()
    phone.talk(TURN, until=lambda: len(phone.media) >= 10)
    assert server.counters()["num_running"] == 1
    if how == "stop":
        phone.stop()
    else:
        phone.ws.socket.close()  # NOTE: no close frame: the TCP connection just ends
    wait_until_free(server)
    [(_, done)] = calls.of(phone, ResponseDone)
    assert done.status == "cancelled"


def test_settings_give_8_khz_sessions_whose_instructions_a_call_may_override() -> None:
    def start(**custom: str) -> TwilioStart:
        return TwilioStart(1, "MZ1", "AC1", "CA1", ("inbound",), custom, TwilioMediaFormat("audio/x-mulaw", 8000, 1))

    settings = TwilioSettings(instructions="be kind")
    config = settings.session_config(start())
    assert (config.input_rate, config.output_rate, config.instructions) == (8000, 8000, "be kind")
    assert config.turn_detection is not None and config.turn_detection.interrupt_response
    assert settings.session_config(start(instructions="be brief")).instructions == "be brief"
    with pytest.raises(ValueError, match="token"):
        TwilioSettings(token="")
