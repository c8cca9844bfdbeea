"""Reference utterances for the locust load test (`loadtest/locustfile.py`), synthesised once.

Each question is spoken by hibari-tts (its bundled voice, no download), trimmed to its voiced part (so
the last sample of a file is the last voiced one: the load test counts latency from there), and written
as 16-bit mono WAVs at 16 kHz (`WS /ws`), 24 kHz (`WS /v1/realtime`, PCM) and 8 kHz (`WS /twilio/media`,
mu-law encoded by the load test) into `OUT/<rate>/<n>.wav`. The folder is gitignored.

Usage: python loadtest/make_utterances.py [--out loadtest/utterances] [--count 5]
"""

from __future__ import annotations

import argparse
import wave
from pathlib import Path

import numpy as np

from voice_server.audio import float32_to_pcm16, resample_signal

HERE = Path(__file__).resolve().parent
QUESTIONS = ("What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
             "What is two plus two?", "Can you name a big animal?")
RATES = (16000, 24000, 8000)
TTS_RATE = 24000


def write_wav(path: Path, pcm16: np.ndarray, rate: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(pcm16.astype("<i2").tobytes())


def make(out: Path, count: int) -> list[Path]:
    from hibari import Hibari

    tts = Hibari()  # NOTE: the bundled default voice; other voices would download
    written = []
    for n, text in enumerate(QUESTIONS[:count]):
        audio = np.asarray(tts(text, seed=0), dtype=np.float32).reshape(-1)
        # NOTE: the synthesiser's own leading and trailing quiet (below -50 dBFS) is cut: the load test
        # adds its own silence, and its "end of speech" is then where a listener hears the voice stop.
        voiced = np.flatnonzero(np.abs(audio) > 10 ** (-50 / 20))
        audio = audio[voiced[0]:voiced[-1] + 1]
        for rate in RATES:
            path = out / str(rate) / f"{n}.wav"
            write_wav(path, float32_to_pcm16(resample_signal(audio, TTS_RATE, rate)), rate)
            written.append(path)
        (out / "text.txt").open("a" if n else "w").write(text + "\n")
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "utterances")
    parser.add_argument("--count", type=int, default=len(QUESTIONS))
    args = parser.parse_args()
    paths = make(args.out, args.count)
    print(f"wrote {len(paths)} files under {args.out}")


if __name__ == "__main__":
    main()
