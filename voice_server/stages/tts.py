"""Text-to-speech stage (`simple` scheduler): hibari-tts behind a `TTSRunner`; the `talker` of the
embedded CPU pipeline, fed a text LLM's deltas through `stream_to`.

hibari-tts (PyPI `hibari-tts`, module `hibari`, Apache-2.0): an 8 MB int8 ONNX model through
onnxruntime, 24 kHz. The voice is pinned to `heart`, the one inside the package, and loaded by its
file path: hibari downloads any other voice on first use, and a serving stage must never reach for
the network (CI and air-gapped hosts have none).

factory_args (all optional):
- `num_threads` (1): onnxruntime intra-op threads (one core runs the model ~100x faster than real time).
- `speed` (1.0): speaking rate, 0.5 .. 2.0.
- `seed` (0): seeds each request's noise generator (the same text always gives the same audio).
- `min_clause_chars` (10), `max_clause_chars` (240): the clause rule (`voice_server/runners/clauses.py`).
- `max_text_chars` (32768): longest text one request may bring; a longer one is refused alone.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from voice_server.config.errors import ConfigError, fail, quoted, show
from voice_server.engine.runtime import StageContext
from voice_server.runners.clauses import ClauseRules
from voice_server.runners.tts_runner import SAMPLE_RATE, TTSRunner, TTSRunnerConfig

log = logging.getLogger(__name__)

FACTORY_ARGS = ("num_threads", "speed", "seed", "min_clause_chars", "max_clause_chars", "max_text_chars")
VOICE = "heart"
INSTALL_HINT = "pip install 'hibari-tts>=0.2.1,<0.3'"


def create_tts(ctx: StageContext) -> TTSRunner:
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    args = dict(ctx.args)
    unknown = sorted(str(k) for k in args if k not in FACTORY_ARGS)
    if unknown:
        raise fail(where, f"factory_args.{unknown[0]}", f"unknown key; known: {', '.join(FACTORY_ARGS)}")
    if stage.device != "cpu":
        raise fail(where, "device", f"hibari-tts runs on the CPU (onnxruntime): must be cpu, got {show(stage.device)}")
    num_threads = _int(where, args, "num_threads", 1, minimum=1)
    try:
        rules = ClauseRules(_int(where, args, "min_clause_chars", 10, minimum=1),
                            _int(where, args, "max_clause_chars", 240, minimum=2))
    except ValueError as exc:
        raise fail(where, "factory_args.max_clause_chars", str(exc)) from exc
    speed = args.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.5 <= speed <= 2.0:
        raise fail(where, "factory_args.speed", f"must be a number in [0.5, 2.0], got {show(speed)}")
    config = TTSRunnerConfig(float(speed), _int(where, args, "seed", 0, minimum=0),
                             _int(where, args, "max_text_chars", 32768, minimum=1), rules)

    start = time.perf_counter()
    ctx.progress(f"loading hibari-tts (voice {VOICE}, {num_threads} thread(s))")
    engine = load_hibari(where, num_threads)
    runner = TTSRunner(engine, config)
    ctx.progress("warming up")
    warm_s = runner.warm_up()
    log.info("stage %s: ready in %.2f s (warm-up %.2f s)", stage.name, time.perf_counter() - start, warm_s)
    return runner


def load_hibari(where: str, num_threads: int) -> Any:
    """A `hibari.Hibari` for the bundled voice, loaded from its file (no code path that downloads)."""
    try:
        import hibari
        from hibari.voices import VOICES
    except ImportError as exc:
        raise fail(where, "factory", f"needs the hibari-tts package (module `hibari`), which cannot be imported "
                   f"({exc}): {INSTALL_HINT}") from exc
    voice = VOICES.get(VOICE, {})
    model = Path(hibari.__file__).parent / "assets" / str(voice.get("file", ""))
    if not voice.get("bundled") or not model.is_file():
        raise fail(where, "factory", f"hibari-tts {getattr(hibari, '__version__', '?')} does not bundle the "
                   f"'{VOICE}' voice (expected at {model}): {INSTALL_HINT}")
    # NOTE: `model=` the bundled file: hibari calls `voice_path` (which downloads a missing voice)
    # only without it. `voice` still picks the G2P variant (American English).
    engine = hibari.Hibari(voice=VOICE, model=str(model), threads=num_threads)
    if engine.sample_rate != SAMPLE_RATE:
        raise ConfigError(f"{where}: hibari-tts gives {engine.sample_rate} Hz audio, expected {SAMPLE_RATE}")
    return engine


def _int(where: str, args: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = args.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(where, f"factory_args.{key}", f"must be an integer >= {minimum}, got {show(value)}")
    return value
