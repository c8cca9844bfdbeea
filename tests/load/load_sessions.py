"""Helpers for whole sessions under faults: a two-process stand-in speech pipeline, good sessions that
talk concurrently (with their first-audio latency), and a snapshot of every resource a session holds
(stage requests, KV pages, relay slots, `/dev/shm` segments, the active sessions gauge) to compare
with a baseline once the faults are over."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness import Pipeline, shm_segments
from live_server import metric, open_session
from realtime_client import RealtimeClient, text_item, transcript
from session_server import SessionServer

from voice_server.audio import b64decode
from voice_server.config import pipeline_from_dict


def two_stage_pipeline(step_delay_ms: int = 30, **fields: Any) -> Pipeline:
    """`front` (an echo: the conversation passes through it and the relay) -> `speech` (the stand-in
    AR stage), each in its own process. Both restart in well under a second after a SIGKILL (no model
    to load), which keeps a crash-under-load test short; `configs/default.yaml` takes 3-6 s per restart."""
    return Pipeline(pipeline_from_dict({"name": "speech-2stage", "restart_backoff_s": 0.05, **fields, "stages": [
        {"name": "front", "factory": "voice_server.stages.numeric:create_echo", "scheduler": "simple",
         "next": "speech", "memory_fraction": 0.01},
        {"name": "speech", "factory": "speech_stages:create_fake_speech", "scheduler": "ar", "terminal": True,
         "max_batch_size": 8, "max_step_tokens": 64, "factory_args": {"step_delay_ms": step_delay_ms}},
    ]}))


@dataclass
class Turn:
    status: str
    error: str
    num_audio_bytes: int
    first_audio_s: float | None
    """Typed turn sent -> first audio byte received."""
    text: str = ""


def talk(ws: Any, text: str = "hello", timeout: float = 20.0, audio: bytes | None = None) -> Turn:
    """One typed turn (or, with `audio`, a spoken one committed by hand: a session opened with
    `turn_detection=None`) to its `response_done`."""
    if audio is not None:
        ws.send(audio)
        ws.send(json.dumps({"type": "input.commit"}))
    sent = time.monotonic()
    ws.send(json.dumps({"type": "response.create"} if audio is not None else {"type": "text", "text": text}))
    first_audio, num_audio, deadline = None, 0, sent + timeout
    while True:
        message = ws.recv(max(0.01, deadline - time.monotonic()))
        if isinstance(message, bytes):
            first_audio = first_audio or time.monotonic() - sent
            num_audio += len(message)
            continue
        event = json.loads(message)
        if event["type"] == "response_done":
            return Turn(event["status"], event.get("error", ""), num_audio, first_audio, event.get("text", ""))


def realtime_talk(client: RealtimeClient, text: str = "hello", timeout: float = 20.0) -> Turn:
    """One typed turn of a `/v1/realtime` session to its `response.done`."""
    sent = time.monotonic()
    client.send("conversation.item.create", item=text_item(text))
    client.send("response.create")
    events = client.until("response.done", timeout)
    audio = [e for e in events if e["type"] == "response.output_audio.delta"]
    response = events[-1]["response"]
    error = ((response.get("status_details") or {}).get("error") or {}).get("message", "")
    return Turn(response["status"], error, sum(len(b64decode(e["delta"])) for e in audio),
                audio[0]["_at"] - sent if audio else None, transcript(events))


def take_turn(session: Any, audio: bytes | None = None, text: str = "hello", timeout: float = 20.0) -> Turn:
    """A Realtime session's typed turn, or a native session's (spoken, with `audio`)."""
    if isinstance(session, RealtimeClient):
        return realtime_talk(session, text, timeout)
    return talk(session, text, timeout, audio)


def talk_in_parallel(sessions: list[Any], rounds: int = 1, audio: bytes | None = None, text: str = "hello",
                     during: Callable[[], None] | None = None, timeout: float = 20.0) -> list[list[Turn]]:
    """Each session (native or Realtime) takes `rounds` turns (`take_turn`) in its own thread, while
    this thread runs `during` (e.g. a fault to inject); the turns of each session, in order."""
    results: list[list[Turn]] = [[] for _ in sessions]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(rounds):
                results[i].append(take_turn(sessions[i], audio, text, timeout))
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return results


def open_sessions(srv: SessionServer, num: int, max_tokens: int = 12, **start: Any) -> list[Any]:
    return [open_session(srv.ws_url, params={"sampling": {"max_tokens": max_tokens}}, **start) for _ in range(num)]


def resources(srv: SessionServer) -> dict[str, Any]:
    """What sessions hold, by name; equal to a baseline once everything they held is freed. Relay
    segments are named without the process generation (a restarted `speech.1` replaces `speech.0`)."""
    coordinator = srv.pipeline.coordinator
    found: dict[str, Any] = {
        "shm": sorted(_ungenerated(n) for n in shm_segments(coordinator.launch_id)),
        "coordinator.inflight": coordinator.num_inflight,
        "coordinator.relay_slots": coordinator.slab.num_live_slots,
        "active_sessions": sum(metric(srv.metrics(), "voice_server_active_sessions", endpoint=e)
                               for e in ("native", "realtime", "twilio")),
    }
    for process, reply in srv.pipeline.run(coordinator.stats()).items():
        found[f"{process}.requests"] = sum(len(ids) for ids in reply.active.values())
        found[f"{process}.relay_slots"] = reply.num_live_slots
        found[f"{process}.relay_bytes"] = reply.num_used_bytes
        for stage, counters in reply.counters.items():
            for name in ("num_running", "num_waiting", "num_used_pages"):
                if name in counters:
                    found[f"{stage}.{name}"] = counters[name]
    return found


def _ungenerated(segment: str) -> str:
    launch_owner, index = segment.rsplit("-", 1)
    owner = launch_owner.split("-", 2)[2]
    return f"{owner.split('.')[0]}-{index}"


def wait_ready(srv: SessionServer, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not srv.pipeline.coordinator.is_ready:
        assert time.monotonic() < deadline, srv.pipeline.coordinator.health()
        time.sleep(0.02)


def wait_baseline(srv: SessionServer, baseline: dict[str, Any], timeout: float = 15.0) -> None:
    """Until `resources` equals `baseline` (everything freed); fails with the difference."""
    deadline = time.monotonic() + timeout
    while (now := resources(srv)) != baseline:
        diff = {k: (baseline.get(k), now.get(k)) for k in set(now) | set(baseline) if now.get(k) != baseline.get(k)}
        assert time.monotonic() < deadline, f"not back to baseline (baseline, now): {diff}"
        time.sleep(0.1)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
