"""Fit the asr stage's phone-audio transform (`voice_server/runners/asr_narrowband.mllr`): the MLLR file that
moves the en-us model's Gaussians to where a call's audio puts speech.

A call brings 8 kHz audio; resampled to 16 kHz it has nothing above 4 kHz, where the model's filterbank reaches
6.8 kHz. Its upper filters sit at their floor, and that moves every cepstral coefficient by an amount that
depends on the others, so a shifted mean (`NARROWBAND_CMN`) mends only part of it. Here the same sentences are
sent as they are and through a phone (`speech_text.by_phone`: 8 kHz u-law, back to 16 kHz as a session does),
PocketSphinx's own front end computes both cepstra (its `mfclogdir`), and per feature stream (cepstra, deltas,
double deltas, as the model's `1s_c_d_dd`) a least-squares fit gives the phone's features from the 16 kHz ones:
`narrow = A wide + b`. PocketSphinx applies it to every Gaussian's mean, and scales each variance by the ratio of
the phone's to the 16 kHz features' (a fit before the two copies were aligned, over three seeds of the set: word
error rate 0.145 / 0.50 clean / in noise, against 0.17 / 0.50 with the variances as they are).

Sentences: none from the turn-taking set or the tests; hibari-tts at four speeds and five levels, clean and in
white noise at 10-25 dB SNR, the set's -60 dBFS floor under all. Deterministic: the same file every run.

Usage: OMP_NUM_THREADS=1 python loadtest/fit_narrowband_mllr.py [--out PATH]   (~7 min on one core), then
`loadtest/bench_asr.py --narrowband` for the word error rates with and without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from bench_asr import decode  # noqa: E402
from pocketsphinx import Decoder  # noqa: E402
from speech_text import by_phone  # noqa: E402
from turntaking_set import Item, _rng, _voice, place  # noqa: E402

from voice_server.runners.asr_decoders import (  # noqa: E402
    NARROWBAND_CMN,
    NARROWBAND_MLLR,
    SPEECH_CMN,
    DecoderOptions,
    build_decoder,
)

TEXTS = (
    "Please set an alarm for seven in the morning.", "How long does it take to boil an egg?",
    "My sister lives in a small town near the coast.", "Can you recommend a good book for a long flight?",
    "The train to Boston leaves at half past nine.", "What time does the pharmacy close on Sundays?",
    "I think it is going to rain later this afternoon.", "Turn off the lights in the living room please.",
    "Who wrote the novel about the white whale?", "We are planning a trip to the mountains next month.",
    "How much water should a person drink every day?", "Remind me to pay the electricity bill on Friday.",
    "The children played football in the park until dark.", "Is there a quick way to learn to play the guitar?",
    "Send a message to my brother saying I will be late.", "What is the difference between a virus and bacteria?",
    "Our neighbours just adopted a very friendly dog.", "Could you explain how a rainbow forms?",
    "I would rather have soup than salad for lunch.", "Which planet is closest to the sun?",
    "The meeting has been moved to Thursday afternoon.", "Tell me a joke about computers.",
    "She bought three apples and a loaf of bread.", "Why do cats purr when they are happy?",
    "Add eggs, milk and butter to my shopping list.", "The museum is free on the first Sunday of every month.",
    "How do I reset my password?", "It was the coldest winter anyone could remember.",
    "What should I cook for dinner tonight?", "Play some relaxing music in the kitchen.",
    "He forgot his umbrella at the restaurant again.", "Where can I find the nearest gas station?",
    "Learning a new language takes patience and practice.", "How many people live in Tokyo?",
    "The bus was late because of the heavy traffic.", "Do you know any good exercises for back pain?",
    "Call my mother and tell her I arrived safely.", "The flowers in the garden bloom every spring.",
    "What is the weather forecast for this weekend?", "I need a taxi to the airport at six tomorrow.",
)
CONDITIONS = ((1.0, -20.0, None), (0.85, -26.0, None), (1.2, -14.0, None), (1.0, -20.0, 20.0),
              (0.9, -14.0, 15.0), (1.1, -26.0, 25.0), (1.0, -30.0, None), (0.95, -20.0, 10.0))
"""(speed, level dBFS, SNR dB or None) of each sentence's renditions."""
NUM_CEP = 13
RIDGE = 1.0
"""A small ridge on the fit (frames number ~10^5: it only keeps the solve well conditioned)."""


def cepstra(decoder: Decoder, item: Item, cmn: str, folder: str) -> npt.NDArray[np.float32]:
    """PocketSphinx's cepstra of `item` (before mean normalisation), decoded from `cmn` as the stage feeds a turn
    (`bench_asr.decode`: 20 ms chunks); `decoder` writes them to `folder` (its `mfclogdir`)."""
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    decode(decoder, DecoderOptions(initial_cmn=cmn), item)
    [name] = os.listdir(folder)
    path = os.path.join(folder, name)
    # NOTE: an int32 count of the floats that follow, in the byte order the file was written in (big-endian here).
    for order in (">", "<"):
        [count] = np.fromfile(path, f"{order}i4", count=1)
        data = np.fromfile(path, f"{order}f4", offset=4)
        if count == data.size:
            return data.reshape(-1, NUM_CEP)
    raise RuntimeError(f"{path}: not a cepstra file")


def features(cep: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """The model's `1s_c_d_dd` vectors of an utterance's cepstra, mean-normalised over the utterance: c[t],
    c[t+2] - c[t-2], and the difference of the deltas a frame either side (edges repeated, as PocketSphinx)."""
    c = cep.astype(np.float64) - cep.mean(0)
    padded = np.pad(c, ((3, 3), (0, 0)), mode="edge")
    delta = padded[4:] - padded[:-4]
    return np.hstack([c, delta[1:-1], delta[2:] - delta[:-2]])


def delay_of(wide: npt.NDArray[np.float32], narrow: npt.NDArray[np.float32]) -> int:
    """Samples by which the phone's copy lags (its resampler's delay): the peak of their cross-correlation."""
    n = min(wide.size, narrow.size, 32000)
    corr = np.correlate(narrow[:n], wide[:n - 400], "valid")
    return int(np.argmax(corr))


Stream = tuple[np.ndarray, np.ndarray, np.ndarray]


def fit(pairs: list[tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]]) -> list[Stream]:
    """Per stream, (A, b, h) of `narrow = A wide + b` over every frame of every (wide, narrow) pair, and h the
    ratio of the narrow features' variance to the wide ones'."""
    wide = np.vstack([w for w, _ in pairs])
    narrow = np.vstack([n for _, n in pairs])
    streams = []
    for s in range(3):
        x = np.hstack([wide[:, s * NUM_CEP:(s + 1) * NUM_CEP], np.ones((len(wide), 1))])
        y = narrow[:, s * NUM_CEP:(s + 1) * NUM_CEP]
        coef = np.linalg.solve(x.T @ x + RIDGE * np.eye(NUM_CEP + 1), x.T @ y)
        streams.append((coef[:NUM_CEP].T, coef[NUM_CEP], y.var(0) / x[:, :NUM_CEP].var(0)))
    return streams


def write_mllr(path: str, streams: list[Stream]) -> None:
    """PocketSphinx's MLLR text: classes, streams, then per stream its length, A (row by row), b and the
    variance scales."""
    lines = ["1", str(len(streams))]
    for a, b, h in streams:
        lines.append(str(a.shape[0]))
        lines += [" ".join(f"{v:.5f}" for v in row) for row in a]
        lines += [" ".join(f"{v:.5f}" for v in b), " ".join(f"{v:.5f}" for v in h)]
    Path(path).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=NARROWBAND_MLLR, help="where to write the MLLR file")
    args = parser.parse_args()
    from hibari import Hibari

    tts = Hibari()  # NOTE: the bundled voice `heart`; another voice would download
    pairs = []
    with tempfile.TemporaryDirectory() as folder:
        decoder = build_decoder(DecoderOptions(), mfclogdir=folder)
        for i, text in enumerate(TEXTS):
            for j, (speed, level, snr) in enumerate(CONDITIONS):
                rng = _rng(7, "narrowband", i * len(CONDITIONS) + j)
                item = place("narrowband", text, _voice(tts, text, speed, 7000 + i), rng, level_db=level,
                             snr_db=snr, speed=speed)
                wide = item.audio
                narrow = by_phone(wide)
                narrow = narrow[delay_of(wide, narrow):]
                n = min(wide.size, narrow.size)
                w = features(cepstra(decoder, dataclasses.replace(item, audio=wide[:n]), SPEECH_CMN, folder))
                v = features(cepstra(decoder, dataclasses.replace(item, audio=narrow[:n]), NARROWBAND_CMN, folder))
                m = min(len(w), len(v))
                pairs.append((w[4:m - 4], v[4:m - 4]))  # NOTE: the edges' deltas are padding
            print(f"{i + 1}/{len(TEXTS)} sentences", flush=True)
    streams = fit(pairs)
    write_mllr(args.out, streams)
    print(f"{sum(len(w) for w, _ in pairs)} frames; wrote {args.out}")


if __name__ == "__main__":
    main()
