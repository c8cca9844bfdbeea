"""Talker prefill for one assistant turn, laid out exactly as transformers'
`Qwen3OmniMoeForConditionalGeneration.generate` builds it (`_get_talker_user_parts`,
`_get_talker_assistant_parts` and the glue around them).

Layout: [user turns of the prompt] + 9 assistant positions. System turns (and earlier assistant turns)
are dropped. User text positions get `text_projection(thinker token embedding)`, user audio/image/video
placeholders get `hidden_projection(thinker hidden at accept_hidden_layer)`. The assistant part adds a
text stream [`<|im_start|>`, `assistant`, `\\n`, tts_pad x4, tts_bos, reply token 1] to a codec stream
[0, 0, 0, nothink, think_bos, think_eos, speaker, codec_pad, codec_bos]. Reply tokens 2.. (then tts_eos)
are the trailing text vectors the decode steps add, one per step, then tts_pad forever.
Positions are 0..L-1 on all three axes, except with images / videos: then transformers runs its M-RoPE
walk (`thinker.rope.get_rope_index`, with the talker's own ids and scales) over the talker's input ids,
so vision placeholders get their grid positions here too, float32 where a video's frame times are
fractional (int64 otherwise). Decode rows continue from the prefill's last position, one at a time
(`voice_server/models/qwen3_omni/thinker/rope.py` `continue_positions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.rope import RopeLayout, get_rope_index
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs

NUM_ASSISTANT_PREFILL = 9


@dataclass(frozen=True)
class TurnTokenIds:
    """Thinker-vocabulary ids the talker prompt layout depends on."""

    im_start: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    audio: int
    image: int
    video: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"TurnTokenIds.{name} must be >= 0, got {value}")

    @property
    def tts_special_ids(self) -> tuple[int, int, int]:
        """(tts_bos, tts_eos, tts_pad): the order `build_talker_prefill` expects their embeddings in."""
        return (self.tts_bos, self.tts_eos, self.tts_pad)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> TurnTokenIds:
        """`d` is the whole checkpoint config.json dict (top-level ids + `thinker_config`)."""
        thinker = d.get("thinker_config") or {}
        return cls(
            im_start=int(d.get("im_start_token_id", 151644)),
            system=int(d.get("system_token_id", 8948)),
            user=int(d.get("user_token_id", 872)),
            assistant=int(d.get("assistant_token_id", 77091)),
            tts_pad=int(d.get("tts_pad_token_id", 151671)),
            tts_bos=int(d.get("tts_bos_token_id", 151672)),
            tts_eos=int(d.get("tts_eos_token_id", 151673)),
            audio=int(thinker.get("audio_token_id", 151646)),
            image=int(thinker.get("image_token_id", 151655)),
            video=int(thinker.get("video_token_id", 151656)),
        )


class TalkerPrefill(NamedTuple):
    inputs_embeds: torch.Tensor  # [1, L, H] talker prefill input
    positions: torch.Tensor  # [3, 1, L] t/h/w rope positions, int64 or float32 (decode: `continue_positions`)
    trailing_text: torch.Tensor  # [1, T, H] text vector added at decode step i < T
    tts_pad: torch.Tensor  # [1, 1, H] text vector added once the trailing text ran out
    input_ids: torch.Tensor  # [1, L] HF's `talker_input_ids` (user ids, then tts_pad x 9)


def text_vector_at(prefill: TalkerPrefill, step: int) -> torch.Tensor:
    """[1, H] text vector for the talker input built after frame `step` (0 = the prefill's frame)."""
    if step < prefill.trailing_text.shape[1]:
        return prefill.trailing_text[:, step]
    return prefill.tts_pad[:, 0]


@torch.no_grad()
def build_talker_prefill(
    talker: Talker,
    ids: TurnTokenIds,
    token_ids: torch.Tensor,
    prompt_len: int,
    thinker_embed: torch.Tensor,
    thinker_hidden: torch.Tensor,
    tts_embeds: torch.Tensor,
    speaker: str,
    visual: VisualInputs | None = None,
    rope_layout: RopeLayout | None = None,
) -> TalkerPrefill:
    """Build the prefill for one sequence.

    token_ids [S]: the tokens the thinker consumed (prompt, then the reply tokens it fed back; HF never
    feeds the last generated token, so it is not part of the talker text). thinker_embed [S, D]: the
    thinker's input embeddings (multimodal features merged in); thinker_hidden [S, D]: its hidden state
    at `accept_hidden_layer`. tts_embeds [3, D]: thinker input embeddings of (tts_bos, tts_eos, tts_pad).
    With images or videos, `visual` gives their grids (its features are not read) and `rope_layout` the
    talker's placeholder ids and scales (transformers reads them from the talker's config); the positions
    are float32 when a video's frame times are fractional.
    """
    if token_ids.ndim != 1 or not token_ids.shape[0] == thinker_embed.shape[0] == thinker_hidden.shape[0]:
        raise ValueError("token_ids [S], thinker_embed [S, D] and thinker_hidden [S, D] must agree on S")
    cfg = talker.cfg
    dtype = talker.codec_head.weight.dtype
    embed, hidden = thinker_embed.to(dtype), thinker_hidden.to(dtype)
    prompt = token_ids[:prompt_len]
    positions = torch.arange(prompt_len, device=token_ids.device)
    is_multimodal = (token_ids == ids.audio) | (token_ids == ids.image) | (token_ids == ids.video)

    # Role of each prompt position = the token after the latest <|im_start|> at or before it.
    last_im_start = torch.cummax(torch.where(prompt == ids.im_start, positions, -1), dim=0).values.clamp_min(0)
    role = prompt[(last_im_start + 1).clamp_max(prompt_len - 1)]
    user_pos = positions[role == ids.user]
    user_mm = is_multimodal[user_pos]
    user_part = torch.empty(len(user_pos), cfg.hidden_size, dtype=dtype, device=embed.device)
    user_part[user_mm] = talker.hidden_projection(hidden[user_pos[user_mm]])
    user_part[~user_mm] = talker.text_projection(embed[user_pos[~user_mm]])

    is_assistant_start = (prompt[:-1] == ids.im_start) & (prompt[1:] == ids.assistant)
    if not is_assistant_start.any():
        raise ValueError("the prompt has no '<|im_start|>assistant' turn")
    start = int(torch.nonzero(is_assistant_start).flatten()[-1])
    if token_ids.shape[0] - start < 4:
        raise ValueError("the talker prefill needs the first reply token after '<|im_start|>assistant\\n'")

    tts_bos, tts_eos, tts_pad = talker.text_projection(tts_embeds.to(dtype)).unsqueeze(1).unbind(0)
    assistant = talker.text_projection(embed[start:])
    text_stream = torch.cat((assistant[:3], tts_pad.expand(4, -1), tts_bos, assistant[3:4]))
    codec_ids = torch.tensor(
        [cfg.codec_nothink_id, cfg.codec_think_bos_id, cfg.codec_think_eos_id, cfg.speaker_token_id(speaker),
         cfg.codec_pad_id, cfg.codec_bos_id],
        device=embed.device,
    )
    codec_stream = torch.cat(
        (torch.zeros(3, cfg.hidden_size, dtype=dtype, device=embed.device), talker.model.codec_embedding(codec_ids))
    )
    inputs_embeds = torch.cat((user_part, text_stream + codec_stream))[None]
    trailing = torch.cat((assistant[4:], tts_eos))[None]

    input_ids = torch.cat((token_ids[user_pos], token_ids.new_full((NUM_ASSISTANT_PREFILL,), ids.tts_pad)))[None]
    rope_positions = _talker_positions(input_ids, ids, visual, rope_layout)
    return TalkerPrefill(inputs_embeds, rope_positions, trailing, tts_pad[None], input_ids)


def _talker_positions(
    input_ids: torch.Tensor, ids: TurnTokenIds, visual: VisualInputs | None, rope_layout: RopeLayout | None
) -> torch.Tensor:
    """[3, 1, L] positions of the talker's input ids [1, L]: int64, float32 when a video's frame times are
    fractional (`get_rope_index`'s, the values transformers' float32 walk gives)."""
    grids = [] if visual is None else [g for g in (visual.image_grid_thw, visual.video_grid_thw) if g is not None]
    if not any(g.numel() for g in grids):
        if bool(((input_ids == ids.image) | (input_ids == ids.video)).any()):
            raise ValueError("the user turns have images or videos: the talker prefill needs their grids (visual)")
        # NOTE: without vision grids HF's talker positions are 0..L-1 on all three axes (audio included).
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand(3, 1, -1)
    if rope_layout is None:
        raise ValueError("image / video grids need the talker's rope_layout")
    assert visual is not None
    positions, _ = get_rope_index(input_ids, rope_layout, **visual.rope_grids())
    return positions
