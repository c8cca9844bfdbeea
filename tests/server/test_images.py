"""Images into the conversation: `/v1/realtime` `input_image` parts (the official `openai` SDK, unmodified) and
the `/ws` `image` message, against real servers: one over a pipeline that sees (the stand-in speech stage with
`factory_args.vision: true`, which names the images each request carried: `i<count>b<bytes>`), one over the
stand-in that does not (refused as `unsupported`, the session going on).

That the images reach the omni thinker's vision tower is shown with the encoder stage's and runners' tests; here,
that the protocols carry them whole, in order, checked as images, and only where the pipeline sees.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from harness import Pipeline
from image_inputs import data_url, flat
from PIL import Image
from realtime_client import RealtimeClient, sdk_events, transcript
from session_server import SessionServer, serve
from websockets.sync.client import connect

from voice_server.config import pipeline_from_dict
from voice_server.session.images import MAX_IMAGES, check_image, parse_data_url
from voice_server.session.realtime.capabilities import IMAGES

PNG, JPEG = flat("PNG"), flat("JPEG")


@pytest.fixture(scope="module")
def seeing() -> Iterator[SessionServer]:
    yield from serve(Pipeline(pipeline_from_dict({"name": "seeing", "stages": [{
        "name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
        "max_batch_size": 8, "max_step_tokens": 64, "factory_args": {"step_delay_ms": 5, "vision": True}}]})))


def image_word(words: list[str]) -> str:
    return next(word for word in words if word.startswith("i"))


async def sdk_turn(port: int, content: list[dict[str, Any]]) -> list[Any]:
    client = openai.AsyncOpenAI(api_key="x", base_url=f"http://127.0.0.1:{port}/v1")
    async with client.realtime.connect(model="anything") as conn:
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 6})
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": content})  # type: ignore[misc]
        await conn.response.create()
        return await sdk_events(conn, timeout_s=30)


def test_an_image_item_over_the_openai_sdk_reaches_the_pipeline(seeing: SessionServer) -> None:
    content = [{"type": "input_image", "image_url": data_url(PNG), "detail": "auto"},
               {"type": "input_image", "image_url": data_url(JPEG, "image/jpeg")},
               {"type": "input_text", "text": "What is in these?"}]
    events = asyncio.run(sdk_turn(seeing.port, content))
    created = next(e for e in events if e.type == "session.created")
    vendor = created.to_dict()["session"]["x_voice_server"]
    assert IMAGES in vendor["served"] and IMAGES not in vendor["refused"]
    added = next(e for e in events if e.type == "conversation.item.added" and e.item.role == "user")
    assert [part.type for part in added.item.content] == ["input_image", "input_image", "input_text"]
    words = "".join(e.delta for e in events if e.type == "response.output_audio_transcript.delta").split()
    assert image_word(words) == f"i2b{len(PNG) + len(JPEG)}", "both images arrived whole"


def test_bad_images_are_errors_naming_the_part(seeing: SessionServer) -> None:
    client = RealtimeClient(seeing.port)
    gif = flat("GIF")
    bad = [
        ("https://example.com/cat.png", "invalid_value"),  # NOTE: never fetched
        ("data:image/gif;base64," + base64.b64encode(gif).decode(), "invalid_value"),
        (data_url(gif), "invalid_value"),  # NOTE: a GIF under a PNG label: the bytes are checked
        (data_url(b"not an image"), "invalid_value"),
        ("data:image/png;base64,@@@", "invalid_value"),
    ]
    for url, code in bad:
        client.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": url}]})
        error = client.until("error")[-1]["error"]
        assert (error["code"], error["param"]) == (code, "item.content[0].image_url"), url
    many = [{"type": "input_image", "image_url": data_url(PNG)}] * (MAX_IMAGES + 1)
    client.send("conversation.item.create", item={"type": "message", "role": "user", "content": many})
    assert client.until("error")[-1]["error"]["param"] == f"item.content[{MAX_IMAGES}]"
    client.send("conversation.item.create", item={"type": "message", "role": "assistant", "content": [
        {"type": "input_image", "image_url": data_url(PNG)}]})
    assert client.until("error")[-1]["error"]["param"] == "item.content[0].type"
    # The session goes on, and nothing of the refused items entered the conversation.
    client.update(max_output_tokens=4)
    client.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hello"}]})
    client.until("conversation.item.done")
    client.send("response.create")
    assert image_word(transcript(client.until("response.done")).split()) == "i0b0"
    client.close()


def ws_session(port: int) -> Any:
    ws = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=5, max_size=None)
    ws.send(json.dumps({"type": "session.start", "output_rate": 24000, "turn_detection": None,
                        "params": {"sampling": {"max_tokens": 6}}}))
    return ws, json.loads(ws.recv(5))


def ws_until(ws: Any, kind: str) -> list[dict[str, Any]]:
    events = []
    while True:
        frame = ws.recv(30)
        if isinstance(frame, str):
            events.append(json.loads(frame))
            if events[-1]["type"] == kind:
                return events


def test_ws_image_message(seeing: SessionServer) -> None:
    ws, started = ws_session(seeing.port)
    assert started["images"] is True
    ws.send(json.dumps({"type": "image", "image": data_url(JPEG, "image/jpeg")}))
    committed = ws_until(ws, "input_committed")[-1]
    assert (committed["text"], committed["images"]) == ("", 1)
    ws.send(json.dumps({"type": "image", "image": base64.b64encode(PNG).decode(), "text": "and this?",
                        "respond": True}))
    done = ws_until(ws, "response_done")[-1]
    assert image_word(done["text"].split()) == f"i2b{len(JPEG) + len(PNG)}"
    ws.send(json.dumps({"type": "image", "image": data_url(b"nope")}))
    error = ws_until(ws, "error")[-1]
    assert error["code"] == "invalid_value" and "image" in error["message"]
    ws.close()


def test_a_pipeline_that_does_not_see_refuses_images(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    assert IMAGES in client.session["x_voice_server"]["refused"]
    client.send("conversation.item.create", item={"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": data_url(PNG)}, {"type": "input_text", "text": "look"}]})
    error = client.until("error")[-1]["error"]
    assert (error["code"], error["param"]) == ("unsupported", "item.content") and "does not see" in error["message"]
    client.close()
    ws, started = ws_session(server.port)
    assert started["images"] is False
    ws.send(json.dumps({"type": "image", "image": data_url(PNG)}))
    assert ws_until(ws, "error")[-1]["code"] == "unsupported"
    ws.close()


def test_image_checks() -> None:
    assert check_image(PNG).mime_type == "image/png" and check_image(JPEG).mime_type == "image/jpeg"
    assert (check_image(PNG).width, check_image(PNG).height) == (37, 21)
    assert parse_data_url(data_url(PNG)) == PNG
    for url in ("data:image/png,abc", "data:text/plain;base64,AAAA", "file:///etc/passwd"):
        with pytest.raises(ValueError):
            parse_data_url(url)
    # A huge image's header alone is refused (nothing is decoded): 20000 x 20000 is 400 MP.
    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, format="PNG")
    with pytest.raises(ValueError, match="pixels"):
        check_image(buffer.getvalue())
