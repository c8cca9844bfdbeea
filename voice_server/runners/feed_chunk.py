"""`FeedChunk`: what the thinker streams to the talker with each reply token, typed on both sides.

It travels under the `_talker` key of the thinker's stream chunks (`TALKER_FEED_KEY`; the leading underscore
keeps it off the client's outputs) as a plain mapping, the form msgpack and the relay carry: `to_wire` on
the thinker's side, `from_wire` (which checks it, refusing the request alone) on the talker's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.runners.payload import float_rows
from voice_server.runners.thinker_visual import GRID_KEYS, read_grids
from voice_server.scheduling import AdmissionError

TALKER_FEED_KEY = "_talker"
_PROMPT_KEYS = ("prompt_ids", "prompt_embeds", "mm_hidden", "tts_embeds")


@dataclass(frozen=True)
class PromptFeed:
    """The thinker's prompt, sent once, with the reply's first token."""

    token_ids: list[int]
    embeds: torch.Tensor
    """[P, H]: the prompt tokens' input embeddings."""
    mm_hidden: torch.Tensor
    """[N, H]: the hidden state at the talker's `accept_hidden_layer` at each audio, image and video
    placeholder, in row order (N may be 0)."""
    tts_embeds: torch.Tensor
    """[3, H]: tts_bos, tts_eos, tts_pad."""
    visual: VisualInputs | None = None
    """The prompt's image and video grids (no features; None: it has none): the talker's prefill positions."""


@dataclass(frozen=True)
class FeedChunk:
    embed: torch.Tensor
    """[1, H]: the reply token's input embedding, which the talker projects as trailing text."""
    prompt: PromptFeed | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"embed": self.embed}
        if self.prompt is not None:
            wire.update(prompt_ids=self.prompt.token_ids, prompt_embeds=self.prompt.embeds,
                        mm_hidden=self.prompt.mm_hidden, tts_embeds=self.prompt.tts_embeds)
            if self.prompt.visual is not None:
                wire.update(_grids_to_wire(self.prompt.visual))
        return wire

    @classmethod
    def from_wire(cls, wire: Any, hidden_size: int, is_first: bool) -> FeedChunk:
        """A chunk's `_talker` mapping, checked (the first of a reply must carry the prompt)."""
        if not isinstance(wire, dict):
            raise AdmissionError(f"chunk payload.{TALKER_FEED_KEY}: missing (list the talker in a thinker's "
                                 "stream_to)")
        embed = float_rows("chunk payload.embed", wire.get("embed"), hidden_size, 1)
        if not is_first:
            return cls(embed)
        missing = [k for k in _PROMPT_KEYS if k not in wire]
        if missing:
            raise AdmissionError(f"chunk payload: the first thinker chunk lacks {', '.join(missing)}")
        token_ids = _ids("chunk payload.prompt_ids", wire["prompt_ids"])
        return cls(embed, PromptFeed(
            token_ids,
            float_rows("chunk payload.prompt_embeds", wire["prompt_embeds"], hidden_size, len(token_ids)),
            float_rows("chunk payload.mm_hidden", wire["mm_hidden"], hidden_size, None),
            float_rows("chunk payload.tts_embeds", wire["tts_embeds"], hidden_size, 3),
            _grids_from_wire(wire),
        ))


def _grids_to_wire(visual: VisualInputs) -> dict[str, Any]:
    def rows(grid: torch.Tensor | None) -> list[list[int]]:
        return [] if grid is None else grid.tolist()

    seconds = visual.video_second_per_grid
    return {"image_grid_thw": rows(visual.image_grid_thw), "video_grid_thw": rows(visual.video_grid_thw),
            "video_second_per_grid": [] if seconds is None else seconds.tolist()}


def _grids_from_wire(wire: dict[str, Any]) -> VisualInputs | None:
    """The grids of a prompt with images or videos (None: the chunk has none), checked for form; whether
    they fit the prompt's blocks the talker's prefill checks."""
    if not any(k in wire for k in GRID_KEYS):
        return None
    return read_grids("chunk payload", wire)


def _ids(where: str, value: Any) -> list[int]:
    if not isinstance(value, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise AdmissionError(f"{where}: must be a list of token ids")
    return list(value)
