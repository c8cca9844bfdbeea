"""Multimodal RoPE positions of the Qwen3-Omni thinker: 3-axis (t, h, w), interleaved (see `mrope.py`).

Positions follow transformers' `get_rope_index` exactly, padding included:
- text and audio advance the position by one per token on all three axes;
- an image block `<vision_start><image_pad>*n<vision_end>` takes, from the block's start s, t = s (+ the
  frame index x `position_id_per_seconds`), h = s + merged row, w = s + merged column, and the text after it
  resumes at the block's largest position + 1 (so a prompt with images has a nonzero rope delta);
- a video block does the same per temporal patch, t = s + k * second_per_grid * position_id_per_seconds;
- audio in a video (`<vision_start><audio_start>` video and audio placeholders interleaved by time
  `<audio_end><vision_end>`, transformers' `use_audio_in_video`) gives audio tokens s, s+1, .. and video
  tokens their video positions, merged in time order (a video token first on ties).
Decode steps continue at `cache_len + rope_delta`.

NOTE: transformers keeps these positions in float32, and a video whose seconds-per-grid times
`position_id_per_seconds` is not whole gets fractional times (and so does all text after it). Ours
are int64 whenever every position is whole, float32 otherwise, computed with the reference's own
float32 operations so they are bit-equal; the model's rotary takes either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from voice_server.models.qwen3_omni.audio.encoder import conv_output_lengths
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig

Grid = tuple[int, int, int]  # (t, h, w) in patches


@dataclass(frozen=True)
class RopeLayout:
    """What the positions depend on besides the grids: placeholder ids and the vision/time scales
    (the thinker's, `of_thinker`; the talker's prompt uses the same rule with its own config values)."""

    audio_token_id: int
    image_token_id: int
    video_token_id: int
    audio_start_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int
    position_id_per_seconds: int | float
    audio_n_window: int

    @classmethod
    def of_thinker(cls, cfg: ThinkerConfig) -> RopeLayout:
        return cls(
            audio_token_id=cfg.audio_token_id, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
            audio_start_token_id=cfg.audio_start_token_id, vision_start_token_id=cfg.vision_start_token_id,
            spatial_merge_size=cfg.vision.spatial_merge_size, position_id_per_seconds=cfg.position_id_per_seconds,
            audio_n_window=cfg.audio.n_window,
        )


@dataclass
class _Media:
    """The batch's media in prompt order (rows one after another) and how many each kind has used."""

    image_grids: list[Grid]
    video_grids: list[Grid]
    second_per_grid: torch.Tensor  # [num_videos] float32
    audio_lens: list[int] | None  # placeholder tokens of each clip, when the clips were given
    num_images: int = 0
    num_videos: int = 0
    num_audios: int = 0

    def next_image(self) -> Grid:
        if self.num_images >= len(self.image_grids):
            raise ValueError(f"the prompt has more image blocks than the {len(self.image_grids)} image grids given")
        self.num_images += 1
        return self.image_grids[self.num_images - 1]

    def next_video(self) -> tuple[Grid, torch.Tensor]:
        if self.num_videos >= len(self.video_grids):
            raise ValueError(f"the prompt has more video blocks than the {len(self.video_grids)} video grids given")
        self.num_videos += 1
        return self.video_grids[self.num_videos - 1], self.second_per_grid[self.num_videos - 1]

    def next_audio(self, num_tokens: int) -> None:
        """Count a clip; check its block's placeholder count when the clips' lengths are known."""
        if self.audio_lens is not None:
            if self.num_audios >= len(self.audio_lens):
                raise ValueError("the prompt has more audio blocks than audio clips were given")
            if num_tokens != self.audio_lens[self.num_audios]:
                raise ValueError(
                    f"audio block {self.num_audios} has {num_tokens} placeholder tokens, its clip needs "
                    f"{self.audio_lens[self.num_audios]}"
                )
        self.num_audios += 1

    def check_all_used(self) -> None:
        for kind, given_as, used, given in (
            ("image", "grids", self.num_images, len(self.image_grids)),
            ("video", "grids", self.num_videos, len(self.video_grids)),
            ("audio", "clips", self.num_audios, None if self.audio_lens is None else len(self.audio_lens)),
        ):
            if given is not None and used != given:
                raise ValueError(f"{given} {kind} {given_as} were given but the prompt has {used} {kind} blocks")


def _run_len(tokens: list[int], start: int, ids: tuple[int, ...]) -> int:
    end = start
    while end < len(tokens) and tokens[end] in ids:
        end += 1
    return end - start


def _vision_positions(grid: Grid, merge: int, t_index: torch.Tensor, start: int | torch.Tensor) -> torch.Tensor:
    """[3, t*h*w/merge**2] float32: one position per merged patch, frame by frame, rows then columns
    (transformers' `get_llm_pos_ids_for_vision`, same operations)."""
    llm_h, llm_w = grid[1] // merge, grid[2] // merge
    h_index = torch.arange(llm_h).view(1, -1, 1).expand(len(t_index), -1, llm_w).flatten().float()
    w_index = torch.arange(llm_w).view(1, 1, -1).expand(len(t_index), llm_h, -1).flatten().float()
    t_flat = t_index.view(-1, 1).expand(-1, llm_h * llm_w).flatten().float()
    return torch.stack([t_flat, h_index, w_index]) + start


def _check_tokens(kind: str, item: int, num_tokens: int, grid: Grid, merge: int) -> None:
    needed = grid[0] * grid[1] * grid[2] // merge**2
    if num_tokens != needed:
        raise ValueError(f"{kind} {item} has {num_tokens} placeholder tokens, its grid {grid} needs {needed}")


def _audio_in_video(
    tokens: list[int], begin: int, layout: RopeLayout, media: _Media, st_idx: int | torch.Tensor
) -> tuple[list[torch.Tensor], int]:
    """Content pieces of a `<vision_start><audio_start>` block whose placeholders begin at `begin`, and
    their token count: the video's and the audio's positions merged by time, as the reference merges
    them (one piece per token, then the tail of whichever list is left)."""
    num_tokens = _run_len(tokens, begin, (layout.audio_token_id, layout.video_token_id))
    content = tokens[begin : begin + num_tokens]
    num_audio = content.count(layout.audio_token_id)
    media.next_audio(num_audio)
    grid, second_per_grid = media.next_video()
    _check_tokens("video", media.num_videos - 1, num_tokens - num_audio, grid, layout.spatial_merge_size)
    audio = torch.arange(num_audio).view(1, -1).expand(3, -1) + st_idx
    t_index = (torch.arange(grid[0]) * second_per_grid * layout.position_id_per_seconds).float()
    video = _vision_positions(grid, layout.spatial_merge_size, t_index, st_idx)
    pieces: list[torch.Tensor] = []
    v, a = 0, 0
    while v < video.shape[1] and a < audio.shape[1]:
        if video[0, v] <= audio[0, a]:
            pieces.append(video[:, v : v + 1])
            v += 1
        else:
            pieces.append(audio[:, a : a + 1])
            a += 1
    # NOTE: the tail of the list left over is one piece: the next text starts after ITS largest position.
    pieces.extend(tail for tail in (video[:, v:], audio[:, a:]) if tail.shape[1])
    return pieces, num_tokens


def _row_positions(tokens: list[int], layout: RopeLayout, media: _Media) -> torch.Tensor:
    """[3, len(tokens)] float32 positions of one unpadded row (transformers' per-segment walk)."""
    merge, per_second = layout.spatial_merge_size, layout.position_id_per_seconds
    pieces: list[torch.Tensor] = []  # [3, n] each; the walk reads only the last one's max
    st = 0  # first token without a position
    num_in_blocks = 0  # placeholders inside blocks

    def next_start() -> int | torch.Tensor:
        return pieces[-1].max() + 1 if pieces else 0

    for i, tok in enumerate(tokens):
        if i < st or tok not in (layout.vision_start_token_id, layout.audio_start_token_id):
            continue
        st_idx = next_start()
        if i > st:
            pieces.append(torch.arange(i - st).view(1, -1).expand(3, -1) + st_idx)
            st_idx += i - st
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        is_audio_in_video = tok == layout.vision_start_token_id and nxt == layout.audio_start_token_id
        bos_len = 2 if is_audio_in_video else 1
        pieces.append(torch.arange(bos_len).view(1, -1).expand(3, -1) + st_idx)
        st_idx += bos_len
        begin = i + bos_len
        if is_audio_in_video:
            content, num_tokens = _audio_in_video(tokens, begin, layout, media, st_idx)
            pieces.extend(content)
        elif tok == layout.audio_start_token_id:
            num_tokens = _run_len(tokens, begin, (layout.audio_token_id,))
            media.next_audio(num_tokens)
            pieces.append(torch.arange(num_tokens).view(1, -1).expand(3, -1) + st_idx)
        elif nxt in (layout.image_token_id, layout.video_token_id):
            is_image = nxt == layout.image_token_id
            num_tokens = _run_len(tokens, begin, (nxt,))
            if is_image:
                grid = media.next_image()
                t_index = (torch.arange(grid[0]) * 1 * per_second).float()
            else:
                grid, second_per_grid = media.next_video()
                t_index = (torch.arange(grid[0]) * second_per_grid * per_second).float()
            item = (media.num_images if is_image else media.num_videos) - 1
            _check_tokens("image" if is_image else "video", item, num_tokens, grid, merge)
            pieces.append(_vision_positions(grid, merge, t_index, st_idx))
        else:
            raise ValueError(f"<vision_start> at token {i} is not followed by an image, video or audio block")
        eos_len = bos_len
        num_in_blocks += num_tokens
        st = begin + num_tokens + eos_len
        if st > len(tokens):
            raise ValueError(f"the block starting at token {i} is not closed")
        pieces.append(torch.arange(eos_len).view(1, -1).expand(3, -1) + next_start())
    if st < len(tokens):
        pieces.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + next_start())
    placeholders = (layout.audio_token_id, layout.image_token_id, layout.video_token_id)
    if sum(tok in placeholders for tok in tokens) != num_in_blocks:
        raise ValueError("the prompt has audio, image or video placeholder tokens outside their blocks")
    return torch.cat([p.float() for p in pieces], dim=1)


def _text_positions(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential positions (transformers' branch without grids; padding gets 1)."""
    positions = attention_mask.long().cumsum(-1) - 1
    positions = positions.masked_fill(attention_mask == 0, 1)
    deltas = positions.max(dim=-1, keepdim=True).values + 1 - attention_mask.long().sum(-1, keepdim=True)
    return positions[None].expand(3, -1, -1), deltas


def _grid_list(grid_thw: torch.Tensor | None) -> list[Grid]:
    if grid_thw is None:
        return []
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [num_items, 3], got {tuple(grid_thw.shape)}")
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


def get_rope_index(
    input_ids: torch.Tensor,
    cfg: ThinkerConfig | RopeLayout,
    attention_mask: torch.Tensor | None = None,
    audio_feature_lens: torch.Tensor | None = None,
    *,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    video_second_per_grid: torch.Tensor | Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, B, L] and rope deltas [B, 1] (int64; float32 only for fractional video times).

    `audio_feature_lens` [num_clips]: mel frame counts of the clips, in prompt order; when given, each
    audio block's placeholder count is checked against it. `image_grid_thw` [num_images, 3] and
    `video_grid_thw` [num_videos, 3] (in patches) with `video_second_per_grid` [num_videos] (seconds per
    temporal patch): the batch's images and videos in prompt order, rows one after another; each
    block's placeholder count is checked against its grid. Padding (`attention_mask` == 0) gets
    position 1 without grids and 0 with them, as in the reference.
    """
    layout = cfg if isinstance(cfg, RopeLayout) else RopeLayout.of_thinker(cfg)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    audio_lens = None
    if audio_feature_lens is not None:
        audio_lens = [int(n) for n in conv_output_lengths(audio_feature_lens.long().cpu(), layout.audio_n_window)]
    video_grids = _grid_list(video_grid_thw)
    if video_grids and video_second_per_grid is None:
        raise ValueError("video_grid_thw needs video_second_per_grid (seconds per temporal patch of each video)")
    second_per_grid = torch.as_tensor(
        video_second_per_grid if video_second_per_grid is not None else [], dtype=torch.float32
    ).cpu().flatten()
    if len(second_per_grid) != len(video_grids):
        raise ValueError(f"{len(second_per_grid)} video_second_per_grid values for {len(video_grids)} videos")
    media = _Media(_grid_list(image_grid_thw), video_grids, second_per_grid, audio_lens)
    is_real = attention_mask.bool().cpu()
    rows = [[t for t, m in zip(row, mask) if m] for row, mask in zip(input_ids.tolist(), is_real.tolist())]
    if image_grid_thw is None and video_grid_thw is None:
        for tokens in rows:
            _row_positions(tokens, layout, media)  # NOTE: run for its block checks only
        media.check_all_used()
        return _text_positions(attention_mask)
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.float32)
    deltas = torch.zeros(len(rows), 1, dtype=torch.float32)
    for b, tokens in enumerate(rows):
        row = _row_positions(tokens, layout, media)
        positions[:, b, is_real[b]] = row
        deltas[b] = row.max() + 1 - len(tokens)
    media.check_all_used()
    if torch.equal(positions, positions.round()):
        positions, deltas = positions.long(), deltas.long()
    return positions.to(input_ids.device), deltas.to(input_ids.device)


def decode_position_ids(past_len: int | torch.Tensor, num_tokens: int, rope_deltas: torch.Tensor) -> torch.Tensor:
    """Positions [3, B, num_tokens] of tokens appended after `past_len` earlier tokens: the cache length,
    or for a left-padded batch the per-row count [B] of real (unpadded) earlier tokens, as HF counts them."""
    past = torch.as_tensor(past_len, device=rope_deltas.device).reshape(-1, 1)
    steps = past + torch.arange(num_tokens, device=rope_deltas.device)[None, :]
    return (steps + rope_deltas)[None].expand(3, -1, -1)


def continue_positions(last: torch.Tensor, num: int) -> torch.Tensor:
    """[num] positions of the `num` rows after the one at `last` (0-d, in its dtype; a prompt's last row is
    text, so all three axes share it): each the one before + 1. The thinker's and the talker's decode rows.

    NOTE: transformers' generate appends `position_ids[..., -1:] + 1` after every step
    (`_update_model_kwargs_for_generation`), in the prefill positions' dtype. Whole positions are then
    `last + k`; fractional float32 ones round at each power of two they cross, so they are summed one at a time
    as there: `last + k`, or `cache_len + rope_delta`, in float32 rounds once and can land an ulp away.
    """
    if not last.is_floating_point():
        return last + torch.arange(1, num + 1, device=last.device)
    positions = []
    for _ in range(num):
        last = last + 1
        positions.append(last)
    return torch.stack(positions) if positions else last.new_empty(0)
