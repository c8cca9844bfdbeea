"""`ThinkerRunner`: the Qwen3-Omni thinker on the AR core (the `DecoderRunner` step loop).

What it adds to a text decoder:
- Audio prompts: a NEW payload may carry `audio_embeds` [N, H] (from the encoder stage, through
  the relay) for the N audio placeholders of its `token_ids`, in order.
- Image and video prompts: `visual_embeds`, `visual_deepstack` and the grids (the encoder stage's
  contract: `voice_server/runners/encoder_runner.py`), checked and turned into the prompt's M-RoPE
  positions once at admission (`voice_server/runners/thinker_visual.py`). A step holding such a prompt
  runs on [3, T] positions (the prompt's rows at theirs, later rows at `p + delta`) and adds the DeepStack
  features of its image / video rows; a step without one runs exactly as a text decoder's.
- Rows at audio, image and video placeholders (the multimodal rows) are fed their embeddings; the prefix
  cache stops at the first of them (the ids of different clips or images are the same, their keys and
  values are not).
- The Talker feed, when the stage streams to a talker (`feeds_talker`): every sampled token streams
  with a `FeedChunk` under `_talker` (`voice_server/runners/feed_chunk.py`): its input embedding [1, H],
  which the talker projects as trailing text, the first also with the prompt (`PromptFeed`: its ids and
  embeddings, the hidden state at the talker's `accept_hidden_layer` at each multimodal row, captured
  while the prompt is computed, the image / video grids, and tts_bos/eos/pad). The leading underscore
  keeps it off the client's outputs (the shell strips such keys from terminal outputs).

Text-and-audio prompts have M-RoPE positions 0..n-1 on all three axes (`thinker/rope.py`), so the
flat positions of the paged context are the model's positions.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from voice_server.models.llama import GGUFTokenizer
from voice_server.models.paged import AttentionContext
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.runners.ar_config import DecoderRunnerConfig, DecoderShape
from voice_server.runners.ar_runner import DecoderRunner
from voice_server.runners.feed_chunk import TALKER_FEED_KEY, FeedChunk, PromptFeed
from voice_server.runners.payload import float_rows
from voice_server.runners.thinker_visual import (
    VISUAL_KEYS,
    PromptVision,
    StepSpan,
    admit_vision,
    step_deepstack,
    step_positions,
)
from voice_server.scheduling import AdmissionError, WorkItem, WorkKind
from voice_server.scheduling.contract import ARSeq

AUDIO_KEYS = ("audio_embeds", "audio_token_counts")


@dataclass
class _Prompt:
    """Per-request state: the prompt, its multimodal rows, and what the talker feed still owes."""

    token_ids: list[int]
    mm_positions: list[int] = field(default_factory=list)
    """Prompt positions of the audio, image and video placeholders, in order."""
    mm_embeds: torch.Tensor | None = None
    """[N, H]: what those rows are fed."""
    mm_hidden: torch.Tensor | None = None
    vision: PromptVision | None = None
    is_prompt_sent: bool = False


@dataclass(frozen=True)
class _MMRows:
    """The multimodal rows one sequence has in a step: flat `rows` of the step, prompt rows [first, last)."""

    prompt: _Prompt
    rows: torch.Tensor
    first: int
    last: int


def thinker_shape(cfg: Qwen3OmniConfig) -> DecoderShape:
    text = cfg.thinker.text
    return DecoderShape(
        num_layers=text.num_hidden_layers, num_kv_heads=text.num_key_value_heads, head_dim=text.head_dim,
        hidden_size=text.hidden_size,
        intermediate_size=max(text.intermediate_size, text.moe_intermediate_size * text.num_experts_per_tok),
        vocab_size=text.vocab_size, max_position_embeddings=text.max_position_embeddings,
        eos_token_ids=(cfg.im_end_token_id,),
    )


class ThinkerRunner(DecoderRunner):
    def __init__(
        self, model: ThinkerModel, cfg: Qwen3OmniConfig, config: DecoderRunnerConfig, feeds_talker: bool,
        tokenizer: GGUFTokenizer | None = None,
    ) -> None:
        text = model.model.language_model
        super().__init__(model, tokenizer, config, thinker_shape(cfg), norm_weight=text.norm.weight)
        self.thinker, self.omni_cfg, self.feeds_talker = model, cfg, feeds_talker
        self.accept_hidden_layer = cfg.talker.accept_hidden_layer
        self.audio_token_id = cfg.thinker.audio_token_id
        self.placeholder_ids = (cfg.thinker.audio_token_id, cfg.thinker.image_token_id, cfg.thinker.video_token_id)
        self.prompts: dict[str, _Prompt] = {}
        ids = [cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]
        with torch.inference_mode():
            self.tts_embeds = text.embed_tokens(torch.tensor(ids, device=self.device))

    # -- admission -----------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW or not isinstance(item.payload, dict):
            admitted = super().admit(item)
            prompt = self.prompts.get(item.request_id)
            if prompt is not None and item.kind is WorkKind.CHUNK:
                # NOTE: streamed prompt text: placeholders need embeddings, which chunks cannot bring.
                if any(t in self.placeholder_ids for t in admitted.payload["token_ids"]):
                    raise AdmissionError("chunk payload.token_ids: audio, image and video placeholders only in "
                                         "the NEW payload")
                prompt.token_ids.extend(admitted.payload["token_ids"])
            return admitted
        audio = item.payload.get("audio_embeds")
        visual = {k: item.payload[k] for k in VISUAL_KEYS if k in item.payload}
        rest = {k: v for k, v in item.payload.items() if k not in AUDIO_KEYS and k not in VISUAL_KEYS}
        admitted = super().admit(dataclasses.replace(item, payload=rest))
        token_ids: list[int] = admitted.payload["token_ids"]
        prompt = _Prompt(list(token_ids))
        prompt.vision = admit_vision(visual, token_ids, self.omni_cfg.thinker, self.device, self.dtype)
        audio_positions = [i for i, t in enumerate(token_ids) if t == self.audio_token_id]
        audio_rows = None
        if audio_positions or audio is not None:
            audio_rows = self._check_audio(audio, len(audio_positions))
        self._merge_rows(prompt, audio_positions, audio_rows)
        if prompt.mm_positions:
            admitted.payload["num_cacheable_tokens"] = prompt.mm_positions[0]
        self.prompts[item.request_id] = prompt
        return admitted

    def _check_audio(self, audio: Any, num_placeholders: int) -> torch.Tensor:
        rows = float_rows("payload.audio_embeds", audio, self.shape.hidden_size, num_placeholders)
        return rows.to(self.device, self.dtype)

    def _merge_rows(self, prompt: _Prompt, audio_positions: list[int], audio: torch.Tensor | None) -> None:
        """The prompt's multimodal rows in row order: the audio rows and the image / video rows."""
        vision = prompt.vision
        if vision is None:
            if audio is None:
                return
            prompt.mm_positions, prompt.mm_embeds = audio_positions, audio
        else:
            prompt.mm_positions = sorted(audio_positions + vision.rows)
            audio_set = set(audio_positions)
            is_audio = torch.tensor([p in audio_set for p in prompt.mm_positions], device=self.device)
            prompt.mm_embeds = vision.embeds.new_empty(len(prompt.mm_positions), vision.embeds.shape[1])
            if audio is not None:
                prompt.mm_embeds[is_audio] = audio
            prompt.mm_embeds[~is_audio] = vision.embeds
        prompt.mm_hidden = torch.zeros_like(prompt.mm_embeds)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self.prompts.pop(request_id, None)

    # -- the step -------------------------------------------------------------------------------------

    def _forward(
        self,
        seqs: tuple[ARSeq, ...],
        ids: list[int],
        positions: torch.Tensor,
        ctx: AttentionContext,
        logits_rows: list[int],
    ) -> torch.Tensor:
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        spans = self._spans(seqs)
        mm_rows = self._mm_rows(spans, seqs)
        is_vision = any(s.vision is not None for s in spans)
        if not mm_rows and not is_vision:
            return self.thinker.forward_paged(input_ids, positions, ctx, rows).logits
        embeds = None
        if mm_rows:
            embeds = self.thinker.model.language_model.embed_tokens(input_ids)
            for part in mm_rows:
                assert part.prompt.mm_embeds is not None
                embeds[part.rows] = part.prompt.mm_embeds[part.first:part.last]
        deepstack = None
        if is_vision:
            positions, deepstack = step_positions(positions, spans), step_deepstack(spans)
        out = self.thinker.forward_paged(input_ids, positions, ctx, rows, inputs_embeds=embeds,
                                         accept_hidden_layer=self.accept_hidden_layer if mm_rows else None,
                                         deepstack=deepstack)
        for part in mm_rows:
            assert part.prompt.mm_hidden is not None and out.accepted_hidden is not None
            part.prompt.mm_hidden[part.first:part.last] = out.accepted_hidden[part.rows]
        return out.logits

    def _spans(self, seqs: tuple[ARSeq, ...]) -> list[StepSpan]:
        spans, row = [], 0
        for seq in seqs:
            prompt = self.prompts.get(seq.request_id)
            end = seq.start_pos + len(seq.token_ids)
            spans.append(StepSpan(row, seq.start_pos, end, None if prompt is None else prompt.vision))
            row += len(seq.token_ids)
        return spans

    def _mm_rows(self, spans: list[StepSpan], seqs: tuple[ARSeq, ...]) -> list[_MMRows]:
        """Each sequence's rows at multimodal placeholders in this step."""
        found = []
        for span, seq in zip(spans, seqs):
            prompt = self.prompts.get(seq.request_id)
            if prompt is None or not prompt.mm_positions:
                continue
            first = bisect.bisect_left(prompt.mm_positions, span.start)
            last = bisect.bisect_left(prompt.mm_positions, span.end)
            if first < last:
                rows = [span.row + p - span.start for p in prompt.mm_positions[first:last]]
                found.append(_MMRows(prompt, torch.tensor(rows, device=self.device), first, last))
        return found

    def _output_data(self, seq: ARSeq, token: int) -> dict[str, Any]:
        if not self.feeds_talker:
            return {}
        embed_tokens = self.thinker.model.language_model.embed_tokens
        embed = embed_tokens(torch.tensor([token], device=self.device))
        prompt = self.prompts.get(seq.request_id)
        if prompt is None or prompt.is_prompt_sent:
            return {TALKER_FEED_KEY: FeedChunk(embed).to_wire()}
        mm_hidden = prompt.mm_hidden if prompt.mm_hidden is not None \
            else torch.zeros(0, self.shape.hidden_size, dtype=self.dtype, device=self.device)
        sent = PromptFeed(list(prompt.token_ids), embed_tokens(torch.tensor(prompt.token_ids, device=self.device)),
                          mm_hidden, self.tts_embeds, None if prompt.vision is None else prompt.vision.grids)
        return {TALKER_FEED_KEY: FeedChunk(embed, sent).to_wire()}

    def _commit(self, seq: ARSeq) -> None:
        # NOTE: the prompt counts as sent only once the step that streamed it succeeded: a step that
        # raised is re-run, and the first token must then carry the prompt again.
        prompt = self.prompts.get(seq.request_id)
        if self.feeds_talker and prompt is not None:
            prompt.is_prompt_sent = True
