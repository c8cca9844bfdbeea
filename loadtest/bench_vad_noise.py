"""Speech detection in noise: Silero VAD (`voice_server.session.turn_models.SileroVad`) vs webrtcvad.

Signals, made at run time (16 kHz):
- speech: distinct hibari-tts sentences (seed 0), each after 1 s of lead-in, 1 s apart; ground truth per
  frame from the CLEAN signal: a frame louder than -45 dBFS is speech;
- noise at SNR 20 / 10 / 5 dB (speech power over the speech frames / noise power), and clean:
  (a) white noise; (b) babble: other hibari sentences, summed at random offsets;
- non-speech events alone, 1.2 s apart on a -60 dBFS white floor: 180 ms white noise bursts at -25 dBFS,
  and synthetic coughs (~250 ms of broadband noise shaped towards 0.3-3 kHz, a 5 ms attack, a decaying
  envelope and a weaker second burst), -20 dBFS over their length.

Detectors: webrtcvad modes 2 and 3 on 20 ms int16 frames (its verdicts include its hangover); Silero
probability > 0.5 on 32 ms windows (one stream, pipecat's periodic reset). Reported per condition:
- recall: speech frames flagged as speech;
- fpr: non-speech frames flagged, counting only frames >= 300 ms from any speech frame (both
  detectors hold on after speech: their hangover is neither a hit nor a false alarm);
- turns: events that would open a turn under ">= 120 ms of consecutive speech frames" (webrtcvad 6
  frames of 20 ms, Silero 4 windows of 32 ms), out of the events played.
CPU: microseconds per frame / window (one thread), and the same as a share of the audio's duration.

NOTE: reading the table: webrtcvad calls the first ~80 ms of a stream speech while its noise model
settles (the constant ~0.012 fpr under white noise); babble IS speech, so its fpr is the share of the
background talkers flagged, which no VAD can reject at 10 dB or less.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_vad_noise.py
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import numpy.typing as npt  # noqa: E402
import webrtcvad  # noqa: E402
from table import cpu_description, format_table  # noqa: E402

from voice_server.audio import float32_to_pcm16, resample_signal  # noqa: E402
from voice_server.session.turn_models import SileroVad, load_silero_session  # noqa: E402

RATE = 16000
SPEECH_DBFS = -45.0
GUARD_S = 0.3
TURN_MS = 120
SNRS_DB = (None, 20.0, 10.0, 5.0)  # None: clean
SENTENCES = ("What is the capital of France?", "Please book a table for two people tonight.",
             "How many legs does a spider have?", "Turn off the lights in the kitchen, please.",
             "My flight leaves at seven in the morning.")
BABBLE = ("The weather has been lovely all week.", "She bought three apples at the market.",
          "We should meet again next Thursday.", "The museum opens at ten o'clock.",
          "He forgot his umbrella on the train.", "Our team won the match yesterday.")
NUM_EVENTS = 12

Audio = npt.NDArray[np.float32]
Detector = Callable[[Audio], tuple[npt.NDArray[np.bool_], int, float]]  # flags, frame_len, seconds of CPU


def synthesize(texts: tuple[str, ...]) -> list[Audio]:
    from hibari import Hibari

    tts = Hibari()
    return [resample_signal(tts(text, seed=0), 24000, RATE) for text in texts]


def dbfs_to_amp(db: float) -> float:
    return float(10 ** (db / 20))


def speech_stream(utterances: list[Audio]) -> Audio:
    gap = np.zeros(RATE, np.float32)
    return np.concatenate([gap] + [part for u in utterances for part in (u, gap)]).astype(np.float32)


def babble(voices: list[Audio], num_samples: int, rng: np.random.Generator) -> Audio:
    out = np.zeros(num_samples, np.float64)
    for voice in voices:
        looped = np.tile(voice, num_samples // len(voice) + 2)
        start = int(rng.integers(len(voice)))
        out += looped[start:start + num_samples]
    return out.astype(np.float32)


def frame_truth(clean: Audio, frame_len: int) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
    """(is_speech, is_far_non_speech) per frame of ``frame_len`` samples of the clean signal."""
    frames = clean[: len(clean) // frame_len * frame_len].reshape(-1, frame_len).astype(np.float64)
    is_speech = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-20) > SPEECH_DBFS
    guard = math.ceil(GUARD_S * RATE / frame_len)
    is_near = np.convolve(is_speech.astype(float), np.ones(2 * guard + 1), mode="same") > 0
    return is_speech, ~is_near


def run_webrtc(mode: int) -> Detector:
    def detect(audio: Audio) -> tuple[npt.NDArray[np.bool_], int, float]:
        vad, frame_len = webrtcvad.Vad(mode), RATE // 50
        pcm = float32_to_pcm16(audio)
        frames = [pcm[i:i + frame_len].tobytes() for i in range(0, len(pcm) - frame_len + 1, frame_len)]
        start = time.perf_counter()
        flags = [vad.is_speech(frame, RATE) for frame in frames]
        return np.array(flags, dtype=bool), frame_len, time.perf_counter() - start

    return detect


def run_silero(session: Any) -> Detector:
    def detect(audio: Audio) -> tuple[npt.NDArray[np.bool_], int, float]:
        vad = SileroVad(session)
        start = time.perf_counter()
        probs = vad.feed(audio)
        return np.array(probs) > 0.5, SileroVad.WINDOW, time.perf_counter() - start

    return detect


def longest_run(flags: npt.NDArray[np.bool_]) -> int:
    best = run = 0
    for flag in flags:
        run = run + 1 if flag else 0
        best = max(best, run)
    return best


def burst(rng: np.random.Generator) -> Audio:
    return (rng.standard_normal(int(0.18 * RATE)) * dbfs_to_amp(-25)).astype(np.float32)


def cough(rng: np.random.Generator) -> Audio:
    """~250 ms: noise shaped towards 0.3-3 kHz, 5 ms attack, decay, and a weaker second burst."""
    num_samples = int(rng.uniform(0.22, 0.28) * RATE)
    spectrum = np.fft.rfft(rng.standard_normal(num_samples))
    hz = np.fft.rfftfreq(num_samples, 1 / RATE)
    spectrum *= 1 / (1 + (300 / np.maximum(hz, 1)) ** 2) / (1 + (hz / 3000) ** 2)
    noise = np.fft.irfft(spectrum, num_samples)
    t = np.arange(num_samples) / RATE
    second = 0.4 * np.exp(-np.maximum(t - 0.12, 0) / 0.04) * (t >= 0.12)
    envelope = np.minimum(t / 0.005, 1) * (np.exp(-t / 0.05) + second)
    out = noise * envelope
    return (out / np.sqrt(np.mean(out**2)) * dbfs_to_amp(-20)).astype(np.float32)


def event_stream(make: Callable[[np.random.Generator], Audio], rng: np.random.Generator) -> tuple[Audio, list[int]]:
    parts, starts, pos = [np.zeros(RATE, np.float32)], [], RATE
    for _ in range(NUM_EVENTS):
        event = make(rng)
        starts.append(pos)
        parts += [event, np.zeros(int(1.2 * RATE), np.float32)]
        pos += len(event) + int(1.2 * RATE)
    audio = np.concatenate(parts)
    return (audio + rng.standard_normal(len(audio)) * dbfs_to_amp(-60)).astype(np.float32), starts


def main() -> None:
    rng = np.random.default_rng(0)
    print("synthesising speech (hibari) ...", file=sys.stderr)
    clean = speech_stream(synthesize(SENTENCES))
    babble_voices = synthesize(BABBLE)
    session = load_silero_session()
    detectors: dict[str, Detector] = {"webrtcvad-2": run_webrtc(2), "webrtcvad-3": run_webrtc(3),
                                      "silero>0.5": run_silero(session)}
    is_speech_samples = np.repeat(frame_truth(clean, 320)[0], 320)
    speech_power = float(np.mean(clean[: len(is_speech_samples)][is_speech_samples].astype(np.float64) ** 2))
    noises = {"white": rng.standard_normal(len(clean)).astype(np.float32),
              "babble": babble(babble_voices, len(clean), rng)}

    rows: list[dict[str, Any]] = []
    cpu_s = dict.fromkeys(detectors, 0.0)
    num_frames = dict.fromkeys(detectors, 0)
    for noise_name, noise in noises.items():
        for snr in SNRS_DB:
            if snr is None and noise_name != "white":
                continue
            mixed = clean.copy()
            if snr is not None:
                scale = math.sqrt(speech_power / 10 ** (snr / 10) / float(np.mean(noise.astype(np.float64) ** 2)))
                mixed = (clean + scale * noise).astype(np.float32)
            condition = "clean" if snr is None else f"{noise_name} {snr:.0f} dB"
            for name, detect in detectors.items():
                flags, frame_len, seconds = detect(mixed)
                cpu_s[name] += seconds
                num_frames[name] += len(flags)
                is_speech, is_far = frame_truth(clean, frame_len)
                is_speech, is_far = is_speech[: len(flags)], is_far[: len(flags)]
                rows.append({"detector": name, "condition": condition, "recall": float(flags[is_speech].mean()),
                             "fpr": float(flags[is_far].mean())})

    for event_name, make in (("burst 180 ms -25 dBFS", burst), ("cough ~250 ms -20 dBFS", cough)):
        audio, starts = event_stream(make, np.random.default_rng(1))
        for name, detect in detectors.items():
            flags, frame_len, seconds = detect(audio)
            cpu_s[name] += seconds
            num_frames[name] += len(flags)
            run_frames = math.ceil(TURN_MS * RATE / 1000 / frame_len)
            num_turns = 0
            for start in starts:  # NOTE: 0.9 s from the event's onset: the event, then its hangover
                first, last = start // frame_len, (start + int(0.9 * RATE)) // frame_len
                num_turns += longest_run(flags[first:last]) >= run_frames
            rows.append({"detector": name, "condition": event_name, "fpr": float(flags.mean()),
                         "turns": f"{num_turns}/{len(starts)}"})

    print(cpu_description())
    print(f"speech: {len(SENTENCES)} hibari sentences, {len(clean) / RATE:.1f} s; truth: clean frames > "
          f"{SPEECH_DBFS:.0f} dBFS; fpr counts non-speech frames >= {GUARD_S * 1000:.0f} ms from speech "
          f"(events: all frames); turn = >= {TURN_MS} ms of consecutive speech frames")
    print(format_table(rows))
    cost = []
    for name in detectors:
        frame_s = (SileroVad.WINDOW if name.startswith("silero") else RATE // 50) / RATE
        seconds_per_frame = cpu_s[name] / num_frames[name]
        cost.append({"detector": name, "frame_ms": round(frame_s * 1000), "us_per_frame": seconds_per_frame * 1e6,
                     "cpu_pct_of_audio": seconds_per_frame / frame_s * 100})
    print(format_table(cost))


if __name__ == "__main__":
    main()
