"""Audio encoder runner (`simple` scheduler): raw audio in, the thinker's audio embeddings out.

The entry stage of the Qwen3-Omni pipeline. NEW payload:

    {"token_ids": [...], "audio": [clip, ...], ...any other keys}

- each clip is float32 PCM at 16 kHz (a 1-D array or tensor) or `{"features": [num_mel_bins, frames]
  float32}` (precomputed log-mel), in prompt order; clips are finite, non-empty, at least
  `LogMelFrontEnd.min_num_samples` samples and at most the stage's `max_audio_seconds`.
- each audio block of `token_ids` is `audio_start, audio..., audio_end` with exactly one `audio`
  placeholder or already the clip's exact `num_audio_tokens`; one block per clip.

RESULT payload (to the `next` stage, the thinker): the same keys, except that `audio` is replaced
by `audio_embeds` (float [sum N_i, thinker hidden], clips in order), `audio_token_counts` ([N_i])
is added and each block's placeholder run is expanded to its clip's N_i in `token_ids`. A request
without audio (no `audio` key, or an empty list, which is dropped) passes through with no forward.
Malformed input is refused at `admit` with an `AdmissionError` naming the field (`payload.audio[2]`).

A payload `{"messages": [{"role", "content", "audio"?}], ...}` (what the session layer sends) is
first turned into `token_ids` and `audio` by the stage's chat template (`models/qwen3_omni/chat.py`),
when the stage has one (a tokenizer, or the tiny preset's stand-in), with the functions of `params["tools"]`
(`models/chat_tools.py`).
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
from voice_server.models.qwen3_omni.thinker.config import ThinkerConfig
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
    """messages (and the request's checked tools) -> (token ids, audio clips); ValueError naming the field."""

    def __call__(self, messages: Any, *, tools: Sequence[Tool] = ...) -> tuple[list[int], list[Any]]: ...


class AudioEncoderRunner(Runner[SimpleBatch, SimpleResult]):
    def __init__(
        self, tower: AudioEncoder, config: AudioEncoderRunnerConfig, chat: ChatTemplate | None = None
    ) -> None:
        if tower.cfg.num_mel_bins != config.num_mel_bins or tower.cfg.n_window != config.n_window:
            raise ValueError("AudioEncoderRunner: the config's num_mel_bins/n_window differ from the tower's")
        self.tower = tower.eval()
        self.config = config
        self.front_end = LogMelFrontEnd(num_mel_bins=config.num_mel_bins, sampling_rate=SAMPLING_RATE)
        self.device = next(tower.parameters()).device
        self.chat = chat

    # -- admission -------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is not WorkKind.NEW or item.is_stream:
            raise AdmissionError("payload: the audio encoder is an entry stage; it takes whole requests, not streams")
        payload = item.payload
        if not isinstance(payload, dict):
            raise AdmissionError(f"payload: must be a mapping, got {type(payload).__name__}")
        if "messages" in payload:
            return self.admit(dataclasses.replace(item, payload=self._from_messages(payload, item.params)))
        raw = payload.get("audio")
        if raw is None or (isinstance(raw, list | tuple) and not raw):
            if isinstance(payload.get("token_ids"), list) and self._audio_runs(payload["token_ids"]):
                raise AdmissionError("payload.audio: the prompt has audio blocks but no audio clips were given")
            return item if raw is None else dataclasses.replace(item, payload=_without_audio(payload))
        if not isinstance(raw, list | tuple):
            raise AdmissionError(f"payload.audio: must be a list of clips, got {type(raw).__name__}")
        clips = [self._clip(f"payload.audio[{i}]", value) for i, value in enumerate(raw)]
        token_ids = self._token_ids(payload.get("token_ids"))
        runs = self._audio_runs(token_ids)
        if len(runs) != len(clips):
            raise AdmissionError(f"payload.audio: {len(clips)} clips, but payload.token_ids has {len(runs)} "
                                 "audio blocks")
        is_features = tuple(c.ndim == 2 for c in clips)
        feature_lens = self._feature_lens(clips, is_features)
        counts = tuple(num_audio_tokens(n, self.config.n_window) for n in feature_lens)
        expanded: list[int] = []
        done = 0
        for i, ((start, run), count) in enumerate(zip(runs, counts)):
            if run not in (1, count):
                raise AdmissionError(f"payload.token_ids: audio block {i} has {run} placeholders; "
                                     f"give 1 or its clip's exact count {count}")
            expanded += token_ids[done:start] + [self.config.audio_token_id] * count
            done = start + run
        expanded += token_ids[done:]
        audio = AdmittedAudio(tuple(clips), is_features, feature_lens, counts)
        return dataclasses.replace(item, payload={**payload, "token_ids": expanded, "audio": audio})

    def _from_messages(self, payload: dict[str, Any], params: Any) -> dict[str, Any]:
        if self.chat is None:
            raise AdmissionError("payload.messages: this stage has no tokenizer; send token_ids (and audio)")
        if "token_ids" in payload or "audio" in payload:
            raise AdmissionError("payload: give either messages or token_ids with audio, not both")
        if not isinstance(params, dict):
            raise AdmissionError(f"params: must be a mapping, got {type(params).__name__}")
        try:
            tools = request_tools(params)
            # NOTE: without tools, the one-argument call every template takes (a stand-in's too)
            token_ids, clips = self.chat(payload["messages"], tools=tools) if tools else self.chat(payload["messages"])
        except ValueError as exc:
            raise AdmissionError(str(exc)) from exc
        rest = {k: v for k, v in payload.items() if k != "messages"}
        return {**rest, "token_ids": token_ids, **({"audio": clips} if clips else {})}

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

    def _token_ids(self, value: Any) -> list[int]:
        vocab = self.config.vocab_size
        if not isinstance(value, list) or not all(type(t) is int and 0 <= t < vocab for t in value):
            raise AdmissionError(f"payload.token_ids: with audio, must be a list of token ids in [0, {vocab})")
        return value

    def _audio_runs(self, token_ids: list[Any]) -> list[tuple[int, int]]:
        """(index of the first placeholder, number of placeholders) of each audio block, in order."""
        cfg, i = self.config, 0
        runs: list[tuple[int, int]] = []
        while i < len(token_ids):
            if token_ids[i] in (cfg.audio_token_id, cfg.audio_end_token_id):
                raise AdmissionError(f"payload.token_ids[{i}]: audio placeholder or audio_end outside an audio block")
            if token_ids[i] != cfg.audio_start_token_id:
                i += 1
                continue
            end = i + 1
            while end < len(token_ids) and token_ids[end] == cfg.audio_token_id:
                end += 1
            if end == i + 1 or end == len(token_ids) or token_ids[end] != cfg.audio_end_token_id:
                raise AdmissionError(f"payload.token_ids[{i}]: audio block {len(runs)} must be audio_start, "
                                     "audio placeholder(s), audio_end")
            runs.append((i + 1, end - i - 1))
            i = end + 1
        return runs

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
        emits = []
        for item in batch.items:
            audio = item.payload.get("audio")
            payload = item.payload
            if isinstance(audio, AdmittedAudio):
                payload = {**_without_audio(payload), "audio_embeds": embeds.pop(0),
                           "audio_token_counts": list(audio.token_counts)}
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
