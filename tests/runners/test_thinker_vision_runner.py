"""`ThinkerRunner` with image and video prompts under the `ARScheduler`, in-process (seeded dummy weights of the
tiny vision config, random visual rows: the runner is compared with the offline greedy reference, not images).

- Prompts with an image, a video whose frame times are fractional (float32 positions for the whole step), a
  video and an image, and text, in steps of 8 tokens (prefill chunks cut their blocks) over a KV cache too small
  for all of them (requests are preempted and recompute): each gives `run_greedy_thinker`'s tokens, and the
  hidden state its talker feed carries at each placeholder is the reference's.
- A payload whose visual fields do not fit its prompt is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from thinker_vision_reference import IDS, IMAGE_GRID, PROMPTS, Prompt, chat, image_block, vision_config_dict
from transformers import GenerationMixin

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.visual import Deepstack, VisualInputs
from voice_server.models.qwen3_omni.turn import run_greedy_thinker
from voice_server.runners.ar_config import DecoderRunnerConfig
from voice_server.runners.feed_chunk import TALKER_FEED_KEY, FeedChunk
from voice_server.runners.prompt_positions import PromptPositions
from voice_server.runners.thinker_runner import ThinkerRunner
from voice_server.runners.thinker_visual import PromptVision, admit_vision
from voice_server.scheduling import AdmissionError, ARScheduler, Emit, EmitKind, WorkItem, WorkKind

torch.set_num_threads(1)
CFG = Qwen3OmniConfig.from_hf_dict(vision_config_dict())
HIDDEN = CFG.thinker.text.hidden_size
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def thinker() -> ThinkerModel:
    model = load_part("thinker", CFG, load_format="dummy", seed=6)
    assert isinstance(model, ThinkerModel)
    return model


def visual_of(prompt: Prompt) -> tuple[VisualInputs | None, dict[str, Any]]:
    """Random rows for the prompt's images and videos: as the reference takes them, and as a payload's fields."""
    ids = prompt.input_ids[0]
    is_image, is_video = ids == CFG.thinker.image_token_id, ids == CFG.thinker.video_token_id
    if not bool((is_image | is_video).any()):
        return None, {}
    g = torch.Generator().manual_seed(prompt.seed)
    num_deepstack = len(CFG.thinker.vision.deepstack_visual_indexes)
    embeds = torch.randn(int((is_image | is_video).sum()), HIDDEN, generator=g)
    deepstack = torch.randn(num_deepstack, embeds.shape[0], HIDDEN, generator=g)
    kinds = is_image[is_image | is_video]
    visual = VisualInputs(
        image_embeds=embeds[kinds], image_deepstack=tuple(deepstack[:, kinds]),
        image_grid_thw=torch.tensor(prompt.image_grids) if prompt.image_grids else None,
        video_embeds=embeds[~kinds], video_deepstack=tuple(deepstack[:, ~kinds]),
        video_grid_thw=torch.tensor(prompt.video_grids) if prompt.video_grids else None,
        video_second_per_grid=torch.tensor(prompt.second_per_grid) if prompt.video_grids else None,
    )
    fields = {"visual_embeds": embeds, "visual_deepstack": deepstack, "image_grid_thw": prompt.image_grids,
              "video_grid_thw": prompt.video_grids, "video_second_per_grid": prompt.second_per_grid}
    return visual, fields


CASES = {
    "image": PROMPTS["image"],
    "video_fractional_time": PROMPTS["video_fractional_time"],
    "image_video": PROMPTS["image_video"],
    "text": Prompt(torch.tensor([chat([40, 41, 42, 43, 44])])),
}


def test_chunked_preempted_vision_requests_give_the_greedy_reference(thinker: ThinkerModel) -> None:
    config = DecoderRunnerConfig(budget_bytes=256 << 20, page_size=4, max_step_tokens=8, max_num_seqs=4)
    runner = ThinkerRunner(thinker, CFG, config, feeds_talker=True)
    # NOTE: 12 pages of 4 positions: one request of at most 40 fits; all four at once do not.
    spec = dataclasses.replace(runner.ar_spec, num_pages=12)
    sched = ARScheduler(spec, max_batch_size=4, max_step_tokens=8)
    for name, prompt in CASES.items():
        _, fields = visual_of(prompt)
        payload = {"token_ids": prompt.input_ids[0].tolist(), **fields}
        params = {"sampling": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
        sched.add(runner.admit(WorkItem(name, WorkKind.NEW, payload, params)), 0.0)
    emits: list[Emit] = []
    while (batch := sched.schedule(0.0)) is not None:
        emits += sched.update(batch, runner.execute(batch))
    assert sched.num_preemptions > 0
    for name, prompt in CASES.items():
        visual, _ = visual_of(prompt)
        ref = run_greedy_thinker(thinker, prompt.input_ids, CFG.talker.accept_hidden_layer, -1, MAX_TOKENS,
                                 visual=visual)
        result = next(e.payload for e in emits if e.request_id == name and e.kind is EmitKind.RESULT)
        assert prompt.input_ids[0].tolist() + result["token_ids"] == ref.text_ids[0].tolist(), name
        first = next(e.payload for e in emits if e.request_id == name and e.kind is EmitKind.STREAM)
        feed = FeedChunk.from_wire(first[TALKER_FEED_KEY], HIDDEN, is_first=True).prompt
        assert feed is not None
        is_mm = torch.isin(prompt.input_ids[0], torch.tensor([IDS["image"], IDS["video"]]))
        torch.testing.assert_close(feed.mm_hidden, ref.accepted_hidden[: prompt.input_ids.shape[1]][is_mm],
                                   atol=1e-5, rtol=1e-5)
        grids = (None if visual is None else visual.image_grid_thw, None if visual is None else visual.video_grid_thw)
        got = (None, None) if feed.visual is None else (feed.visual.image_grid_thw, feed.visual.video_grid_thw)
        assert all(a is b is None or torch.equal(a, b) for a, b in zip(got, grids)), name


def _fields(**changes: Any) -> dict[str, Any]:
    _, fields = visual_of(PROMPTS["two_images"])
    return {k: v for k, v in {**fields, **changes}.items() if v is not None}


@pytest.mark.parametrize(("fields", "token_ids", "match"), [
    ({}, None, r"payload.visual_embeds: the prompt has 9 image / video placeholders but no visual_embeds"),
    (_fields(visual_embeds=torch.zeros(8, HIDDEN)), None, r"payload.visual_embeds: must be a float array \[9, 32\]"),
    (_fields(visual_deepstack=torch.zeros(1, 9, HIDDEN)), None, r"payload.visual_deepstack: must be a float array "
                                                                 r"\[2, 9, 32\]"),
    (_fields(image_grid_thw=[[1, 4, 6]]), None, "payload.image_grid_thw: 1 grids of 6 tokens for the prompt's 9 "
                                                "image placeholders"),
    (_fields(image_grid_thw=[[1, 4, 6], [1, 3, 4]]), None, r"payload.image_grid_thw\[1\]: h and w must be multiples"),
    (_fields(image_grid_thw=[[1, 4, 6], [1, 6, 0]]), None, r"payload.image_grid_thw\[1\]: must be 3 integers >= 1"),
    (_fields(video_second_per_grid=[1.0]), None, "payload.video_second_per_grid: must be a list of 0 numbers"),
    (_fields(image_grid_thw=[[1, 6, 2], [1, 4, 6]]), None,
     r"payload.token_ids: image 0 has 6 placeholder tokens, its grid \(1, 6, 2\) needs 3"),
    (_fields(), chat([IDS["image"]] * 3, image_block(IMAGE_GRID)),
     "payload.token_ids: the prompt has audio, image or video placeholder tokens outside their blocks"),
])
def test_visual_fields_that_do_not_fit_the_prompt_are_refused_naming_the_field(
    fields: dict[str, Any], token_ids: list[int] | None, match: str,
) -> None:
    ids = PROMPTS["two_images"].input_ids[0].tolist() if token_ids is None else token_ids
    with pytest.raises(AdmissionError, match=match):
        admit_vision(fields, ids, CFG.thinker, torch.device("cpu"), torch.float32)


def test_rows_past_a_fractional_prompt_continue_as_transformers_generate() -> None:
    # NOTE: a prompt ending at 16.0433.. (3 rows after the second temporal patch of a video of 301 / 300 s a patch,
    # x 13): transformers' generate appends `position_ids[..., -1:] + 1` after each step, in float32. The rows past
    # the prompt must be those values, in whatever chunks and repeats the scheduler asks for them (a preempted
    # request re-runs its rows), where `p + delta` (one rounding) lands an ulp away.
    num_prompt, num = 6000, 3000
    last = (torch.arange(2) * torch.tensor(301 / 300) * 13).float()[1] + 3
    positions = torch.arange(num_prompt, dtype=torch.float32).expand(3, -1).clone()
    positions[:, -1] = last
    vision = PromptVision([], torch.zeros(0, 4), Deepstack(torch.zeros(0, dtype=torch.long), torch.zeros(1, 0, 4)),
                          PromptPositions(positions), VisualInputs())
    kwargs = {"position_ids": last.expand(4, 1, 1)}
    for _ in range(num):
        kwargs = GenerationMixin._update_model_kwargs_for_generation(None, {}, kwargs)  # type: ignore[arg-type]
    expected = kwargs["position_ids"][1, 0, 1:]
    spans = [(num_prompt - 2, num_prompt + 5), (num_prompt + 5, num_prompt + 1700),
             (num_prompt + 100, num_prompt + 101), (num_prompt + 1700, num_prompt + num)]
    got = torch.cat([vision.rope_rows(start, end)[:, max(0, num_prompt - start):] for start, end in spans[:2]]
                    + [vision.rope_rows(*spans[3])], dim=1)
    assert got.dtype == torch.float32 and torch.equal(got, expected.expand(3, -1))
    assert torch.equal(vision.rope_rows(*spans[2])[0], expected[100:101]), "a re-run row gets the same value"
    assert not torch.equal(torch.arange(num_prompt, num_prompt + num) + (last + 1 - num_prompt), expected)
