"""What a `Session` tells its endpoint, one typed event per happening, independent of the protocol.

Each endpoint (`/ws`, later `/v1/realtime` and `/twilio/media`) maps these onto its own wire format.
Times are ms on the session's input timeline (`*_ms`) or ms after the request was submitted
(`timings_ms`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from voice_server.session.tools import ToolCall


@dataclass(frozen=True)
class SpeechStarted:
    item_id: str
    audio_start_ms: int


@dataclass(frozen=True)
class SpeechStopped:
    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class InputCommitted:
    item_id: str
    num_audio_ms: int
    text: str = ""
    is_buffer: bool = False
    """The item is the input buffer's audio (a detected or committed turn), not an item the client created."""
    call_id: str = ""
    """A tool's output (a `function_call_output` item): the call it answers; `text` is the output."""
    num_images: int = 0
    """The images the item holds (a user message with images)."""


@dataclass(frozen=True)
class InputTranscriptDelta:
    """More of a spoken user item's transcript (pipelines that transcribe; may precede the commit)."""

    item_id: str
    delta: str


@dataclass(frozen=True)
class InputTranscriptDone:
    """A spoken user item's final transcript (it may revise what the deltas said)."""

    item_id: str
    transcript: str


@dataclass(frozen=True)
class ResponseStarted:
    response_id: str
    item_id: str


@dataclass(frozen=True)
class ResponsePaused:
    """Speech started over the reply: its audio stops here (the server holds what comes; a client that
    can pause its playback holds what it queued) until `ResponseResumed` or the reply is cut.

    `is_tentative`: only a first window of speech, which may be a click (`OnsetHeard`): the server stops
    sending what a client would queue ahead (`Pacer`), and a client that pauses its own playback is not
    told (`/ws`): for the ~32-64 ms until the turn opens (a `ResponsePaused` proper) or the blip ends (a
    tentative `ResponseResumed`), the audio it holds plays on."""

    response_id: str
    is_tentative: bool = False


@dataclass(frozen=True)
class ResponseResumed:
    """The speech over the reply was not an interruption: the reply goes on from where it paused."""

    response_id: str
    is_tentative: bool = False


@dataclass(frozen=True)
class TextDelta:
    response_id: str
    item_id: str
    delta: str


@dataclass(frozen=True)
class AudioDelta:
    response_id: str
    item_id: str
    pcm16: npt.NDArray[np.int16]
    """Mono PCM at the session's output rate."""


@dataclass(frozen=True)
class ToolCalled:
    """The model called a function, checked against the response's tools (`ToolSet.check`): the client runs
    it and answers with its output. The call is a `function_call` item of the conversation."""

    response_id: str
    item_id: str
    call: ToolCall


@dataclass(frozen=True)
class ResponseDone:
    response_id: str
    item_id: str
    status: str
    """`completed`, `cancelled` (barge-in or cancel) or `failed`."""
    text: str
    num_audio_ms: int
    """Audio sent (or, after a barge-in, heard)."""
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Each stage's first output after the response started (`submit` excluded), and at the session:
    `first_audio_sent` (the first audio byte), `first_audible` (when the client hears the first audible
    frame, `PlayoutClock`) and, for a spoken turn, `end_of_speech` (<= 0: the user's speech ended this
    long before the response started; the reply gap a person perceives is `first_audible - end_of_speech`)
    and, for a response started speculatively, `pause` (<= 0: when it started, at the user's pause)."""
    error: str = ""
    usage: dict[str, int] = field(default_factory=dict)
    """Token counts the pipeline reported, as far as it did (`ResponseRun.usage`)."""


@dataclass(frozen=True)
class ItemTruncated:
    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class SessionError:
    code: str
    message: str


SessionEvent = (SpeechStarted | SpeechStopped | InputCommitted | InputTranscriptDelta | InputTranscriptDone
                | ResponseStarted | ResponsePaused | ResponseResumed | TextDelta | AudioDelta | ToolCalled
                | ResponseDone | ItemTruncated | SessionError)
