"""Camera frames in the browser demo (`web/camera.js`): where the session's pipeline sees (`session.started.images`)
the "📷 send camera frame" button sends one frame of the camera (chromium's fake one) as a JPEG `image` message,
with the text box's words if any, and shows it in the chat as the user's; elsewhere it is disabled.

- On a real server (`tests/server/session_server.py`) over the stand-in speech stage with `factory_args.vision:
  true` (`tests/speech_stages.py`: its reply names the images the request carried, `i<count>b<total bytes>`): a
  frame with a typed question gets a reply that saw exactly the JPEG the page says it sent, a frame without
  words gets no reply of its own (the next question sees both), one camera stream serves the session and stops
  with it; a denied camera is a notice. Over the default stand-in (which does not see) the button is disabled.
- On a scripted peer (`tests/web/scripted_peer.py`), exactly on the wire: the message's fields, and a frame the
  server refuses shows as a refused frame and a notice.

Screenshot: `browser-demo-camera.png` in $VOICE_SERVER_ARTIFACTS (default: test-artifacts/).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
from demo_browser import DemoPage, chromium, require_browser, write_wav
from harness import Pipeline
from PIL import Image
from scripted_peer import Peer, ScriptedServer
from session_server import SessionServer, serve

from voice_server.config import pipeline_from_dict

if TYPE_CHECKING:
    from playwright.sync_api import Browser

require_browser()

BUTTON = "#camera"
IS_ENABLED = "!document.getElementById('camera').disabled"
JPEG_PREFIX = "data:image/jpeg;base64,"
QUESTION = "what is this?"
# NOTE: keeps every camera stream the page opens, to check the page reuses one and stops it with the session.
RECORD_STREAMS = """(() => {
  const open = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  window.testStreams = [];
  navigator.mediaDevices.getUserMedia = async (constraints) => {
    const stream = await open(constraints);
    if (constraints.video) window.testStreams.push(stream);
    return stream;
  };
})();"""
DENY_CAMERA = """(() => {
  const open = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
  navigator.mediaDevices.getUserMedia = async (constraints) => {
    if (constraints.video) throw new DOMException("Permission denied", "NotAllowedError");
    return open(constraints);
  };
})();"""


@pytest.fixture(scope="module")
def seeing() -> Iterator[SessionServer]:
    yield from serve(Pipeline(pipeline_from_dict({"name": "seeing", "stages": [{
        "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
        "max_batch_size": 8, "max_step_tokens": 64, "factory_args": {"step_delay_ms": 5, "vision": True}}]})))


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    # NOTE: a silent microphone: every turn here is typed, and the server's VAD must start none of its own.
    wav = write_wav(tmp_path_factory.mktemp("mic") / "silence.wav", np.zeros(48000, np.float32), 48000)
    with chromium(wav) as browser:
        yield browser


def image_word(text: str) -> str:
    return next(word for word in text.split() if word.startswith("i"))


def thumbnail(demo: DemoPage, index: int) -> Image.Image:
    """The thumbnail's picture, whose bytes the test checks against what the page says it sent."""
    src = demo.page.locator(".bubble.user .picture").nth(index).get_attribute("src") or ""
    assert src.startswith(JPEG_PREFIX), src[:40]
    data = base64.b64decode(src.removeprefix(JPEG_PREFIX))
    picture = Image.open(io.BytesIO(data))
    picture.info["num_bytes"] = len(data)
    return picture


def test_a_camera_frame_is_sent_seen_and_shown(browser: Browser, seeing: SessionServer) -> None:
    demo = DemoPage(browser, f"http://127.0.0.1:{seeing.port}/?max_tokens=6", init_script=RECORD_STREAMS)
    try:
        assert demo.page.is_disabled(BUTTON) and demo.page.get_attribute(BUTTON, "title") == "Start a session first"
        demo.start()
        demo.wait(IS_ENABLED)

        # A frame with a typed question: sent with it, and the reply sees that one JPEG, byte for byte.
        demo.page.fill("#text-input", QUESTION)
        demo.page.click(BUTTON)
        demo.wait("demo.images.length === 1 && demo.images[0].status === 'committed'"
                  " && demo.turns.length === 1 && demo.turns[0].status === 'completed'")
        state = demo.state()
        (image,) = state["images"]
        assert image["text"] == QUESTION and image["itemId"]
        # NOTE: chromium's fake camera honours the 1280x720 asked for; the page scales it to 1024 px wide.
        assert (image["width"], image["height"]) == (1024, 576), image
        assert image_word(state["turns"][0]["text"]) == f"i1b{image['bytes']}", state["turns"][0]
        picture = thumbnail(demo, 0)
        assert (picture.format, picture.size, picture.info["num_bytes"]) == (
            "JPEG", (image["width"], image["height"]), image["bytes"])
        assert demo.page.input_value("#text-input") == ""
        bubble = demo.page.locator(".bubble.user").first
        assert bubble.locator(".text").inner_text() == QUESTION
        assert bubble.locator(".meta").inner_text() == f"camera frame, 1024×576, {-(-image['bytes'] // 1024)} KiB"

        # A frame without words: committed, no reply of its own; the next (typed) question sees both frames.
        demo.page.click(BUTTON)
        demo.wait("demo.images.length === 2 && demo.images[1].status === 'committed'")
        demo.page.fill("#text-input", "and now?")
        demo.page.press("#text-input", "Enter")
        demo.wait("demo.turns.length === 2 && demo.turns[1].status === 'completed'")
        state = demo.state()
        second = state["images"][1]
        assert second["text"] == "" and thumbnail(demo, 1).info["num_bytes"] == second["bytes"]
        assert image_word(state["turns"][1]["text"]) == f"i2b{image['bytes'] + second['bytes']}"
        assert len(state["turns"]) == 2 and demo.page.locator(".bubble.user .picture").count() == 2
        assert [e["role"] for e in state["transcripts"]].count("user") == 3  # NOTE: no second bubble per frame
        demo.screenshot("browser-demo-camera.png")

        # One camera stream for the session, stopped with it; the button is disabled again.
        demo.page.click("#start")  # Stop
        demo.wait("demo.state === 'closed'")
        assert demo.page.is_disabled(BUTTON)
        streams = demo.page.evaluate("() => window.testStreams.map((s) => s.getVideoTracks().map((t) => t.readyState))")
        assert streams == [["ended"]], streams
        assert demo.errors == [] and demo.state()["errors"] == []
    finally:
        demo.close()


def test_a_denied_camera_is_a_notice(browser: Browser, seeing: SessionServer) -> None:
    demo = DemoPage(browser, f"http://127.0.0.1:{seeing.port}/", init_script=DENY_CAMERA)
    try:
        demo.start()
        demo.wait(IS_ENABLED)
        demo.page.fill("#text-input", QUESTION)
        demo.page.click(BUTTON)
        demo.wait("demo.transcripts.some((e) => e.role === 'notice')")
        demo.wait(IS_ENABLED)  # NOTE: the user may allow the camera and try again
        notice = demo.page.locator(".bubble.notice").first.inner_text()
        assert notice == "no camera frame sent (NotAllowedError: Permission denied)", notice
        state = demo.state()
        assert state["images"] == [] and state["turns"] == []
        assert demo.page.input_value("#text-input") == QUESTION  # NOTE: kept, to send once the camera works
        assert demo.errors == [] and state["errors"] == []
    finally:
        demo.close()


def test_a_pipeline_that_does_not_see_disables_the_button(browser: Browser, server: SessionServer) -> None:
    demo = DemoPage(browser, f"http://127.0.0.1:{server.port}/")
    try:
        demo.start()
        assert demo.page.is_disabled(BUTTON)
        assert "does not see images" in (demo.page.get_attribute(BUTTON, "title") or "")
        assert demo.errors == []
    finally:
        demo.close()


async def refused_then_accepted(peer: Peer) -> None:
    record = peer.record
    await peer.next("session.start")
    await peer.send(type="session.started", input_rate=16000, output_rate=24000, turn_detection="server_vad",
                    voice="heart", voices=["heart"], noise_reduction=None, images=True)
    record["first"] = await peer.next("image")
    await peer.send(type="error", code="invalid_value", message="image: not a PNG or JPEG")
    record["second"] = await peer.next("image")
    await peer.send(type="input_committed", item_id="item_i2", audio_ms=0, text=record["second"]["text"],
                    images=1)
    record["done"] = True
    await peer.closed()  # NOTE: until the page closes (Stop)


def test_the_page_sends_frames_exactly_on_the_wire(browser: Browser) -> None:
    scripted = ScriptedServer(refused_then_accepted)
    demo = DemoPage(browser, f"http://127.0.0.1:{scripted.port}/")

    wait = scripted.waiter(demo)

    try:
        demo.start()
        wait(IS_ENABLED)
        demo.page.click(BUTTON)
        wait(f"demo.images.length === 1 && demo.images[0].status !== 'sending' && {IS_ENABLED}")
        demo.page.fill("#text-input", QUESTION)
        demo.page.click(BUTTON)
        wait("demo.images.length === 2 && demo.images[1].status === 'committed'")
        demo.page.click("#start")  # Stop
        wait("demo.state === 'closed'")
        record, state = scripted.record, demo.state()
        assert record.get("error") is None and record.get("done")
        first, second = record["first"], record["second"]
        assert {k: v for k, v in first.items() if k != "image"} == {"type": "image", "text": "", "respond": False}
        assert {k: v for k, v in second.items() if k != "image"} == {"type": "image", "text": QUESTION, "respond": True}
        for message, image in zip((first, second), state["images"], strict=True):
            assert message["image"].startswith(JPEG_PREFIX)
            assert len(base64.b64decode(message["image"].removeprefix(JPEG_PREFIX))) == image["bytes"]
        assert [i["status"] for i in state["images"]] == ["refused: invalid_value", "committed"]
        assert demo.page.locator(".bubble.user.failed .picture").count() == 1
        assert demo.page.locator(".bubble.user .picture").count() == 2
        notices = demo.page.locator(".bubble.notice").all_inner_texts()
        assert notices == ["error invalid_value: image: not a PNG or JPEG"], notices
        assert [e["code"] for e in state["errors"]] == ["invalid_value"] and demo.errors == []
    finally:
        demo.close()
        scripted.close()
