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

Cancellation (barge-in, `response.cancel`, the client gone) cancels the task running `consume`: the
request stream closes, which aborts the request in every stage (`RequestStream`), and nothing more
is sent to the client from the moment the task is cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from voice_server.audio import PlayoutClock, StreamResampler, float32_to_pcm16
from voice_server.engine.requests import RequestError, RequestStream, TerminalOutput
from voice_server.session.conversation import Conversation, Item, new_id
from voice_server.session.events import (
    AudioDelta,
    InputTranscriptDelta,
    InputTranscriptDone,
    SessionError,
    SessionEvent,
    TextDelta,
    ToolCalled,
)
from voice_server.session.tools import ToolCallError, ToolSet

Emit = Callable[[SessionEvent], Awaitable[None]]


class ResponseRun:
    def __init__(self, response_id: str, item: Item, output_rate: int, emit: Emit,
                 user_item_id: str = "", conversation: Conversation | None = None,
                 tools: ToolSet | None = None) -> None:
        self.response_id, self.item, self.output_rate, self.emit = response_id, item, output_rate, emit
        self.tools = tools
        """What this response may call (from its request params); its calls are checked against it."""
        self.num_tool_calls = 0
        self.user_item_id = user_item_id
        """The spoken user item this response answers, which a transcribing pipeline transcribes."""
        self.conversation = conversation
        """Where the final transcript lands on the user item.

        NOTE: the conversation, not a callback into the session: a bound method of the session here made
        session -> run -> session a reference cycle, so every closed session (its socket, audio buffers,
        zlib streams, conversation audio) waited for a full garbage collection, which a server with a
        large heap runs rarely: +8.5 MB/min over a 10-minute soak."""
        self.partial_sent = ""
        """The live transcript the client has been sent (deltas only ever extend it)."""
        self.last_partial = ""
        """The recogniser's latest partial hypothesis, revisions included."""
        self.timings_ms: dict[str, float] = {}
        self.usage: dict[str, int] = {}
        """`num_prompt_tokens`, `num_cached_tokens`, `num_output_tokens`, from the final outputs that carry them,
        else output tokens counted as text deltas (one per step in the AR stages)."""
        self.started_at = 0.0
        """When the response started: its submit, or the end of a streamed turn (`start`)."""
        self.speech_end_at: float | None = None
        """When the user's speech that this response answers ended (the turn detector's estimate; the
        end-of-turn silence lies between it and `started_at`), for spoken turns."""
        self.playout = PlayoutClock(output_rate)
        """When the client hears what was sent: `first_audible` is the latency a person perceives."""
        self.num_samples = 0
        self._resampler: StreamResampler | None = None
        self._resampler_rate = 0
        self.opened_at = 0.0
        """Since when stage outputs count as this response's (`speculate` or `start`)."""
        self.is_held = False
        """A speculative response: its outputs wait in `_held` until `release` (or the run is dropped)."""
        self._held: deque[tuple[TerminalOutput, float]] = deque()
        """Outputs not yet handled, with their arrival times."""
        self._drain_lock = asyncio.Lock()
        self._released = asyncio.Event()
        self._stamps: dict[str, float] = {}
        self.held_transcript: str | None = None
        """The final transcript of the audio up to the pause, once a held response has it..."""
        self.held_confident = ""
        """...its words that the recogniser is sure of (all of them where it gives no confidences)..."""
        self.held_alternatives: list[str] = []
        """...the recogniser's other hypotheses where it is unsure of the last word..."""
        self.has_held_transcript = asyncio.Event()
        """...and set then."""
        self.held_turn_end_p: float | None = None
        """The thinker's probability that the user's words end where the transcript does (`turn_end_p`, with
        its first token, where the request asked for it: `score_turn_end`)..."""
        self.has_held_reply = asyncio.Event()
        """...set at the thinker's first output (with or without that score), or when the request ended."""

    def _since_start_ms(self, at: float) -> float:
        return round(1000.0 * (at - self.started_at), 3)

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.opened_at = self.opened_at or self.started_at
        if self.speech_end_at is not None:
            self.timings_ms["end_of_speech"] = self._since_start_ms(self.speech_end_at)
        for stage, at in self._stamps.items():
            # NOTE: negative for what a speculative response had done before its turn was committed.
            self.timings_ms.setdefault(stage, self._since_start_ms(at))

    def speculate(self) -> None:
        """The turn's input ended at a pause the turn may not end at: run on, but keep what comes back."""
        self.opened_at, self.is_held = time.monotonic(), True
        # NOTE: in `timings_ms` (negative): where a reply's wait went before the commit (the pause, then the
        # stages' first outputs) is what a slow turn needs explained.
        self._stamps.setdefault("pause", self.opened_at)

    def hold(self) -> None:
        """Keep what comes back from here on until `release` (speech over the reply, to be judged)."""
        self.is_held = True
        self._released.clear()

    async def release(self) -> None:
        """The turn was committed: send everything held back, in order, then stream on (call after `start`)."""
        self.is_held = False
        self._released.set()
        await self._drain()

    async def consume(self, stream: RequestStream) -> str:
        """Stream an already submitted request's outputs (`RequestStream`); '' or the error message."""
        try:
            async for output in stream:
                if self.is_held:
                    if _is_partial_only(output):
                        async with self._drain_lock:  # NOTE: the live transcript goes on; nothing else is sent
                            await self._on_output(output, time.monotonic())
                    else:
                        self._keep_transcript(output.payload)
                        self._held.append((output, time.monotonic()))
                    continue
                self._held.append((output, time.monotonic()))
                await self._drain()
        except RequestError as exc:
            return str(exc)
        finally:
            self.has_held_reply.set()  # NOTE: no output is coming: nothing may wait for one
            await stream.aclose()
        if self.is_held:
            await self._released.wait()  # NOTE: the whole speculative response came back before the commit
        await self._drain()
        tail = self._resampler.flush() if self._resampler is not None else None
        if tail is not None and tail.size:
            await self._send_audio(tail)
        if self.tools is not None:
            try:
                self.tools.check_done(self.num_tool_calls)
            except ToolCallError as exc:
                await self.emit(SessionError(exc.code, str(exc)))
        return ""

    def _keep_transcript(self, payload: dict[str, Any]) -> None:
        """A held output's final transcript, for the turn detector and the interruption judge, and the
        thinker's score of the user's words."""
        if "token_ids" in payload and not self.has_held_reply.is_set():  # NOTE: the thinker's first token
            score = payload.get("turn_end_p")
            self.held_turn_end_p = float(score) if isinstance(score, float | int) else None
            self.has_held_reply.set()
        final = payload.get("input_transcript")
        if not isinstance(final, str):
            return
        confident = payload.get("input_transcript_confident", final)
        alternatives = payload.get("input_transcript_alternatives")
        self.held_transcript = final
        self.held_confident = confident if isinstance(confident, str) else ""
        self.held_alternatives = [a for a in alternatives if isinstance(a, str)] if isinstance(
            alternatives, list) else []
        self.has_held_transcript.set()

    async def _drain(self) -> None:
        # NOTE: `release` (the session's task) and `consume` (the run's) both drain; one at a time, in order.
        async with self._drain_lock:
            while self._held:
                await self._on_output(*self._held.popleft())

    async def _on_output(self, output: TerminalOutput, arrived_at: float) -> None:
        if self.opened_at:
            for stage, at in output.timings.items():
                if stage != "submit" and at >= self.opened_at and stage not in self._stamps:
                    self._stamps[stage] = at
                    if self.started_at:
                        self.timings_ms.setdefault(stage, self._since_start_ms(at))
        await self._on_transcript(output.payload, arrived_at)
        if output.is_final:
            self._count_tokens(output.payload)
            return
        calls = output.payload.get("tool_calls")
        if isinstance(calls, list) and self.tools is not None:
            await self._on_tool_calls(self.tools, calls)
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

    async def _on_tool_calls(self, tools: ToolSet, calls: list[Any]) -> None:
        """The thinker's raw calls (cut out of the spoken text): each checked, then a `function_call` item
        and `ToolCalled`, or a `SessionError` naming what failed (nothing of it was spoken either way)."""
        for raw in calls:
            try:
                call = tools.check(raw if isinstance(raw, str) else "", new_id("call"))
            except ToolCallError as exc:
                await self.emit(SessionError(exc.code, str(exc)))
                continue
            self.num_tool_calls += 1
            item = Item(new_id("item"), "assistant", kind="function_call", call=call)
            if self.conversation is not None:
                self.conversation.add(item)
            await self.emit(ToolCalled(self.response_id, item.item_id, call))

    async def _on_transcript(self, payload: dict[str, Any], arrived_at: float) -> None:
        partial, final = payload.get("input_transcript_partial"), payload.get("input_transcript")
        if isinstance(partial, str):
            self.last_partial = partial
        if isinstance(partial, str) and partial.startswith(self.partial_sent) and partial != self.partial_sent:
            # NOTE: a recogniser revises its hypothesis; deltas are append-only, so a revision waits
            # for the final transcript (which replaces the deltas) or for the text to grow past it.
            delta, self.partial_sent = partial[len(self.partial_sent):], partial
            await self.emit(InputTranscriptDelta(self.user_item_id, delta))
        if isinstance(final, str):
            if self.opened_at:
                at = self._stamps.setdefault("transcript", arrived_at)
                if self.started_at:
                    self.timings_ms.setdefault("transcript", self._since_start_ms(at))
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
        playout = self.playout
        was_audible = playout.first_audible_at is not None
        playout.sent(pcm16, time.monotonic())
        if "first_audio_sent" not in self.timings_ms and playout.first_byte_at is not None:
            self.timings_ms["first_audio_sent"] = self._since_start_ms(playout.first_byte_at)
        if not was_audible and playout.first_audible_at is not None:
            self.timings_ms["first_audible"] = self._since_start_ms(playout.first_audible_at)
        self.num_samples += pcm16.size
        self.item.num_audio_ms = self.num_samples * 1000 // self.output_rate
        await self.emit(AudioDelta(self.response_id, self.item.item_id, pcm16))


def _is_partial_only(output: TerminalOutput) -> bool:
    """An output that only revises the user's live transcript: shown at once even while a response is held."""
    payload = output.payload
    return (not output.is_final and "input_transcript_partial" in payload
            and not any(key in payload for key in ("input_transcript", "text", "pcm")))
