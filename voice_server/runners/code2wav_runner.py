"""`Code2WavRunner`: the torch side of a `code2wav` stage, streaming Qwen3-Omni's vocoder.

`admit` validates each CHUNK's codes (`payload.codes`: [G, T] ints in [0, codebook_size), a tensor,
an array or nested lists) and keeps them per stream; the scheduler then sees `{"num_frames": T}`.
`execute` decodes one chunk per stream: streams whose states line up (`batched.step_key`: same new
frames, cache and context lengths; true in steady state) run as one batched forward, the others
alone. Stream state is committed only after every forward of the step succeeded, so a step that
raised left every stream as it was and the scheduler may re-run its chunks alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from voice_server.models.layers import KVCache
from voice_server.models.qwen3_omni.code2wav.batched import StepKey, decode_streams, step_key
from voice_server.models.qwen3_omni.code2wav.model import Code2Wav
from voice_server.models.qwen3_omni.code2wav.streaming import (
    Code2WavStreamState,
    conv_context_frames,
    lookahead_samples,
    new_stream_state,
)
from voice_server.scheduling import AdmissionError, Runner, WorkItem, WorkKind
from voice_server.scheduling.contract import Code2WavBatch, Code2WavChunk, Code2WavOutput, Code2WavResult, Code2WavSpec


@dataclass
class _StreamCodes:
    state: Code2WavStreamState
    pending: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """Admitted frames not decoded yet, [G, T] long tensors in order."""
    num_pending: int = 0


class Code2WavRunner(Runner[Code2WavBatch, Code2WavResult]):
    def __init__(self, model: Code2Wav, left_context_frames: int | None = None) -> None:
        """`left_context_frames` (default: `conv_context_frames(cfg)`, the smallest exact value) is the
        transformer output kept per stream as the conv stacks' left context.

        NOTE: HF's `chunked_decode` keeps 25 frames of left context because it recomputes the
        transformer over them; ours carries each stream's KV cache, so it needs only the conv
        receptive field. A smaller value is allowed (cheaper, inexact; refused below the lookahead)."""
        self.model = model.eval()
        cfg = model.cfg
        self.num_quantizers, self.codebook_size = cfg.num_quantizers, cfg.codebook_size
        self.left_context_frames = conv_context_frames(cfg) if left_context_frames is None else left_context_frames
        new_stream_state(cfg, 1, self.left_context_frames)  # NOTE: refuses a too short context now, not per request
        self.lookahead_samples = lookahead_samples(cfg)
        self.device = model.code_embedding.weight.device
        self.code2wav_spec = Code2WavSpec(sample_rate=cfg.sample_rate)
        self._streams: dict[str, _StreamCodes] = {}
        self.num_forwards = 0
        """Model forwards run; with `num_rows`, how well steps batch (rows per forward)."""
        self.num_rows = 0

    # -- admission -------------------------------------------------------------------------------

    def admit(self, item: WorkItem) -> WorkItem:
        if item.kind is WorkKind.DONE:
            return item
        if item.kind is WorkKind.NEW:
            state = Code2WavStreamState(1, self.left_context_frames, self.lookahead_samples,
                                        KVCache(self.model.cfg.num_hidden_layers))
            self._streams[item.request_id] = _StreamCodes(state)
            if item.is_stream:
                return item  # NOTE: a stream opens empty; its codes come in chunks
        stream = self._streams.get(item.request_id)
        if stream is None:
            raise AdmissionError(f"request {item.request_id}: codes before the request opened")
        if item.kind is WorkKind.CHUNK and "codes" not in item.payload:
            # NOTE: the talker's codec-EOS step streams its token and no frame.
            return dataclasses.replace(item, payload={"num_frames": 0})
        codes = self._codes(item.payload.get("codes"))
        if codes.shape[1] > 0:
            stream.pending.append(codes)
            stream.num_pending += codes.shape[1]
        return dataclasses.replace(item, payload={"num_frames": int(codes.shape[1])})

    def _codes(self, value: Any) -> torch.Tensor:
        where = f"payload.codes: must be [{self.num_quantizers}, T] integer codes in [0, {self.codebook_size})"
        try:
            if isinstance(value, torch.Tensor):
                codes = value.detach().to("cpu", copy=True)
            elif isinstance(value, np.ndarray):
                codes = torch.from_numpy(np.array(value, copy=True))
            elif isinstance(value, list):
                codes = torch.tensor(value)
            else:
                raise AdmissionError(f"{where}, got {type(value).__name__}")
        except (TypeError, ValueError, RuntimeError) as exc:
            raise AdmissionError(f"{where}: {exc}") from exc
        if codes.dtype == torch.bool or codes.dtype.is_floating_point or codes.dtype.is_complex:
            raise AdmissionError(f"{where}, got dtype {str(codes.dtype).removeprefix('torch.')}")
        if codes.ndim != 2 or codes.shape[0] != self.num_quantizers:
            raise AdmissionError(f"{where}, got shape {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise AdmissionError(f"{where}, got values in [{int(codes.min())}, {int(codes.max())}]")
        return codes.to(self.device, torch.long)

    def release(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- execution -------------------------------------------------------------------------------

    def _take(self, chunk: Code2WavChunk) -> tuple[_StreamCodes, torch.Tensor]:
        """The stream of `chunk` and its codes [G, num_frames] (not removed from the stream yet)."""
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            raise ValueError(f"request {chunk.request_id}: no stream in the runner")
        if chunk.num_frames_before != stream.state.num_frames or chunk.num_frames > stream.num_pending:
            raise ValueError(
                f"request {chunk.request_id}: chunk of frames [{chunk.num_frames_before}, "
                f"{chunk.num_frames_before + chunk.num_frames}) but {stream.state.num_frames} decoded and "
                f"{stream.num_pending} pending"
            )
        pending = torch.cat(stream.pending, dim=1) if stream.pending else torch.zeros(
            self.num_quantizers, 0, dtype=torch.long, device=self.device)
        return stream, pending[:, : chunk.num_frames]

    @torch.no_grad()
    def execute(self, batch: Code2WavBatch) -> Code2WavResult:
        upsample = self.model.total_upsample
        groups: dict[StepKey, list[int]] = {}
        taken = [self._take(chunk) for chunk in batch.chunks]
        for i, (chunk, (stream, _)) in enumerate(zip(batch.chunks, taken)):
            groups.setdefault(step_key(stream.state, chunk.num_frames, chunk.is_last, upsample), []).append(i)
        new_states: dict[int, Code2WavStreamState] = {}
        outputs: dict[int, Code2WavOutput] = {}
        for key, rows in groups.items():
            codes = torch.stack([taken[i][1] for i in rows])
            pcm, states = decode_streams(self.model, codes, [taken[i][0].state for i in rows], is_last=key[-1])
            pcm = pcm.to("cpu", torch.float32)
            self.num_forwards += 1
            self.num_rows += len(rows)
            for row, (i, state) in enumerate(zip(rows, states)):
                # NOTE: clone, so one stream's output does not keep the whole batch's buffer alive.
                outputs[i] = Code2WavOutput(pcm[row].clone(), int(pcm.shape[1]))
                new_states[i] = state
        # NOTE: commit only now that every forward of the step succeeded (see the module note).
        for i, (chunk, (stream, _)) in enumerate(zip(batch.chunks, taken)):
            stream.state = new_states[i]
            rest = torch.cat(stream.pending, dim=1)[:, chunk.num_frames :] if stream.pending else None
            stream.pending = [rest] if rest is not None and rest.shape[1] else []
            stream.num_pending -= chunk.num_frames
        return Code2WavResult(tuple(outputs[i] for i in range(len(batch.chunks))))
