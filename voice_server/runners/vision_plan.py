"""The vision tower's activation memory, and the forwards a batch of images and videos runs in to stay
inside the encoder stage's activation budget. Torch-free: the numbers come from the config and the grids.

Why a budget of its own: a vision forward's activations grow with its patches (tens of kB each at the
released sizes), so a long video or one large image needs many times the tower's ~1 GiB of bf16 weights.
A stage budget that counts weights (and KV) alone would let one request exhaust the device.

`peak_activation_bytes` is the formula; `plan_forwards` packs a batch's frames (a frame is one temporal
patch group of an item: an image is one, a video `t`) into forwards, each within the budget, splitting a
video along time where needed. Frames never attend to each other in the tower, so a video split into
pieces and concatenated equals the video run whole (`tests/runners/test_vision_encoder_runner.py`); the
formula is checked against measured peaks in `tests/runners/test_vision_budget.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from voice_server.models.qwen3_omni.vision.config import VisionEncoderConfig

Grid = tuple[int, int, int]  # (t, h, w): temporal patch groups (frames), patch rows and columns
_FP32 = 4
_INDEX_BYTES_PER_PATCH = 4 * 8 + 4 * 8 + 4 * 4
"""The grid's row/column/height/width (int64), the position table's 4 taps (int64) and their weights (fp32)."""


def peak_activation_bytes(cfg: VisionEncoderConfig, dtype_bytes: int, num_patches: int, frame_len: int) -> int:
    """Peak bytes of live tensors during one `VisionEncoder` forward (besides the weights), as
    `voice_server/models/qwen3_omni/vision/encoder.py` computes it, over `num_patches` patches whose
    largest frame has `frame_len`. N patches, H hidden, I intermediate, d head_dim, b `dtype_bytes`,
    L `frame_len`:

    held through the forward:
    - the pixel input N * patch_dim, fp32 (the runner gathers each forward's rows into one tensor);
    - the grid's and position taps' index rows (80 B a patch) and the rotary cos/sin, N * d fp32 each;
    - the residual stream x, N * H * b, and the DeepStack features kept so far (at most all of them),
      num_deepstack * N / merge**2 * out_hidden * b;
    plus the largest of these transients:
    - position embedding: the 4 table rows of each patch (4 N H b) and their weighted sum in fp32 (4 N H fp32);
      on a non-fp32 tower the pixel input's cast (N * patch_dim * b) comes first, alone;
    - attention, rotary: the norm1 output and qkv (4 N H b), the rotated q (N H b), and the rotation's
      fp32 temporaries (3 N H fp32; 3.5 when q/k are cast to fp32 first);
    - attention, per frame: norm1 out, qkv, rotated q and k (6 N H b), the other frames' outputs
      ((N - L) H b) and the frame's fused SDPA ([1, heads, L, d] inputs take the flash kernel, which never
      holds the [heads, L, L] scores): its output (L H b) and log-sum-exp (heads L fp32); the kernel's
      per-thread blocks are not tensors (and are small: a q block by a kv block of scores per thread);
    - attention, output: norm1 out, qkv, rotated q and k, the frame outputs, their concatenation, its
      transposed copy and the projection (10 N H b);
    - MLP: norm2 out (N H b) and the larger of fc1 + GELU (2 N I b) and GELU + fc2 (N I b + N H b);
      the mergers (2 N H b) are below it.
    """
    if dtype_bytes < 1 or not 1 <= frame_len <= num_patches:
        raise ValueError(f"peak_activation_bytes: dtype_bytes {dtype_bytes}, num_patches {num_patches}, "
                         f"frame_len {frame_len}")
    n, h, i, b, longest = num_patches, cfg.hidden_size, cfg.intermediate_size, dtype_bytes, frame_len
    nh = n * h
    held = (n * cfg.patch_dim * _FP32 + n * _INDEX_BYTES_PER_PATCH + 2 * n * cfg.head_dim * _FP32 + nh * b
            + len(cfg.deepstack_visual_indexes) * n // cfg.spatial_merge_size**2 * cfg.out_hidden_size * b)
    cast = 0 if b == _FP32 else n * cfg.patch_dim * b
    position = 4 * nh * b + 4 * nh * _FP32
    rotary_temps = 3 * nh * _FP32 + (0 if b == _FP32 else nh * _FP32 // 2)
    rotary = 5 * nh * b + rotary_temps
    frame = 6 * nh * b + (n - longest) * h * b + longest * h * b + cfg.num_heads * longest * _FP32
    projection = 10 * nh * b
    mlp = nh * b + max(2 * n * i * b, n * i * b + nh * b)
    return held + max(cast, position, rotary, frame, projection, mlp)


@dataclass(frozen=True)
class Piece:
    """Frames [t_start, t_end) of item `item` (an index into the planned grids)."""

    item: int
    t_start: int
    t_end: int


@dataclass(frozen=True)
class VisionPlan:
    forwards: tuple[tuple[Piece, ...], ...]
    """In order: items in the order given, each item's frames in time order, so the forwards' outputs
    concatenated are the items' rows one after another."""
    refused: tuple[int, ...]
    """Items whose single frame needs more than the budget (none of their frames is planned)."""


def plan_forwards(
    grids: Sequence[Grid], cfg: VisionEncoderConfig, dtype_bytes: int, budget_bytes: int
) -> VisionPlan:
    """Pack the items' frames greedily, in order, into forwards of at most `budget_bytes` each."""
    forwards: list[tuple[Piece, ...]] = []
    refused: list[int] = []
    pieces: list[Piece] = []
    num_patches = longest = 0  # NOTE: of the forward being filled
    for item, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"plan_forwards: grid {item} is {(t, h, w)}")
        frame_len = h * w
        if peak_activation_bytes(cfg, dtype_bytes, frame_len, frame_len) > budget_bytes:
            refused.append(item)
            continue
        start = 0
        for frame in range(t):
            grown = peak_activation_bytes(cfg, dtype_bytes, num_patches + frame_len, max(longest, frame_len))
            if num_patches and grown > budget_bytes:
                if frame > start:
                    pieces.append(Piece(item, start, frame))
                forwards.append(tuple(pieces))
                pieces, num_patches, longest, start = [], 0, 0, frame
            num_patches, longest = num_patches + frame_len, max(longest, frame_len)
        pieces.append(Piece(item, start, t))
    if pieces:
        forwards.append(tuple(pieces))
    return VisionPlan(tuple(forwards), tuple(refused))
