"""Chat messages -> a Qwen3-Omni prompt: token ids with one block per image, video and audio clip, and those.

The layout of the model's chat template, written out so it needs no template engine:

    <|im_start|>{role}\\n[images][videos][audio]{text}<|im_end|>\\n ... <|im_start|>assistant\\n

with function calling as Qwen3's template writes it (`models/chat_tools.py`: the tools in the system turn, an
assistant's calls after its text, tool results as one user turn). Each image is
`<|vision_start|><|image_pad|><|vision_end|>`, each video `<|vision_start|><|video_pad|><|vision_end|>` and
the clip `<|audio_start|><|audio_pad|><|audio_end|>`. NOTE: the template writes a turn's parts in the
order of its content list; messages carry them as fields, so they go in the order Qwen's own examples
list them (images, videos, audio, then the text).

The role names are the config's `system`/`user`/`assistant` token ids (single tokens in the released
vocabulary), so only text and "\\n" need the tokenizer. Each block has one placeholder; the encoder
stage expands it to its item's token count. This is what the session layer's requests
(`{"messages": [{"role", "content", "audio"?, "images"?, "videos"?}]}`) become at the omni pipeline's entry.

The tiny test config has no tokenizer: `tiny_encode` maps UTF-8 bytes into its plain-text id range
(a stand-in with the same shape: deterministic, "\\n" is its own id), so the tiny pipeline serves
sessions end to end. Its replies are noise either way (random weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from voice_server.models.chat_tools import TOOL_KEYS, Tool, chat_turns, tool_fields
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig

Encode = Callable[[str], list[int]]
MAX_MESSAGES = 512
_ROLES = ("system", "user", "assistant", "tool")
_MEDIA_KEYS = ("audio", "images", "videos")
"""Fields only user turns carry."""


class ChatPrompt(NamedTuple):
    token_ids: list[int]
    """Ending with the assistant's turn opening; one placeholder per block."""
    audio: list[np.ndarray]
    """The clips, in prompt order (one per audio block)."""
    images: list[Any]
    """The images (encoded bytes or HWC uint8 arrays, as given), in prompt order."""
    videos: list[Any]
    """The videos (`{"frames", "fps"}`, as given), in prompt order."""


def tiny_encode(text: str) -> list[int]:
    """The tiny preset's stand-in tokenizer: "\\n" is 10, every other byte an id in 20..99."""
    return [10 if b == 10 else 20 + b % 80 for b in text.encode("utf-8")]


def chat_prompt(
    messages: Sequence[Any], cfg: Qwen3OmniConfig, encode: Encode, tools: Sequence[Tool] = ()
) -> tuple[list[int], list[np.ndarray]]:
    """(token ids, audio clips) of `chat_inputs`, for callers that take no images or videos (their
    blocks would still be in the ids)."""
    prompt = chat_inputs(messages, cfg, encode, tools)
    return prompt.token_ids, prompt.audio


def chat_inputs(
    messages: Sequence[Any], cfg: Qwen3OmniConfig, encode: Encode, tools: Sequence[Tool] = ()
) -> ChatPrompt:
    """The prompt's token ids, and its clips, images and videos in prompt order.

    Each message: `role` (system/user/assistant/tool), `content` (text, may be ""), on user turns only
    an optional `audio` (16 kHz mono float32 clip), `images` (a list of encoded PNG/JPEG/... bytes or
    HWC uint8 arrays) and `videos` (a list of `{"frames": THWC uint8 array, "fps": float}`), an
    assistant's `tool_calls`, a tool result's `tool_call_id`; `tools` (checked, `request_tools`) go into
    the system turn, calls and results are written as Qwen3's template writes them
    (`models/chat_tools.py`). ValueError naming the field for anything else; the images and videos
    themselves are checked by the encoder stage."""
    if not isinstance(messages, list | tuple) or not messages or len(messages) > MAX_MESSAGES:
        raise ValueError(f"payload.messages: must be a list of 1 to {MAX_MESSAGES} messages")
    role_ids = {"system": cfg.system_token_id, "user": cfg.user_token_id, "assistant": cfg.assistant_token_id}
    for i, message in enumerate(messages):
        where = f"payload.messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise ValueError(f"{where}: must be a mapping with a role of {', '.join(_ROLES)}")
        if not isinstance(message.get("content", ""), str):
            raise ValueError(f"{where}.content: must be a string")
        unknown = sorted(str(k) for k in message if k not in ("role", "content", *_MEDIA_KEYS, *TOOL_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
        for key in _MEDIA_KEYS:
            if message.get(key) is not None and message["role"] != "user":
                raise ValueError(f"{where}.{key}: only user turns carry {key}")
        for key in ("images", "videos"):
            if not isinstance(message.get(key, []), list | tuple):
                raise ValueError(f"{where}.{key}: must be a list")
        tool_fields(where, message)
    th = cfg.thinker
    newline = encode("\n")
    prompt = ChatPrompt([], [], [], [])
    tokens = prompt.token_ids
    for turn in chat_turns(messages, tools):
        tokens += [cfg.im_start_token_id, role_ids[turn.role], *newline]
        message = {} if turn.message is None else messages[turn.message]
        for image in message.get("images") or ():
            tokens += [th.vision_start_token_id, th.image_token_id, th.vision_end_token_id]
            prompt.images.append(image)
        for video in message.get("videos") or ():
            tokens += [th.vision_start_token_id, th.video_token_id, th.vision_end_token_id]
            prompt.videos.append(video)
        if message.get("audio") is not None:
            tokens += [th.audio_start_token_id, th.audio_token_id, th.audio_end_token_id]
            prompt.audio.append(message["audio"])
        tokens += encode(turn.text) if turn.text else []
        tokens += [cfg.im_end_token_id, *newline]
    tokens += [cfg.im_start_token_id, cfg.assistant_token_id, *newline]
    return prompt
