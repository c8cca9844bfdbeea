"""A session's turn detector by its config (`make_detector`), and `PauseScorer`, which runs the
end-of-turn model for a `semantic_vad` pause off the event loop.

`PauseScorer` keeps at most one score in flight per session: a new pause, a resumed speaker, a commit
or the session's end cancels the one before (its result would be for a pause that is over). The model
runs in a worker thread (`asyncio.to_thread`: onnxruntime releases the GIL), so a 50-100 ms prediction
never holds up other sessions' audio. A model that fails is logged and reads as "not complete": the
turn then ends at the eagerness's maximum silence, never stays open.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import numpy as np
import numpy.typing as npt

from voice_server.session.config import SessionConfig
from voice_server.session.conversation import SPEECH_RATE
from voice_server.session.semantic_vad import SemanticTurnDetector
from voice_server.session.vad import TurnDetector

__all__ = ["Detector", "OnScore", "PauseScorer", "make_detector"]

log = logging.getLogger(__name__)

Detector = TurnDetector | SemanticTurnDetector


def make_detector(config: SessionConfig) -> Detector | None:
    """The detector of `config.turn_detection` (None: manual turns). A `semantic_vad` one takes the session's
    input at 16 kHz (`InputBuffer.append`'s, what its models read), a `server_vad` one the input as it is."""
    turns = config.turn_detection
    if turns is None:
        return None
    if turns.is_semantic:
        return SemanticTurnDetector(turns, SPEECH_RATE)
    return TurnDetector(turns, config.input_rate)


OnScore = Callable[[int, float], Awaitable[None]]
"""Where a pause's score goes: `(token, probability)`."""


class PauseScorer:
    """NOTE: it keeps no reference to its session (only its task does, while it runs): session -> scorer ->
    session would be a reference cycle, and a closed session would wait for the cycle collector."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def score(self, detector: Detector | None, token: int, audio: npt.NDArray[np.int16], on_score: OnScore) -> None:
        """Score the turn in `audio` for the pause `token`, then hand the result to `on_score`."""
        if not isinstance(detector, SemanticTurnDetector):
            return
        self.cancel()
        self._task = asyncio.get_running_loop().create_task(self._run(detector, token, audio, on_score))

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None

    async def _run(self, detector: SemanticTurnDetector, token: int, audio: npt.NDArray[np.int16],
                   on_score: OnScore) -> None:
        try:
            probability = await asyncio.to_thread(detector.score, audio)
        except Exception:
            log.exception("the end-of-turn model failed; the turn ends at its maximum silence instead")
            probability = 0.0
        # NOTE: detached first: the handling may cancel "the score in flight", which is no longer this.
        if self._task is asyncio.current_task():
            self._task = None
        await on_score(token, probability)
