"""The thinker -> talker feed contract (`FeedChunk`): what the thinker writes the talker reads back the same,
and a chunk the talker cannot use refuses its request, naming what is wrong."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.runners.feed_chunk import FeedChunk, PromptFeed
from voice_server.scheduling import AdmissionError

HIDDEN = 8


def first_chunk() -> FeedChunk:
    prompt = PromptFeed([5, 6, 7], torch.randn(3, HIDDEN), torch.zeros(0, HIDDEN), torch.randn(3, HIDDEN))
    return FeedChunk(torch.randn(1, HIDDEN), prompt)


def test_a_chunk_reads_back_as_it_was_written() -> None:
    sent = first_chunk()
    got = FeedChunk.from_wire(sent.to_wire(), HIDDEN, is_first=True)
    assert got.prompt is not None and sent.prompt is not None
    assert got.prompt.token_ids == [5, 6, 7] and torch.equal(got.embed, sent.embed)
    for name in ("embeds", "mm_hidden", "tts_embeds"):
        assert torch.equal(getattr(got.prompt, name), getattr(sent.prompt, name)), name
    assert got.prompt.visual is None and "image_grid_thw" not in sent.to_wire()
    later = FeedChunk(torch.randn(1, HIDDEN))
    assert set(later.to_wire()) == {"embed"}
    assert FeedChunk.from_wire(later.to_wire(), HIDDEN, is_first=False).prompt is None


def test_a_vision_prompts_grids_read_back_as_they_were_written() -> None:
    grids = VisualInputs(image_grid_thw=torch.tensor([[1, 4, 6]]), video_grid_thw=torch.tensor([[3, 4, 4], [2, 2, 2]]),
                         video_second_per_grid=torch.tensor([0.7, 2.0]))
    sent = FeedChunk(torch.randn(1, HIDDEN), PromptFeed([5, 6], torch.randn(2, HIDDEN), torch.zeros(0, HIDDEN),
                                                       torch.randn(3, HIDDEN), grids))
    got = FeedChunk.from_wire(sent.to_wire(), HIDDEN, is_first=True).prompt
    assert got is not None and got.visual is not None
    for name in ("image_grid_thw", "video_grid_thw", "video_second_per_grid"):
        assert torch.equal(getattr(got.visual, name), getattr(grids, name)), name
    only_video = dataclasses.replace(grids, image_grid_thw=None)
    got = FeedChunk.from_wire(FeedChunk(sent.embed, dataclasses.replace(sent.prompt, visual=only_video)).to_wire(),
                              HIDDEN, is_first=True).prompt
    assert got is not None and got.visual is not None and got.visual.image_grid_thw is None


@pytest.mark.parametrize(("wire", "is_first", "match"), [
    (None, False, r"payload._talker: missing \(list the talker in a thinker's stream_to\)"),
    ({"embed": torch.randn(1, HIDDEN)}, True, "the first thinker chunk lacks prompt_ids, prompt_embeds"),
    ({"embed": torch.randn(2, HIDDEN)}, False, "chunk payload.embed"),
    ({**first_chunk().to_wire(), "prompt_ids": [5, True, 7]}, True, "prompt_ids: must be a list of token ids"),
    ({**first_chunk().to_wire(), "tts_embeds": torch.randn(2, HIDDEN)}, True, "chunk payload.tts_embeds"),
    ({**first_chunk().to_wire(), "image_grid_thw": [[1, 2]]}, True, r"chunk payload.image_grid_thw\[0\]: must be 3"),
    ({**first_chunk().to_wire(), "video_grid_thw": [[1, 2, 2]]}, True,
     "chunk payload.video_second_per_grid: must be a list of 1 numbers"),
])
def test_a_chunk_the_talker_cannot_use_names_what_is_wrong(wire: object, is_first: bool, match: str) -> None:
    with pytest.raises(AdmissionError, match=match):
        FeedChunk.from_wire(wire, HIDDEN, is_first=is_first)
