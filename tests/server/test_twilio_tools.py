"""Tool calls on `WS /twilio/media`, answered by a webhook, end to end: a real uvicorn server over the stand-in
speech stage, scripted (`tests/speech_stages.py`: a call's instructions say what the "model" answers to each
spoken turn, `<tool_call>`s included; a tool's output it answers with "The tool says: <output>"), phones
that speak Twilio's wire format (`twilio_phone.Phone`), and a local HTTP server as the webhook
(`tool_webhooks.py`): one that answers, one slower than the timeout, ones that fail (500, nobody listening, a
reply too large), a webhook a call names that the server does not allow, and a caller who hangs up while a
webhook is in flight. What the session did is read through the call listener (`TwilioSettings.listener`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import Pipeline
from live_server import metric
from serving import free_port
from session_server import STEP_DELAY_MS, SessionServer, serve
from speech_signals import signal_of
from text_stages import text_deltas
from tool_webhooks import ToolWebhooks
from twilio_phone import Calls, Phone, ulaw_of
from websockets.exceptions import ConnectionClosed

from voice_server.audio import ResamplerSpec
from voice_server.config import pipeline_from_dict
from voice_server.session.events import InputCommitted, ResponseStarted, ToolCalled
from voice_server.session.tools import Tool
from voice_server.session.twilio import TwilioDtmf
from voice_server.session.twilio.settings import TwilioSettings

WEATHER: dict[str, Any] = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = (Tool("get_weather", WEATHER["description"], WEATHER["parameters"]),)
SAID = "Let me check."
FALLBACK = "Sorry, the weather service is down."
TURN = ulaw_of(signal_of(16000, ("noise", 300), ("voice", 900)))
WORD_SAMPLES = 640  # NOTE: the stand-in speaks an 80 ms tone per delta: 640 samples at 8 kHz
TAIL = ResamplerSpec.for_rates(24000, 8000).delay_out


def call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


def spoken_samples(text: str) -> int:
    """What a reply of `text` sends the phone: a tone per delta, resampled 24 -> 8 kHz (its filter's tail too)."""
    return len(text_deltas(text)) * WORD_SAMPLES + TAIL


@pytest.fixture(scope="module")
def server() -> Iterator[SessionServer]:
    yield from serve(Pipeline(pipeline_from_dict({"name": "tools-test", "stages": [{
        "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
        "max_batch_size": 8, "max_step_tokens": 64,
        "factory_args": {"step_delay_ms": STEP_DELAY_MS, "scripted": True}}]})))


@pytest.fixture(scope="module")
def hooks() -> Iterator[ToolWebhooks]:
    hooks = ToolWebhooks(slow_s=3.0)
    yield hooks
    hooks.close()


@pytest.fixture
def calls(server: SessionServer, hooks: ToolWebhooks) -> Calls:
    calls = Calls()
    configure(server, calls, hooks.url("/ok"), hooks)
    return calls


def configure(server: SessionServer, calls: Calls, webhook: str, hooks: ToolWebhooks, timeout_s: float = 2.0,
              tools: tuple[Tool, ...] = TOOLS) -> None:
    server.app.state.twilio = TwilioSettings(listener=calls, tools=tools, tool_webhook=webhook,
                                             tool_timeout_s=timeout_s, tool_fallback=FALLBACK,
                                             allowed_tool_webhooks=(hooks.url("/"),))


def close_of(phone: Phone, timeout_s: float = 5.0) -> tuple[int, str]:
    """The code and reason the server closes the socket with."""
    deadline = time.monotonic() + timeout_s
    with pytest.raises(ConnectionClosed) as info:
        while time.monotonic() < deadline:
            phone.pump(time.monotonic() + 0.05)
    assert info.value.rcvd is not None, "the server did not close the socket"
    return info.value.rcvd.code, info.value.rcvd.reason


def errors(server: SessionServer, kind: str) -> float:
    return metric(server.metrics(), "voice_server_protocol_errors_total", endpoint="twilio", type=kind)


@pytest.mark.parametrize("how", ["settings", "customParameters"])
def test_a_tool_call_is_posted_and_its_result_spoken(server: SessionServer, hooks: ToolWebhooks, calls: Calls,
                                                      how: str) -> None:
    custom = {"instructions": SAID + call("Paris")}
    if how == "customParameters":
        # NOTE: the call brings its own tools and an allowed webhook; the server's have neither.
        configure(server, calls, "", hooks, tools=())
        custom |= {"tools": json.dumps([WEATHER]), "tool_webhook": hooks.url("/ok")}
    num_hits = len(hooks.hits)
    phone = Phone(server.port)
    phone.start(**custom)
    phone.talk(TURN, until=lambda: len(calls.done(phone)) >= 2 and not phone.is_playing)
    [(_, called)] = calls.of(phone, ToolCalled)
    assert (called.call.name, json.loads(called.call.arguments)) == ("get_weather", {"city": "Paris"})
    # The webhook got the contract's body: the call, and which phone call it is of.
    [hit] = hooks.hits[num_hits:]
    assert hit.path == "/ok" and hit.body == {
        "call_id": called.call.call_id, "name": "get_weather", "arguments": called.call.arguments,
        "call_sid": phone.call_sid, "stream_sid": phone.stream_sid}
    # Its output is the call's function_call_output item, and the next response speaks it.
    [output] = [e for _, e in calls.of(phone, InputCommitted) if e.text]
    assert (output.text, output.call_id) == ("Sunny in Paris.", called.call.call_id)
    first, second = calls.done(phone)
    assert (first.status, first.text) == ("completed", SAID)
    assert (second.status, second.text) == ("completed", "The tool says: Sunny in Paris.")
    assert second.response_id == calls.of(phone, ResponseStarted)[1][1].response_id
    # Nothing of the call was spoken: the first reply's audio is its four deltas' (the call has ~30), and the
    # phone got and played both replies.
    assert first.num_audio_ms == spoken_samples(SAID) // 8
    assert phone.num_received_samples == spoken_samples(SAID) + spoken_samples(second.text)
    assert phone.num_played_samples == phone.num_received_samples
    phone.stop()
    assert phone.closed_with() == 1000


def test_the_calls_of_one_response_are_answered_by_one_response(server: SessionServer, hooks: ToolWebhooks,
                                                                  calls: Calls) -> None:
    phone = Phone(server.port)
    phone.start(instructions="Sure." + call("Oslo") + call("Rome"))
    phone.talk(TURN, until=lambda: len(calls.done(phone)) >= 2 and not phone.is_playing)
    phone.pump(time.monotonic() + 0.5)  # NOTE: a third response would have started by now
    called = [e.call for _, e in calls.of(phone, ToolCalled)]
    assert [json.loads(c.arguments)["city"] for c in called] == ["Oslo", "Rome"]
    # Both outputs, in call order, then one response (whose last message is the second output).
    assert [(e.text, e.call_id) for _, e in calls.of(phone, InputCommitted) if e.text] == [
        ("Sunny in Oslo.", called[0].call_id), ("Sunny in Rome.", called[1].call_id)]
    assert [d.text for d in calls.done(phone)] == ["Sure.", "The tool says: Sunny in Rome."]
    phone.stop()


def test_a_slow_webhook_gets_the_fallback_and_the_call_goes_on(server: SessionServer, hooks: ToolWebhooks,
                                                                calls: Calls) -> None:
    configure(server, calls, hooks.url("/slow"), hooks, timeout_s=0.8)
    before = errors(server, "tool_webhook_timeout")
    phone = Phone(server.port)
    phone.start(instructions=SAID + call("Lima") + " || Anything else?")
    phone.talk(TURN, until=lambda: calls.of(phone, ToolCalled))
    [(called_at, _)] = calls.of(phone, ToolCalled)
    # While the webhook keeps the call waiting, the session loop goes on: a key press reaches the listener at once.
    pressed_at = time.monotonic()
    phone.send("dtmf", dtmf={"track": "inbound_track", "digit": "7"})
    phone.talk(b"", until=lambda: len(calls.done(phone)) >= 2 and not phone.is_playing)
    [(dtmf_at, _)] = calls.of(phone, TwilioDtmf)
    assert dtmf_at - pressed_at < 0.2 and dtmf_at < called_at + 0.8
    # At the timeout: the error is the call's output (with the fallback), and the next response says the fallback.
    [(fallback_at, fallback_started)] = calls.of(phone, ResponseStarted)[1:]
    assert 0.8 <= fallback_at - called_at < 0.8 + 0.5
    [output] = [e for _, e in calls.of(phone, InputCommitted) if e.text]
    assert output.text == f"error: the tool did not answer (no answer within 0.8 s). Tell the caller: {FALLBACK}"
    fallback = calls.done(phone)[1]
    assert fallback.response_id == fallback_started.response_id and fallback.status == "completed"
    assert fallback.text == f"The tool says: {output.text}" and FALLBACK in fallback.text
    assert errors(server, "tool_webhook_timeout") == before + 1
    # The webhook's connection was closed at the timeout, not left to its answer 3 s later.
    hit = hooks.hits[-1]
    assert hit.closed_at is not None and hit.closed_at - hit.at < 0.8 + 0.3
    # The call goes on: the caller's next turn is answered.
    phone.talk(TURN, until=lambda: len(calls.done(phone)) >= 3)
    assert calls.done(phone)[2].text == "Anything else?"
    phone.stop()
    assert phone.closed_with() == 1000


@pytest.mark.parametrize("how", ["500", "nobody listening", "reply too large"])
def test_a_failing_webhook_gets_the_fallback(server: SessionServer, hooks: ToolWebhooks, calls: Calls,
                                             how: str) -> None:
    url = {"500": hooks.url("/fail"), "nobody listening": f"http://127.0.0.1:{free_port()}/tools",
           "reply too large": hooks.url("/big")}[how]
    configure(server, calls, url, hooks)
    before = errors(server, "tool_webhook_failed")
    phone = Phone(server.port)
    phone.start(instructions=SAID + call("Cairo"))
    phone.talk(TURN, until=lambda: len(calls.done(phone)) >= 2)
    fallback = calls.done(phone)[1]
    assert fallback.status == "completed" and fallback.text.startswith("The tool says: error: the tool did not answer")
    assert fallback.text.endswith(f"Tell the caller: {FALLBACK}")
    assert errors(server, "tool_webhook_failed") == before + 1
    phone.stop()


@pytest.mark.parametrize(("custom", "reason"), [
    ({"tool_webhook": "http://169.254.169.254/latest/meta-data/"}, "tool_webhook: not allowed"),
    ({"tool_webhook": "HOOKS/../admin"}, "tool_webhook: must not have '.' or '..' path segments"),
    ({"tool_webhook": "file:///etc/passwd"}, "tool_webhook: must be an http:// or https:// URL"),
    ({"tools": "[{\"type\": \"function\"}]"}, "tools[0].name: Missing required parameter"),
    ({"tools": "not json"}, "tools: must be a JSON array"),
])
def test_a_call_with_a_webhook_or_tools_the_server_refuses_is_closed_with_1008(
        server: SessionServer, hooks: ToolWebhooks, calls: Calls, custom: dict[str, str], reason: str) -> None:
    num_hits = len(hooks.hits)
    phone = Phone(server.port)
    phone.start(**{key: value.replace("HOOKS/", hooks.url("/")) for key, value in custom.items()})
    code, why = close_of(phone)
    assert code == 1008 and why.startswith(reason), why
    assert calls.events[phone.call_sid] == [] and len(hooks.hits) == num_hits, "no session, no request"


@pytest.mark.parametrize("how", ["stop", "socket dropped"])
def test_hanging_up_while_a_webhook_is_in_flight_ends_the_call_cleanly(
        server: SessionServer, hooks: ToolWebhooks, calls: Calls, how: str, caplog: pytest.LogCaptureFixture) -> None:
    configure(server, calls, hooks.url("/slow"), hooks, timeout_s=5.0)
    num_hits = len(hooks.hits)
    phone = Phone(server.port)
    phone.start(instructions=SAID + call("Quito"))
    phone.talk(TURN, until=lambda: len(hooks.hits) > num_hits and calls.done(phone))
    hung_up_at = time.monotonic()
    with caplog.at_level(logging.WARNING):
        if how == "stop":
            phone.stop()
            assert phone.closed_with() == 1000
        else:
            phone.ws.socket.close()  # NOTE: no close frame: the TCP connection just ends
        # The webhook's request was cancelled: its connection closed at once, not at the 5 s timeout.
        hit = hooks.hits[-1]
        deadline = time.monotonic() + 3
        while hit.closed_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hit.closed_at is not None and hit.closed_at - hung_up_at < 1.0
        time.sleep(0.3)

        async def tool_tasks() -> list[str]:
            return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("twilio-tool")]

        assert server.pipeline.run(tool_tasks()) == []
    # Nothing was said (or added) after the hang-up, and nothing failed on the way out.
    assert len(calls.done(phone)) == 1 and [e for _, e in calls.of(phone, InputCommitted) if e.text] == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("voice_server")] == []
    server.wait_idle()
