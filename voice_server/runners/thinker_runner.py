"""`ThinkerRunner`: the Qwen3-Omni thinker on the AR core (the `DecoderRunner` step loop).

What it adds to a text decoder:
- Audio prompts: a NEW payload may carry `audio_embeds` [N, H] (from the encoder stage, through
  the relay) for the N audio placeholders of its `token_ids`, in order. Rows at placeholder positions
  are fed those embeddings; the prefix cache stops at the first placeholder (the ids of different
  clips are the same, their keys and values are not).
- The Talker feed, when the stage streams to a talker (`feeds_talker`): every sampled token streams
  with a `FeedChunk` under `_talker` (`voice_server/runners/feed_chunk.py`): its input embedding [1, H],
  which the talker projects as trailing text, the first also with the prompt (`PromptFeed`: its ids and
  embeddings, the hidden state at the talker's `accept_hidden_layer` at each audio position, captured
  while the prompt is computed, and tts_bos/eos/pad). The leading underscore keeps it off the client's
  outputs (the shell strips such keys from terminal outputs).

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
from voice_server.scheduling import AdmissionError, WorkItem, WorkKind
from voice_server.scheduling.contract import ARSeq

AUDIO_KEYS = ("audio_embeds", "audio_token_counts")
"""Where a token's talker feed travels in the stream payload (a `_` key: downstream stages only)."""


@dataclass
class _Prompt:
    """Per-request state: the prompt, its audio, and what the talker feed still owes."""

    token_ids: list[int]
    audio_positions: list[int] = field(default_factory=list)
    audio: torch.Tensor | None = None
    mm_hidden: torch.Tensor | None = None
    is_prompt_sent: bool = False


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
                if self.audio_token_id in admitted.payload["token_ids"]:
                    raise AdmissionError("chunk payload.token_ids: audio placeholders only in the NEW payload")
                prompt.token_ids.extend(admitted.payload["token_ids"])
            return admitted
        audio = item.payload.get("audio_embeds")
        rest = {k: v for k, v in item.payload.items() if k not in AUDIO_KEYS}
        admitted = super().admit(dataclasses.replace(item, payload=rest))
        token_ids: list[int] = admitted.payload["token_ids"]
        positions = [i for i, t in enumerate(token_ids) if t == self.audio_token_id]
        prompt = _Prompt(list(token_ids), positions)
        if positions or audio is not None:
            prompt.audio = self._check_audio(audio, len(positions))
            prompt.mm_hidden = torch.zeros_like(prompt.audio)
            admitted.payload["num_cacheable_tokens"] = positions[0]
        self.prompts[item.request_id] = prompt
        return admitted

    def _check_audio(self, audio: Any, num_placeholders: int) -> torch.Tensor:
        rows = float_rows("payload.audio_embeds", audio, self.shape.hidden_size, num_placeholders)
        return rows.to(self.device, self.dtype)

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
        audio_rows = self._audio_rows(seqs)
        if not audio_rows:
            return self.thinker.forward_paged(input_ids, positions, ctx, rows).logits
        embeds = self.thinker.model.language_model.embed_tokens(input_ids)
        for row, prompt, index in audio_rows:
            assert prompt.audio is not None
            embeds[row] = prompt.audio[index]
        out = self.thinker.forward_paged(input_ids, positions, ctx, rows, inputs_embeds=embeds,
                                         accept_hidden_layer=self.accept_hidden_layer)
        assert out.accepted_hidden is not None
        for row, prompt, index in audio_rows:
            assert prompt.mm_hidden is not None
            prompt.mm_hidden[index] = out.accepted_hidden[row]
        return out.logits

    def _audio_rows(self, seqs: tuple[ARSeq, ...]) -> list[tuple[int, _Prompt, int]]:
        """(flat row, request, audio index) of every row at an audio placeholder in this step."""
        found = []
        row = 0
        for seq in seqs:
            prompt = self.prompts.get(seq.request_id)
            end = seq.start_pos + len(seq.token_ids)
            if prompt is not None and prompt.audio_positions:
                first = bisect.bisect_left(prompt.audio_positions, seq.start_pos)
                last = bisect.bisect_left(prompt.audio_positions, end)
                found += [(row + prompt.audio_positions[i] - seq.start_pos, prompt, i) for i in range(first, last)]
            row += len(seq.token_ids)
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
                          mm_hidden, self.tts_embeds)
        return {TALKER_FEED_KEY: FeedChunk(embed, sent).to_wire()}

    def _commit(self, seq: ARSeq) -> None:
        # NOTE: the prompt counts as sent only once the step that streamed it succeeded: a step that
        # raised is re-run, and the first token must then carry the prompt again.
        prompt = self.prompts.get(seq.request_id)
        if self.feeds_talker and prompt is not None:
            prompt.is_prompt_sent = True
