"""`Session`: one client connection's voice conversation, independent of the wire protocol.

The endpoint feeds it input audio (PCM16 at the session's input rate), text turns, commits, cancels
and playback reports, and sends out the `SessionEvent`s it emits. Turn detection runs on the input
audio (`TurnDetector` for `server_vad`, `SemanticTurnDetector` for `semantic_vad`); at the end of a user
turn the turn's audio (prefix padding included) becomes a user item and, with `create_response`, a
response starts (`ResponseRun`).

The parts, one file each: this one takes input and turn events; `StreamedTurns` (`streamed_turns.py`)
keeps a turn's request open while the user speaks and starts responses speculatively at pauses;
`Responses` (`responses.py`) runs responses, barge-ins and the interruptions that pause a reply first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from voice_server.audio import NARROWBAND_MAX_RATE
from voice_server.audio.denoise import NoiseSuppressor
from voice_server.session.config import SessionConfig
from voice_server.session.connection import Engine
from voice_server.session.conversation import SPEECH_RATE, Item, new_id, speech_item
from voice_server.session.detectors import PauseScorer, make_detector
from voice_server.session.end_of_turn import OnsetHeard, OnsetLost, Phase
from voice_server.session.events import (
    InputCommitted,
    ItemTruncated,
    SessionError,
    SessionEvent,
    SpeechStarted,
    SpeechStopped,
)
from voice_server.session.input_buffer import InputBuffer
from voice_server.session.interruptions import InterruptionRules, Verdict, judge
from voice_server.session.pause_words import read_pause_words
from voice_server.session.response import Emit, ResponseRun
from voice_server.session.semantic_vad import SemanticTurnDetector, SilenceStarted, SpeechResumed
from voice_server.session.streamed_turns import StreamedTurns
from voice_server.session.vad import SpeechStarted as VadStarted
from voice_server.session.vad import SpeechStopped as VadStopped

__all__ = ["Session"]

TRANSCRIPT_WAIT_S = 1.5
"""The longest a pause's score waits for the pause's final transcript and the thinker's first token (a failed
request never sends them)."""


async def _discard(event: SessionEvent) -> None:
    """`emit` of a closed session."""


def _suppressor(config: SessionConfig) -> NoiseSuppressor | None:
    """The session's noise suppressor (SuppressorUnavailable, naming the install command, if missing)."""
    return None if config.noise_reduction is None else NoiseSuppressor(config.input_rate)


class Session(StreamedTurns):
    def __init__(self, coordinator: Engine, config: SessionConfig, emit: Emit) -> None:
        super().__init__(coordinator, config, emit)
        self.detector = make_detector(config)
        self.interruption_rules = InterruptionRules()
        self._turn_lock = asyncio.Lock()
        self._scorer = PauseScorer()
        self.denoiser = _suppressor(config)

    # -- input ---------------------------------------------------------------------------------------

    async def on_audio(self, pcm16: npt.NDArray[np.int16]) -> None:
        if self.denoiser is not None:
            # NOTE: before everything: the turn detector, the turn's streamed audio and the committed item
            # all take the denoised audio (`delay_ms` behind, the same number of samples: one timeline).
            pcm16 = self.denoiser.process(pcm16)
        speech = self.input.append(pcm16)
        if self._turn is not None:
            await self._send_turn_audio(speech)
        detector = self.detector
        if detector is None:
            return
        # NOTE: under the lock, so that a pause's score (handled by its own task) and the audio's events
        # reach the state machine and the client in one order.
        async with self._turn_lock:
            await self._on_turn_events(detector.feed(speech if detector.input_rate == SPEECH_RATE else pcm16))
            if self.interruption is not None:
                await self._judge()

    async def _on_turn_events(self, events: Sequence[object]) -> None:
        detector = self.detector
        assert detector is not None
        for event in events:
            if isinstance(event, VadStarted):
                await self._on_speech_started(event)
            elif isinstance(event, OnsetHeard):
                if detector.config.interrupt_response:
                    await self.hold_at_onset()
            elif isinstance(event, OnsetLost):
                await self.release_onset()
            elif isinstance(event, SilenceStarted):
                if self.interruption is None:
                    self._scorer.score(detector, event.token, self.input.peek(self._turn_start_ms), self._on_score)
                # NOTE: over a reply, the pause is not scored as a turn's end (`_judge` decides first), but
                # its final transcript is what the judge weighs: the recogniser's confidence in each word.
                self._speculate()
            elif isinstance(event, SpeechResumed):
                self._scorer.cancel()
                await self._resume_turn()
            elif isinstance(event, VadStopped):
                self._scorer.cancel()
                await self._on_speech_stopped(event)

    async def _on_speech_started(self, event: VadStarted) -> None:
        assert self.detector is not None
        turns = self.detector.config
        self._turn_item_id, self._turn_start_ms = new_id("item"), event.audio_start_ms
        self._num_turn_speculations = 0
        if turns.interrupt_response and turns.is_semantic and self.interruption is None and self.is_playing():
            # NOTE: judged before it is a turn: `SpeechStarted` waits for the verdict (`_judge`).
            await self._pause(self._turn_item_id, event.audio_start_ms)
        else:
            await self.release_onset()
            await self.emit(SpeechStarted(self._turn_item_id, event.audio_start_ms))
            if turns.interrupt_response:
                await self.barge_in()
        if self.is_stream_input and turns.create_response:
            await self._open_turn(self._turn_item_id, event.audio_start_ms)

    async def _judge(self) -> None:
        """Confirm or dismiss the speech over a paused reply (`interruptions.py`)."""
        pending, detector, turn = self.interruption, self.detector, self._turn
        assert pending is not None and isinstance(detector, SemanticTurnDetector)
        # NOTE: only the pause's final transcript, and only the words the recogniser is sure of confirm: partial
        # hypotheses carry no confidence, and PocketSphinx hears "uh huh" as "at hand" or "fat half". The
        # words it is unsure of only keep a pause from dismissing early.
        words, heard = (turn.run.held_confident, turn.run.held_transcript or "") if turn is not None else ("", "")
        is_words_pending = turn is not None and turn.is_awaiting_transcript
        verdict = judge(pending, self.interruption_rules, speech_ms=detector.speech_ms, words=words,
                        silence_ms=detector.silence_ms, now=time.monotonic(), is_words_pending=is_words_pending,
                        heard=heard)
        if verdict is Verdict.CONFIRMED:
            await self._confirm()
            if detector.machine.phase is Phase.PAUSED:
                # NOTE: the speaker paused while this was judged ("Wait, stop." then silence): that pause's
                # score was never asked for, and without it the turn would end only at the maximum silence.
                self._scorer.score(detector, detector.machine.token, self.input.peek(self._turn_start_ms),
                                   self._on_score)
                self._speculate()
        elif verdict is Verdict.DISMISSED:
            await self._dismiss()
            # NOTE: the speech was not a turn: its request goes, the detector forgets it, nothing is committed.
            self._scorer.cancel()
            if turn is not None and turn.is_speculating:
                self.num_discarded_speculations += 1
            self._drop_turn()
            detector.reset()

    def _is_scoring_turn_end(self) -> bool:
        return isinstance(self.detector, SemanticTurnDetector)

    async def _on_score(self, token: int, probability: float) -> None:
        """A pause's end-of-turn score (`PauseScorer`), from its task (a stale token is ignored)."""
        turn = self._turn
        if turn is not None and turn.is_speculating:
            # NOTE: the words rules weigh the pause's final transcript and the thinker's reading of it. Under
            # load the recogniser runs behind the audio, and its last partial ends wherever it got to ("how
            # many legs does a"), which would hold a finished turn to the maximum silence. Waiting costs no
            # latency: the held reply cannot be heard before its transcript and its first token anyway.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._words_of(turn.run), TRANSCRIPT_WAIT_S)
        async with self._turn_lock:
            if not isinstance(self.detector, SemanticTurnDetector):
                return
            run = self._turn.run if self._turn is not None else None
            is_unfinished, is_maybe_unfinished = (False, False) if run is None else read_pause_words(
                run.held_transcript or "", run.last_partial, run.held_alternatives, run.held_turn_end_p,
                is_narrowband=self.config.input_rate <= NARROWBAND_MAX_RATE)
            await self._on_turn_events(self.detector.on_score(token, probability, is_unfinished, is_maybe_unfinished))

    @staticmethod
    async def _words_of(run: ResponseRun) -> None:
        """Until a speculative run has its final transcript and, for words, the thinker's first token."""
        await run.has_held_transcript.wait()
        if run.held_transcript and run.held_transcript.strip():
            await run.has_held_reply.wait()

    async def _on_speech_stopped(self, event: VadStopped) -> None:
        assert self.detector is not None
        item_id = self._turn_item_id or new_id("item")
        # NOTE: input arrives in real time, so the speech ended this long before now on the clock.
        self._speech_end_at = time.monotonic() - max(0, self.input.now_ms - event.speech_end_ms) / 1000.0
        await self.emit(SpeechStopped(item_id, event.audio_end_ms))
        is_committed = await self._commit_audio(item_id, self._turn_start_ms, event.audio_end_ms)
        if self._turn is not None:
            await self._end_turn(is_committed)
        elif is_committed and self.detector.config.create_response:
            await self.create_response()
        self._speech_end_at = None  # NOTE: only the response this turn starts answers it

    async def commit(self) -> None:
        """Manual turn end: everything buffered becomes the user's item."""
        await self._commit_audio(new_id("item"), self.input.start_ms, self.input.now_ms)

    async def clear(self) -> None:
        self.input.clear()
        self._scorer.cancel()
        if self.detector is not None:
            self.detector.reset()
        self._drop_turn()
        await self.release_onset()  # NOTE: the reset forgets the onset, which will never be lost now

    async def add_text(self, text: str, role: str = "user", item_id: str | None = None) -> Item:
        """A typed item (`item_id`: the client's own id, if it names one) at the end of the conversation."""
        return await self.add_item(Item(item_id or new_id("item"), role, text))

    async def add_item(self, item: Item) -> Item:
        """A client's item (a typed message, a function call or its output) at the end of the conversation;
        ValueError when an item of its id exists."""
        if self.conversation.get(item.item_id) is not None:
            raise ValueError(f"item_id: an item {item.item_id!r} exists already")
        self.conversation.add(item)
        call_id = item.call.call_id if item.kind == "function_call_output" and item.call is not None else ""
        await self.emit(InputCommitted(item.item_id, item.num_audio_ms, item.text, call_id=call_id,
                                       num_images=len(item.images)))
        return item

    def on_playback(self, played_ms: int) -> None:
        self.played_ms, self.played_at = max(0, int(played_ms)), time.monotonic()

    async def reconfigure(self, config: SessionConfig) -> None:
        """A new config (e.g. a protocol's `session.update`). A changed input rate or turn detection
        restarts turn detection and drops buffered input; the output rate applies from the next response.
        SuppressorUnavailable (nothing changed) when it asks for noise reduction and the model is missing."""
        # NOTE: near_field <-> far_field keeps the suppressor (the same model); turning it on or off mid-stream
        # moves the audio by its delay (35 ms at 16 kHz) at that point. Made first: it is what may fail.
        is_new_denoiser = (config.input_rate, config.noise_reduction is None) != (
            self.config.input_rate, self.config.noise_reduction is None)
        denoiser = _suppressor(config) if is_new_denoiser else self.denoiser
        if (config.input_rate, config.turn_detection) != (self.config.input_rate, self.config.turn_detection):
            self._scorer.cancel()
            self.detector = make_detector(config)
            self.input = InputBuffer(config.input_rate)
            self._drop_turn()
            await self.release_onset()  # NOTE: the old detector's onset will never be lost
        if is_new_denoiser and self.denoiser is not None:
            self.denoiser.close()
        self.denoiser, self.config = denoiser, config

    async def truncate(self, item_id: str, audio_end_ms: int) -> None:
        """The client says it played only `audio_end_ms` of an assistant item (ValueError if no such
        item or past its audio): cut the item's audio and text there."""
        item = self.conversation.truncate(item_id, audio_end_ms)
        await self.emit(ItemTruncated(item.item_id, item.num_audio_ms))

    async def _commit_audio(self, item_id: str, start_ms: int, end_ms: int) -> bool:
        audio = self.input.take(start_ms, end_ms)
        if audio.size == 0:
            await self.emit(SessionError("input_audio_buffer_commit_empty", "no audio to commit"))
            return False
        item = self.conversation.add(speech_item(item_id, audio, SPEECH_RATE, end_ms - start_ms))
        await self.emit(InputCommitted(item.item_id, item.num_audio_ms, is_buffer=True))
        return True

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
        if self.denoiser is not None:
            self.denoiser.close()  # NOTE: the model's C state, now rather than at the next collection
            self.denoiser = None
        self.emit, self._run, self._response, self.interruption = _discard, None, None, None
