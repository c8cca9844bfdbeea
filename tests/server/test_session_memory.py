"""A closed session is freed by reference counting alone, on every endpoint.

With the cyclic garbage collector off, real clients talk to a real in-process server (`session_server`:
uvicorn over the stand-in speech stage) on `/ws`, `/v1/realtime` and `/twilio/media`: a spoken turn, a
barge-in, a cancelled reply, a client that vanishes mid-reply. Once they are gone no object of the
session layer may be left. A reference cycle through a session would keep its socket, zlib streams,
audio buffers and conversation audio until a full collection, which a server process with a large
heap runs rarely: that is how a 10-minute soak once grew the server by 8.5 MB/min.
"""

from __future__ import annotations

import gc
import json
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest
from live_server import RATE, events_until, stream_audio
from live_server import open_session as live_open_session
from realtime_client import RealtimeClient, encode
from session_server import SessionServer
from speech_signals import signal_of
from twilio_phone import Phone, ulaw_of

from voice_server.session.twilio.settings import TwilioSettings

SPOKEN = signal_of(RATE, ("noise", 300), ("voice", 900), ("noise", 700))
PCM24_BYTES_PER_MS = 48


def session_objects() -> Counter[str]:
    """Live objects whose class belongs to the session layer or the server, by class name."""
    return Counter(type(o).__qualname__ for o in gc.get_objects()
                   if isinstance(module := type(o).__module__, str)
                   and module.startswith(("voice_server.session", "voice_server.server")))


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()


def wait_for_no_new_objects(baseline: Counter[str], timeout_s: float = 10.0) -> Counter[str]:
    """What is still alive over `baseline` once the server has finished with the closed sessions."""
    deadline = time.monotonic() + timeout_s
    while (extra := session_objects() - baseline) and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


def native_sessions(server: SessionServer) -> None:
    url = f"ws://127.0.0.1:{server.port}/ws"
    ws = live_open_session(url)
    stream_audio(ws, SPOKEN, pace=4.0)
    assert events_until(ws, "response_done")[0][-1]["status"] == "completed"
    ws.send(json.dumps({"type": "text", "text": "a long one"}))
    events_until(ws, "response_started")
    stream_audio(ws, SPOKEN, pace=4.0)  # NOTE: speaks over the reply: a barge-in
    events_until(ws, "response_done")
    ws.close()
    vanishing = live_open_session(url, params={"sampling": {"max_tokens": 200}})
    vanishing.send(json.dumps({"type": "text", "text": "tell me a long story"}))
    events_until(vanishing, "response_started")
    vanishing.socket.close()  # NOTE: gone mid-reply, without a close frame


def realtime_sessions(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=12)
    client.stream(encode(signal_of(24000, ("noise", 300), ("voice", 900), ("noise", 700))), PCM24_BYTES_PER_MS,
                  pace=4.0)
    assert client.until("response.done")[-1]["response"]["status"] == "completed"
    client.send("response.create")
    client.until("response.created")
    client.send("response.cancel")
    client.until("response.done")
    client.close()


def twilio_call(server: SessionServer) -> None:
    server.app.state.twilio = TwilioSettings(params=(("sampling", {"max_tokens": 12}),))
    phone = Phone(server.port)
    phone.start()
    phone.talk(ulaw_of(signal_of(16000, ("noise", 300), ("voice", 900))), until=lambda: phone.marks)
    phone.stop()
    phone.ws.close()


@pytest.mark.parametrize("talk", [native_sessions, realtime_sessions, twilio_call],
                         ids=["ws", "realtime", "twilio"])
def test_a_closed_session_leaves_nothing_for_the_cycle_collector(server: SessionServer, no_cycle_collection: None,
                                                                  talk: object) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5):
        pass  # NOTE: starlette builds its middleware stack on the first request: not a session's
    baseline = session_objects()
    assert callable(talk)
    talk(server)
    server.wait_idle()
    extra = wait_for_no_new_objects(baseline)
    assert not extra, f"left alive after the sessions closed (a reference cycle?): {dict(extra)}"
