"""The turn-taking test set of `bench_turntaking.py`, made at run time (nothing is stored).

Speech is hibari-tts's bundled voice (24 kHz, resampled to 16 kHz), varied in speaking rate and level
(active speech level -26, -20 or -14 dBFS RMS), half of it in white noise at 20 dB SNR; a quiet room
floor (white noise, -60 dBFS RMS) lies under every item, as from an open microphone. Coughs and bursts
are synthetic. Each `Item` records its ground truth: where the voice (or the noise event) is, and a
hesitation's pause, as sample ranges of its 16 kHz audio. Categories:
- `complete`: complete short questions;
- `hesitation`: a sentence with a 400-900 ms pause after a word a sentence cannot end on ("book a,
  table"): the voice's own pause at the comma stretched to that length (as `tests/speech_text.py`'s
  `hesitant_speech` does);
- `backchannel`: "uh huh", "yeah", "mm-hmm", "right", "okay" (what a listener says over a reply);
- `cough`: 40 ms attack, exponential decay over ~250 ms, noise band-limited to 300-3000 Hz, -20 dBFS peak;
- `burst`: 180 ms of white noise at -25 dBFS RMS;
- `barge_in`: real interruptions ("Wait, stop, I have another question.");
- `prompt`: questions with long answers, spoken to get a reply that the items above talk over.

The record of a session (pure, no network: the clients fill it, the benchmark measures it): `Utterance`,
an item as the microphone sent it (when each sample was spoken); `Playout`, the player as a client runs
it: each received chunk is heard from max(its arrival, the end of the audio queued before it); a flush
drops what was queued and not yet heard; a pause stops the playout clock (queued audio waits) until a
resume; `Heard`, the 10 ms frames of what was heard and when; `Track`, all of it for one session.
"""

from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from voice_server.audio import AUDIBLE_DB, frame_levels_db, resample_signal

RATE = 16000
TTS_RATE = 24000
FRAME_LEN = RATE // 100  # 10 ms, as `frame_levels_db`
FRAME_S = 0.02
"""The microphone's frames."""
LEVEL_FRAME_S = 0.01  # NOTE: `frame_levels_db`'s frames
FLOOR_DB = -60.0
LEAD_S, TAIL_S = 0.3, 0.3
CONDITIONS = ((1.0, -20.0, None), (0.85, -26.0, None), (1.2, -14.0, None),
              (1.0, -26.0, 20.0), (0.9, -20.0, 20.0), (1.15, -14.0, 20.0))
"""(speaking rate, active speech level dBFS, SNR dB or None for no added noise), cycled over the items."""
COMPLETE = ("What is the capital of France?", "How many legs does a spider have?", "What color is the sky?",
            "What is two plus two?", "Can you name a big animal?", "Who wrote Romeo and Juliet?",
            "How far away is the moon?", "What is the tallest mountain in the world?", "Do you like music?",
            "What is the boiling point of water?", "How do you say hello in Spanish?", "What day comes after Monday?")
HESITATION = ("I would like to book a, table for two people tonight.",
              "Can you tell me the, weather for tomorrow in Paris?",
              "My flight is on, Tuesday the fifth of March.",
              "I want to know the name of, the river that runs through London.",
              "Please remind me to call my, sister on Sunday morning.",
              "What is the best way to get to the, train station from here?",
              "I am looking for a, good book about space travel.",
              "Could you help me find a, restaurant that is open late?",
              "I need to buy some milk and, bread before the shop closes.",
              "I was late today because, the bus did not come.")
BACKCHANNEL = ("Uh huh.", "Yeah.", "Mm-hmm.", "Right.", "Okay.")
BARGE_IN = ("Wait, stop, I have another question.", "Sorry, can you repeat that please?",
            "No no, that is not what I asked.", "Hold on, I want to ask something else.",
            "Stop, let me tell you what I need.")
PROMPT = ("Tell me about the history of Paris.", "Can you tell me a story about a brave little dragon?",
          "Tell me about the history of the Roman Empire.", "Tell me a story about a pirate who found a treasure.",
          "Explain how airplanes fly.", "Tell me a story about a cat who lived in a big city.")
COUNTS = {"complete": 12, "hesitation": 10, "backchannel": 20, "cough": 20, "burst": 20, "barge_in": 12,
          "prompt": len(PROMPT)}
QUICK_COUNTS = {"complete": 3, "hesitation": 2, "backchannel": 2, "cough": 2, "burst": 2, "barge_in": 2,
                "prompt": 3}
CATEGORIES = tuple(COUNTS)


@dataclass(frozen=True)
class Item:
    category: str
    name: str
    """The text spoken, or a label (`cough 3`)."""
    audio: npt.NDArray[np.float32]
    """16 kHz mono, the room floor (and noise) included."""
    speech: tuple[int, int]
    """Samples [start, end) of the voice or noise event: its first and last 10 ms frame at -40 dBFS or more,
    measured before the floor and noise were added."""
    pause: tuple[int, int] | None = None
    """A hesitation's pause, samples [start, end)."""
    speed: float = 1.0
    level_db: float = -20.0
    snr_db: float | None = None

    @property
    def speech_s(self) -> tuple[float, float]:
        return self.speech[0] / RATE, self.speech[1] / RATE

    @property
    def pause_s(self) -> tuple[float, float] | None:
        return None if self.pause is None else (self.pause[0] / RATE, self.pause[1] / RATE)

    @property
    def duration_s(self) -> float:
        return self.audio.size / RATE


def _rng(seed: int, category: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(category.encode()), index])


def _rms_db(x: npt.NDArray[np.floating]) -> float:
    return float(10 * np.log10(max(float(np.mean(np.square(x, dtype=np.float64))), 1e-20)))


def _voice(tts: Any, text: str, speed: float, seed: int) -> npt.NDArray[np.float32]:
    """`text` spoken at 16 kHz, cut to its voiced part (the synthesiser's own quiet ends removed)."""
    audio = resample_signal(np.asarray(tts(text, speed=speed, seed=seed), np.float32).reshape(-1),
                            TTS_RATE, RATE)
    voiced = np.flatnonzero(np.abs(audio) > 10 ** (-50 / 20))
    return audio[voiced[0]:voiced[-1] + 1].astype(np.float32)


def stretch_pause(audio: npt.NDArray[np.float32], pause_s: float,
                  expected_s: float) -> tuple[npt.NDArray[np.float32], tuple[int, int]]:
    """The voice's longest quiet gap that starts from 200 ms before `expected_s` to 100 ms after it
    (`expected_s`: where the words before the comma, said alone, end; in the sentence they end a little
    sooner), without one its quietest 10 ms frame there, replaced by `pause_s` of silence; returns the
    new audio and the pause's [start, end) samples.

    NOTE: the voice pauses briefly at the comma with a continuing contour (a person not done); the gap
    found is that pause, stretched: what a speaker who hesitates sounds like."""
    levels = frame_levels_db(audio, RATE)
    loud = np.flatnonzero(levels >= AUDIBLE_DB)
    gaps = [(int(a) + 1, int(b)) for a, b in zip(loud[:-1], loud[1:], strict=True) if b - a > 1]
    expected = int(expected_s * 100)
    near = [g for g in gaps if expected - 20 <= g[0] <= expected + 10]
    if near:
        start, end = max(near, key=lambda gap: gap[1] - gap[0])
    else:
        low = max(1, expected - 20)
        start = low + int(np.argmin(levels[low:expected + 10]))
        end = start + 1
    silence = np.zeros(int(pause_s * RATE), np.float32)
    out = np.concatenate([audio[: start * FRAME_LEN], silence, audio[end * FRAME_LEN:]])
    return out.astype(np.float32), (start * FRAME_LEN, start * FRAME_LEN + silence.size)


def active_level_db(audio: npt.NDArray[np.floating]) -> float:
    """RMS level over the 10 ms frames within 30 dB of the loudest (the pauses and quiet ends left out)."""
    levels = frame_levels_db(audio, RATE)
    return float(10 * np.log10(np.mean(10 ** (levels[levels >= levels.max() - 30] / 10))))


def place(category: str, name: str, voice: npt.NDArray[np.float32], rng: np.random.Generator, *,
          level_db: float | None, snr_db: float | None = None, speed: float = 1.0,
          pause: tuple[int, int] | None = None, tail_s: float = TAIL_S) -> Item:
    """`voice` scaled to `level_db` (None: as it is), between `LEAD_S` and `tail_s` of quiet, with white
    noise at `snr_db` below the voice over the whole item and the room floor under everything."""
    if level_db is not None:
        voice = voice * np.float32(10 ** ((level_db - active_level_db(voice)) / 20))
    lead = int(LEAD_S * RATE)
    clean = np.concatenate([np.zeros(lead, np.float32), voice, np.zeros(int(tail_s * RATE), np.float32)])
    loud = np.flatnonzero(frame_levels_db(clean, RATE) >= AUDIBLE_DB)
    speech = ((int(loud[0]) * FRAME_LEN, min(clean.size, (int(loud[-1]) + 1) * FRAME_LEN)) if loud.size
              else (lead, lead + voice.size))
    level = _rms_db(voice) if level_db is None else level_db
    noise_db = FLOOR_DB if snr_db is None else 10 * np.log10(10 ** ((level - snr_db) / 10) + 10 ** (FLOOR_DB / 10))
    audio = clean + rng.standard_normal(clean.size).astype(np.float32) * np.float32(10 ** (noise_db / 20))
    shifted = None if pause is None else (pause[0] + lead, pause[1] + lead)
    return Item(category, name, np.clip(audio, -1, 1).astype(np.float32), speech, shifted, speed,
                round(level, 1), snr_db)


def cough(rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """A synthetic cough: noise band-limited to ~300-3000 Hz, 40 ms attack, exponential decay (-40 dB over
    ~250 ms, varied a little), -20 dBFS peak."""
    decay_s = rng.uniform(0.2, 0.3)
    t = np.arange(int((0.04 + decay_s) * RATE)) / RATE
    envelope = np.where(t < 0.04, t / 0.04, np.exp(-(t - 0.04) * np.log(100) / decay_s))
    spectrum = np.fft.rfft(rng.standard_normal(t.size))
    freqs = np.fft.rfftfreq(t.size, 1 / RATE)
    spectrum[(freqs < rng.uniform(250, 350)) | (freqs > rng.uniform(2700, 3300))] = 0
    burst = np.fft.irfft(spectrum, t.size) * envelope
    return (burst * 10 ** (-20 / 20) / np.abs(burst).max()).astype(np.float32)


def noise_burst(rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """180 ms of white noise at -25 dBFS RMS, with 5 ms ramps."""
    n, ramp = int(0.18 * RATE), int(0.005 * RATE)
    envelope = np.ones(n)
    envelope[:ramp] = envelope[-ramp:][::-1] = np.linspace(0, 1, ramp)
    burst = rng.standard_normal(n) * envelope
    return (burst * 10 ** (-25 / 20) / np.sqrt(np.mean(burst**2))).astype(np.float32)


def _texts(category: str) -> tuple[str, ...]:
    return {"complete": COMPLETE, "hesitation": HESITATION, "backchannel": BACKCHANNEL, "barge_in": BARGE_IN,
            "prompt": PROMPT}[category]


def make_items(category: str, num_items: int, seed: int = 0, tts: Any = None,
               conditions: tuple[tuple[float, float, float | None], ...] = CONDITIONS) -> list[Item]:
    """`num_items` items of `category` (texts and `conditions` cycled; the same `seed`, the same items)."""
    items = []
    for i in range(num_items):
        rng = _rng(seed, category, i)
        if category == "cough":
            items.append(place(category, f"cough {i}", cough(rng), rng, level_db=None, tail_s=0.5))
            continue
        if category == "burst":
            items.append(place(category, f"burst {i}", noise_burst(rng), rng, level_db=None, tail_s=0.5))
            continue
        if tts is None:
            from hibari import Hibari

            tts = Hibari()  # NOTE: the bundled voice `heart`; another voice would download
        texts = _texts(category)
        text = texts[i % len(texts)]
        # NOTE: a prompt is spoken plainly: it only has to be understood, its answer is what matters.
        speed, level, snr = (1.0, -20.0, None) if category == "prompt" else conditions[(i + seed) % len(conditions)]
        voice = _voice(tts, text, speed, seed * 1000 + i)
        pause = None
        if category == "hesitation":
            pause_s = 0.4 + 0.5 * ((i * 0.37 + seed * 0.11) % 1.0)
            # NOTE: the words before the comma said alone end about where the whole sentence pauses.
            prefix_s = _voice(tts, text[: text.index(",") + 1], speed, seed * 1000 + i).size / RATE
            voice, pause = stretch_pause(voice, pause_s, prefix_s)
        items.append(place(category, text, voice, rng, level_db=level, snr_db=snr, speed=speed, pause=pause))
    return items


def make_set(categories: tuple[str, ...] = CATEGORIES, seed: int = 0, is_quick: bool = False) -> dict[str, list[Item]]:
    counts = QUICK_COUNTS if is_quick else COUNTS
    return {c: make_items(c, counts[c], seed) for c in categories}


# -- the record of a session: what was said, what was heard -----------------------------------------------

@dataclass
class Segment:
    start: float
    """When its first sample is heard (monotonic)."""
    samples: npt.NDArray[np.float32]
    key: str
    """The response it belongs to."""


@dataclass(frozen=True)
class Heard:
    """The 10 ms frames of everything heard, in time order."""

    starts: npt.NDArray[np.float64]
    ends: npt.NDArray[np.float64]
    levels: npt.NDArray[np.float64]
    keys: npt.NDArray[np.object_]

    @property
    def is_audible(self) -> npt.NDArray[np.bool_]:
        return self.levels >= AUDIBLE_DB


class Playout:
    """A client's player (see the module docstring); times are `time.monotonic()`s."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.segments: list[Segment] = []
        self.end = 0.0
        """When what is queued has been heard (while paused: as if resumed at the pause)."""
        self.paused_at: float | None = None
        self.flushes: list[tuple[float, float]] = []
        """(when, seconds of queued audio dropped)."""
        self.pauses: list[tuple[float, float | None, str]] = []
        """(paused, resumed or None, the response paused)."""
        self.onsets: dict[str, float] = {}
        """Each response's first audible frame as heard when it arrived (for scheduling: a later pause
        does not move it)."""

    def add(self, samples: npt.NDArray[np.float32], now: float, key: str) -> None:
        if samples.size == 0:
            return
        start = max(now, self.end) if self.paused_at is None else max(self.end, self.paused_at)
        self.segments.append(Segment(start, samples, key))
        self.end = start + samples.size / self.rate
        if key not in self.onsets:
            loud = np.flatnonzero(frame_levels_db(samples, self.rate) >= AUDIBLE_DB)
            if loud.size:
                self.onsets[key] = start + int(loud[0]) * LEVEL_FRAME_S

    def flush(self, now: float) -> float:
        """Drop what is queued and not yet heard; returns the seconds dropped."""
        at = now if self.paused_at is None else self.paused_at  # NOTE: nothing was heard since the pause
        dropped = 0.0
        for seg in self.segments:
            seg_end = seg.start + seg.samples.size / self.rate
            if seg_end <= at:
                continue
            keep = max(0, int(round((at - seg.start) * self.rate)))
            dropped += (seg.samples.size - keep) / self.rate
            seg.samples = seg.samples[:keep]
        self.segments = [s for s in self.segments if s.samples.size]
        if self.paused_at is not None:
            self._end_pause(now)
        self.end = min(self.end, now)
        self.flushes.append((now, dropped))
        return dropped

    def pause(self, now: float, key: str) -> None:
        if self.paused_at is None:
            self.paused_at = now
            self.pauses.append((now, None, key))

    def resume(self, now: float) -> None:
        """Queued audio plays on from `now`: what was not heard at the pause moves later by the pause."""
        paused_at = self.paused_at
        if paused_at is None:
            return
        shift = now - paused_at
        moved: list[Segment] = []
        for seg in self.segments:
            if seg.start >= paused_at:
                seg.start += shift
            elif seg.start + seg.samples.size / self.rate > paused_at:
                cut = int(round((paused_at - seg.start) * self.rate))
                moved.append(Segment(now, seg.samples[cut:], seg.key))
                seg.samples = seg.samples[:cut]
        self.segments = sorted([s for s in self.segments if s.samples.size] + moved, key=lambda s: s.start)
        if self.end > paused_at:
            self.end += shift
        self._end_pause(now)

    def _end_pause(self, now: float) -> None:
        paused, _, key = self.pauses[-1]
        self.pauses[-1] = (paused, now, key)
        self.paused_at = None

    def played_s(self, key: str, now: float) -> float:
        """Seconds of response `key` heard by `now`."""
        at = now if self.paused_at is None else min(now, self.paused_at)
        return sum(min(max(0.0, at - s.start), s.samples.size / self.rate) for s in self.segments if s.key == key)

    def heard(self) -> Heard:
        """What was heard (while paused: up to the pause; what waits has not been heard)."""
        starts, ends, levels, keys = [], [], [], []
        for seg in self.segments:
            samples = seg.samples
            if self.paused_at is not None:
                samples = samples[: max(0, int(round((self.paused_at - seg.start) * self.rate)))]
            if not samples.size:
                continue
            level = frame_levels_db(samples, self.rate)
            first = seg.start + np.arange(level.size) * LEVEL_FRAME_S
            starts.append(first)
            ends.append(np.minimum(first + LEVEL_FRAME_S, seg.start + samples.size / self.rate))
            levels.append(level)
            keys.append(np.full(level.size, seg.key, dtype=object))
        if not starts:
            return Heard(np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0, dtype=object))
        start = np.concatenate(starts)
        order = np.argsort(start, kind="stable")
        return Heard(start[order], np.concatenate(ends)[order], np.concatenate(levels)[order],
                     np.concatenate(keys)[order])


@dataclass
class Utterance:
    """An item as the microphone sent it."""

    item: Item
    role: str
    """`question`, `prompt` (asks for a long reply) or `event` (said over the reply)."""
    send_times: list[float] = field(default_factory=list)
    """When each 20 ms frame went out: its audio was spoken over the 20 ms before."""
    sent: threading.Event = field(default_factory=threading.Event)

    def at(self, offset_s: float) -> float:
        """When the item's sample at `offset_s` was spoken."""
        k = min(int(offset_s / FRAME_S), len(self.send_times) - 1)
        return self.send_times[k] - FRAME_S + (offset_s - k * FRAME_S)

    @property
    def speech_start_at(self) -> float:
        return self.at(self.item.speech_s[0])

    @property
    def speech_end_at(self) -> float:
        return self.at(self.item.speech_s[1])


@dataclass
class Track:
    """What one session said and heard."""

    endpoint: str
    heard: Heard
    flushes: list[tuple[float, float]]
    pauses: list[tuple[float, float | None, str]]
    statuses: dict[str, tuple[float, str]]
    """Each finished response: (when its end arrived, status); none on Twilio (no such event)."""
    utterances: list[Utterance]
    problems: list[str]
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each finished response's `timings_ms` as the server reported them (`/ws` only)."""
