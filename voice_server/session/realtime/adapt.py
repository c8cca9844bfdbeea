"""Between the Realtime protocol and the session core: the session config, input audio in, output audio out,
and the pace guard on appended audio.

Config mapping (a Realtime ``SessionConfig`` -> the core's):

- ``audio.input.format``: ``audio/pcm`` runs the session at ``input_rate`` 24000; ``audio/pcmu`` and
  ``audio/pcma`` are decoded to PCM16 at 8 kHz and the session runs at ``input_rate`` 8000 (no
  resampling before turn detection: the detector works at any supported rate). The output format
  likewise sets ``output_rate`` (24000 or 8000) and how each audio delta is encoded.
- ``instructions``; ``turn_detection``: ``server_vad`` or ``semantic_vad`` -> ``TurnDetectionConfig`` (whose server-side
  bounds are tighter than the protocol's: e.g. ``prefix_padding_ms`` <= 5000; a value past them is
  refused), ``null`` -> manual turns.
- ``max_output_tokens`` and ``temperature`` -> ``params.sampling`` of every request; ``tools`` and
  ``tool_choice`` -> ``params.tools`` / ``params.tool_choice`` (``tool_params``), which the thinker renders
  into its prompt and each response checks its calls against.
- ``voice``: resolved against the pipeline's voices (``voice_server/session/voices.py``: a voice's own name or
  one of the OpenAI names it declares, e.g. ``alloy`` -> ``heart``), whose params go into every request
  (``{"talker": {"speaker": "chelsie"}}`` for Qwen3-Omni); an unknown name is ``invalid_value``, listing the
  voices. The name is echoed as the client sent it. A pipeline that declares no voices keeps any name as
  metadata. ``speed`` is metadata (echoed, not sent).
- ``output_modalities: ["text"]`` is the bridge's business: the pipeline still speaks, no audio is sent.
- ``noise_reduction`` ``{"type": "near_field" | "far_field"}`` -> ``noise_reduction`` (both types run the same
  model, RNNoise, on the input before turn detection and recognition: ``voice_server/audio/denoise.py``; its
  ``strength`` is echoed, not acted on); ``null`` (the default) is off. Asking for it where the model is not
  installed is ``unsupported``, naming the install command.
- ``idle_timeout_ms`` and ``transcription`` are accepted and echoed, not acted on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import alaw_decode, alaw_encode, pcm16_from_bytes, pcm16_to_bytes, ulaw_decode, ulaw_encode
from voice_server.audio.denoise import SuppressorUnavailable, check_available
from voice_server.config.voices import VoiceConfig
from voice_server.session.config import SessionConfig as CoreConfig
from voice_server.session.realtime.errors import UNSUPPORTED, FieldError, invalid_value
from voice_server.session.realtime.session_config import SessionConfig as RealtimeConfig
from voice_server.session.realtime.session_fields import AudioFormat
from voice_server.session.tools import Tool, ToolSet
from voice_server.session.turn_config import TurnDetectionConfig
from voice_server.session.voices import UnknownVoice, choose_voice, with_voice

MAX_INPUT_PACE = 2.0
"""Appended audio may run at most this many times faster than real time (since the session started)."""
INPUT_BURST_MS = 1000
"""On top of the pace: audio a client may send ahead at once (its first buffer, a network hiccup)."""
VOICE_PARAM = "session.audio.output.voice"
NOISE_REDUCTION_PARAM = "session.audio.input.noise_reduction"


def core_config(session: RealtimeConfig, voices: tuple[VoiceConfig, ...] = ()) -> CoreConfig:
    """The core config of a Realtime session; ValueError (naming the field) past the server's bounds, FieldError
    for a voice the pipeline does not declare or noise reduction whose model is not installed."""
    try:
        voice = choose_voice(voices, session.voice)
    except UnknownVoice as exc:
        raise invalid_value(VOICE_PARAM, str(exc)) from exc
    vad = session.turn_detection
    turns = None if vad is None else TurnDetectionConfig(
        threshold=vad.threshold, prefix_padding_ms=vad.prefix_padding_ms, silence_duration_ms=vad.silence_duration_ms,
        create_response=vad.create_response, interrupt_response=vad.interrupt_response,
        idle_timeout_ms=vad.idle_timeout_ms, type=vad.type, eagerness=vad.eagerness)
    sampling = sampling_params(session.max_output_tokens, session.temperature)
    params: dict[str, Any] = {"sampling": sampling} if sampling else {}
    if session.tools:
        params.update(tool_params(session.tools, session.tool_choice))
    return CoreConfig(input_rate=session.input_format.rate_hz, output_rate=session.output_format.rate_hz,
                      instructions=session.instructions, turn_detection=turns,
                      params=tuple(with_voice(params, voice).items()), noise_reduction=noise_reduction(session))


def noise_reduction(session: RealtimeConfig) -> str | None:
    """The core's noise reduction of a Realtime session; FieldError when its model is not installed here."""
    if session.noise_reduction is None:
        return None
    try:
        check_available()
    except SuppressorUnavailable as exc:
        raise FieldError(UNSUPPORTED, str(exc), NOISE_REDUCTION_PARAM) from exc
    return str(session.noise_reduction["type"])


def tool_params(tools: tuple[Tool, ...], choice: str) -> dict[str, Any]:
    """What a request sends of its tools: none at all for no tools or ``none`` (an empty list, so that a
    response's ``tool_choice: none`` overrides the session's tools)."""
    offered = ToolSet.create(tools, choice)
    return {"tools": []} if offered is None else offered.to_params()


def sampling_params(max_output_tokens: int | None, temperature: float | None,
                    base: dict[str, Any] | None = None) -> dict[str, Any]:
    sampling = dict(base or {})
    if max_output_tokens is not None:
        sampling["max_tokens"] = max_output_tokens
    if temperature is not None:
        sampling["temperature"] = temperature
    return sampling


def decode_input(audio: bytes, fmt: AudioFormat) -> npt.NDArray[np.int16]:
    """An append's bytes -> PCM16 at the format's rate; ValueError for PCM of an odd number of bytes."""
    if fmt.type == "audio/pcmu":
        return ulaw_decode(np.frombuffer(audio, dtype=np.uint8))
    if fmt.type == "audio/pcma":
        return alaw_decode(np.frombuffer(audio, dtype=np.uint8))
    return np.ascontiguousarray(pcm16_from_bytes(audio))


def encode_output(pcm16: npt.NDArray[np.int16], fmt: AudioFormat) -> bytes:
    if fmt.type == "audio/pcmu":
        return ulaw_encode(pcm16).tobytes()
    if fmt.type == "audio/pcma":
        return alaw_encode(pcm16).tobytes()
    return pcm16_to_bytes(pcm16)


class InputPace:
    """Refuses appended audio that runs ahead of `MAX_INPUT_PACE` x the wall time since the session started
    (plus `INPUT_BURST_MS`).

    NOTE: why a limit at all: turn detection and the conversation's timeline assume live audio; a client
    pushing minutes of audio in a second makes the server do minutes of VAD work at once (starving the
    other sessions on the loop) and produces turns faster than anyone speaks. Twice real time leaves
    room for a client that catches up after a stall.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started_at = clock()
        self.num_ms = 0.0

    def admit(self, num_ms: float) -> bool:
        """Count `num_ms` of audio if it keeps within the pace; False (and not counted) if it does not."""
        elapsed_ms = 1000.0 * (self.clock() - self.started_at)
        if self.num_ms + num_ms > MAX_INPUT_PACE * elapsed_ms + INPUT_BURST_MS:
            return False
        self.num_ms += num_ms
        return True
