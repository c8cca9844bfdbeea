"""Twilio Media Streams outbound messages: ``media``, ``mark`` and ``clear``, and the audio they carry.

``TwilioAudioEncoder`` turns int16 PCM at any supported rate into 20 ms mu-law payloads: resampled to
8 kHz (``StreamResampler``), G.711 mu-law encoded (``ulaw_encode``) and cut into 160-byte frames. Twilio
accepts any payload size, but one frame per message lets a mark follow every 20 ms of audio, so the
played position (``PlaybackTracker``) is known to 20 ms.

Builders return the JSON text of one frame; they raise ValueError on bad arguments (a server bug, not
client input).
"""

from __future__ import annotations

import json

import numpy as np
import numpy.typing as npt

from voice_server.audio import StreamResampler, b64encode, ulaw_encode
from voice_server.session.twilio.inbound import TWILIO_SAMPLE_RATE

__all__ = [
    "FRAME_MS",
    "NUM_FRAME_SAMPLES",
    "TwilioAudioEncoder",
    "build_clear_message",
    "build_mark_message",
    "build_media_message",
]

FRAME_MS = 20
NUM_FRAME_SAMPLES = TWILIO_SAMPLE_RATE * FRAME_MS // 1000  # 160 mu-law bytes
MAX_MARK_NAME_CHARS = 256


def _check_stream_sid(stream_sid: str) -> None:
    if not isinstance(stream_sid, str) or not stream_sid:
        raise ValueError(f"stream_sid must be a non-empty string, got {stream_sid!r}")


def build_media_message(stream_sid: str, payload: bytes) -> str:
    """A ``media`` frame carrying ``payload``: raw mu-law at 8 kHz (no header), base64 on the wire."""
    _check_stream_sid(stream_sid)
    if not isinstance(payload, bytes) or not payload:
        raise ValueError("payload must be non-empty mu-law bytes")
    return json.dumps({"event": "media", "streamSid": stream_sid, "media": {"payload": b64encode(payload)}})


def build_mark_message(stream_sid: str, name: str) -> str:
    """A ``mark`` frame: Twilio echoes it once the audio sent before it has played (or is cleared)."""
    _check_stream_sid(stream_sid)
    if not isinstance(name, str) or not name or len(name) > MAX_MARK_NAME_CHARS:
        raise ValueError(f"mark name must be a non-empty string of at most {MAX_MARK_NAME_CHARS} characters")
    return json.dumps({"event": "mark", "streamSid": stream_sid, "mark": {"name": name}})


def build_clear_message(stream_sid: str) -> str:
    """A ``clear`` frame: Twilio drops the audio it has buffered and echoes every pending mark."""
    _check_stream_sid(stream_sid)
    return json.dumps({"event": "clear", "streamSid": stream_sid})


class TwilioAudioEncoder:
    """int16 PCM at ``rate_in`` -> 160-byte (20 ms) mu-law frames at 8 kHz, streaming.

    ``encode`` returns the whole frames available so far and keeps the remainder (< 20 ms) for the next
    call; ``flush`` ends an utterance: the resampler's tail and the remainder go out, the last frame
    possibly short (never padded, so the sent duration equals the audio's); ``reset`` drops everything
    buffered (barge-in: the rest of the response must not be sent).
    """

    def __init__(self, rate_in: int) -> None:
        self._resampler = StreamResampler(rate_in, TWILIO_SAMPLE_RATE)
        self._pending = np.zeros(0, dtype=np.uint8)

    @property
    def rate_in(self) -> int:
        return self._resampler.spec.rate_in

    @property
    def num_buffered_samples(self) -> int:
        """mu-law samples encoded but not yet returned (less than one frame)."""
        return len(self._pending)

    def encode(self, pcm16: npt.NDArray[np.int16]) -> list[bytes]:
        """The whole 20 ms frames that ``pcm16`` (1-D int16 at ``rate_in``) completes."""
        if not isinstance(pcm16, np.ndarray) or pcm16.dtype != np.int16 or pcm16.ndim != 1:
            raise ValueError("pcm16 must be a 1-D numpy int16 array")
        return self._frames(self._resampler.process_int16(pcm16), is_final=False)

    def flush(self) -> list[bytes]:
        """The rest of the utterance: whole frames, then one short frame if samples remain."""
        # NOTE: a resampler that took nothing would still return its tail of silence; send none.
        is_idle = self._resampler.num_input == 0
        tail = np.zeros(0, dtype=np.int16) if is_idle else self._resampler.flush_int16()
        return self._frames(tail, is_final=True)

    def reset(self) -> None:
        self._resampler.reset()
        self._pending = np.zeros(0, dtype=np.uint8)

    def _frames(self, pcm_8k: npt.NDArray[np.int16], *, is_final: bool) -> list[bytes]:
        codes = np.concatenate((self._pending, ulaw_encode(pcm_8k)))
        num_whole = len(codes) // NUM_FRAME_SAMPLES * NUM_FRAME_SAMPLES
        frames = [codes[i : i + NUM_FRAME_SAMPLES].tobytes() for i in range(0, num_whole, NUM_FRAME_SAMPLES)]
        self._pending = codes[num_whole:]
        if is_final and len(self._pending):
            frames.append(self._pending.tobytes())
            self._pending = np.zeros(0, dtype=np.uint8)
        return frames
