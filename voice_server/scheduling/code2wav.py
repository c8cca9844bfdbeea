"""Code2WavScheduler: cuts each stream of code frames into vocoder chunks and batches the streams.

A request arrives as a stream (`NewRequest(is_stream=True)`, `CHUNK`s, `DONE`) or whole (a `NEW`
with its codes). The runner keeps the codes at admission and replaces each payload by
`{"num_frames": n}`, so this scheduler handles only counts (no torch).

Per stream: the first chunk is `initial_chunk_frames` frames (short, for a low first-audio
latency), then chunks of `chunk_frames`; once the input has ended, the rest goes as the last chunk
(`is_last`: the runner then also emits the held-back lookahead samples), also when no frame is left
(a flush) or none ever came (the stream ends with an empty RESULT). One step takes at most one chunk
per stream and at most `max_batch_size` streams, in round-robin order: a stream that was served
goes to the back, so every ready stream is served within ceil(ready / max_batch_size) steps.

Emits: STREAM `{"pcm": float32 [n], "sample_rate", "num_frames"}` per chunk that made samples
final, then RESULT `{"num_samples", "num_frames"}` (totals; the PCM is not repeated).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from voice_server.scheduling.base import BaseScheduler, Emit, EmitKind, WorkItem, WorkKind
from voice_server.scheduling.contract import (
    Code2WavBatch,
    Code2WavChunk,
    Code2WavResult,
    Code2WavSpec,
)
from voice_server.scheduling.solo import SoloQueue


@dataclass
class _Stream:
    num_received: int = 0
    """Frames admitted so far."""
    num_sent: int = 0
    """Frames handed to the runner (in a batch that ran or is queued to re-run alone)."""
    num_samples: int = 0
    is_input_done: bool = False
    is_last_sent: bool = False


def _num_frames(item: WorkItem) -> int:
    value = item.payload.get("num_frames")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        # NOTE: the runner's `admit` sets it; anything else is a stage wired to the wrong runner.
        raise ValueError(f"payload.num_frames: must be an integer >= 0 (set by the runner's admit), got {value!r}")
    return value


class Code2WavScheduler(BaseScheduler[Code2WavBatch, Code2WavResult]):
    def __init__(self, spec: Code2WavSpec, max_batch_size: int, initial_chunk_frames: int = 2,
                 chunk_frames: int = 10) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("initial_chunk_frames", initial_chunk_frames),
                            ("chunk_frames", chunk_frames)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.initial_chunk_frames = initial_chunk_frames
        self.chunk_frames = chunk_frames
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        """In service order: a stream moves to the back when a step takes its chunk."""
        self._solo: SoloQueue[Code2WavChunk] = SoloQueue(lambda chunk: chunk.request_id)
        """Chunks of a batch that raised, each to re-run alone before anything else."""
        self.num_streams_done = 0
        self.num_frames_decoded = 0
        self.num_samples_decoded = 0

    def add(self, item: WorkItem, now: float) -> None:
        rid = item.request_id
        if item.kind is WorkKind.NEW:
            if rid in self._streams:
                raise ValueError(f"request {rid} is already in this stage")
            stream = _Stream()
            if not item.is_stream:  # NOTE: whole input (client or upstream `next`): no DONE will come
                stream.num_received, stream.is_input_done = _num_frames(item), True
            self._streams[rid] = stream
            return
        held = self._streams.get(rid)
        if held is None:
            return  # late chunk of a request that already left (aborted or failed)
        if item.kind is WorkKind.CHUNK:
            held.num_received += _num_frames(item)
        else:
            held.is_input_done = True

    def _next_chunk(self, rid: str, stream: _Stream) -> Code2WavChunk | None:
        if stream.is_last_sent:
            return None
        num_left = stream.num_received - stream.num_sent
        size = self.initial_chunk_frames if stream.num_sent == 0 else self.chunk_frames
        if stream.is_input_done and num_left <= size:
            return Code2WavChunk(rid, stream.num_sent, num_left, is_last=True)
        if num_left >= size:
            return Code2WavChunk(rid, stream.num_sent, size, is_last=False)
        return None

    def next_wakeup(self, now: float) -> float | None:
        if self._solo or any(self._next_chunk(rid, s) is not None for rid, s in self._streams.items()):
            return 0.0
        return None

    def schedule(self, now: float) -> Code2WavBatch | None:
        solo = self._solo.pop()
        if solo is not None:
            return Code2WavBatch((solo,))
        chunks: list[Code2WavChunk] = []
        for rid, stream in self._streams.items():
            chunk = self._next_chunk(rid, stream)
            if chunk is not None:
                chunks.append(chunk)
                if len(chunks) == self.max_batch_size:
                    break
        for chunk in chunks:
            stream = self._streams[chunk.request_id]
            stream.num_sent += chunk.num_frames
            stream.is_last_sent = chunk.is_last
            self._streams.move_to_end(chunk.request_id)
        return Code2WavBatch(tuple(chunks)) if chunks else None

    def update(self, batch: Code2WavBatch, result: Code2WavResult) -> list[Emit]:
        if len(result.outputs) != len(batch.chunks):
            raise ValueError(f"Code2WavResult has {len(result.outputs)} outputs for {len(batch.chunks)} chunks")
        emits = []
        for chunk, output in zip(batch.chunks, result.outputs):
            stream = self._streams.get(chunk.request_id)
            if stream is None:
                continue  # aborted while the batch ran
            stream.num_samples += output.num_samples
            self.num_frames_decoded += chunk.num_frames
            self.num_samples_decoded += output.num_samples
            if output.num_samples > 0:
                emits.append(Emit(chunk.request_id, EmitKind.STREAM, {
                    "pcm": output.pcm, "sample_rate": self.spec.sample_rate, "num_frames": chunk.num_frames,
                }))
            if chunk.is_last:
                del self._streams[chunk.request_id]
                self.num_streams_done += 1
                emits.append(Emit(chunk.request_id, EmitKind.RESULT, {
                    "num_samples": stream.num_samples, "num_frames": stream.num_received,
                }))
        return emits

    def fail(self, batch: Code2WavBatch, message: str) -> list[Emit]:
        chunks = [c for c in batch.chunks if c.request_id in self._streams]
        # NOTE: one bad stream must not fail the streams batched with it (`SoloQueue`): each chunk re-runs
        # alone first. Safe: the runner commits stream state only after every forward of the step succeeded.
        if self._solo.defer(chunks):
            return []
        for chunk in chunks:
            self.abort(chunk.request_id)
        return [Emit(c.request_id, EmitKind.ERROR, message=message) for c in chunks]

    def abort(self, request_id: str) -> bool:
        held = self._streams.pop(request_id, None) is not None
        self._solo.discard(request_id)
        return held

    @property
    def active_request_ids(self) -> set[str]:
        return set(self._streams)

    def stats(self) -> dict[str, int]:
        return {
            "num_streams": len(self._streams),
            "num_streams_done": self.num_streams_done,
            "num_frames_decoded": self.num_frames_decoded,
            "num_samples_decoded": self.num_samples_decoded,
            "num_frames_waiting": sum(s.num_received - s.num_sent for s in self._streams.values()),
        }
