"""The tiny Qwen3-Omni thinker and talker (seeded dummy weights) and the thinker's stream as `ThinkerRunner`
sends it to the talker, for in-process `TalkerRunner` tests (tests/runners/test_talker_runner.py,
tests/runners/test_talker_voices.py)."""

from __future__ import annotations

from typing import Any

import torch

from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.presets import tiny_config_dict
from voice_server.models.qwen3_omni.talker.model import Talker
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.turn import ThinkerTurn
from voice_server.runners.feed_chunk import TALKER_FEED_KEY

CFG = Qwen3OmniConfig.from_hf_dict(tiny_config_dict())


def models() -> tuple[ThinkerModel, Talker]:
    thinker = load_part("thinker", CFG, load_format="dummy", seed=3)
    talker = load_part("talker", CFG, load_format="dummy", seed=3)
    assert isinstance(thinker, ThinkerModel) and isinstance(talker, Talker)
    return thinker, talker


def thinker_chunks(thinker: ThinkerModel, turn: ThinkerTurn, prompt_len: int) -> list[dict[str, Any]]:
    """What `ThinkerRunner` streams for this turn: per reply token its embedding, the first with the prompt."""
    embed = thinker.model.language_model.embed_tokens
    prompt = turn.text_ids[0, :prompt_len]
    reply = turn.text_ids[0, prompt_len:].tolist()
    tts = torch.tensor([CFG.tts_bos_token_id, CFG.tts_eos_token_id, CFG.tts_pad_token_id])
    chunks: list[dict[str, Any]] = []
    with torch.no_grad():
        for k, token in enumerate(reply):
            feed: dict[str, Any] = {"embed": embed(torch.tensor([token]))}
            if k == 0:
                feed.update(prompt_ids=prompt.tolist(), prompt_embeds=embed(prompt),
                            mm_hidden=torch.zeros(0, CFG.thinker.text.hidden_size), tts_embeds=embed(tts))
            chunks.append({"token_ids": [token], TALKER_FEED_KEY: feed})
    return chunks

