"""`conversation.item.create` with `input_audio` parts over `WS /v1/realtime`: a spoken user turn the client
sends whole (a recording, a telephony leg, a test), against a real server over the stand-in speech stage
(`tests/speech_stages.py`, whose reply names what it was given: `m{messages}a{with audio}` and the level of the
last user audio in dBFS, `l{db}`). Every server event is checked against the `openai` SDK's models.

What must hold: the item reaches the pipeline as audio at the speech rate (its level survives the session's
input format and the resampling), it is announced as an `input_audio` item with no buffer commit (OpenAI commits
no buffer for it), and bad audio is an error event naming the part while the session goes on (images:
`tests/server/test_images.py`).
"""

from __future__ import annotations

import numpy as np
from realtime_client import RealtimeClient, encode, text_item, transcript, without_deltas
from session_server import SessionServer
from speech_signals import signal_of
from speech_stages import level_db

from voice_server.audio import b64encode
from voice_server.session.conversation import SPEECH_RATE, speech_item

RATE = 24000


def clip(rate: int, gain: float = 1.0) -> np.ndarray:
    return (signal_of(rate, ("voice", 700)) * gain).astype(np.float32)


def audio_item(*payloads: bytes, role: str = "user") -> dict[str, object]:
    return {"type": "message", "role": role,
            "content": [{"type": "input_audio", "audio": b64encode(payload)} for payload in payloads]}


def reply_words(client: RealtimeClient) -> list[str]:
    client.send("response.create")
    return transcript(client.until("response.done")).split()


def level_of(words: list[str]) -> int:
    """The stage's `l{db}` word: the level of the last user audio it was given."""
    return int(next(word for word in words if word.startswith("l"))[1:])


def test_an_audio_item_is_a_spoken_turn_at_the_speech_rate(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=6, audio={"input": {"turn_detection": None}})
    loud, quiet = clip(RATE), clip(RATE, gain=0.1)
    # NOTE: two parts are one item: their audio joined, in order.
    client.send("conversation.item.create", item=audio_item(encode(loud[:8000]), encode(loud[8000:])))
    events = client.until("conversation.item.done")
    assert without_deltas(events) == ["conversation.item.added", "conversation.item.done"], "no buffer commit"
    item = events[-1]["item"]
    assert item["role"] == "user" and item["content"] == [{"type": "input_audio", "transcript": None}]
    words = reply_words(client)
    assert words[0] == "m1a1"
    # The level the stage measured is the clip's own (resampled 24 -> 16 kHz keeps it): the audio arrived whole.
    assert abs(level_of(words) - int(level_db(loud))) <= 1
    client.send("conversation.item.create", item=audio_item(encode(quiet)))
    client.until("conversation.item.done")
    words = reply_words(client)
    assert words[0] == "m3a2" and abs(level_of(words) - int(level_db(quiet))) <= 1
    client.close()


def test_an_audio_item_in_the_sessions_g711_format(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=6, audio={"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None}})
    loud = clip(8000)
    client.send("conversation.item.create", item=audio_item(encode(loud, "audio/pcmu")))
    client.until("conversation.item.done")
    words = reply_words(client)
    assert words[0] == "m1a1" and abs(level_of(words) - int(level_db(loud))) <= 1
    client.close()


def test_bad_audio_items_are_errors_and_the_session_goes_on(server: SessionServer) -> None:
    client = RealtimeClient(server.port)
    client.update(max_output_tokens=4, audio={"input": {"turn_detection": None}})
    bad = [
        (audio_item(b"\x01\x02\x03"), "invalid_value", "item.content"),  # PCM16 of an odd number of bytes
        (audio_item(b""), "invalid_value", "item.content"),
        (audio_item(encode(clip(RATE)), role="system"), "invalid_value", "item.content[0].type"),
        ({"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "not base64!"}]},
         "invalid_base64", "item.content[0].audio"),
        ({"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_audio", "audio": b64encode(b"\0\0")}]},
         "unsupported", "item.content"),
    ]
    for item, code, param in bad:
        client.send("conversation.item.create", item=item)
        error = client.until("error")[-1]["error"]
        assert (error["code"], error["param"]) == (code, param), item
    client.send("conversation.item.create", item=text_item("still here?"))
    client.until("conversation.item.done")
    assert reply_words(client)[0] == "m1a0", "nothing of the bad items entered the conversation"
    client.close()


def test_the_speech_rate_is_what_the_stage_gets() -> None:
    # NOTE: why the level check above means the audio arrived at the speech rate: the stand-in measures the
    # samples it is given; a clip at the wrong rate keeps its level, so the rate is checked here directly.
    item = speech_item("item_a", clip(RATE), RATE)
    assert item.audio is not None and item.audio.size == 700 * SPEECH_RATE // 1000
    assert item.num_audio_ms == 700
