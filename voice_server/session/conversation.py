"""A session's conversation: the items of both sides, what the next response sees, and truncation.

Items are kept as the pipeline reads them: user turns as text or as 16 kHz float32 audio (the rate
speech encoders take), assistant turns as the text of what the user actually heard. After a
barge-in the assistant item is cut to the audio the client played (`truncate`), and its text to the
words spoken up to that point, so the next response does not believe it said what nobody heard.

NOTE: the text is cut in proportion to the audio heard, at a word boundary (a pipeline gives no
word timings; speech rate is close enough to constant over one reply). Words are kept only when
their end falls within the heard fraction: a word cut off mid-way counts as not said.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import resample_signal
from voice_server.session.tools import ToolCall

SPEECH_RATE = 16000
"""Sample rate of user audio in the conversation (what speech encoders take)."""
ROLES = ("system", "user", "assistant", "tool")
KINDS = ("message", "function_call", "function_call_output")
"""OpenAI's item types: a function call is the assistant's, its output the tool's (the client's answer)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


@dataclass
class Item:
    item_id: str
    role: str
    text: str = ""
    audio: npt.NDArray[np.float32] | None = None
    """User audio, float32 mono at `SPEECH_RATE`."""
    num_audio_ms: int = 0
    """Assistant: audio sent to the client (after truncation: heard). User: length of `audio`."""
    status: str = "completed"
    """`in_progress` while a response writes it, `completed`, or `incomplete` (cancelled, truncated)."""
    kind: str = "message"
    call: ToolCall | None = None
    """A `function_call` item's call; a `function_call_output` item names it by `call.call_id` (its
    name and arguments empty) and carries the output as `text`."""
    images: tuple[bytes, ...] = ()
    """User images, encoded (PNG or JPEG, checked by `voice_server/session/images.py`), before the text."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"item.role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.kind == "message":
            is_valid = self.call is None and self.role != "tool"
        else:
            is_valid = self.call is not None and self.role == ("assistant" if self.kind == "function_call" else "tool")
        if self.kind not in KINDS or not is_valid:
            raise ValueError(f"item: a {self.kind!r} item with role {self.role!r} and call {self.call!r}")
        if self.images and (self.role != "user" or self.kind != "message"):
            raise ValueError(f"item: images belong to user messages, not a {self.role} {self.kind}")


    @property
    def num_media_bytes(self) -> int:
        """What its user audio and images hold in memory."""
        return (0 if self.audio is None else self.audio.nbytes) + sum(len(image) for image in self.images)


@dataclass
class Conversation:
    max_items: int = 512
    """Oldest items are dropped beyond this (a long call must not grow without bound)."""
    max_media_bytes: int = 256 << 20
    """...and beyond this much user audio and images (~70 minutes of speech): an item's count alone would let
    a client that sends large images hold hundreds of MiB per session."""
    items: list[Item] = field(default_factory=list)

    def add(self, item: Item) -> Item:
        self.items.append(item)
        if len(self.items) > self.max_items:
            del self.items[: len(self.items) - self.max_items]
        num_bytes = sum(i.num_media_bytes for i in self.items)
        while num_bytes > self.max_media_bytes and len(self.items) > 1:
            num_bytes -= self.items.pop(0).num_media_bytes  # NOTE: the newest item always stays
        return item

    def get(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.item_id == item_id), None)

    def set_transcript(self, item_id: str, transcript: str) -> None:
        """A spoken user item's transcript (from a transcribing pipeline); no-op if it is gone."""
        item = self.get(item_id)
        if item is not None and item.role == "user":
            item.text = transcript

    def delete(self, item_id: str) -> bool:
        item = self.get(item_id)
        if item is not None:
            self.items.remove(item)
        return item is not None

    def truncate(self, item_id: str, audio_end_ms: int) -> Item:
        """Keep only the first `audio_end_ms` of an assistant item's audio, and its text up to there."""
        item = self.get(item_id)
        if item is None or item.role != "assistant" or item.kind != "message":
            raise ValueError(f"item_id: no assistant message item {item_id!r}")
        if not 0 <= audio_end_ms <= item.num_audio_ms:
            raise ValueError(f"audio_end_ms: must be in [0, {item.num_audio_ms}] (the audio sent), got {audio_end_ms}")
        if audio_end_ms < item.num_audio_ms:
            item.text = cut_text(item.text, audio_end_ms / item.num_audio_ms if item.num_audio_ms else 0.0)
            item.num_audio_ms = audio_end_ms
            item.status = "incomplete"
        return item

    def to_messages(self, instructions: str) -> list[dict[str, Any]]:
        """What the pipeline sees: the instructions as the system message, then every item. A function call
        joins the assistant message before it (`tool_calls`), as the model wrote them in one turn; its
        output is a `tool` message."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        for item in self.items:
            call = item.call
            if item.kind == "function_call" and call is not None:
                entry = {"id": call.call_id, "name": call.name, "arguments": call.arguments}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(entry)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [entry]})
                continue
            if item.kind == "function_call_output" and call is not None:
                messages.append({"role": "tool", "tool_call_id": call.call_id, "content": item.text})
                continue
            if item.role == "assistant" and not item.text:
                continue  # NOTE: nothing of it was heard (or it was audio only): it was not said
            message: dict[str, Any] = {"role": item.role, "content": item.text}
            if item.audio is not None and not (item.role == "user" and item.text):
                # NOTE: a transcribed turn travels as its transcript: only a pipeline that transcribes
                # sets one, and it would transcribe the audio again.
                message["audio"] = item.audio
            if item.images:
                message["images"] = list(item.images)
            messages.append(message)
        return messages

    def last_untranscribed_id(self) -> str:
        """The last user item that is audio without a transcript ('' if none): what a transcribing
        pipeline transcribes for the next response."""
        for item in reversed(self.items):
            if item.role == "user":
                return item.item_id if item.audio is not None and not item.text else ""
        return ""


def speech_item(item_id: str, audio: npt.NDArray[np.float32], rate: int, num_audio_ms: int | None = None) -> Item:
    """A spoken user item from float32 audio at `rate` (resampled to `SPEECH_RATE` as a whole: aligned, its tail
    kept); `num_audio_ms`: the turn's length on the session's timeline, when known (else the audio's)."""
    speech = audio if rate == SPEECH_RATE else resample_signal(audio, rate, SPEECH_RATE)
    num_ms = round(1000 * audio.size / rate) if num_audio_ms is None else num_audio_ms
    return Item(item_id, "user", audio=speech, num_audio_ms=num_ms)


def cut_text(text: str, fraction: float) -> str:
    """The words of `text` whose last character lies within the first `fraction` of its characters."""
    if fraction >= 1.0:
        return text
    limit = fraction * len(text)
    kept, end = [], 0
    for word in text.split(" "):
        end += len(word)
        if end > limit:
            break
        kept.append(word)
        end += 1
    return " ".join(kept).rstrip()
