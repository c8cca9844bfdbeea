"""`Responses`: a session's responses, barge-in and interruptions, under `Session` (`core.py`).

One response at a time: a new one cancels the running one (as a barge-in would).

Barge-in: with `interrupt_response`, a confirmed user turn over a response cancels it (no audio is sent
after that moment; the request is aborted in every stage) and cuts the assistant item to what the
client played (its last playback report; without one, everything sent) and its text to the words
spoken up to there.

Interruptions a person would accept (`semantic_vad`): speech starting over a reply that is still
generating or still playing at the client first *pauses* it (`ResponsePaused`: the server holds what
the pipeline sends, the client holds what it queued) and is confirmed or dismissed (`Interruptions`,
`interruptions.py`): confirmed (words or enough speech), the user turn starts (`SpeechStarted`, which
the realtime clients flush on) and the barge-in above cuts the reply; dismissed (a backchannel, a
cough that got past the VAD, nothing within the wait), the reply resumes from where it paused
(`ResponseResumed`) and the speech is not a turn. `server_vad` barges in at once, as OpenAI's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from voice_server.engine.requests import RequestError, RequestStream
from voice_server.session.config import SessionConfig
from voice_server.session.connection import Engine
from voice_server.session.conversation import Conversation, Item, new_id
from voice_server.session.events import (
    ItemTruncated,
    ResponseDone,
    ResponsePaused,
    ResponseResumed,
    ResponseStarted,
    SpeechStarted,
)
from voice_server.session.interruptions import Interruption
from voice_server.session.response import Emit, ResponseRun
from voice_server.session.tools import ToolSet

__all__ = ["REPORT_GAP_S", "Responses"]

REPORT_GAP_S = 0.6
"""Playback reports come every ~250 ms while a client plays (the demo's rate); none for this long: stopped."""


class Responses:
    def __init__(self, coordinator: Engine, config: SessionConfig, emit: Emit) -> None:
        self.coordinator, self.config, self.emit = coordinator, config, emit
        self.conversation = Conversation()
        self._response: asyncio.Task[None] | None = None
        self._run: ResponseRun | None = None
        self.played_ms: int | None = None
        """The client's last playback report for the running (or last) response."""
        self.played_at: float | None = None
        """When it came (monotonic)."""
        self.num_barge_ins = 0
        self.interruption: Interruption | None = None
        """Speech over a reply, not yet confirmed or dismissed (`semantic_vad`)."""
        self._onset_held: str | None = None
        """The response whose audio a speech onset holds tentatively (`hold_at_onset`), if any."""
        self._speech_end_at: float | None = None
        """When the last spoken turn's speech ended (monotonic), for the next response's `end_of_speech`."""

    def _is_responding(self) -> bool:
        return self._response is not None and not self._response.done()

    def is_responding(self) -> bool:
        return self._is_responding()

    def is_playing(self) -> bool:
        """A response generates, or the client still plays what it was sent (`PlayoutClock`). A client that
        reports playback and has gone quiet for `REPORT_GAP_S` has stopped playing (a flush, a Stop button)."""
        run, now = self._run, time.monotonic()
        if self._is_responding():
            return True
        if run is None or run.playout.play_end_at <= now:
            return False
        return self.played_at is None or now - self.played_at < REPORT_GAP_S

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
        merged = {**self.config.request_params(), **(params or {})}
        run = ResponseRun(response_id, item, self.config.output_rate, self.emit,
                          self.conversation.last_untranscribed_id(), self.conversation, ToolSet.from_params(merged))
        run.speech_end_at, self._speech_end_at = self._speech_end_at, None
        self._run, self.played_ms, self.played_at = run, None, None
        await self.emit(ResponseStarted(response_id, item.item_id))
        self._response = asyncio.create_task(self._respond(run, payload, merged))
        return response_id

    async def _respond(self, run: ResponseRun, payload: dict[str, Any], params: dict[str, Any]) -> None:
        run.start()
        try:
            stream = self.coordinator.submit(payload, params)
        except RequestError as exc:
            await self._finish(run, str(exc))
            return
        await self._respond_to(run, stream)

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

    # -- interruptions -------------------------------------------------------------------------------

    async def hold_at_onset(self) -> None:
        """A first window of speech over a reply playing: hold its paced audio until a turn opens (`_pause`
        takes the hold over) or the onset fades (`release_onset`). Why: at a barge-in, the turn opens a
        window or two (Silero's `min_speech_ms`) after the first one, and every window held earlier is
        audio the caller hears less of over their own words."""
        run = self._run
        if run is None or self._onset_held is not None or self.interruption is not None or not self.is_playing():
            return
        self._onset_held = run.response_id
        await self.emit(ResponsePaused(run.response_id, is_tentative=True))

    async def release_onset(self) -> None:
        """The onset held at `hold_at_onset` opened no interruption: the paced audio goes on."""
        response_id, self._onset_held = self._onset_held, None
        if response_id is not None and self.interruption is None:
            await self.emit(ResponseResumed(response_id, is_tentative=True))

    async def _pause(self, item_id: str, audio_start_ms: int) -> None:
        """Speech started over a reply: hold it until the speech is confirmed or dismissed."""
        run = self._run
        assert run is not None
        self._onset_held = None  # NOTE: the interruption holds it now
        is_generating = self._is_responding()
        if is_generating:
            run.hold()
        self.interruption = Interruption(run.response_id, item_id, audio_start_ms, time.monotonic(),
                                         run if is_generating else None)
        await self.emit(ResponsePaused(run.response_id))

    async def _confirm(self) -> None:
        """The speech over the reply is a turn: it starts (the deferred `SpeechStarted`) and cuts the reply."""
        pending, self.interruption = self.interruption, None
        assert pending is not None
        await self.emit(SpeechStarted(pending.item_id, pending.audio_start_ms))
        await self.barge_in()

    async def _dismiss(self) -> None:
        """The speech over the reply was not an interruption: the reply goes on from where it paused."""
        pending, self.interruption = self.interruption, None
        assert pending is not None
        await self.emit(ResponseResumed(pending.response_id))
        if pending.run is not None and pending.run is self._run and self._is_responding():
            await pending.run.release()
