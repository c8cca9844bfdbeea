"""Audio encoder runner (`simple` scheduler): raw audio, images and video in; the thinker's embeddings out.

The entry stage of the Qwen3-Omni pipeline. NEW payload:

    {"token_ids": [...], "audio": [clip, ...], "images": [image, ...], "videos": [video, ...], ...any other keys}

- each clip is float32 PCM at 16 kHz (a 1-D array or tensor) or `{"features": [num_mel_bins, frames]
  float32}` (precomputed log-mel), in prompt order; clips are finite, non-empty, at least
  `LogMelFrontEnd.min_num_samples` samples and at most the stage's `max_audio_seconds`.
- each image is encoded bytes (PNG, JPEG, WEBP, GIF, BMP) or an HxW / HxWxC uint8 array, each video
  `{"frames": [T, H, W, C] uint8 array, "fps": number}`, in prompt order; they are preprocessed as the
  model's processors do (`voice_server/models/qwen3_omni/vision/preprocess.py`, `video.py`: resized to
  multiples of patch_size * merge, a video sampled at 2 fps). Only a stage built with `vision: true`
  takes them; elsewhere a request with any is refused ("this pipeline does not take images").
- each audio block of `token_ids` is `audio_start, audio..., audio_end`, each image block
  `vision_start, image..., vision_end` and each video block `vision_start, video..., vision_end`, with
  exactly one placeholder or already the item's exact token count (a clip's `num_audio_tokens`, an
  image's or video's t * h * w / merge**2); one block per item, in order (`prompt_blocks.py`).

RESULT payload (to the `next` stage, the thinker): the same keys, except that `audio` is replaced
by `audio_embeds` (float [sum N_i, thinker hidden], clips in order), `audio_token_counts` ([N_i])
is added and each block's placeholder run is expanded to its item's count in `token_ids`. With images
or videos, `images`/`videos` are replaced by (`vision_input.py`):
- `visual_embeds` [sum M_j, out_hidden]: every image's and video's rows in prompt order, i.e. the rows
  of the image and video placeholders of `token_ids` in the order they appear;
- `visual_deepstack` [num_deepstack, sum M_j, out_hidden]: the DeepStack features of those same rows,
  one per `deepstack_visual_indexes` block in order (the thinker adds feature k after decoder layer k);
- `image_grid_thw`, `video_grid_thw`: [[t, h, w], ...] in patches, per image / per video in prompt
  order (M_j = t * h * w / merge**2; the thinker's M-RoPE reads h / merge x w / merge positions per
  temporal patch); `video_second_per_grid` [float]: seconds per temporal patch of each video.
A request without audio or vision (no such key, or empty lists, which are dropped) passes through
with no forward. Malformed input is refused at `admit` with an `AdmissionError` naming the field
(`payload.audio[2]`, `payload.images[0]`), as is an image or video one frame of which needs more
activation memory than the stage's budget (`activation_budget_mb`); the other requests of its batch
run. `execute` runs one audio forward per batch and the vision forwards `vision_plan.py` packs the
batch's frames into, each within the budget, a long video split along time.

A payload `{"messages": [{"role", "content", "audio"?, "images"?, "videos"?}], ...}` (what the session
layer sends) is first turned into `token_ids`, `audio`, `images` and `videos` by the stage's chat
template (`models/qwen3_omni/chat.py`), when the stage has one (a tokenizer, or the tiny preset's
stand-in), with the functions of `params["tools"]` (`models/chat_tools.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from voice_server.models.chat_tools import Tool, request_tools
from voice_server.models.qwen3_omni.audio.encoder import AudioEncoder, num_audio_tokens
from voice_server.models.qwen3_omni.audio.mel import LogMelFrontEnd
from voice_server.models.qwen3_omni.chat import ChatPrompt
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
from voice_server.models.qwen3_omni.vision.encoder import VisionEncoder
from voice_server.runners.prompt_blocks import Block, BlockKind, checked_token_ids, expand_blocks, find_blocks
from voice_server.runners.vision_input import (
    VISION_KEYS,
    AdmittedVision,
    VisionInputConfig,
    admit_vision,
    encode_vision,
)
from voice_server.scheduling import AdmissionError, Emit, EmitKind, Runner, SimpleBatch, SimpleResult, WorkItem
from voice_server.scheduling.base import WorkKind

SAMPLING_RATE = 16000
DEFAULT_MAX_AUDIO_SECONDS = 600.0
"""10 minutes: 38 MB of float32 PCM and ~7800 audio tokens per clip; longer turns are rarely
conversational and would hold the relay and one batch for long."""


@dataclass(frozen=True)
class AudioEncoderRunnerConfig:
    audio_token_id: int
    audio_start_token_id: int
    audio_end_token_id: int
    vocab_size: int
    num_mel_bins: int
    n_window: int
    """Half a conv chunk, in mel frames (the tower's `n_window`, for `num_audio_tokens`)."""
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS

    def __post_init__(self) -> None:
        ids = (self.audio_token_id, self.audio_start_token_id, self.audio_end_token_id)
        if len(set(ids)) != 3 or not all(0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"AudioEncoderRunnerConfig: audio ids {ids} must be distinct, < {self.vocab_size}")
        if self.num_mel_bins < 1 or self.n_window < 1:
            raise ValueError(f"AudioEncoderRunnerConfig: num_mel_bins {self.num_mel_bins}, n_window {self.n_window}")
        if not (isinstance(self.max_audio_seconds, int | float) and 0 < self.max_audio_seconds < math.inf):
            raise ValueError(f"AudioEncoderRunnerConfig: max_audio_seconds must be > 0, got {self.max_audio_seconds!r}")

    @classmethod
    def from_thinker(
        cls, cfg: ThinkerConfig, max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    ) -> AudioEncoderRunnerConfig:
        return cls(cfg.audio_token_id, cfg.audio_start_token_id, cfg.audio_end_token_id, cfg.text.vocab_size,
                   cfg.audio.num_mel_bins, cfg.audio.n_window, float(max_audio_seconds))

    @property
    def max_num_samples(self) -> int:
        return int(self.max_audio_seconds * SAMPLING_RATE)

    @property
    def block_kind(self) -> BlockKind:
        return BlockKind("audio", "clip", "audio", self.audio_start_token_id, self.audio_token_id,
                         self.audio_end_token_id)


@dataclass(frozen=True)
class AdmittedAudio:
    """What `admit` leaves in `payload["audio"]`: checked clips, in prompt order, and their sizes."""

    clips: tuple[torch.Tensor, ...]
    """1-D PCM samples, or [num_mel_bins, frames] log-mel when `is_features[i]`."""
    is_features: tuple[bool, ...]
    feature_lens: tuple[int, ...]
    """Mel frames of each clip (for PCM: as the front end computes them for this request's clips)."""
    token_counts: tuple[int, ...]
    """`num_audio_tokens` of each clip: its audio embeddings and its expanded placeholder run."""

    def __post_init__(self) -> None:
        if not len(self.clips) == len(self.is_features) == len(self.feature_lens) == len(self.token_counts) > 0:
            raise ValueError("AdmittedAudio: clips, is_features, feature_lens and token_counts differ in length")


class ChatTemplate(Protocol):
    """messages (and the request's checked tools) -> the prompt and its items; ValueError naming the field."""

    def __call__(self, messages: Any, *, tools: Sequence[Tool] = ...) -> ChatPrompt: ...


class AudioEncoderRunner(Runner[SimpleBatch, SimpleResult]):
    def __init__(
        self, tower: AudioEncoder, config: AudioEncoderRunnerConfig, chat: ChatTemplate | None = None,
        vision_tower: VisionEncoder | None = None, vision_config: VisionInputConfig | None = None,
    ) -> None:
        if tower.cfg.num_mel_bins != config.num_mel_bins or tower.cfg.n_window != config.n_window:
            raise ValueError("AudioEncoderRunner: the config's num_mel_bins/n_window differ from the tower's")
        if (vision_tower is None) != (vision_config is None) or (
                vision_tower is not None and vision_config is not None and vision_tower.cfg != vision_config.tower):
            raise ValueError("AudioEncoderRunner: give both vision_tower and vision_config, of the same tower config")
        self.tower = tower.eval()
        self.config = config
        self.front_end = LogMelFrontEnd(num_mel_bins=config.num_mel_bins, sampling_rate=SAMPLING_RATE)
        self.device = next(tower.parameters()).device
        self.chat = chat
        self.vision_tower = None if vision_tower is None else vision_tower.eval()
        self.vision_config = vision_config

    # -- admission -------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW or item.is_stream:
            raise AdmissionError("payload: the audio encoder is an entry stage; it takes whole requests, not streams")
        payload = item.payload
        if not isinstance(payload, dict):
            raise AdmissionError(f"payload: must be a mapping, got {type(payload).__name__}")
        if "messages" in payload:
            return self.admit(dataclasses.replace(item, payload=self._from_messages(payload, item.params)))
        admitted = admit_vision(self._admit_audio(payload), self.vision_config)
        return item if admitted is payload else dataclasses.replace(item, payload=admitted)

    def _admit_audio(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` with `audio` checked and replaced by an AdmittedAudio and its audio blocks expanded;
        the same object when it has none."""
        raw = payload.get("audio")
        if raw is None or (isinstance(raw, list | tuple) and not raw):
            if isinstance(payload.get("token_ids"), list) and self._audio_blocks(payload["token_ids"]):
                raise AdmissionError("payload.audio: the prompt has audio blocks but no audio clips were given")
            return payload if raw is None else _without_audio(payload)
        if not isinstance(raw, list | tuple):
            raise AdmissionError(f"payload.audio: must be a list of clips, got {type(raw).__name__}")
        clips = [self._clip(f"payload.audio[{i}]", value) for i, value in enumerate(raw)]
        token_ids = checked_token_ids(payload.get("token_ids"), self.config.vocab_size, "with audio")
        blocks = self._audio_blocks(token_ids)
        if len(blocks) != len(clips):
            raise AdmissionError(f"payload.audio: {len(clips)} clips, but payload.token_ids has {len(blocks)} "
                                 "audio blocks")
        is_features = tuple(c.ndim == 2 for c in clips)
        feature_lens = self._feature_lens(clips, is_features)
        counts = tuple(num_audio_tokens(n, self.config.n_window) for n in feature_lens)
        audio = AdmittedAudio(tuple(clips), is_features, feature_lens, counts)
        return {**payload, "token_ids": expand_blocks(token_ids, blocks, counts), "audio": audio}

    def _audio_blocks(self, token_ids: list[Any]) -> list[Block]:
        return find_blocks(token_ids, [self.config.block_kind])

    def _from_messages(self, payload: dict[str, Any], params: Any) -> dict[str, Any]:
        if self.chat is None:
            raise AdmissionError("payload.messages: this stage has no tokenizer; send token_ids (and audio)")
        if any(key in payload for key in ("token_ids", "audio", *VISION_KEYS)):
            raise AdmissionError("payload: give either messages or token_ids with audio, images, videos; not both")
        if not isinstance(params, dict):
            raise AdmissionError(f"params: must be a mapping, got {type(params).__name__}")
        try:
            tools = request_tools(params)
            # NOTE: without tools, the one-argument call every template takes (a stand-in's too)
            prompt = self.chat(payload["messages"], tools=tools) if tools else self.chat(payload["messages"])
        except ValueError as exc:
            raise AdmissionError(str(exc)) from exc
        rest = {k: v for k, v in payload.items() if k != "messages"}
        items = {"audio": prompt.audio, "images": prompt.images, "videos": prompt.videos}
        return {**rest, "token_ids": prompt.token_ids, **{k: v for k, v in items.items() if v}}

    def _clip(self, where: str, value: Any) -> torch.Tensor:
        if isinstance(value, dict):
            if set(value) != {"features"}:
                raise AdmissionError(f"{where}: a precomputed clip is {{'features': array}}, got keys {sorted(value)}")
            clip = _float32_tensor(f"{where}.features", value["features"])
            max_frames = self.front_end.num_frames(self.config.max_num_samples)
            if clip.ndim != 2 or clip.shape[0] != self.config.num_mel_bins or not 1 <= clip.shape[1] <= max_frames:
                raise AdmissionError(f"{where}.features: must be [{self.config.num_mel_bins}, frames] with 1 <= "
                                     f"frames <= {max_frames}, got shape {list(clip.shape)}")
        else:
            clip = _float32_tensor(where, value)
            if clip.ndim != 1:
                raise AdmissionError(f"{where}: must be 1-D mono PCM, got shape {list(clip.shape)}")
            num_samples, limit = clip.shape[0], self.config.max_num_samples
            if not self.front_end.min_num_samples <= num_samples <= limit:
                raise AdmissionError(f"{where}: has {num_samples} samples; need {self.front_end.min_num_samples} to "
                                     f"{limit} ({self.config.max_audio_seconds:g} s at {SAMPLING_RATE} Hz)")
        if not bool(torch.isfinite(clip).all()):
            raise AdmissionError(f"{where}: has non-finite values")
        return clip

    def _feature_lens(self, clips: list[torch.Tensor], is_features: tuple[bool, ...]) -> tuple[int, ...]:
        num_samples = [c.shape[0] for c, is_feat in zip(clips, is_features) if not is_feat]
        pcm_lens = iter(self.front_end.feature_lens(num_samples) if num_samples else [])
        return tuple(c.shape[1] if is_feat else next(pcm_lens) for c, is_feat in zip(clips, is_features))

    # -- execution -------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: SimpleBatch) -> SimpleResult:
        audios = [a for item in batch.items if isinstance(a := item.payload.get("audio"), AdmittedAudio)]
        embeds: list[torch.Tensor] = []
        if audios:
            features = torch.cat([self._features(a) for a in audios], dim=1).to(self.device)
            feature_lens = torch.tensor([n for a in audios for n in a.feature_lens], device=self.device)
            # NOTE: one tower forward for every clip of the batch. Attention windows never cross clips,
            # and conv chunks are always padded to a full chunk (the reference pads to the call's
            # longest, which leaks into a short clip's last tokens), so a clip's tokens do not depend
            # on its batch; they equal the reference's whenever its call holds a clip of >= 1 s.
            tokens = self.tower(features, feature_lens, chunk_pad_len=2 * self.config.n_window)
            embeds = list(tokens.split([sum(a.token_counts) for a in audios]))
        visions = [v for item in batch.items if isinstance(v := item.payload.get("vision"), AdmittedVision)]
        vision_rows = []
        if visions:
            # NOTE: admission makes an AdmittedVision only on a stage with vision
            assert self.vision_tower is not None and self.vision_config is not None
            vision_rows = encode_vision(self.vision_tower, visions, self.vision_config)
        emits = []
        for item in batch.items:
            payload = item.payload
            if isinstance(audio := payload.get("audio"), AdmittedAudio):
                payload = {**_without_audio(payload), "audio_embeds": embeds.pop(0),
                           "audio_token_counts": list(audio.token_counts)}
            if isinstance(vision := payload.get("vision"), AdmittedVision):
                rest = {k: v for k, v in payload.items() if k != "vision"}
                payload = {**rest, **vision.result_fields(*vision_rows.pop(0))}
            emits.append(Emit(item.request_id, EmitKind.RESULT, payload))
        return SimpleResult(tuple(emits))

    def _features(self, audio: AdmittedAudio) -> torch.Tensor:
        """One request's clips as packed log-mel [num_mel_bins, sum(feature_lens)], in clip order."""
        pcm = [c for c, is_feat in zip(audio.clips, audio.is_features) if not is_feat]
        # NOTE: log-mel per request, not per batch: the front end pads a call's clips to the longest
        # and a clip's last frame and frame count depend on it (as in HF's processor), so batching
        # requests together must not change them.
        pcm_features: Iterator[torch.Tensor] = iter(())
        if pcm:
            mel = self.front_end(pcm)
            pcm_features = iter(mel.packed().split(mel.feature_lens.tolist(), dim=1))
        parts = [c if is_feat else next(pcm_features) for c, is_feat in zip(audio.clips, audio.is_features)]
        if [p.shape[1] for p in parts] != list(audio.feature_lens):
            raise RuntimeError("log-mel frame counts differ from those admitted")  # NOTE: a bug, not bad input
        return torch.cat(parts, dim=1)


def _without_audio(payload: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in payload.items() if k != "audio"}


def _float32_tensor(where: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            raise AdmissionError(f"{where}: samples must be float32, got {value.dtype}")
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        if value.dtype != np.float32:
            raise AdmissionError(f"{where}: samples must be float32, got {value.dtype}")
        # NOTE: a copy: relayed arrays are read-only views of shared memory.
        return torch.tensor(value)
    raise AdmissionError(f"{where}: must be a float32 array, got {type(value).__name__}")
