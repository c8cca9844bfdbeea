"""Speech-like test signals (re-exported from `voice_server.audio.synthetic`, shared with the benchmarks)."""

from __future__ import annotations

from voice_server.audio.synthetic import signal_of, voice

__all__ = ["signal_of", "voice"]
