"""Whisper-style audio encoder of the Qwen3-Omni thinker (HF `Qwen3OmniMoeAudioEncoder`, `thinker.audio_tower`).

Mel frames are cut into 1 s chunks (2 * n_window frames), each chunk goes through three stride-2 convs
(100 frames -> 13 tokens), the tokens of one clip are re-joined and attend to each other inside windows
of n_window_infer frames (8 chunks = 104 tokens in the release), then `ln_post -> proj1 -> GELU -> proj2`.
Parameter names equal the transformers in-memory names; no buffers, so meta-device construction is safe.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from voice_server.models.qwen3_omni.thinker.config import AudioEncoderConfig
from voice_server.models.shapes import FLOATING, INTEGER, expect_shapes


def conv_output_lengths(num_frames: torch.Tensor, n_window: int = 50) -> torch.Tensor:
    """Audio tokens produced from `num_frames` mel frames (HF `_get_feat_extract_output_lengths`): 13 per
    full 100-frame chunk plus three stride-2 halvings of the remainder."""
    chunk_len = n_window * 2
    tail = num_frames % chunk_len
    tail_len = (tail - 1) // 2 + 1
    tail_len = ((tail_len - 1) // 2 + 1 - 1) // 2 + 1
    return tail_len + (num_frames // chunk_len) * 13


def num_audio_tokens(num_frames: int, n_window: int = 50) -> int:
    """How many audio placeholder tokens a clip of `num_frames` mel frames needs in the prompt."""
    return int(conv_output_lengths(torch.tensor(num_frames), n_window))


def sinusoid_positions(num_positions: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Rows [0, num_positions) of the Whisper sinusoid table, [num_positions, channels] fp32."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(num_positions)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class AudioAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: torch.Tensor, window_lens: list[int]) -> torch.Tensor:
        """x [N, D] (all tokens of all clips); full attention inside each window, none across."""
        n = x.shape[0]
        q, k, v = (
            proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        outs = [
            F.scaled_dot_product_attention(qw, kw, vw)
            for qw, kw, vw in zip(q.split(window_lens, 1), k.split(window_lens, 1), v.split(window_lens, 1))
        ]
        return self.out_proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, -1))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.self_attn = AudioAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def forward(self, x: torch.Tensor, window_lens: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), window_lens)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    # NOTE: the reference convolves at most this many chunks at once to bound memory; same result.
    conv_chunksize = 500

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        freq_after_conv = (((cfg.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2
        self.conv_out = nn.Linear(hidden * freq_after_conv, cfg.d_model, bias=False)
        self.layers = nn.ModuleList([AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)

    def chunk_lengths(self, feature_lens: torch.Tensor) -> torch.Tensor:
        """Frames of every conv chunk, clip after clip: full chunks then the remainder (if any)."""
        chunk_len = 2 * self.cfg.n_window
        lens: list[int] = []
        for n in feature_lens.tolist():
            lens += [chunk_len] * (n // chunk_len) + ([n % chunk_len] if n % chunk_len else [])
        return torch.tensor(lens, dtype=torch.long)

    def window_lens(self, feature_lens: torch.Tensor, padded_chunk_len: int) -> list[int]:
        """Token counts of the attention windows, clip after clip (HF `get_audio_cu_seqlens`)."""
        n_window = self.cfg.n_window
        # NOTE: the window is sized from the padded conv chunk (the longest of the call), as the reference does.
        tokens_per_chunk = int(conv_output_lengths(torch.tensor(padded_chunk_len), n_window))
        window = tokens_per_chunk * (self.cfg.n_window_infer // (2 * n_window))
        lens: list[int] = []
        for num_tokens in conv_output_lengths(feature_lens, n_window).tolist():
            lens += [window] * (num_tokens // window) + ([num_tokens % window] if num_tokens % window else [])
        return lens

    def forward(
        self, input_features: torch.Tensor, feature_lens: torch.Tensor, *, chunk_pad_len: int | None = None
    ) -> torch.Tensor:
        """input_features [num_mel_bins, sum(feature_lens)] (clips packed along time, see
        `MelFeatures.packed`), feature_lens [num_clips] -> audio tokens [sum(num_audio_tokens), output_dim].

        Conv chunks are zero-padded to the longest chunk of the call (the reference), or to at least
        `chunk_pad_len` frames. NOTE: the padding is not masked between the convs (GELU(bias) != 0),
        so a partial chunk's last tokens depend on the padded length: a full chunk (2 * n_window)
        makes every clip's tokens independent of the other clips of the call."""
        expect_shapes(
            ("input_features", input_features, "[num_mel_bins, T]", FLOATING),
            ("feature_lens", feature_lens, "[num_clips]", INTEGER), dims={"num_mel_bins": self.cfg.num_mel_bins},
        )
        if input_features.shape[1] != int(feature_lens.sum()):
            raise ValueError(
                f"input_features has {input_features.shape[1]} frames but feature_lens sum to {int(feature_lens.sum())}"
            )
        chunk_lens = self.chunk_lengths(feature_lens.cpu())
        chunks = input_features.T.split(chunk_lens.tolist(), dim=0)
        padded = nn.utils.rnn.pad_sequence(list(chunks), batch_first=True).transpose(1, 2)  # [C, mels, T]
        if chunk_pad_len is not None and padded.shape[-1] < chunk_pad_len:
            padded = F.pad(padded, (0, chunk_pad_len - padded.shape[-1]))
        padded = padded.unsqueeze(1).to(self.conv2d1.weight.dtype)
        embeds = []
        for group in padded.split(self.conv_chunksize, dim=0):
            h = F.gelu(self.conv2d1(group))
            h = F.gelu(self.conv2d2(h))
            embeds.append(F.gelu(self.conv2d3(h)))
        h = torch.cat(embeds, dim=0)
        num_chunks, channels, freq, frames = h.shape
        h = self.conv_out(h.permute(0, 3, 1, 2).reshape(num_chunks, frames, channels * freq))
        h = h + sinusoid_positions(frames, self.cfg.d_model).to(h.device, h.dtype)[None]
        tokens_per_chunk = conv_output_lengths(chunk_lens, self.cfg.n_window).to(h.device)
        valid = torch.arange(frames, device=h.device)[None, :] < tokens_per_chunk[:, None]
        x = h[valid]  # [N, d_model], chunk-major as the reference's index_select
        window_lens = self.window_lens(feature_lens.cpu(), padded.shape[-1])
        for layer in self.layers:
            x = layer(x, window_lens)
        return self.proj2(F.gelu(self.proj1(self.ln_post(x))))
