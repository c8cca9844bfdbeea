"""No dead air from the talker: trim the quiet a speech engine puts around every sentence, and join
clauses with pauses of our own choosing.

Why: hibari-tts opens each sentence with 250-320 ms of near-silence (-140 dBFS, then a fade-in) and
closes it with ~400 ms. A reply's first audible sound therefore came ~300 ms after its first byte, and
every clause join carried ~700 ms of dead air; Piper pads its sentences too. A person hears the
silence, so it is latency.

Rules (`EdgeRules`), on 10 ms frames of each sentence's audio:
- a sentence's audio runs from its first frame above `level_db` (RMS dBFS) to its last, widened by
  `margin_ms` on each side (so a weak onset consonant or a decaying tail keeps its edge); what lies
  outside is dropped, and the margin is faded (linear) so a cut never clicks;
- nothing at or above `level_db` is ever dropped: with the default -45 dBFS that is everything a
  listener hears (the audibility floor used for "first audible audio" is -40 dBFS);
- joins are silence we add: `sentence_pause_ms` after a sentence end (`. ! ? …`), `clause_pause_ms`
  after any other mark (`, ; :`, a dash), half of it after a clause cut with no mark at all (a long
  first clause or a run-on cut at a word: the voice should barely stop). The pause is put before the next
  clause's audio, never after the last, so a reply ends when its speech ends and its first clause
  starts speaking within `margin_ms` (plus the onset's own fade-in) of its first sample.

A sentence quieter than `level_db` throughout is dropped whole (an engine's output for a symbol).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from voice_server.audio.levels import FRAME_MS, frame_levels_db

__all__ = ["EdgeRules", "audible_span", "join_sentences", "pause_after", "trim_edges"]
_SENTENCE_ENDS = frozenset(".!?…")
_CLOSERS = "\"'”’)]}*_`"


@dataclass(frozen=True)
class EdgeRules:
    is_trimmed: bool = True
    """False keeps the engine's audio as it is (its own silences) and adds no pauses."""
    level_db: float = -45.0
    """RMS level (dBFS, 10 ms frames) below which a sentence's edges are silence."""
    margin_ms: int = 10
    """Kept (and faded) on each side of the audible part."""
    clause_pause_ms: int = 150
    """Silence between clauses that end mid-sentence (`, ; :` and the like)."""
    sentence_pause_ms: int = 300
    """Silence after a sentence end, between clauses and between sentences inside one clause."""

    def __post_init__(self) -> None:
        if not isinstance(self.is_trimmed, bool):
            raise ValueError(f"EdgeRules.is_trimmed must be true or false, got {self.is_trimmed!r}")
        level = self.level_db
        if isinstance(level, bool) or not isinstance(level, int | float) or not -90.0 <= level <= -20.0:
            raise ValueError(f"EdgeRules.level_db must be a number in [-90, -20] dBFS, got {level!r}")
        object.__setattr__(self, "level_db", float(level))
        for name, high in (("margin_ms", 200), ("clause_pause_ms", 2000), ("sentence_pause_ms", 2000)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
                raise ValueError(f"EdgeRules.{name} must be an integer in [0, {high}] ms, got {value!r}")


def audible_span(pcm: npt.NDArray[np.float32], rate: int, rules: EdgeRules) -> tuple[int, int]:
    """Sample range `[first, last)` that trimming keeps; (0, 0) when nothing reaches `level_db`."""
    loud = np.flatnonzero(frame_levels_db(pcm, rate) >= rules.level_db)
    if loud.size == 0:
        return 0, 0
    frame_len = rate * FRAME_MS // 1000
    margin = rate * rules.margin_ms // 1000
    return max(0, int(loud[0]) * frame_len - margin), min(pcm.size, (int(loud[-1]) + 1) * frame_len + margin)


def trim_edges(pcm: npt.NDArray[np.float32], rate: int, rules: EdgeRules) -> npt.NDArray[np.float32]:
    """One sentence's audio without its leading and trailing silence (see the module docstring)."""
    if not rules.is_trimmed or pcm.size == 0:
        return pcm
    first, last = audible_span(pcm, rate, rules)
    out = pcm[first:last].astype(np.float32, copy=True)
    # NOTE: fade only what was cut: a sentence that starts (or ends) loud keeps its edge as it is.
    num_faded = min(rate * rules.margin_ms // 1000, out.size)
    if first > 0 and num_faded:
        out[:num_faded] *= np.linspace(0.0, 1.0, num_faded, endpoint=False, dtype=np.float32)
    if last < pcm.size and num_faded:
        out[-num_faded:] *= np.linspace(1.0, 0.0, num_faded, endpoint=False, dtype=np.float32)
    return out


def pause_after(clause: str, rules: EdgeRules) -> int:
    """The pause (ms) that follows `clause` before the next one: longer after a sentence end, shorter
    where no mark ends it."""
    core = clause.rstrip().rstrip(_CLOSERS)
    if core and core[-1] in _SENTENCE_ENDS:
        return rules.sentence_pause_ms
    return rules.clause_pause_ms // 2 if core and core[-1].isalnum() else rules.clause_pause_ms


def join_sentences(pieces: list[npt.NDArray[np.float32]], rate: int, rules: EdgeRules,
                   lead_ms: int = 0) -> npt.NDArray[np.float32]:
    """A clause's sentences, trimmed, joined with `sentence_pause_ms`, after `lead_ms` of silence (the
    pause owed to the clause before). Nothing audible -> an empty array, and no lead either."""
    trimmed = [trim_edges(np.asarray(p, dtype=np.float32).reshape(-1), rate, rules) for p in pieces]
    spoken = [p for p in trimmed if p.size]
    if not spoken:
        return np.zeros(0, np.float32)
    if not rules.is_trimmed:
        return np.concatenate(spoken)
    gap = np.zeros(rate * rules.sentence_pause_ms // 1000, np.float32)
    parts = [np.zeros(rate * lead_ms // 1000, np.float32)]
    for index, piece in enumerate(spoken):
        if index:
            parts.append(gap)
        parts.append(piece)
    return np.concatenate(parts)
