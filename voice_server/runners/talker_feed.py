"""Per-request talker input while the thinker is still decoding: the streaming side of the talker.

The thinker streams one chunk per reply token t1, t2, ... (`ThinkerRunner._output_data`), the first
also with the prompt. Following transformers' `generate` (which runs the talker after the thinker):
- the talker prefill needs the reply's first token t1, and that t1 is not the reply's last token
  (the thinker never feeds its last generated token back, so the last one is not part of the talker
  text): it is built once t2 or the thinker's end arrives;
- frame 0 comes from the prefill; frame m + 1 is fed `codec_sum(frame m) + text_vector(m)`, where
  the text vectors are t2 .. t(n-1) (tn, the thinker's last token, is never fed back), then tts_eos
  once the thinker ended, then tts_pad forever. So t(k) is a text vector once t(k+1) arrives.
So the talker may have `1 + number of known text vectors` frames (unlimited after the thinker's end),
which its runner passes to the scheduler as `max_num_outputs`. Every input row a step may need is
rebuilt from stored vectors, so a preempted request recomputes exactly.

Positions: 0..L-1 on all three axes, then one per frame, unless the prompt has images or videos: then
the prefill's rows take the M-RoPE positions `build_talker_prefill` gives them (the grids' walk over the
talker's own input ids) and every later row the one before + 1, as transformers' frame loop does
(`voice_server/runners/prompt_positions.py`, shared with the thinker; float32 where a video's frame times are
fractional: `is_fractional`).

A reply with no token to speak (the thinker's end after at most one token: its EOS at once, or a reply
that was only tool calls, whose tokens the thinker's stage never streams) is silent: no prefill, and the
request's one position is a step that decides the codec EOS without the model (`TalkerRunner.execute`),
so it ends like any reply, with no frame, and the vocoder's stream after it ends empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.talker.prefill import TurnTokenIds, build_talker_prefill
from voice_server.models.qwen3_omni.thinker.rope import RopeLayout
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs
from voice_server.runners.feed_chunk import FeedChunk
from voice_server.runners.prompt_positions import PromptPositions
from voice_server.scheduling import AdmissionError


@dataclass
class TalkerFeed:
    speaker: str
    device: torch.device
    """The talker's: the thinker's vectors arrive in CPU memory (the relay) and are moved here once."""
    prompt_ids: list[int] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None
    mm_hidden: torch.Tensor | None = None
    tts_embeds: torch.Tensor | None = None
    visual: VisualInputs | None = None
    """The prompt's image and video grids (None: it has none)."""
    reply_embeds: list[torch.Tensor] = field(default_factory=list)
    """Thinker input embeddings [H_thinker] of the reply tokens received, t1 first."""
    is_thinker_done: bool = False
    prefill: torch.Tensor | None = None
    """Talker input rows of the prefill [L, H] once built."""
    rope: PromptPositions | None = None
    """The rows' positions when the prompt has images or videos (None: 0..L-1 and on): the prefill's [3, L],
    int64 or float32 where a video's frame times are fractional, and every row after it."""
    text_vectors: list[torch.Tensor] = field(default_factory=list)
    """Projected trailing text vectors [H] known so far (tts_eos last once the thinker ended)."""
    tts_pad: torch.Tensor | None = None
    codec_sums: list[torch.Tensor] = field(default_factory=list)
    """Per frame: the sum of its G codebook embeddings [H]."""
    code0_seen: torch.Tensor | None = None
    """[V] bool: code-0 ids chosen so far (repetition penalty)."""

    @property
    def is_silent(self) -> bool:
        """The thinker ended and its reply has no token to speak (every token but the last is spoken)."""
        return self.is_thinker_done and len(self.reply_embeds) < 2

    @property
    def max_num_outputs(self) -> int | None:
        if self.is_thinker_done:
            return None
        return 0 if self.prefill is None else 1 + len(self.text_vectors)

    def add_chunk(self, chunk: FeedChunk) -> None:
        """One thinker chunk: a reply token's embedding (the first also with the prompt)."""
        if chunk.prompt is not None:
            prompt = chunk.prompt
            self.prompt_ids, self.prompt_embeds = prompt.token_ids, prompt.embeds.to(self.device)
            self.mm_hidden, self.tts_embeds = prompt.mm_hidden.to(self.device), prompt.tts_embeds.to(self.device)
            self.visual = prompt.visual
        self.reply_embeds.append(chunk.embed[0].to(self.device))

    def advance(self, talker: Talker, ids: TurnTokenIds, rope_layout: RopeLayout | None = None) -> list[int] | None:
        """Build the prefill and text vectors the received input allows; the prefill's placeholder
        token ids when it was just built (the scheduler counts positions by them), else None. A silent
        reply gets one placeholder when the thinker's end makes it so: the step that ends it."""
        # NOTE: the thinker's last token (EOS, or the one that hit max_tokens) is never fed back, so
        # the talker text is every reply token but the last received: a token counts once another
        # follows it, and the thinker's end adds none.
        num_consumed = len(self.reply_embeds) - 1
        built = None
        if self.prefill is None:
            if num_consumed < 1:
                # NOTE: only the thinker's end (DONE, which comes once) makes a reply silent.
                return [0] if self.is_silent else None
            self.prefill = self._build_prefill(talker, ids, rope_layout)
            built = [0] * self.prefill.shape[0]
        # Text vector m is reply token m + 2 (t1 went into the prefill).
        while len(self.text_vectors) < num_consumed - 1:
            embed = self.reply_embeds[len(self.text_vectors) + 1]
            self.text_vectors.append(talker.text_projection(embed.to(self._dtype(talker))[None])[0])
        if self.is_thinker_done and len(self.text_vectors) == max(0, num_consumed - 1):
            assert self.tts_embeds is not None
            self.text_vectors.append(talker.text_projection(self.tts_embeds[1:2].to(self._dtype(talker)))[0])
        return built

    def _build_prefill(self, talker: Talker, ids: TurnTokenIds, rope_layout: RopeLayout | None) -> torch.Tensor:
        assert self.prompt_embeds is not None and self.mm_hidden is not None and self.tts_embeds is not None
        dtype = self._dtype(talker)
        device = self.prompt_embeds.device
        token_ids = torch.tensor([*self.prompt_ids, 0], device=device)  # t1's id is never read
        embeds = torch.cat((self.prompt_embeds, self.reply_embeds[0][None])).to(dtype)
        hidden = torch.zeros_like(embeds)
        is_multimodal = (token_ids == ids.audio) | (token_ids == ids.image) | (token_ids == ids.video)
        is_multimodal[-1] = False
        if int(is_multimodal.sum()) != self.mm_hidden.shape[0]:
            raise AdmissionError(f"chunk payload.mm_hidden: {self.mm_hidden.shape[0]} rows for "
                                 f"{int(is_multimodal.sum())} audio, image and video positions of the prompt")
        hidden[is_multimodal] = self.mm_hidden.to(dtype)
        try:
            prefill = build_talker_prefill(talker, ids, token_ids, len(self.prompt_ids), embeds, hidden,
                                           self.tts_embeds, self.speaker, self.visual, rope_layout)
        except ValueError as exc:
            raise AdmissionError(f"talker prefill: {exc}") from exc
        self.tts_pad = prefill.tts_pad[0, 0]
        if self.visual is not None:
            self.rope = PromptPositions(prefill.positions[:, 0])
        return prefill.inputs_embeds[0]

    @property
    def prefill_positions(self) -> torch.Tensor | None:
        return None if self.rope is None else self.rope.positions

    @property
    def rope_delta(self) -> int:
        """Whole positions: row p past the prefill sits at p + rope_delta on every axis."""
        return 0 if self.rope is None else self.rope.delta

    @property
    def is_fractional(self) -> bool:
        """The prompt's positions are float32 (a video with fractional frame times): see `rope_rows`."""
        return self.rope is not None and self.rope.is_fractional

    def input_rows(self, start: int, end: int) -> torch.Tensor:
        """Talker input rows of positions [start, end) (prefill rows, then feedback rows)."""
        assert self.prefill is not None
        num_prefill = self.prefill.shape[0]
        rows = [self.prefill[start:min(end, num_prefill)]]
        for m in range(max(start, num_prefill) - num_prefill, end - num_prefill):
            rows.append((self.codec_sums[m] + self.text_vector(m))[None])
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def rope_rows(self, start: int, end: int) -> torch.Tensor | None:
        """[3, end - start] positions of rows [start, end), the prefill's dtype; None when they are start..end-1
        (no vision)."""
        return None if self.rope is None else self.rope.rows(start, end)

    def text_vector(self, m: int) -> torch.Tensor:
        if m < len(self.text_vectors):
            return self.text_vectors[m]
        if not self.is_thinker_done or self.tts_pad is None:
            raise RuntimeError(f"text vector {m} is not known yet (the scheduler's output limit was not kept)")
        return self.tts_pad

    @staticmethod
    def _dtype(talker: Talker) -> torch.dtype:
        return talker.codec_head.weight.dtype

