"""One response of a session: a pipeline request whose text and audio stream back to the client.

The request payload is `{"messages": [...]}` (`Conversation.to_messages`: `role`, `content`, and
`audio` for spoken user turns); the pipeline's terminal outputs are read by key: a stream output's
`text` is a text delta, its `pcm` (float32 mono, at its `sample_rate`) audio. Final outputs carry
totals and are not replayed. Audio is resampled to the session's output rate as it arrives.

A pipeline that transcribes the user (`stream_input`) also sends `input_transcript_partial` (the
hypothesis so far, which may revise itself) and `input_transcript` (final) for the user item the
response answers; they become `InputTranscriptDelta`s (only where the hypothesis grows) and one
`InputTranscriptDone`. Such a request may open before the response starts (at speech start): its
`timings_ms` count from `start()`, the end of the user's turn, and leave out earlier stage stamps.

`OpenTurn` is a spoken turn whose request opened at speech start (`stream_input` pipelines): its
response run, the request's input stream and the resampler to 16 kHz.

Cancellation (barge-in, `response.cancel`, the client gone) cancels the task running `consume`: the
request stream closes, which aborts the request in every stage (`RequestStream`), and nothing more
is sent to the client from the moment the task is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import StreamResampler, float32_to_pcm16, pcm16_to_float32
from voice_server.engine.requests import InputStream, RequestError, RequestStream, TerminalOutput
from voice_server.session.conversation import Conversation, Item
from voice_server.session.events import (
    AudioDelta,
    InputTranscriptDelta,
    InputTranscriptDone,
    SessionEvent,
    TextDelta,
)

Emit = Callable[[SessionEvent], Awaitable[None]]


class ResponseRun:
    def __init__(self, response_id: str, item: Item, output_rate: int, emit: Emit,
                 user_item_id: str = "", conversation: Conversation | None = None) -> None:
        self.response_id, self.item, self.output_rate, self.emit = response_id, item, output_rate, emit
        self.user_item_id = user_item_id
        """The spoken user item this response answers, which a transcribing pipeline transcribes."""
        self.conversation = conversation
        """Where the final transcript lands on the user item.

        NOTE: the conversation, not a callback into the session: a bound method of the session here made
        session -> run -> session a reference cycle, so every closed session (its socket, audio buffers,
        zlib streams, conversation audio) waited for a full garbage collection, which a server with a
        large heap runs rarely: +8.5 MB/min over a 10-minute soak."""
        self._partial_sent = ""
        self.timings_ms: dict[str, float] = {}
        self.usage: dict[str, int] = {}
        """`num_prompt_tokens`, `num_cached_tokens`, `num_output_tokens`, from the final outputs that carry them,
        else output tokens counted as text deltas (one per step in the AR stages)."""
        self.started_at = 0.0
        """When the response started: its submit, or the end of a streamed turn (`start`)."""
        self.first_audio_at: float | None = None
        self.num_samples = 0
        self._resampler: StreamResampler | None = None
        self._resampler_rate = 0

    def start(self) -> None:
        self.started_at = time.monotonic()

    async def consume(self, stream: RequestStream) -> str:
        """Stream an already submitted request's outputs (`RequestStream`); '' or the error message."""
        try:
            async for output in stream:
                await self._on_output(output)
        except RequestError as exc:
            return str(exc)
        finally:
            await stream.aclose()
        tail = self._resampler.flush() if self._resampler is not None else None
        if tail is not None and tail.size:
            await self._send_audio(tail)
        return ""

    async def _on_output(self, output: TerminalOutput) -> None:
        if self.started_at:
            for stage, at in output.timings.items():
                if stage != "submit" and at >= self.started_at:
                    self.timings_ms.setdefault(stage, round(1000.0 * (at - self.started_at), 3))
        await self._on_transcript(output.payload)
        if output.is_final:
            self._count_tokens(output.payload)
            return
        text = output.payload.get("text")
        if isinstance(text, str) and text:
            if "num_prompt_tokens" not in self.usage:
                self.usage["num_output_tokens"] = self.usage.get("num_output_tokens", 0) + 1
            self.item.text += text
            await self.emit(TextDelta(self.response_id, self.item.item_id, text))
        pcm = output.payload.get("pcm")
        if pcm is not None:
            rate = int(output.payload.get("sample_rate", self.output_rate))
            samples = np.asarray(pcm, dtype=np.float32).reshape(-1)
            await self._send_audio(self._resample(samples, rate))

    async def _on_transcript(self, payload: dict[str, Any]) -> None:
        partial, final = payload.get("input_transcript_partial"), payload.get("input_transcript")
        if isinstance(partial, str) and partial.startswith(self._partial_sent) and partial != self._partial_sent:
            # NOTE: a recogniser revises its hypothesis; deltas are append-only, so a revision waits
            # for the final transcript (which replaces the deltas) or for the text to grow past it.
            delta, self._partial_sent = partial[len(self._partial_sent):], partial
            await self.emit(InputTranscriptDelta(self.user_item_id, delta))
        if isinstance(final, str):
            if self.started_at:
                self.timings_ms.setdefault("transcript", round(1000.0 * (time.monotonic() - self.started_at), 3))
            if self.conversation is not None:
                self.conversation.set_transcript(self.user_item_id, final)
            await self.emit(InputTranscriptDone(self.user_item_id, final))

    def _count_tokens(self, payload: dict[str, Any]) -> None:
        # NOTE: the first final with counts wins: in a multi-stage pipeline that is the text stage's
        # (a vocoder's final carries none), and its counts replace the per-delta estimate.
        prompt, token_ids = payload.get("num_prompt_tokens"), payload.get("token_ids")
        if "num_prompt_tokens" in self.usage or not isinstance(prompt, int) or not isinstance(token_ids, list):
            return
        cached = payload.get("num_cached_tokens")
        self.usage = {"num_prompt_tokens": prompt, "num_cached_tokens": cached if isinstance(cached, int) else 0,
                      "num_output_tokens": len(token_ids)}

    def _resample(self, samples: np.ndarray, rate: int) -> np.ndarray:
        if rate == self.output_rate:
            return samples
        if self._resampler is None or self._resampler_rate != rate:
            # NOTE: one stream resampler per response (its state spans chunks; a pipeline has one rate).
            self._resampler, self._resampler_rate = StreamResampler(rate, self.output_rate), rate
        return self._resampler.process(samples)

    async def _send_audio(self, samples: np.ndarray) -> None:
        if not samples.size:
            return
        pcm16 = float32_to_pcm16(np.nan_to_num(samples, nan=0.0, posinf=1.0, neginf=-1.0))
        if self.first_audio_at is None:
            self.first_audio_at = time.monotonic()
            self.timings_ms["first_audio_sent"] = round(1000.0 * (self.first_audio_at - self.started_at), 3)
        self.num_samples += pcm16.size
        self.item.num_audio_ms = self.num_samples * 1000 // self.output_rate
        await self.emit(AudioDelta(self.response_id, self.item.item_id, pcm16))


@dataclass
class OpenTurn:
    """A spoken turn whose request is open while the user speaks (`stream_input` pipelines)."""

    run: ResponseRun
    input: InputStream
    """The request's input: `send(payload)`, `end()`."""
    task: asyncio.Task[None]
    resampler: StreamResampler | None
    """Input rate -> 16 kHz, with its state across the turn's chunks (None at 16 kHz)."""

    def send(self, pcm16: npt.NDArray[np.int16]) -> None:
        """Raises RequestError (OverloadError: the relay is full) when the chunk could not be sent."""
        audio = pcm16_to_float32(pcm16)
        if self.resampler is not None:
            audio = self.resampler.process(audio)
        if audio.size:
            self.input.send({"audio": audio})
