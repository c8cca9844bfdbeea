"""Tiny Qwen3-Omni configs in the checkpoint's config.json format (for tests, benches and dummy runs).

`tiny_config_dict()` builds the smallest full model (thinker with audio + vision towers and a 2-layer MoE
decoder, talker with shared-expert MoE + code predictor, code2wav) with every special id remapped into
the tiny vocabularies. The same dict feeds `transformers.Qwen3OmniMoeConfig(**d)` and
`Qwen3OmniConfig.from_hf_dict(d)`. A whole greedy turn runs on one CPU thread in well under a second.
"""

from __future__ import annotations

from typing import Any

# Thinker vocabulary layout: ids 100..114 are the chat / multimodal specials, "\n" is 10.
TINY_TEXT_VOCAB = 160
TINY_IDS: dict[str, int] = {
    "im_start": 100, "im_end": 101, "system": 102, "user": 103, "assistant": 104,
    "tts_pad": 105, "tts_bos": 106, "tts_eos": 107,
    "audio": 108, "image": 109, "video": 110, "audio_start": 111, "vision_start": 112,
    "vision_end": 113, "audio_end": 114,
}
TINY_NUM_CODE_GROUPS = 4  # talker num_code_groups == code2wav num_quantizers (released: 16)
TINY_CODEBOOK = 32  # code predictor vocab == code2wav codebook_size (released: 2048)
# NOTE: HF generate() suppresses talker ids [vocab - 1024, vocab) except codec_eos, so the talker vocab is
# 1024 + codebook and the codec control ids sit in that top range (released vocab 3072, ids 2148..).
TINY_TALKER_VOCAB = 1024 + TINY_CODEBOOK
TINY_CODEC_IDS: dict[str, int] = {
    "pad": 1040, "bos": 1041, "eos": 1042, "nothink": 1043, "think_bos": 1044, "think_eos": 1045,
}
TINY_SPEAKERS: dict[str, int] = {"ethan": 1050, "chelsie": 1051}

_THINKER_HIDDEN, _TALKER_HIDDEN = 32, 16
_MROPE = {"mrope_section": [2, 1, 1], "rope_type": "default", "interleaved": True, "rope_theta": 1e6}


def tiny_config_dict(is_full_rate: bool = False) -> dict[str, Any]:
    """A fresh dict each call (callers may edit it).

    `is_full_rate`: the vocoder upsamples like the released one (1,920 samples per frame, 80 ms at 24 kHz)
    instead of 8 samples per frame, so a reply is as long in audio as the released model's for as many
    frames: what a load test's playback and underrun figures need (at 8 samples per frame 50 frames are
    17 ms of audio, and any player starves). Only the vocoder's upsampling layers differ."""
    ids = TINY_IDS
    multimodal_ids = {
        "audio_token_id": ids["audio"], "image_token_id": ids["image"], "video_token_id": ids["video"],
        "audio_start_token_id": ids["audio_start"], "vision_start_token_id": ids["vision_start"],
        "position_id_per_seconds": 13,
    }
    thinker = {
        "audio_config": {
            "d_model": 16, "encoder_attention_heads": 2, "encoder_ffn_dim": 32, "encoder_layers": 1,
            "num_mel_bins": 16, "downsample_hidden_size": 8, "output_dim": _THINKER_HIDDEN,
            "n_window": 50, "n_window_infer": 200,
        },
        "vision_config": {
            "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 1, "temporal_patch_size": 2, "out_hidden_size": _THINKER_HIDDEN,
            "deepstack_visual_indexes": [0], "num_position_embeddings": 16,
        },
        "text_config": {
            "vocab_size": TINY_TEXT_VOCAB, "hidden_size": _THINKER_HIDDEN, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "rope_parameters": dict(_MROPE), "max_position_embeddings": 512,
        },
        **multimodal_ids,
        "user_token_id": ids["user"],
        # NOTE: undeclared in Qwen3OmniMoeThinkerConfig but read by HF get_rope_index() during generate().
        "vision_end_token_id": ids["vision_end"], "audio_end_token_id": ids["audio_end"],
    }
    talker = {
        "text_config": {
            "vocab_size": TINY_TALKER_VOCAB, "hidden_size": _TALKER_HIDDEN, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            # NOTE: not a declared HF field, but the talker's shared expert needs it.
            "shared_expert_intermediate_size": 16,
            "rope_parameters": dict(_MROPE), "max_position_embeddings": 512,
        },
        "code_predictor_config": {
            "vocab_size": TINY_CODEBOOK, "hidden_size": _TALKER_HIDDEN, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "num_code_groups": TINY_NUM_CODE_GROUPS, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        },
        "num_code_groups": TINY_NUM_CODE_GROUPS, "thinker_hidden_size": _THINKER_HIDDEN,
        "accept_hidden_layer": 1,
        "codec_eos_token_id": TINY_CODEC_IDS["eos"], "codec_pad_id": TINY_CODEC_IDS["pad"],
        "codec_bos_id": TINY_CODEC_IDS["bos"], "codec_nothink_id": TINY_CODEC_IDS["nothink"],
        "codec_think_bos_id": TINY_CODEC_IDS["think_bos"], "codec_think_eos_id": TINY_CODEC_IDS["think_eos"],
        "speaker_id": dict(TINY_SPEAKERS),
        **multimodal_ids,
        "spatial_merge_size": 1,
    }
    code2wav = {
        "codebook_size": TINY_CODEBOOK, "num_quantizers": TINY_NUM_CODE_GROUPS, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "sliding_window": 8, "decoder_dim": 16,
        "upsample_rates": [8, 5, 4, 3] if is_full_rate else [2, 2],
        "upsampling_ratios": [2, 2] if is_full_rate else [2],
        "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }
    return {
        "model_type": "qwen3_omni_moe",
        "thinker_config": thinker,
        "talker_config": talker,
        "code2wav_config": code2wav,
        "enable_audio_output": True,
        "im_start_token_id": ids["im_start"], "im_end_token_id": ids["im_end"],
        "system_token_id": ids["system"], "user_token_id": ids["user"], "assistant_token_id": ids["assistant"],
        "tts_pad_token_id": ids["tts_pad"], "tts_bos_token_id": ids["tts_bos"], "tts_eos_token_id": ids["tts_eos"],
    }


def tiny_prompt_ids(num_user_text: int = 6, num_audio_tokens: int = 0) -> list[int]:
    """`<|im_start|>user\\n [audio block] text <|im_end|>\\n<|im_start|>assistant\\n` in the tiny vocabulary."""
    ids = TINY_IDS
    audio = (
        [ids["audio_start"]] + [ids["audio"]] * num_audio_tokens + [ids["audio_end"]] if num_audio_tokens else []
    )
    user = [ids["im_start"], ids["user"], 10, *audio, *range(20, 20 + num_user_text), ids["im_end"], 10]
    return user + [ids["im_start"], ids["assistant"], 10]
