"""Function calling in the browser demo (`web/tools.js`): with its Tools box checked the page offers its own
tools (`get_time`, `roll_dice`) in `session.start`, runs each `tool_call` itself, shows it in the chat apart
from the assistant's words, and answers with `tool_result` once the response that made the call is done.

- On a real server (`tests/server/session_server.py`) over a scripted thinker (`tests/text_stages.py`: it says
  the user's typed text, tool calls included, and answers a tool's output with "The tool says: <output>") and
  the hibari talker: a call is shown, answered and replied to, and none of it is in the assistant's bubbles;
  a call the server refuses shows as a failed call; two calls in one reply ask for one next reply.
- On a scripted peer (`tests/web/scripted_peer.py`), exactly on the wire: nothing is answered before the
  response is done, a tool the page lacks gets an `{"error": ...}` output rather than no answer, and the
  calls of a cancelled response are answered without asking for a reply.

Screenshot: `browser-demo-tools.png` in $VOICE_SERVER_ARTIFACTS (default: test-artifacts/).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from demo_browser import DemoPage, chromium, require_browser, write_wav
from scripted_peer import Peer, ScriptedServer
from session_server import SessionServer, serve
from talker_checks import talker_pipeline

if TYPE_CHECKING:
    from playwright.sync_api import Browser

require_browser()

SAID = "Let me check."
TOOL_NAMES = ["get_time", "roll_dice"]


def call(name: str, arguments: dict[str, Any]) -> str:
    """What the scripted thinker is to say for a call; one line, as a text input drops line breaks."""
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


@pytest.fixture(scope="module")
def tools_server() -> Iterator[SessionServer]:
    yield from serve(talker_pipeline("tools"), stage="thinker")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    # NOTE: a silent microphone: every turn here is typed, and the server's VAD must start none of its own.
    wav = write_wav(tmp_path_factory.mktemp("mic") / "silence.wav", np.zeros(48000, np.float32), 48000)
    with chromium(wav) as browser:
        yield browser


def say(demo: DemoPage, text: str) -> None:
    demo.page.fill("#text-input", text)
    demo.page.press("#text-input", "Enter")


def check_time(output: str) -> None:
    now = json.loads(output)
    assert set(now) == {"local_time", "time_zone", "iso"} and now["time_zone"], now
    assert abs((datetime.fromisoformat(now["iso"]) - datetime.now().astimezone()).total_seconds()) < 600, now


def test_a_tool_call_is_shown_answered_and_replied_to(browser: Browser, tools_server: SessionServer) -> None:
    demo = DemoPage(browser, f"http://127.0.0.1:{tools_server.port}/")
    try:
        # Off by default (the default thinker never calls a tool; offering them only lengthens its prompt).
        assert not demo.page.is_checked("#tools")
        demo.page.check("#tools")
        demo.start()
        assert demo.page.is_disabled("#tools")  # NOTE: tools go in session.start: fixed for the session

        say(demo, SAID + call("get_time", {}))
        demo.wait("demo.toolCalls.length === 1 && demo.toolCalls[0].status === 'answered' && demo.turns.length === 2"
                  " && demo.turns[1].status === 'completed'")
        state = demo.state()
        (time_call,) = state["toolCalls"]
        assert (time_call["name"], time_call["arguments"]) == ("get_time", "{}")
        check_time(time_call["output"])
        first, second = state["turns"]
        assert (first["status"], first["text"]) == ("completed", SAID) and first["audioMs"] > 0
        # The second reply is the model reading the page's answer (what the scripted thinker does with it).
        assert second["text"] == f"The tool says: {time_call['output']}" and second["audioMs"] > 0
        tool = demo.page.locator(".bubble.tool").first.inner_text()
        assert tool.startswith("🔧 get_time({})\n→ {") and "answered" in tool, tool

        # A call the server refuses: a failed call in the chat (no notice), nothing to answer, no next reply.
        say(demo, SAID + call("order_pizza", {"size": "large"}))
        demo.wait("demo.toolCalls.length === 2 && demo.turns.length === 3")
        refused = demo.state()["toolCalls"][1]
        assert (refused["status"], refused["error"]) == ("failed", "tool_call_unknown_function"), refused
        assert demo.page.locator(".bubble.tool.failed").count() == 1
        assert demo.page.locator(".bubble.notice").count() == 0

        # Two calls in one reply: both answered, and only the last answer asks for a reply (one asking each
        # would start a reply only for the second answer to cancel it).
        say(demo, "Sure." + call("roll_dice", {"sides": 20}) + call("get_time", {}))
        demo.wait("demo.toolCalls.length === 4 && demo.toolCalls.every((c) => c.status !== 'running')"
                  " && demo.turns.length >= 5 && demo.toolCalls.slice(2).every((c) => c.status === 'answered')")
        demo.screenshot("browser-demo-tools.png")
        state = demo.state()
        dice, time_again = state["toolCalls"][2:]
        roll = json.loads(dice["output"])
        assert (dice["name"], dice["arguments"], roll["sides"]) == ("roll_dice", '{"sides": 20}', 20)
        assert 1 <= roll["roll"] <= 20
        check_time(time_again["output"])
        assert [t["status"] for t in state["turns"]] == ["completed"] * 5
        assert [t["text"] for t in state["turns"][2:]] == [SAID, "Sure.", f"The tool says: {time_again['output']}"]

        # Nothing of a call is in the assistant's bubbles; the answers going into the conversation (which the
        # server echoes as committed items) are not shown as the user's.
        assistant = [e["text"] for e in state["transcripts"] if e["role"] == "assistant"]
        assert assistant == [t["text"] for t in state["turns"]]
        assert not any("tool_call" in text or '"name"' in text for text in assistant), assistant
        assert [e["role"] for e in state["transcripts"]].count("user") == 3
        assert [e["code"] for e in state["errors"]] == ["tool_call_unknown_function"]
        assert demo.errors == []
    finally:
        demo.close()


async def tool_calls(peer: Peer) -> None:
    record = peer.record
    record["start"] = await peer.next("session.start")
    await peer.send(type="session.started", input_rate=16000, output_rate=24000, turn_detection="server_vad")
    typed = await peer.next("text")
    await peer.send(type="input_committed", item_id="item_t1", audio_ms=0, text=typed["text"])
    # A reply with two calls, one of a tool the page does not have, and a call the server refused.
    await peer.send(type="response_started", response_id="resp_1", item_id="item_a1")
    await peer.send(type="text_delta", response_id="resp_1", delta=SAID)
    await peer.send(type="tool_call", response_id="resp_1", item_id="item_c1", call_id="call_1", name="get_time",
                    arguments="{}")
    await peer.send(type="tool_call", response_id="resp_1", item_id="item_c2", call_id="call_2", name="order_pizza",
                    arguments='{"size": "large"}')
    await peer.send(type="error", code="tool_call_invalid_arguments",
                    message="the arguments of 'roll_dice' do not match its schema at sides: 1 is less than 2")
    await peer.reports_for(0.5)  # NOTE: what the page sends before the response is done: no answers
    record["before_done"] = [m["type"] for m in record["messages"]]
    await peer.send(type="response_done", response_id="resp_1", item_id="item_a1", status="completed", text=SAID,
                    audio_ms=0, timings_ms={}, error="")
    record["answers"] = [await peer.next("tool_result"), await peer.next("tool_result")]
    for n, answer in enumerate(record["answers"]):
        await peer.send(type="input_committed", item_id=f"item_o{n}", audio_ms=0, text=answer["output"],
                        call_id=answer["call_id"])
    await peer.send(type="response_started", response_id="resp_2", item_id="item_a2")
    await peer.send(type="response_done", response_id="resp_2", item_id="item_a2", status="completed",
                    text="It is noon.", audio_ms=0, timings_ms={}, error="")
    # A reply cancelled after its call: the call is answered, and no reply is asked for.
    typed = await peer.next("text")
    await peer.send(type="input_committed", item_id="item_t2", audio_ms=0, text=typed["text"])
    await peer.send(type="response_started", response_id="resp_3", item_id="item_a3")
    await peer.send(type="tool_call", response_id="resp_3", item_id="item_c3", call_id="call_3", name="roll_dice",
                    arguments='{"sides": 20}')
    await peer.send(type="response_done", response_id="resp_3", item_id="item_a3", status="cancelled", text="",
                    audio_ms=0, timings_ms={}, error="")
    record["answers"].append(await peer.next("tool_result"))
    await peer.send(type="input_committed", item_id="item_o3", audio_ms=0, text=record["answers"][-1]["output"],
                    call_id=record["answers"][-1]["call_id"])
    record["done"] = True
    await peer.closed()  # NOTE: until the page closes (Stop)


def test_the_page_answers_calls_exactly_on_the_wire(browser: Browser) -> None:
    scripted = ScriptedServer(tool_calls)
    demo = DemoPage(browser, f"http://127.0.0.1:{scripted.port}/?tools=1")

    wait = scripted.waiter(demo)

    try:
        assert demo.page.is_checked("#tools")
        demo.start()
        say(demo, "what time is it?")
        wait("demo.turns.length === 2")
        say(demo, "roll a die")
        wait("demo.toolCalls.length === 4 && demo.toolCalls[3].status.startsWith('answered')")
        demo.page.click("#start")  # Stop
        wait("demo.state === 'closed'")
        record, state = scripted.record, demo.state()
        assert record.get("error") is None and record.get("done")
        tools = record["start"]["tools"]
        assert [t["name"] for t in tools] == TOOL_NAMES and all(t["type"] == "function" for t in tools)
        assert all(t["description"] and t["parameters"]["type"] == "object" for t in tools)
        assert "tool_result" not in record["before_done"]
        first, unknown, cancelled = record["answers"]
        assert {k: v for k, v in first.items() if k != "output"} == {
            "type": "tool_result", "call_id": "call_1", "respond": False}
        check_time(first["output"])
        assert (unknown["call_id"], unknown["respond"]) == ("call_2", True)
        assert json.loads(unknown["output"]) == {
            "error": 'unknown tool "order_pizza"; this page has get_time, roll_dice'}
        assert (cancelled["call_id"], cancelled["respond"]) == ("call_3", False)
        roll = json.loads(cancelled["output"])
        assert roll["sides"] == 20 and 1 <= roll["roll"] <= 20
        assert [c["status"] for c in state["toolCalls"]] == [
            "answered", "answered", "failed", "answered, no new reply (the reply was cut short)"]
        assert state["toolCalls"][2]["error"] == "tool_call_invalid_arguments"
        assert demo.page.locator(".bubble.tool").count() == 4
        assert demo.page.locator(".bubble.tool.failed").count() == 2  # the unknown tool's and the refused call
        assert demo.page.locator(".bubble.user").count() == 2 and demo.page.locator(".bubble.notice").count() == 0
        # The cancelled reply said nothing before its call: no empty bubble for it.
        assert demo.page.locator(".bubble.assistant:visible .text").all_inner_texts() == [SAID, "It is noon."]
        assert demo.page.locator(".bubble.assistant").count() == 3
        assert [e["code"] for e in state["errors"]] == ["tool_call_invalid_arguments"]
        assert demo.errors == []
    finally:
        demo.close()
        scripted.close()
