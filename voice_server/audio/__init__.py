"""Audio utilities of the session layer (numpy only: the process serving sessions never imports torch).

- ``levels``: frame levels and when a listener first hears a response (``PlayoutClock``);
- ``g711``: mu-law / A-law codecs, bit-exact with the ITU-T G.191 reference;
- ``pcm``: PCM16 bytes <-> int16 <-> float32 and strict base64 for JSON audio payloads;
- ``resample``: streaming polyphase resampling between 8, 16, 24, 44.1 and 48 kHz;
- ``denoise``: a session's noise suppressor (RNNoise's C library, from the `pyrnnoise` wheel, through ctypes).
"""

from __future__ import annotations

from voice_server.audio.g711 import alaw_decode, alaw_encode, ulaw_decode, ulaw_encode
from voice_server.audio.levels import AUDIBLE_DB, PlayoutClock, frame_levels_db
from voice_server.audio.pcm import (
    NARROWBAND_MAX_RATE,
    b64decode,
    b64encode,
    float32_to_pcm16,
    pcm16_from_bytes,
    pcm16_to_bytes,
    pcm16_to_float32,
)
from voice_server.audio.resample import (
    SUPPORTED_RATES,
    AlignedResampler,
    ResamplerSpec,
    StreamResampler,
    resample_signal,
)

__all__ = [
    "NARROWBAND_MAX_RATE",
    "AlignedResampler",
    "AUDIBLE_DB",
    "PlayoutClock",
    "SUPPORTED_RATES",
    "ResamplerSpec",
    "StreamResampler",
    "alaw_decode",
    "alaw_encode",
    "b64decode",
    "b64encode",
    "float32_to_pcm16",
    "frame_levels_db",
    "pcm16_from_bytes",
    "pcm16_to_bytes",
    "pcm16_to_float32",
    "resample_signal",
    "ulaw_decode",
    "ulaw_encode",
]
