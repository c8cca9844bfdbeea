"""`StreamedTurns`: a spoken turn's request, open while the user speaks, and speculative responses; under
`Session` (`core.py`).

Streamed turns: with a pipeline that transcribes (`PipelineConfig.stream_input`) and turn detection
that creates responses, a turn's request opens at speech start and its audio (16 kHz int16) streams
to the entry stage while the user speaks (`OpenTurn`); the end of the turn ends the stream and starts
the response on the same request, so recognition is done when the user stops rather than starting then.

Speculative responses (`semantic_vad`): at a pause, before the turn is committed, the turn's input ends
(`_speculate`): the final transcript, the thinker and the first clause run during the pause, their
output held in the server (`ResponseRun.speculate`). The commit releases it at once; speech that
resumes drops the request (aborted in every stage) and opens the turn again with all its audio
(`_resume_turn`). At most `MAX_SPECULATIONS_PER_TURN` pauses of a turn speculate.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from voice_server.engine.requests import InputStream, RequestError
from voice_server.session.config import SessionConfig
from voice_server.session.connection import Engine
from voice_server.session.conversation import Item, new_id
from voice_server.session.events import ResponseStarted, SessionError
from voice_server.session.input_buffer import InputBuffer
from voice_server.session.response import Emit, ResponseRun
from voice_server.session.responses import Responses
from voice_server.session.tools import ToolSet

__all__ = ["MAX_SPECULATIONS_PER_TURN", "StreamedTurns"]

MAX_SPECULATIONS_PER_TURN = 3
"""Pauses of one turn that may start a speculative response (each one resumed costs the pipeline the
work done for it)."""


@dataclass
class OpenTurn:
    """A spoken turn whose request is open while the user speaks (`stream_input` pipelines)."""

    run: ResponseRun
    input: InputStream
    """The request's input: `send(payload)`, `end()`."""
    task: asyncio.Task[None]

    @property
    def is_speculating(self) -> bool:
        """The input ended at a pause (`ResponseRun.speculate`); the turn is not committed yet."""
        return self.input.is_ended

    @property
    def is_awaiting_transcript(self) -> bool:
        """Speculating, and the pause's final transcript (`ResponseRun.held_transcript`) not in yet."""
        return self.is_speculating and self.run.held_transcript is None

    def send(self, pcm16: npt.NDArray[np.int16]) -> None:
        """The next 16 kHz chunk (`InputBuffer`'s). Raises RequestError (OverloadError: the relay is full)
        when the chunk could not be sent."""
        if self.input.is_ended:
            return  # NOTE: speculating: the pause's silence is not the request's; speech resuming reopens it
        if pcm16.size:
            self.input.send({"audio": pcm16})  # NOTE: the asr stage takes 16 kHz int16 as it is


class StreamedTurns(Responses):
    def __init__(self, coordinator: Engine, config: SessionConfig, emit: Emit) -> None:
        super().__init__(coordinator, config, emit)
        self.is_stream_input = bool(coordinator.cfg.stream_input)
        """The pipeline transcribes turns as they are spoken (see the module docstring)."""
        self.input = InputBuffer(config.input_rate)
        self._turn: OpenTurn | None = None
        self._turn_item_id = ""
        self._turn_start_ms = 0
        self.num_speculations = 0
        """Responses started at a pause before the turn was committed (`_speculate`)..."""
        self.num_discarded_speculations = 0
        """...and those of them thrown away because the speaker went on."""
        self._num_turn_speculations = 0

    async def _open_turn(self, item_id: str, start_ms: int, partial_sent: str = "") -> None:
        """Speech started (or resumed after a speculative pause): open the turn's request and send the
        audio since `start_ms` (its padding); `partial_sent` is the transcript the client has already."""
        self._drop_turn()
        payload = {"messages": self.conversation.to_messages(self.config.instructions)}
        try:
            params = self.config.request_params()
            if self._is_scoring_turn_end():
                params["score_turn_end"] = True  # NOTE: the thinker scores the words at each pause (`core.py`)
            stream = self.coordinator.submit(payload, params, stream_input=True)
        except RequestError as exc:
            # NOTE: the turn goes on without it; its end falls back to a whole request.
            await self.emit(SessionError("pipeline_unavailable", str(exc)))
            return
        assert stream.input is not None  # NOTE: a stream_input request always has its input stream
        run = ResponseRun(new_id("resp"), Item(new_id("item"), "assistant", status="in_progress"),
                          self.config.output_rate, self.emit, item_id, self.conversation,
                          ToolSet.from_params(dict(self.config.params)))
        run.partial_sent = partial_sent
        self._turn = OpenTurn(run, stream.input, asyncio.create_task(self._respond_to(run, stream)))
        await self._send_turn_audio(self.input.peek(start_ms))

    async def _send_turn_audio(self, pcm16: npt.NDArray[np.int16]) -> None:
        assert self._turn is not None
        try:
            self._turn.send(pcm16)
        except RequestError as exc:
            # NOTE: a chunk lost would leave a hole in the turn: drop the streamed request; the turn's
            # end then sends the committed audio as a whole request (the pipeline transcribes it then).
            self._drop_turn()
            await self.emit(SessionError("pipeline_overloaded", f"streaming the turn failed: {exc}"))

    def _is_scoring_turn_end(self) -> bool:
        """Whether the turn detector weighs the thinker's score of the user's words (`semantic_vad`)."""
        return False

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
        self._response, self._run, self.played_ms, self.played_at = turn.task, turn.run, None, None
        await self.emit(ResponseStarted(turn.run.response_id, turn.run.item.item_id))
        if turn.run.is_held:
            await turn.run.release()

    def _drop_turn(self) -> None:
        if self._turn is not None:
            self._turn.task.cancel()  # NOTE: the request stream closes: aborted in every stage
            self._turn = None
