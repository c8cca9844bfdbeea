"""`Session`: one client connection's voice conversation, independent of the wire protocol.

The endpoint feeds it input audio (PCM16 at the session's input rate), text turns, commits, cancels
and playback reports, and sends out the `SessionEvent`s it emits. Turn detection runs on the input
audio (`TurnDetector`); at the end of a user turn the turn's audio (prefix padding included) becomes a
user item and, with `create_response`, a response starts (`ResponseRun`).

Barge-in: speech that starts while a response is running, with `interrupt_response`, cancels the
response at once (no audio is sent after that moment; the request is aborted in every stage) and cuts
the assistant item to what the client played (its last playback report; without one, everything
sent) and its text to the words spoken up to there.

One response at a time: a new one cancels the running one (as a barge-in would).

Streamed turns: with a pipeline that transcribes (`PipelineConfig.stream_input`) and server VAD that
creates responses, a turn's request opens at speech start and its audio (16 kHz float32) streams to
the entry stage while the user speaks (`OpenTurn`); the end of the turn ends the stream and starts the
response on the same request, so recognition is done when the user stops rather than starting then.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import StreamResampler, pcm16_to_float32
from voice_server.engine.requests import RequestError, RequestStream
from voice_server.session.config import SessionConfig
from voice_server.session.conversation import SPEECH_RATE, Conversation, Item, new_id
from voice_server.session.detectors import PauseScorer, make_detector
from voice_server.session.end_of_turn import UNFINISHED_SCORE, words_suggest_more
from voice_server.session.events import (
    InputCommitted,
    ItemTruncated,
    ResponseDone,
    ResponseStarted,
    SessionError,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
)
from voice_server.session.response import Emit, OpenTurn, ResponseRun
from voice_server.session.semantic_vad import SemanticTurnDetector, SilenceStarted, SpeechResumed
from voice_server.session.vad import SpeechStarted as VadStarted
from voice_server.session.vad import SpeechStopped as VadStopped


async def _discard(event: SessionEvent) -> None:
    """`emit` of a closed session."""


MAX_BUFFER_S = 120
"""Input audio a turn keeps at least (at most `MAX_BUFFER_S + TRIM_SLACK_S`); older audio is dropped (a
turn that never ends)."""
TRIM_SLACK_S = 10
MAX_SPECULATIONS_PER_TURN = 3
"""Pauses of one turn that may start a speculative response (each one resumed costs the pipeline the
work done for it)."""
"""How far the buffer may grow past `MAX_BUFFER_S` before it is trimmed back to it."""


class Session:
    def __init__(self, coordinator: Any, config: SessionConfig, emit: Emit) -> None:
        self.coordinator, self.config, self.emit = coordinator, config, emit
        self.is_stream_input = bool(coordinator.cfg.stream_input)
        """The pipeline transcribes turns as they are spoken (see the module docstring)."""
        self._turn: OpenTurn | None = None
        self.conversation = Conversation()
        self.detector = make_detector(config)
        self._turn_lock = asyncio.Lock()
        self._scorer = PauseScorer()
        self._buffer: list[npt.NDArray[np.int16]] = []
        self._buffer_start_ms = 0
        """Input timeline position of the first buffered sample."""
        self._num_input_samples = 0
        self._turn_item_id = ""
        self._turn_start_ms = 0
        self._response: asyncio.Task[None] | None = None
        self._run: ResponseRun | None = None
        self.played_ms: int | None = None
        """The client's last playback report for the running (or last) response."""
        self.num_barge_ins = 0
        self.num_speculations = 0
        """Responses started at a pause before the turn was committed (`_speculate`)..."""
        self.num_discarded_speculations = 0
        """...and those of them thrown away because the speaker went on."""
        self._num_turn_speculations = 0
        self._speech_end_at: float | None = None
        """When the last spoken turn's speech ended (monotonic), for the next response's `end_of_speech`."""

    # -- input ---------------------------------------------------------------------------------------

    async def on_audio(self, pcm16: npt.NDArray[np.int16]) -> None:
        self._buffer.append(pcm16)
        self._num_input_samples += pcm16.size
        self._trim_buffer()
        if self._turn is not None:
            await self._send_turn_audio(pcm16)
        if self.detector is None:
            return
        # NOTE: under the lock, so that a pause's score (handled by its own task) and the audio's events
        # reach the state machine and the client in one order.
        async with self._turn_lock:
            await self._on_turn_events(self.detector.feed(pcm16))

    async def _on_turn_events(self, events: Sequence[object]) -> None:
        detector = self.detector
        assert detector is not None
        for event in events:
            if isinstance(event, VadStarted):
                self._turn_item_id, self._turn_start_ms = new_id("item"), event.audio_start_ms
                self._num_turn_speculations = 0
                await self.emit(SpeechStarted(self._turn_item_id, event.audio_start_ms))
                if detector.config.interrupt_response:
                    await self.barge_in()
                if self.is_stream_input and detector.config.create_response:
                    await self._open_turn(self._turn_item_id, event.audio_start_ms)
            elif isinstance(event, SilenceStarted):
                self._scorer.score(detector, event.token, self._peek(self._turn_start_ms), self._on_score)
                self._speculate()
            elif isinstance(event, SpeechResumed):
                self._scorer.cancel()
                await self._resume_turn()
            elif isinstance(event, VadStopped):
                self._scorer.cancel()
                await self._on_speech_stopped(event)

    async def _on_score(self, token: int, probability: float) -> None:
        """A pause's end-of-turn score (`PauseScorer`), from its task (a stale token is ignored)."""
        async with self._turn_lock:
            if not isinstance(self.detector, SemanticTurnDetector):
                return
            if self._turn is not None:
                run = self._turn.run
                words = run.held_transcript if run.held_transcript is not None else run.partial_sent
                if words_suggest_more(words):
                    probability = min(probability, UNFINISHED_SCORE)
            await self._on_turn_events(self.detector.on_score(token, probability))

    async def _on_speech_stopped(self, event: VadStopped) -> None:
        assert self.detector is not None
        item_id = self._turn_item_id or new_id("item")
        # NOTE: input arrives in real time, so the speech ended this long before now on the clock.
        input_ms = self._num_input_samples * 1000 / self.config.input_rate
        self._speech_end_at = time.monotonic() - max(0.0, input_ms - event.speech_end_ms) / 1000.0
        await self.emit(SpeechStopped(item_id, event.audio_end_ms))
        is_committed = await self._commit_audio(item_id, self._turn_start_ms, event.audio_end_ms)
        if self._turn is not None:
            await self._end_turn(is_committed)
        elif is_committed and self.detector.config.create_response:
            await self.create_response()
        self._speech_end_at = None  # NOTE: only the response this turn starts answers it

    async def commit(self) -> None:
        """Manual turn end: everything buffered becomes the user's item."""
        end_ms = self._num_input_samples * 1000 // self.config.input_rate
        await self._commit_audio(new_id("item"), self._buffer_start_ms, end_ms)

    def clear(self) -> None:
        self._buffer, self._buffer_start_ms = [], self._num_input_samples * 1000 // self.config.input_rate
        self._scorer.cancel()
        if self.detector is not None:
            self.detector.reset()
        self._drop_turn()

    async def add_text(self, text: str, role: str = "user", item_id: str | None = None) -> Item:
        """A typed item (`item_id`: the client's own id, if it names one) at the end of the conversation."""
        if item_id is not None and self.conversation.get(item_id) is not None:
            raise ValueError(f"item_id: an item {item_id!r} exists already")
        item = self.conversation.add(Item(item_id or new_id("item"), role, text))
        await self.emit(InputCommitted(item.item_id, 0, text))
        return item

    def on_playback(self, played_ms: int) -> None:
        self.played_ms = max(0, int(played_ms))

    def reconfigure(self, config: SessionConfig) -> None:
        """A new config (e.g. a protocol's `session.update`). A changed input rate or turn detection
        restarts turn detection and drops buffered input; the output rate applies from the next response."""
        if (config.input_rate, config.turn_detection) != (self.config.input_rate, self.config.turn_detection):
            self._scorer.cancel()
            self.detector = make_detector(config)
            self._buffer, self._buffer_start_ms, self._num_input_samples = [], 0, 0
            self._drop_turn()
        self.config = config

    async def truncate(self, item_id: str, audio_end_ms: int) -> None:
        """The client says it played only `audio_end_ms` of an assistant item (ValueError if no such
        item or past its audio): cut the item's audio and text there."""
        item = self.conversation.truncate(item_id, audio_end_ms)
        await self.emit(ItemTruncated(item.item_id, item.num_audio_ms))

    async def _commit_audio(self, item_id: str, start_ms: int, end_ms: int) -> bool:
        audio = self._take(start_ms, end_ms)
        if audio.size == 0:
            await self.emit(SessionError("input_audio_buffer_commit_empty", "no audio to commit"))
            return False
        speech = audio if self.config.input_rate == SPEECH_RATE else StreamResampler(
            self.config.input_rate, SPEECH_RATE).process(audio)
        item = self.conversation.add(Item(item_id, "user", audio=speech, num_audio_ms=end_ms - start_ms))
        await self.emit(InputCommitted(item.item_id, item.num_audio_ms))
        return True

    def _take(self, start_ms: int, end_ms: int) -> npt.NDArray[np.float32]:
        """The buffered input between two timeline positions, as float32; the buffer restarts at `end_ms`."""
        pcm = np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int16)
        rate = self.config.input_rate
        first = max(0, (start_ms - self._buffer_start_ms) * rate // 1000)
        last = max(first, (end_ms - self._buffer_start_ms) * rate // 1000)
        rest = pcm[last:]
        self._buffer = [rest] if rest.size else []
        self._buffer_start_ms = end_ms
        return pcm16_to_float32(pcm[first:last])

    def _peek(self, start_ms: int) -> npt.NDArray[np.int16]:
        """The buffered input from `start_ms` to now, at the input rate (the buffer is left as it is)."""
        pcm = np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int16)
        return pcm[max(0, (start_ms - self._buffer_start_ms) * self.config.input_rate // 1000):]

    def _trim_buffer(self) -> None:
        # NOTE: the length comes from the timeline (not a pass over the chunks for every chunk) and the
        # trim leaves TRIM_SLACK_S of room: a turn that never ends (an open line nobody speaks on) costs
        # one copy of the buffer per TRIM_SLACK_S instead of one per 20 ms chunk.
        rate = self.config.input_rate
        if self._num_input_samples * 1000 // rate - self._buffer_start_ms <= (MAX_BUFFER_S + TRIM_SLACK_S) * 1000:
            return
        pcm = np.concatenate(self._buffer)[-MAX_BUFFER_S * rate:].copy()  # NOTE: a copy frees the rest
        self._buffer = [pcm]
        self._buffer_start_ms = (self._num_input_samples - pcm.size) * 1000 // rate

    # -- responses -------------------------------------------------------------------------------------

    def _is_responding(self) -> bool:
        return self._response is not None and not self._response.done()

    def is_responding(self) -> bool:
        return self._is_responding()

    async def create_response(self, params: dict[str, Any] | None = None, instructions: str | None = None) -> str:
        """Start a response (`params` over the session's; `instructions` in place of the session's, for
        this response only)."""
        if self._is_responding():
            await self.cancel_response()
        response_id = new_id("resp")
        item = self.conversation.add(Item(new_id("item"), "assistant", status="in_progress"))
        payload = {"messages": self.conversation.to_messages(
            self.config.instructions if instructions is None else instructions)}
        # NOTE: the new item is in the conversation (it is the reply) but not in the payload: empty.
        run = ResponseRun(response_id, item, self.config.output_rate, self.emit,
                          self.conversation.last_untranscribed_id(), self.conversation)
        run.speech_end_at, self._speech_end_at = self._speech_end_at, None
        self._run, self.played_ms = run, None
        await self.emit(ResponseStarted(response_id, item.item_id))
        self._response = asyncio.create_task(self._respond(run, payload, {**dict(self.config.params),
                                                                            **(params or {})}))
        return response_id

    async def _respond(self, run: ResponseRun, payload: dict[str, Any], params: dict[str, Any]) -> None:
        run.start()
        try:
            stream = self.coordinator.submit(payload, params)
        except RequestError as exc:
            await self._finish(run, str(exc))
            return
        await self._respond_to(run, stream)

    # -- streamed turns ---------------------------------------------------------------------------------

    async def _open_turn(self, item_id: str, start_ms: int, partial_sent: str = "") -> None:
        """Speech started (or resumed after a speculative pause): open the turn's request and send the
        audio since `start_ms` (its padding); `partial_sent` is the transcript the client has already."""
        self._drop_turn()
        payload = {"messages": self.conversation.to_messages(self.config.instructions)}
        try:
            stream = self.coordinator.submit(payload, dict(self.config.params), stream_input=True)
        except RequestError as exc:
            # NOTE: the turn goes on without it; its end falls back to a whole request.
            await self.emit(SessionError("pipeline_unavailable", str(exc)))
            return
        run = ResponseRun(new_id("resp"), Item(new_id("item"), "assistant", status="in_progress"),
                          self.config.output_rate, self.emit, item_id, self.conversation)
        run.partial_sent = partial_sent
        rate = self.config.input_rate
        resampler = None if rate == SPEECH_RATE else StreamResampler(rate, SPEECH_RATE)
        self._turn = OpenTurn(run, stream.input, asyncio.create_task(self._respond_to(run, stream)), resampler)
        pcm = np.concatenate(self._buffer) if self._buffer else np.zeros(0, np.int16)
        await self._send_turn_audio(pcm[max(0, (start_ms - self._buffer_start_ms) * rate // 1000):])

    async def _send_turn_audio(self, pcm16: npt.NDArray[np.int16]) -> None:
        assert self._turn is not None
        try:
            self._turn.send(pcm16)
        except RequestError as exc:
            # NOTE: a chunk lost would leave a hole in the turn: drop the streamed request; the turn's
            # end then sends the committed audio as a whole request (the pipeline transcribes it then).
            self._drop_turn()
            await self.emit(SessionError("pipeline_overloaded", f"streaming the turn failed: {exc}"))

    def _speculate(self) -> None:
        """A pause: the turn may be over. End its request's input now (the final transcript, the thinker
        and the first clause run during the pause), holding what comes back until the turn is committed."""
        turn = self._turn
        if turn is None or turn.is_speculating or turn.task.done():
            return
        if self._num_turn_speculations >= MAX_SPECULATIONS_PER_TURN:
            return  # NOTE: a speaker who keeps pausing: the commit starts the response as without speculation
        self._num_turn_speculations += 1
        self.num_speculations += 1
        turn.run.speculate()
        turn.input.end()

    async def _resume_turn(self) -> None:
        """The speaker went on after a pause: a speculative request is dropped (aborted in every stage) and
        the turn's request opens again with all its audio so far."""
        turn = self._turn
        if turn is None or not turn.is_speculating:
            return
        self.num_discarded_speculations += 1
        await self._open_turn(self._turn_item_id, self._turn_start_ms, turn.run.partial_sent)

    async def _end_turn(self, is_committed: bool) -> None:
        """Speech stopped: the turn's stream ends and, with its audio committed, its response starts."""
        turn, self._turn = self._turn, None
        assert turn is not None
        if not is_committed:
            turn.task.cancel()
            return
        if self._is_responding():
            await self.cancel_response()
        if turn.task.done():
            # NOTE: the streamed request failed while the user spoke (e.g. every decoder busy): the
            # committed audio goes as a whole request, which reports its own outcome.
            await self.create_response()
            return
        turn.input.end()
        self.conversation.add(turn.run.item)
        turn.run.speech_end_at, self._speech_end_at = self._speech_end_at, None
        turn.run.start()  # NOTE: no await since the check above: the task cannot have ended unseen
        self._response, self._run, self.played_ms = turn.task, turn.run, None
        await self.emit(ResponseStarted(turn.run.response_id, turn.run.item.item_id))
        if turn.run.is_held:
            await turn.run.release()

    def _drop_turn(self) -> None:
        if self._turn is not None:
            self._turn.task.cancel()  # NOTE: the request stream closes: aborted in every stage
            self._turn = None

    async def _respond_to(self, run: ResponseRun, stream: RequestStream) -> None:
        error = await run.consume(stream)
        if run.started_at == 0.0:
            return  # NOTE: the turn was dropped before its response started: nothing to report
        await self._finish(run, error)

    async def _finish(self, run: ResponseRun, error: str) -> None:
        run.item.status = "incomplete" if error else "completed"
        await self.emit(ResponseDone(run.response_id, run.item.item_id, "failed" if error else "completed",
                                     run.item.text, run.item.num_audio_ms, dict(run.timings_ms), error,
                                     dict(run.usage)))

    async def cancel_response(self) -> bool:
        """Stop the running response where it is (audio sent so far stays sent); False if none runs."""
        run = await self._stop()
        if run is None:
            return False
        await self._done(run, "cancelled")
        return True

    async def barge_in(self) -> None:
        """The user speaks over the response: cancel it and keep only what the client played (its
        last playback report; without one, all the audio sent). The truncation comes before the
        cancelled `ResponseDone`, which then reports what was heard.

        A response that finished generating may still be playing (generation runs faster than real
        time): with a playback report short of its audio, its item is cut to what was played too."""
        run = await self._stop()
        if run is None:
            await self._cut_to_played()
            return
        self.num_barge_ins += 1
        heard = run.item.num_audio_ms if self.played_ms is None else min(self.played_ms, run.item.num_audio_ms)
        self.conversation.truncate(run.item.item_id, heard)
        await self.emit(ItemTruncated(run.item.item_id, heard))
        await self._done(run, "cancelled")

    async def _cut_to_played(self) -> None:
        run, played = self._run, self.played_ms
        if run is None or played is None or run.item.status == "in_progress" or played >= run.item.num_audio_ms:
            return
        if self.conversation.get(run.item.item_id) is None:
            return  # NOTE: the client deleted the item meanwhile
        self.num_barge_ins += 1
        self.conversation.truncate(run.item.item_id, played)
        await self.emit(ItemTruncated(run.item.item_id, played))

    async def _stop(self) -> ResponseRun | None:
        task, run = self._response, self._run
        if task is None or run is None or task.done():
            return None
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        run.item.status = "incomplete"
        return run

    async def _done(self, run: ResponseRun, status: str) -> None:
        await self.emit(ResponseDone(run.response_id, run.item.item_id, status, run.item.text,
                                     run.item.num_audio_ms, dict(run.timings_ms), usage=dict(run.usage)))

    async def close(self) -> None:
        """The connection ended: abort whatever runs (the request leaves every stage), and let go of the
        connection.

        NOTE: the connection holds its session, and the session and its runs hold the connection's `emit`:
        a reference cycle, so a closed session (socket, zlib streams, audio buffers, the conversation's
        audio) would wait for a full garbage collection, which a server with a large heap runs rarely (a
        10-minute soak grew the server by 8.5 MB/min). Dropping `emit` and the last run here lets reference
        counting free it all at once; nothing may reach the client after this anyway."""
        self._scorer.cancel()
        self._drop_turn()
        await self.cancel_response()
        self.emit, self._run, self._response = _discard, None, None
