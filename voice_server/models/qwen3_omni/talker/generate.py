"""A plain frame loop over `Talker.step` for tests, benches and offline use (runners drive `step` themselves)."""

from __future__ import annotations

import torch

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.talker.model import Talker, TalkerStepOutput
from voice_server.models.qwen3_omni.talker.prefill import TalkerPrefill, text_vector_at
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling


@torch.no_grad()
def generate_frames(
    talker: Talker,
    prefill: TalkerPrefill,
    max_frames: int,
    sampling: TalkerSampling | None = None,
    generator: torch.Generator | None = None,
) -> list[TalkerStepOutput]:
    """Frames until code 0 is codec EOS (that frame is not returned) or `max_frames` frames.

    Frame i comes from talker pass i (pass 0 is the prefill); its `next_input_embeds` feeds pass i + 1.
    """
    kv_cache = KVCache(len(talker.model.layers))
    code0_seen = torch.zeros(1, talker.cfg.vocab_size, dtype=torch.bool, device=prefill.inputs_embeds.device)
    inputs, positions = prefill.inputs_embeds, prefill.positions
    next_pos = int(positions.max()) + 1
    frames: list[TalkerStepOutput] = []
    for i in range(max_frames):
        out = talker.step(inputs, positions, kv_cache, text_vector_at(prefill, i), code0_seen, sampling, generator)
        if int(out.codes[0, 0]) == talker.cfg.codec_eos_token_id:
            break
        frames.append(out)
        inputs = out.next_input_embeds
        positions = torch.full((3, 1, 1), next_pos + i, device=inputs.device)
    return frames
