"""A greedy whole turn (thinker text -> talker codes -> waveform), step by step with explicit KV caches.

This is the offline reference driver (tests, benches, a CLI demo): it reproduces transformers'
`Qwen3OmniMoeForConditionalGeneration.generate(..., thinker_do_sample=False, talker_do_sample=False)`
for one sequence, with its own frame loop (`generate_frames`). Serving runners drive the same public
pieces stage by stage instead; these loops stay only as the reference they are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.config import Qwen3OmniConfig
from voice_server.models.qwen3_omni.loading import load_part
from voice_server.models.qwen3_omni.talker.model import Talker, TalkerStepOutput
from voice_server.models.qwen3_omni.talker.prefill import (
    TalkerPrefill,
    TurnTokenIds,
    build_talker_prefill,
    text_vector_at,
)
from voice_server.models.qwen3_omni.talker.sampling import TalkerSampling
from voice_server.models.qwen3_omni.thinker.model import ThinkerModel
from voice_server.models.qwen3_omni.thinker.rope import (
    RopeLayout,
    continue_positions,
    decode_position_ids,
    get_rope_index,
)
from voice_server.models.qwen3_omni.thinker.visual import VisualInputs


@dataclass(frozen=True)
class TurnModels:
    cfg: Qwen3OmniConfig
    thinker: ThinkerModel
    talker: Talker
    code2wav: Code2Wav


@dataclass(frozen=True)
class ThinkerTurn:
    text_ids: torch.Tensor  # [1, prompt + generated] (HF `sequences`)
    consumed_ids: torch.Tensor  # [S]: tokens the thinker was fed (the last generated one never is)
    inputs_embeds: torch.Tensor  # [S, D]: its input embeddings, audio / image / video features merged in
    accepted_hidden: torch.Tensor  # [S, D]: its hidden state at the talker's accept_hidden_layer


@dataclass(frozen=True)
class TurnResult:
    text_ids: torch.Tensor  # [1, prompt + generated]
    codes: torch.Tensor  # [1, num_code_groups, num_frames]
    waveform: torch.Tensor  # [1, 1, num_samples] at the code2wav sample rate


@torch.no_grad()
def generate_frames(
    talker: Talker,
    prefill: TalkerPrefill,
    max_frames: int,
    sampling: TalkerSampling | None = None,
    generator: torch.Generator | None = None,
) -> list[TalkerStepOutput]:
    """Frames until code 0 is codec EOS (that frame is not returned) or `max_frames` frames.

    Frame i comes from talker pass i (pass 0 is the prefill); its `next_input_embeds` feeds pass i + 1, at the
    position after pass i's last (`continue_positions`: float32 after a prefill with fractional video times).
    """
    kv_cache = KVCache(len(talker.model.layers))
    code0_seen = torch.zeros(1, talker.cfg.vocab_size, dtype=torch.bool, device=prefill.inputs_embeds.device)
    inputs, positions = prefill.inputs_embeds, prefill.positions
    frames: list[TalkerStepOutput] = []
    for i in range(max_frames):
        out = talker.step(inputs, positions, kv_cache, text_vector_at(prefill, i), code0_seen, sampling, generator)
        if int(out.codes[0, 0]) == talker.cfg.codec_eos_token_id:
            break
        frames.append(out)
        inputs = out.next_input_embeds
        positions = continue_positions(positions[0, 0, -1], 1).expand(3, 1, 1)
    return frames


def turn_token_ids(cfg: Qwen3OmniConfig) -> TurnTokenIds:
    th = cfg.thinker
    return TurnTokenIds(
        im_start=cfg.im_start_token_id, system=cfg.system_token_id, user=cfg.user_token_id,
        assistant=cfg.assistant_token_id, tts_pad=cfg.tts_pad_token_id, tts_bos=cfg.tts_bos_token_id,
        tts_eos=cfg.tts_eos_token_id, audio=th.audio_token_id, image=th.image_token_id, video=th.video_token_id,
    )


def talker_rope_layout(cfg: Qwen3OmniConfig) -> RopeLayout:
    """The talker's M-RoPE layout: its own placeholder ids, the rest from the thinker's config.

    NOTE: transformers reads vision_start / audio_start, spatial_merge_size and position_id_per_seconds
    from the talker's config; `TalkerConfig` does not hold them yet, so the thinker's values stand in
    (equal in the tiny preset)."""
    th, tk = cfg.thinker, cfg.talker
    return RopeLayout(
        audio_token_id=tk.audio_token_id, image_token_id=tk.image_token_id, video_token_id=tk.video_token_id,
        audio_start_token_id=th.audio_start_token_id, vision_start_token_id=th.vision_start_token_id,
        spatial_merge_size=th.vision.spatial_merge_size, position_id_per_seconds=th.position_id_per_seconds,
        audio_n_window=th.audio.n_window,
    )


def load_turn_models(
    ckpt_dir: str | Path | None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    *,
    load_format: str = "auto",
    cfg: Qwen3OmniConfig | None = None,
    seed: int = 0,
) -> TurnModels:
    """All three parts, from a checkpoint folder (config from its config.json) or, with
    `load_format="dummy"`, seeded random weights for `cfg`. The vision tower is not built."""
    if cfg is None:
        if ckpt_dir is None:
            raise ValueError("give a checkpoint directory or a config")
        cfg = Qwen3OmniConfig.from_json_file(Path(ckpt_dir))
    parts = [load_part(p, cfg, ckpt_dir, load_format=load_format, dtype=dtype, device=device, seed=seed)
             for p in ("thinker", "talker", "code2wav")]
    thinker, talker, code2wav = parts
    assert isinstance(thinker, ThinkerModel) and isinstance(talker, Talker) and isinstance(code2wav, Code2Wav)
    return TurnModels(cfg, thinker, talker, code2wav)


@torch.no_grad()
def run_greedy_thinker(
    thinker: ThinkerModel,
    input_ids: torch.Tensor,
    accept_hidden_layer: int,
    eos_token_id: int,
    max_new_tokens: int,
    input_features: torch.Tensor | None = None,
    feature_lens: torch.Tensor | None = None,
    visual: VisualInputs | None = None,
) -> ThinkerTurn:
    """Greedy thinker decode of one sequence until `eos_token_id` (kept) or `max_new_tokens`.

    `visual`: the prompt's images / videos as the vision tower gave them (`VisualInputs.encode`)."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, L], got {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    audio = None
    if input_features is not None:
        if feature_lens is None:
            raise ValueError("input_features needs feature_lens")
        audio = thinker.encode_audio(input_features, feature_lens)
    kv_cache = KVCache(thinker.cfg.text.num_hidden_layers)
    grids = {} if visual is None else visual.rope_grids()
    positions, deltas = get_rope_index(input_ids, thinker.cfg, audio_feature_lens=feature_lens, **grids)
    out = thinker(
        input_ids, positions, kv_cache, audio_embeds=audio, accept_hidden_layer=accept_hidden_layer, visual=visual
    )
    embeds, hiddens, generated = [out.inputs_embeds[0]], [out.accepted_hidden], []
    for step in range(max_new_tokens):
        next_id = out.logits[:, -1].float().argmax(-1, keepdim=True)  # [1, 1]
        generated.append(next_id)
        if int(next_id) == eos_token_id or step == max_new_tokens - 1:
            break
        if positions.is_floating_point():
            # NOTE: fractional video times: each row the one before + 1 in float32, as transformers' generate
            # appends them (`cache_len + delta` rounds once and drifts an ulp away on long prompts).
            positions = continue_positions(positions[0, 0, -1], 1).expand(3, 1, 1)
        else:
            positions = decode_position_ids(kv_cache.seq_len, 1, deltas)
        out = thinker(next_id, positions, kv_cache, accept_hidden_layer=accept_hidden_layer)
        embeds.append(out.inputs_embeds[0])
        hiddens.append(out.accepted_hidden)
    text_ids = torch.cat([input_ids, *generated], dim=1)
    accepted = torch.cat([h[0] for h in hiddens if h is not None])
    return ThinkerTurn(text_ids, text_ids[0, :-1], torch.cat(embeds), accepted)


@torch.no_grad()
def chunked_decode(
    code2wav: Code2Wav, codes: torch.Tensor, chunk_size: int = 300, left_context_size: int = 25
) -> torch.Tensor:
    """codes [B, G, T] -> PCM [B, 1, samples], decoding `chunk_size` frames at a time with up to
    `left_context_size` frames of left context whose samples are dropped (HF `chunked_decode`)."""
    wavs = []
    start = 0
    while start < codes.shape[-1]:
        end = min(start + chunk_size, codes.shape[-1])
        context = left_context_size if start - left_context_size > 0 else start
        wav = code2wav(codes[..., start - context : end])
        wavs.append(wav[..., context * code2wav.total_upsample :])
        start = end
    if not wavs:
        return codes.new_zeros((codes.shape[0], 1, 0), dtype=torch.float32)
    return torch.cat(wavs, dim=-1)


@torch.no_grad()
def run_greedy_turn(
    models: TurnModels,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    max_codec_frames: int,
    input_features: torch.Tensor | None = None,
    feature_lens: torch.Tensor | None = None,
    speaker: str = "ethan",
    eos_token_id: int | None = None,
    visual: VisualInputs | None = None,
) -> TurnResult:
    """One greedy turn for input_ids [1, L] (the chat prompt ending in `<|im_start|>assistant\\n`).

    Audio input: `input_features` packed log-mel [num_mel_bins, sum(feature_lens)] (`MelFeatures.packed`)
    and `feature_lens` [num_clips], with matching audio blocks in the prompt. Images / videos: `visual`
    (`VisualInputs.encode` with the vision tower), with matching blocks in the prompt. The thinker stops at
    `eos_token_id` (default `<|im_end|>`); the talker at codec EOS or after `max_codec_frames` full frames
    (HF's `talker_max_new_tokens` = max_codec_frames + 1, since its last token never gets its residual codes).
    """
    cfg = models.cfg
    eos = cfg.im_end_token_id if eos_token_id is None else eos_token_id
    turn = run_greedy_thinker(
        models.thinker, input_ids, cfg.talker.accept_hidden_layer, eos, max_new_tokens, input_features, feature_lens,
        visual,
    )
    special = torch.tensor(turn_token_ids(cfg).tts_special_ids, device=input_ids.device)
    tts_embeds = models.thinker.model.language_model.embed_tokens(special)
    prefill = build_talker_prefill(
        models.talker, turn_token_ids(cfg), turn.consumed_ids, input_ids.shape[1], turn.inputs_embeds,
        turn.accepted_hidden, tts_embeds, speaker, visual, talker_rope_layout(cfg),
    )
    frames = generate_frames(models.talker, prefill, max_codec_frames, TalkerSampling())
    num_groups = cfg.talker.num_code_groups
    if frames:
        codes = torch.stack([f.codes for f in frames], dim=-1)  # [1, G, T]
    else:
        codes = torch.zeros(1, num_groups, 0, dtype=torch.long, device=input_ids.device)
    return TurnResult(turn.text_ids, codes, chunked_decode(models.code2wav, codes))
