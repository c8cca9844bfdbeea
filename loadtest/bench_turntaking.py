"""Turn-taking as a person hears it, per endpoint (`/ws`, `/v1/realtime`, `/twilio/media`), measured from
the audio itself on the embedded CPU default (`configs/default.yaml`, sessions on `semantic_vad`).

Starts `voice-server serve` (a real process); each session is a client (`turntaking_clients.py`) that
speaks the test set (`turntaking_set.py`, made at run time) at real-time pace over an open microphone
and plays what comes back as a client would (arrival, queue, flush, pause): every sample sent has the
moment it was spoken, every sample received the moment it was heard. Scenarios:
- `complete`: questions; latency = the first audible heard 10 ms frame (-40 dBFS) - the end of the user's
  speech (its last frame at -40 dBFS or more, before noise); at each `--sessions` level (staggered, each
  session asking every question, from its own on);
- `hesitation`: sentences with a 400-900 ms pause where the speaker is not done; premature = audible
  reply audio that starts before the sentence ends;
- `backchannel`, `cough`, `burst`: said 1.0-1.5 s after a long reply became audible; stopped = within
  2 s the reply's audible audio stops (a flush, its cancel, or >= 300 ms inaudible) and does not go on;
  `paused`: the server paused it and it went on; items whose reply had already ended are counted apart
  (`reply_ended`); the client stops the reply 2.5 s after the event (only the first 2 s are judged);
- `barge_in`: real interruptions over a reply; stop = the end of the reply's audible audio (as heard) -
  the onset of the user's first word.
A conversation is at most `MAX_TURNS` turns (then a new session): the thinker's context is 2048 tokens.
Goals (met / not met; `too few items` below the counts they name): reply p50 <= 300 ms and p90 <= 500 ms
at 1 session, p90 <= 700 ms at 8; no stopped reply in >= 20 each of backchannels, coughs and bursts;
<= 1 in 10 hesitations answered early; every barge-in stops within 300 ms; Twilio's p90 <= 1.3x `/ws`'s.

Usage: OMP_NUM_THREADS=1 python loadtest/bench_turntaking.py [--quick] [--endpoints ws,realtime,twilio]
       [--scenarios complete,hesitation,backchannel,cough,burst,barge_in] [--sessions 1,8] [--seed 0]
       [--asks N (questions a session asks in `complete`; all 12 by default)] [--details (a line per item)]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sessions import pct, start_server  # noqa: E402
from table import cpu_description, format_table  # noqa: E402
from turntaking_clients import CLIENTS, Client  # noqa: E402
from turntaking_set import LEVEL_FRAME_S, Heard, Item, Track, Utterance, make_set  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WINDOW_S = 2.0
"""How soon after an event a reply must stop to count as stopped by it."""
GAP_S = 0.3
"""Inaudible heard audio that counts as the reply stopping."""
EVENT_DELAY_S = (1.0, 1.5)
"""When the event starts after the reply became audible."""
MAX_TURNS = 8
INTERRUPTIONS = ("backchannel", "cough", "burst")
SCENARIOS = ("complete", "hesitation", *INTERRUPTIONS, "barge_in")


# -- measurement: pure functions of a recorded `Track` -----------------------------------------------------

def onset_after(heard: Heard, t: float, key: str | None = None) -> float | None:
    """The first audible frame heard at `t` or later (of response `key` if given)."""
    mask = heard.is_audible & (heard.starts >= t)
    if key is not None:
        mask &= heard.keys == key
    found = np.flatnonzero(mask)
    return float(heard.starts[found[0]]) if found.size else None


def audible_end(heard: Heard, key: str) -> float | None:
    """When the last audible frame of response `key` ends, as heard."""
    found = np.flatnonzero(heard.is_audible & (heard.keys == key))
    return float(heard.ends[found].max()) if found.size else None


def key_at(heard: Heard, t: float) -> str | None:
    """The response heard at `t`: that of the last audible frame that started before it."""
    found = np.flatnonzero(heard.is_audible & (heard.starts < t))
    return str(heard.keys[found[-1]]) if found.size else None


def latency_ms(track: Track, utterance: Utterance) -> float | None:
    """End of the user's speech -> the first audible reply frame heard after the speech started."""
    onset = onset_after(track.heard, utterance.speech_start_at)
    return None if onset is None else 1000 * (onset - utterance.speech_end_at)


def is_premature(track: Track, utterance: Utterance) -> bool:
    """Audible reply audio started before the speaker finished the sentence (in or after the pause)."""
    onset = onset_after(track.heard, utterance.speech_start_at)
    return onset is not None and onset < utterance.speech_end_at


def interruption_verdict(track: Track, utterance: Utterance, window_s: float = WINDOW_S,
                         gap_s: float = GAP_S) -> str:
    """What an event said over a reply did to it: `stopped` (within `window_s` its audible audio stops,
    by a flush, its cancel, or `gap_s` of inaudible audio, and does not go on), `paused` (the server
    paused it and it went on), `kept`, or `ended` (the reply had no audible audio left at the event, or
    ran out inside the window by itself: no judgement)."""
    heard, t = track.heard, utterance.speech_start_at
    key = key_at(heard, t)
    end = None if key is None else audible_end(heard, key)
    if key is None or end is None or end <= t:
        return "ended"
    until = t + window_s
    if any(t <= at <= until and dropped > 0 for at, dropped in track.flushes):
        return "stopped"
    at, status = track.statuses.get(key, (0.0, ""))
    if status == "cancelled" and t <= at <= until:
        return "stopped"
    is_paused = any(key == paused_key and t <= at <= until for at, _, paused_key in track.pauses)
    gap_ms = reply_gap_ms(track, utterance, window_s)
    if gap_ms is not None and gap_ms >= 1000 * gap_s:
        return "paused" if is_paused else "kept"  # NOTE: a gap, then the reply went on
    if end > until:
        return "paused" if is_paused else "kept"
    # NOTE: the reply's audible audio ended inside the window and never came back: stopped only if the
    # server paused it there (and never resumed it); otherwise it ran out by itself.
    is_left_paused = any(key == k and t <= at <= until and resumed is None for at, resumed, k in track.pauses)
    return "stopped" if is_left_paused else "ended"


def reply_gap_ms(track: Track, utterance: Utterance, window_s: float = WINDOW_S) -> float | None:
    """The longest silence in the reply (as heard) that began within `window_s` of the event's onset and after
    which the reply went on: how long a reply held over the event kept the listener waiting (a phone line has
    no pause message: its reply is held in the server, and the call hears the same gap). None: no such gap."""
    heard, t = track.heard, utterance.speech_start_at
    key = key_at(heard, t)
    if key is None:
        return None
    mask = heard.is_audible & (heard.keys == key)
    starts, ends = heard.starts[mask], heard.ends[mask]
    later = np.flatnonzero(starts >= t)
    if not later.size:
        return None
    first = int(later[0])
    prev_end = max(float(ends[first - 1]) if first else t, t)
    longest = 0.0
    for i in range(first, len(starts)):
        if prev_end > t + window_s:
            break
        longest = max(longest, float(starts[i]) - prev_end)
        prev_end = max(prev_end, float(ends[i]))
    return 1000 * longest if longest >= LEVEL_FRAME_S else None  # NOTE: adjacent frames meet within rounding


def barge_in_stop_ms(track: Track, utterance: Utterance) -> float | None:
    """The end of the interrupted reply's audible audio (as heard) - the onset of the first word; None
    when no reply was audible at the onset."""
    heard, t = track.heard, utterance.speech_start_at
    key = key_at(heard, t)
    end = None if key is None else audible_end(heard, key)
    return None if end is None or end <= t else 1000 * (end - t)


# -- driving sessions ------------------------------------------------------------------------------------------

def _wait(condition: Callable[[], Any], timeout_s: float, client: Client) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and client.is_open:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return None


def _onset_since(client: Client, t: float) -> float | None:
    with client.lock:
        return min((at for at in client.playout.onsets.values() if at >= t), default=None)


def settle(client: Client, timeout_s: float = 45.0) -> None:
    """Until nothing runs or plays (for 0.5 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and client.is_open:
        if _wait(lambda: client.is_idle(time.monotonic()), deadline - time.monotonic(), client):
            time.sleep(0.5)
            if client.is_idle(time.monotonic()):
                return


def ask(client: Client, item: Item, reply_timeout_s: float = 20.0) -> None:
    """Say `item`, wait for the reply (for a hesitation: one after its end) and for it to end."""
    utterance = client.say(item, "question")
    utterance.sent.wait(60)
    after = utterance.speech_end_at if item.category == "hesitation" else utterance.speech_start_at
    _wait(lambda: _onset_since(client, after), reply_timeout_s, client)
    settle(client)


def interrupt(client: Client, prompt: Item, event: Item, delay_s: float) -> None:
    """Ask `prompt`; `delay_s` after its reply became audible, say `event` over it; cut the reply short
    2.5 s later (NOTE: only the first 2 s after the event are judged; this saves the rest of a long reply)."""
    asked = client.say(prompt, "prompt")
    asked.sent.wait(60)
    onset = _wait(lambda: _onset_since(client, asked.speech_start_at), 20.0, client)
    if onset is None:
        with client.lock:
            client.problems.append(f"no reply to the prompt {prompt.name!r}")
        settle(client)
        return
    # NOTE: frame k goes out up to 20 ms after `say` and carries the 20 ms spoken before it.
    time.sleep(max(0.0, onset + delay_s - event.speech_s[0] + 0.01 - time.monotonic()))
    said = client.say(event, "event")
    said.sent.wait(60)
    time.sleep(max(0.0, said.speech_start_at + WINDOW_S + 0.5 - time.monotonic()))
    client.cut()
    settle(client)


def asking(items: list[Item]) -> list[Callable[[Client], None]]:
    return [partial(ask, item=item) for item in items]


def run_session(endpoint: str, port: int, seed: int, steps: list[Callable[[Client], None]]) -> Track:
    """One session that takes `steps` in turn."""
    client = CLIENTS[endpoint](port, seed)
    try:
        with client:
            time.sleep(0.5)  # NOTE: the room floor first, as a call opens before anyone speaks
            for step in steps:
                step(client)
    except Exception as exc:  # NOTE: reported with the tables; the other sessions go on
        client.problems.append(f"{type(exc).__name__}: {exc}")
    return client.track()


def _batches(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def session_questions(items: list[Item], index: int, num_asks: int | None = None) -> list[Item]:
    """What session `index` of `complete` asks: `num_asks` questions (all of them by default) in the set's order,
    from its own on, so that with every session asking all of them each question is asked equally often."""
    # NOTE: two a session (16 answers at 8, the runs before 2026-12-05) asked 7 of 9 questions twice, so a
    # question held by its words was two of the three answers a p90 reads: all of them, each 8 times, is
    # a p90 of the set, not of its one hardest question.
    return [items[(index + k) % len(items)] for k in range(len(items) if num_asks is None else num_asks)]


def run_complete(endpoint: str, port: int, items: list[Item], num_sessions: int, seed: int,
                 num_asks: int | None = None) -> list[Track]:
    """`num_sessions` at once, started 0.3 s apart, each asking its `session_questions` in turn."""
    tracks: list[Track] = []

    def session(i: int) -> None:
        for batch in _batches(session_questions(items, i, num_asks), MAX_TURNS):
            tracks.append(run_session(endpoint, port, seed + i, asking(batch)))

    threads = [threading.Thread(target=session, args=(i,)) for i in range(num_sessions)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)
    for thread in threads:
        thread.join()
    return tracks


def run_interruptions(endpoint: str, port: int, prompts: list[Item], events: list[Item], seed: int) -> list[Track]:
    """Each event over the reply to a prompt (prompts in turn), `MAX_TURNS // 2` of them per session."""
    rng = np.random.default_rng(seed)
    steps = [partial(interrupt, prompt=prompts[i % len(prompts)], event=event,
                     delay_s=float(rng.uniform(*EVENT_DELAY_S))) for i, event in enumerate(events)]
    return [run_session(endpoint, port, seed, batch) for batch in _batches(steps, MAX_TURNS // 2)]


def run_scenario(endpoint: str, scenario: str, port: int, test_set: dict[str, list[Item]], levels: list[int],
                 seed: int, num_asks: int | None = None) -> list[tuple[str, dict[str, Any], list[Track]]]:
    """(table, its row, the tracks) of one scenario on one endpoint."""
    if scenario == "complete":
        runs = [(level, run_complete(endpoint, port, test_set["complete"], level, seed, num_asks))
                for level in levels]
        return [("complete", complete_row(endpoint, level, tracks), tracks) for level, tracks in runs]
    if scenario == "hesitation":
        tracks = [run_session(endpoint, port, seed, asking(b)) for b in _batches(test_set["hesitation"], MAX_TURNS)]
        return [("hesitation", hesitation_row(endpoint, tracks), tracks)]
    tracks = run_interruptions(endpoint, port, test_set["prompt"], test_set[scenario], seed)
    if scenario == "barge_in":
        return [("barge_in", barge_in_row(endpoint, tracks), tracks)]
    return [("interruptions", interruption_row(endpoint, scenario, tracks), tracks)]


# -- tables ----------------------------------------------------------------------------------------------------

def _of(tracks: list[Track], role: str) -> list[tuple[Track, Utterance]]:
    return [(t, u) for t in tracks for u in t.utterances if u.role == role and u.send_times]


def complete_row(endpoint: str, num_sessions: int, tracks: list[Track]) -> dict[str, Any]:
    said = _of(tracks, "question")
    values = [v for t, u in said if (v := latency_ms(t, u)) is not None]
    return {"endpoint": endpoint, "sessions": num_sessions, "num_items": len(said), "num_answered": len(values),
            "p50_ms": pct(values, 0.5) if values else None, "p90_ms": pct(values, 0.9) if values else None,
            "max_ms": max(values) if values else None}


def hesitation_row(endpoint: str, tracks: list[Track]) -> dict[str, Any]:
    said = _of(tracks, "question")
    premature = [is_premature(t, u) for t, u in said]
    after = [v for (t, u), early in zip(said, premature, strict=True)
             if not early and (v := latency_ms(t, u)) is not None]
    return {"endpoint": endpoint, "num_items": len(said), "num_premature": sum(premature),
            "num_answered_after": len(after), "after_p50_ms": pct(after, 0.5) if after else None}


def interruption_row(endpoint: str, kind: str, tracks: list[Track]) -> dict[str, Any]:
    events = _of(tracks, "event")
    verdicts = [interruption_verdict(t, u) for t, u in events]
    counts = Counter(verdicts)
    gaps = [g for (t, u), v in zip(events, verdicts, strict=True)
            if v in ("paused", "kept") and (g := reply_gap_ms(t, u))]
    return {"endpoint": endpoint, "kind": kind, "num_items": sum(counts.values()), "num_reply_ended": counts["ended"],
            "num_stopped": counts["stopped"], "num_paused": counts["paused"], "num_kept": counts["kept"],
            "pause_p50_ms": pct(gaps, 0.5) if gaps else None, "pause_max_ms": max(gaps) if gaps else None}


def barge_in_row(endpoint: str, tracks: list[Track]) -> dict[str, Any]:
    said = _of(tracks, "event")
    stops = [v for t, u in said if (v := barge_in_stop_ms(t, u)) is not None]
    return {"endpoint": endpoint, "num_items": len(said), "num_reply_ended": len(said) - len(stops),
            "stop_p50_ms": pct(stops, 0.5) if stops else None, "stop_p90_ms": pct(stops, 0.9) if stops else None,
            "stop_max_ms": max(stops) if stops else None, "num_within_300ms": sum(v <= 300 for v in stops)}


def details(tracks: list[Track]) -> list[str]:
    """One line per measured utterance (`--details`): what it measured, and the reply it met."""
    lines = []
    for track in tracks:
        heard = track.heard
        for u in track.utterances:
            if u.role == "prompt" or not u.send_times:
                continue
            if u.role == "event":
                key = key_at(heard, u.speech_start_at)
                onset = None if key is None else onset_after(heard, 0.0, key)
                end = None if key is None else audible_end(heard, key)
                span = "no reply" if onset is None or end is None else (
                    f"reply heard {onset - u.speech_start_at:+.2f}..{end - u.speech_start_at:+.2f} s")
                stop = barge_in_stop_ms(track, u)
                verdict = interruption_verdict(track, u)
                gap = reply_gap_ms(track, u) if verdict in ("paused", "kept") else None
                result = (f"stop {stop:.0f} ms" if stop is not None else "-") if u.item.category == "barge_in" else (
                    verdict + ("" if gap is None else f" {gap:.0f} ms"))
                result += f", {span}"
            else:
                value = latency_ms(track, u)
                result = "no reply" if value is None else f"latency {value:.0f} ms" + (
                    ", premature" if u.item.category == "hesitation" and is_premature(track, u) else "")
                onset = onset_after(heard, u.speech_start_at)
                key = None if onset is None else key_at(heard, onset + 0.005)
                if key in track.timings_ms:
                    # NOTE: the server's stage times, ms after the commit (a speculative start is negative)
                    result += "; server " + " ".join(f"{stage} {ms:.0f}" for stage, ms in track.timings_ms[key].items())
            lines.append(f"{track.endpoint} {u.item.category} {u.item.name!r} ({u.item.level_db:g} dBFS, "
                         f"x{u.item.speed:g}, snr {u.item.snr_db}): {result}")
    return lines


def _goal(name: str, endpoint: str, value: str, is_met: bool | None, is_enough: bool = True) -> dict[str, Any]:
    verdict = "no data" if is_met is None else "not met" if not is_met else "met" if is_enough else "too few items"
    return {"goal": name, "endpoint": endpoint, "value": value, "verdict": verdict}


def goals(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    latency = {(r["endpoint"], r["sessions"]): r for r in rows.get("complete", []) if r["p90_ms"] is not None}
    for (endpoint, level), r in latency.items():
        if level == 1:
            out.append(_goal("reply p50 <= 300 ms, p90 <= 500 ms (1 session)", endpoint,
                             f"{r['p50_ms']:.0f} / {r['p90_ms']:.0f} ms", r["p50_ms"] <= 300 and r["p90_ms"] <= 500))
        if level == 8:
            out.append(_goal("reply p90 <= 700 ms (8 sessions)", endpoint, f"{r['p90_ms']:.0f} ms", r["p90_ms"] <= 700))
    for (endpoint, level), r in latency.items():
        if endpoint == "twilio" and ("ws", level) in latency:
            ratio = r["p90_ms"] / latency["ws", level]["p90_ms"]
            out.append(_goal(f"twilio p90 <= 1.3x /ws ({level} sessions)", endpoint, f"{ratio:.2f}x", ratio <= 1.3))
    for r in rows.get("interruptions", []):
        judged = r["num_items"] - r["num_reply_ended"]
        out.append(_goal(f"0 stopped replies of >= 20 {r['kind']}s", r["endpoint"], f"{r['num_stopped']} of {judged}",
                         None if not judged else r["num_stopped"] == 0, is_enough=judged >= 20))
    for r in rows.get("hesitation", []):
        num_items, num_early = r["num_items"], r["num_premature"]
        out.append(_goal("hesitations answered early <= 1 in 10", r["endpoint"], f"{num_early} of {num_items}",
                         None if not num_items else num_early * 10 <= num_items, is_enough=num_items >= 10))
    for r in rows.get("barge_in", []):
        judged, num_fast = r["num_items"] - r["num_reply_ended"], r["num_within_300ms"]
        out.append(_goal("every barge-in stops audible audio <= 300 ms", r["endpoint"], f"{num_fast} of {judged}",
                         None if not judged else num_fast == judged, is_enough=judged >= 10))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--endpoints", default="ws,realtime,twilio")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--sessions", default="1,8", help="concurrency levels of `complete`")
    parser.add_argument("--quick", action="store_true", help="a few items per category (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--asks", type=int, default=None,
                        help="questions each session of `complete` asks (default: all of the set's, in turn)")
    parser.add_argument("--details", action="store_true", help="a line per item")
    args = parser.parse_args()
    endpoints, scenarios = args.endpoints.split(","), args.scenarios.split(",")
    if unknown := [s for s in scenarios if s not in SCENARIOS] + [e for e in endpoints if e not in CLIENTS]:
        parser.error(f"unknown: {', '.join(unknown)}")
    if args.asks is not None and args.asks < 1:
        parser.error(f"--asks must be at least 1, got {args.asks}")
    print(cpu_description())
    needed = tuple(dict.fromkeys([*scenarios, "prompt"] if set(scenarios) - {"complete", "hesitation"} else scenarios))
    test_set = make_set(needed, args.seed, args.quick)
    levels = [int(x) for x in args.sessions.split(",")]
    fd, name = tempfile.mkstemp(prefix="turntaking-", suffix=".log")
    os.close(fd)
    log_path = Path(name)
    proc, port = start_server(Path(args.config), log_path)
    rows: dict[str, list[dict[str, Any]]] = {}
    problems: Counter[str] = Counter()
    lines: list[str] = []
    try:
        warm_up = next(test_set[c] for c in ("complete", "prompt", "hesitation") if c in test_set)
        run_session(endpoints[0], port, args.seed, asking(warm_up[:1]))  # NOTE: first-call paths, caches
        for endpoint in endpoints:
            for scenario in scenarios:
                runs = run_scenario(endpoint, scenario, port, test_set, levels, args.seed, args.asks)
                for group, row, tracks in runs:
                    rows.setdefault(group, []).append(row)
                    problems.update(f"{endpoint}: {p}" for t in tracks for p in t.problems)
                    lines += details(tracks)
    finally:
        proc.terminate()
        proc.wait(30)
    if args.details:
        print("\n".join(lines))
    titles = {"complete": "End of speech -> audible reply (complete questions)",
              "hesitation": "Hesitations: audible reply before the sentence ended",
              "interruptions": f"Backchannels, coughs, bursts over a reply: stopped within {WINDOW_S:g} s",
              "barge_in": "Barge-in: end of audible reply - onset of the first word"}
    for name, title in titles.items():
        if rows.get(name):
            print(f"\n== {title} ==\n{format_table(rows[name])}\n{cpu_description()}")
    print(f"\n== Goals ==\n{format_table(goals(rows))}\n{cpu_description()}")
    for problem, count in problems.most_common(20):
        print(f"problem ({count}x): {problem}")
    log = log_path.read_text(errors="replace").splitlines()
    errors = [line for line in log if "ERROR" in line or "Traceback" in line]
    print(f"server log {log_path}: {len(log)} lines, {len(errors)} errors" + "".join(f"\n  {e}" for e in errors[:5]))


if __name__ == "__main__":
    main()
