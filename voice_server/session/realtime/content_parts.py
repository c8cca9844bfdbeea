"""The content of a ``conversation.item.create`` message: its parts parsed into one typed message item.

- Typed: ``input_text`` parts (user, system), ``output_text`` or beta ``text`` (assistant), joined in order.
- Spoken: ``input_audio`` parts (user), base64 in the session's input format, joined in order; decoded by the
  handler (the format may change by ``session.update`` before it is read). A client's ``transcript`` is
  accepted and not used ("not sent to the model", OpenAI says); a transcribing pipeline writes its own.
- Images: ``input_image`` parts (user) with a PNG or JPEG data URL (``image_url``; remote URLs are not
  fetched), checked as images here (`voice_server/session/images.py`); ``detail`` is accepted and not used
  (the model's processor sizes every image). Whether the pipeline sees is the handler's question.

Audio and text in one message are ``unsupported`` (a turn is spoken or typed); images go with either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from voice_server.audio import b64decode
from voice_server.session.images import MAX_IMAGES, check_image, parse_data_url
from voice_server.session.realtime.errors import (
    AUDIO_TOO_LARGE,
    INVALID_BASE64,
    UNSUPPORTED,
    FieldError,
    as_choice,
    as_object,
    as_str,
    check_keys,
    invalid_type,
    invalid_value,
    join,
    require,
)

__all__ = ["MAX_ITEM_AUDIO_BYTES", "AudioMessageItem", "MessageItem", "Role", "parse_message"]

Role = Literal["user", "system", "assistant"]
MAX_ITEM_AUDIO_BYTES = 15 * 1024 * 1024
"""An audio item's bytes, all parts together: OpenAI's limit per ``input_audio_buffer.append``."""
_TEXT_PARTS = {"user": ("input_text",), "system": ("input_text",), "assistant": ("output_text", "text")}
_UNSERVED_PARTS = frozenset({"output_audio", "audio"})
_USER_PARTS = ("input_audio", "input_image")


@dataclass(frozen=True)
class MessageItem:
    """A typed message for the conversation: one string per text part, in order, and a user's images."""

    role: Role
    texts: tuple[str, ...]
    item_id: str | None = None
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ("user", "system", "assistant"):
            raise ValueError(f"role must be user, system or assistant, got {self.role!r}")
        if not self.texts and not self.images:
            raise ValueError("a message needs at least one content part")
        if self.images and self.role != "user":
            raise ValueError("images belong to user messages")

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass(frozen=True)
class AudioMessageItem:
    """A spoken user message: its parts' audio bytes joined, in the session's input format, and its images."""

    audio: bytes
    item_id: str | None = None
    images: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not self.audio:
            raise ValueError("an audio message needs audio")


def parse_message(role: Role, content: object, path: str, item_id: str | None) -> MessageItem | AudioMessageItem:
    """A message's ``content`` (at `path`) -> its item; FieldError naming the part for anything refused."""
    if not isinstance(content, list):
        raise invalid_type(path, "an array", content)
    if not content:
        raise invalid_value(path, "a message needs at least one content part.")
    texts: list[str] = []
    audio: list[bytes] = []
    images: list[bytes] = []
    for index, part_raw in enumerate(content):
        part_path = f"{path}[{index}]"
        part = as_object(part_raw, part_path)
        part_type = as_str(require(part, "type", part_path), join(part_path, "type"))
        if part_type in _USER_PARTS and role != "user":
            raise invalid_value(join(part_path, "type"), f"{part_type} parts belong to user messages.")
        if part_type == "input_audio":
            audio.append(_part_audio(part, part_path, sum(map(len, audio))))
        elif part_type == "input_image":
            if len(images) == MAX_IMAGES:
                raise invalid_value(part_path, f"a message holds at most {MAX_IMAGES} images.")
            images.append(_part_image(part, part_path))
        elif part_type in _UNSERVED_PARTS:
            raise FieldError(UNSUPPORTED, f"Content parts of type '{part_type}' are not supported in "
                                          f"conversation.item.create; send text.", join(part_path, "type"))
        else:
            as_choice(part_type, join(part_path, "type"), _TEXT_PARTS[role])
            check_keys(part, part_path, {"type", "text"})
            texts.append(as_str(require(part, "text", part_path), join(part_path, "text")))
    if audio and texts:
        raise FieldError(UNSUPPORTED, "A message is either spoken (input_audio parts) or typed (input_text parts) "
                                      "here, not both; send two items.", path)
    if audio:
        if not any(audio):
            raise invalid_value(path, "the input_audio parts hold no audio.")
        return AudioMessageItem(b"".join(audio), item_id, tuple(images))
    return MessageItem(role, tuple(texts), item_id, tuple(images))


def _part_audio(part: Mapping[str, Any], path: str, num_bytes_before: int) -> bytes:
    check_keys(part, path, {"type", "audio", "transcript"})
    payload = as_str(require(part, "audio", path), join(path, "audio"))
    # NOTE: base64 length bounds the decoded size, so oversize audio is refused without decoding it.
    if num_bytes_before + len(payload) // 4 * 3 > MAX_ITEM_AUDIO_BYTES + 2:
        raise FieldError(AUDIO_TOO_LARGE, f"An audio item is at most {MAX_ITEM_AUDIO_BYTES} bytes of audio.",
                         join(path, "audio"))
    try:
        return b64decode(payload)
    except ValueError as exc:
        raise FieldError(INVALID_BASE64, f"Invalid 'audio': {exc}.", join(path, "audio")) from exc


def _part_image(part: Mapping[str, Any], path: str) -> bytes:
    check_keys(part, path, {"type", "image_url", "detail"})
    if part.get("detail") is not None:
        as_choice(part["detail"], join(path, "detail"), ("auto", "low", "high"))
    where = join(path, "image_url")
    try:
        data = parse_data_url(as_str(require(part, "image_url", path), where))
        check_image(data)
    except ValueError as exc:
        raise invalid_value(where, f"{exc}.") from exc
    return data
