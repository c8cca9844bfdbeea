"""Multimodal RoPE positions of the Qwen3-Omni thinker: 3-axis (t, h, w), interleaved (see `mrope.py`).

Positions for text + audio follow transformers' `get_rope_index`: audio tokens advance the position by one
each, like text, so a text + audio prompt gets `0 .. n-1` on all three axes (vision is not built here, and
`position_id_per_seconds` only scales video time). Decode steps continue at `cache_len + rope_delta`.
"""

from __future__ import annotations

import torch

from voice_server.models.qwen3_omni.audio.encoder import num_audio_tokens
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig


def _check_audio_blocks(tokens: list[int], audio_lens: list[int], cfg: ThinkerConfig) -> int:
    """Check that each `audio_start` is followed by as many audio placeholders as its clip yields;
    return how many clips this row used."""
    used = 0
    for i, tok in enumerate(tokens):
        if tok != cfg.audio_start_token_id:
            continue
        run = 0
        while i + 1 + run < len(tokens) and tokens[i + 1 + run] == cfg.audio_token_id:
            run += 1
        if used >= len(audio_lens):
            raise ValueError("the prompt has more audio blocks than audio clips were given")
        if run != audio_lens[used]:
            raise ValueError(f"audio block {used} has {run} placeholder tokens, its clip needs {audio_lens[used]}")
        used += 1
    return used


def get_rope_index(
    input_ids: torch.Tensor,
    cfg: ThinkerConfig,
    attention_mask: torch.Tensor | None = None,
    audio_feature_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, B, L] (int64) and rope deltas [B, 1] for a text + audio prompt.

    `audio_feature_lens` are the mel frame counts of the clips, in prompt order; when given, each audio
    block's placeholder count is checked against it. Padding (`attention_mask` == 0) gets position 1,
    as in the reference.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if audio_feature_lens is not None:
        audio_lens = [num_audio_tokens(int(n), cfg.audio.n_window) for n in audio_feature_lens.tolist()]
        used = 0
        for row, mask in zip(input_ids.tolist(), attention_mask.bool().tolist()):
            used += _check_audio_blocks(
                [t for t, m in zip(row, mask) if m], audio_lens[used:], cfg
            )
        if used != len(audio_lens):
            raise ValueError(f"{len(audio_lens)} audio clips were given but the prompt has {used} audio blocks")
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 1)
    deltas = positions.max(dim=-1, keepdim=True).values + 1 - attention_mask.long().sum(-1, keepdim=True)
    return positions[None].expand(3, -1, -1), deltas


def decode_position_ids(past_len: int | torch.Tensor, num_tokens: int, rope_deltas: torch.Tensor) -> torch.Tensor:
    """Positions [3, B, num_tokens] of tokens appended after `past_len` earlier tokens: the cache length,
    or for a left-padded batch the per-row count [B] of real (unpadded) earlier tokens, as HF counts them."""
    past = torch.as_tensor(past_len, device=rope_deltas.device).reshape(-1, 1)
    steps = past + torch.arange(num_tokens, device=rope_deltas.device)[None, :]
    return (steps + rope_deltas)[None].expand(3, -1, -1)
