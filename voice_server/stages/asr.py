"""Speech recognition stage (`simple` scheduler, CPU): PocketSphinx (default) or Whisper tiny.en on the user's
16 kHz audio.

The entry of the embedded CPU pipeline: `asr` (`next: thinker`, `terminal: true`) -> thinker -> talker.
It takes a user's turn streamed while they speak (`Coordinator.submit(..., stream_input=True)`) or a
whole request with audio messages, and hands the thinker the conversation with the user's words as
text. Payload contract: `voice_server/runners/asr_runner.py`.

factory_args (all optional):
- `engine` (pocketsphinx): `pocketsphinx` decodes while the user speaks (partials, ~10 ms at the end of a
  turn); `whisper` (tiny.en, the `whisper` extra: `pip install 'voice-server[whisper]'`) is more robust to
  a noisy microphone but transcribes the whole turn when it ends (~0.3 s on one core) and gives no partials.
- `max_streams` (16): recognisers built before the stage reports ready (pocketsphinx: one decoder each,
  ~0.25 s and ~90 MB each; whisper: one audio buffer each, one shared model). With all of them lent, a new
  turn waits for one while its user speaks; a turn that ends still waiting gets one more built, up to what
  the stage's memory budget (`memory_fraction`) holds; beyond, it is refused alone as an overload.
- `narrowband_streams` (0, pocketsphinx only): decoders built beside them for phone calls (8 kHz audio:
  `/twilio/media`, G.711 on `/v1/realtime`), their model adapted to it (word error rate on calls 0.34 -> 0.16
  clean, 0.54 -> 0.52 in noise). A turn that finds none of its kind free borrows the other kind (heard worse,
  not later); grown ones count in the same memory budget.
- `max_audio_seconds` (60): the longest turn (or a whole request's audio); longer is refused alone.
- `fwdflat` (false, pocketsphinx only): PocketSphinx's second search pass at the end of each utterance
  (~50 ms more latency before the thinker can start, for no measured accuracy gain on synthetic speech).
- `max_hmms_per_frame` (3000, pocketsphinx only): the search's bound on active HMMs per frame
  (PocketSphinx's `maxhmmpf`; its own default, 30000, costs ~1.5x the CPU per second of speech at the same
  word error rate here: `loadtest/bench_asr.py`).
- `num_threads` (1, whisper only): CTranslate2 threads for one transcription.
"""

from __future__ import annotations

import logging
from typing import Any

from voice_server.config.errors import ConfigError, fail, quoted, show
from voice_server.config.fields import Choice, Flag, Number, read_arg
from voice_server.engine.runtime import StageContext
from voice_server.runners.asr_decoders import DecoderOptions, DecoderPool
from voice_server.runners.asr_recognizer import RecognizerPool
from voice_server.runners.asr_runner import DEFAULT_MAX_AUDIO_SECONDS, AsrRunner, AsrRunnerConfig
from voice_server.runners.asr_whisper import WhisperOptions, WhisperPool, WhisperUnavailable

log = logging.getLogger(__name__)

FACTORY_ARGS = ("engine", "max_streams", "narrowband_streams", "max_audio_seconds", "fwdflat", "max_hmms_per_frame",
                "num_threads")
ENGINES = ("pocketsphinx", "whisper")
ENGINE_ARGS = {"fwdflat": "pocketsphinx", "max_hmms_per_frame": "pocketsphinx", "narrowband_streams": "pocketsphinx",
               "num_threads": "whisper"}
"""Factory args that only one engine takes."""
MAX_THREADS = 64
DEFAULT_MAX_STREAMS = 16
MAX_STREAMS_LIMIT = 1024
"""A sanity bound: each PocketSphinx decoder holds ~90 MB."""
DECODER_BYTES = 90 << 20
"""What one PocketSphinx decoder holds (its acoustic model, language model and search), measured."""


def max_decoders(ctx: StageContext, max_streams: int, bytes_each: int) -> int:
    """How many recognisers the stage's memory budget holds (never fewer than `max_streams`; no more without
    a budget, as for a stage built outside a launch)."""
    if ctx.budget_bytes is None:
        return max_streams
    return max(max_streams, min(MAX_STREAMS_LIMIT, ctx.budget_bytes // bytes_each))
MAX_HMMS_LIMIT = 1_000_000


def create_asr(ctx: StageContext) -> AsrRunner:
    stage = ctx.stage
    where = f"stage {quoted(stage.name)}"
    if stage.scheduler != "simple":
        raise fail(where, "scheduler", f"the asr stage runs under 'simple', got {show(stage.scheduler)}")
    if stage.device != "cpu":
        raise fail(where, "device", f"the asr engines run on the CPU only, got {show(stage.device)}")
    args = ctx.known_args(FACTORY_ARGS)
    engine = read_arg(where, args, "engine", Choice(ENGINES), "pocketsphinx")
    for key, owner in ENGINE_ARGS.items():
        if key in args and engine != owner:
            raise fail(where, f"factory_args.{key}", f"only for engine {owner}, this stage's engine is {engine}")
    max_streams = read_arg(where, args, "max_streams", Number(int, minimum=1, maximum=MAX_STREAMS_LIMIT),
                           DEFAULT_MAX_STREAMS)
    max_seconds = read_arg(where, args, "max_audio_seconds", Number(float, minimum=0.0, is_min_exclusive=True),
                           DEFAULT_MAX_AUDIO_SECONDS)
    config = AsrRunnerConfig(float(max_seconds))
    if engine == "whisper":
        return AsrRunner(_whisper_pool(ctx, where, max_streams, args, 4 * config.max_num_samples), config)
    is_fwdflat = read_arg(where, args, "fwdflat", Flag(), False)
    max_hmms = read_arg(where, args, "max_hmms_per_frame", Number(int, minimum=100, maximum=MAX_HMMS_LIMIT),
                        DecoderOptions.max_hmms_per_frame)
    num_narrowband = read_arg(where, args, "narrowband_streams", Number(int, minimum=0, maximum=MAX_STREAMS_LIMIT), 0)
    log.info("stage %s: building %d + %d narrowband PocketSphinx decoders (en-us, fwdflat %s, maxhmmpf %d)",
             stage.name, max_streams, num_narrowband, "on" if is_fwdflat else "off", max_hmms)
    try:
        options = DecoderOptions(is_fwdflat=is_fwdflat, max_hmms_per_frame=max_hmms)
        most = max_decoders(ctx, max_streams + num_narrowband, DECODER_BYTES)
        pool = DecoderPool(max_streams, options, stage.name, ctx.progress, most, num_narrowband)
    except RuntimeError as exc:  # NOTE: PocketSphinx's own error for a model it cannot load
        raise ConfigError(f"{where}: cannot build a speech decoder: {exc}") from exc
    log.info("stage %s: %d decoders ready in %.2f s", stage.name, pool.num_decoders, pool.load_s)
    return AsrRunner(pool, config)


def _whisper_pool(
    ctx: StageContext, where: str, max_streams: int, args: dict[str, Any], buffer_bytes: int,
) -> RecognizerPool:
    num_threads = read_arg(where, args, "num_threads", Number(int, minimum=1, maximum=MAX_THREADS), 1)
    log.info("stage %s: loading Whisper tiny.en (int8, %d threads) for %d streams", ctx.stage.name, num_threads,
             max_streams)
    try:
        pool = WhisperPool(max_streams, WhisperOptions(num_threads=num_threads), ctx.stage.name, ctx.progress,
                           max_decoders(ctx, max_streams, buffer_bytes))
    except WhisperUnavailable as exc:
        raise fail(where, "factory_args.engine", f"'whisper' needs the whisper extra ({exc}): "
                   "pip install 'voice-server[whisper]'") from exc
    except RuntimeError as exc:  # NOTE: CTranslate2's own error for a model it cannot load
        raise ConfigError(f"{where}: cannot load the Whisper model: {exc}") from exc
    log.info("stage %s: Whisper ready in %.2f s", ctx.stage.name, pool.load_s)
    return pool
