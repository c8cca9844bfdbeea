"""Prometheus metrics of the session layer (`GET /metrics`), one registry per app.

How an endpoint reports (every endpoint: `/ws`, `/v1/realtime`, `/twilio/media`):

- the session gate (`voice_server/server/sessions.py`) counts sessions opened, refused and dropped
  (`voice_server_active_sessions{endpoint}`, `..._sessions_refused_total`, `..._sessions_dropped_total`);
  an endpoint that admits through `SessionGate.admit` gets these for free;
- per connection, `tracker = metrics.track(endpoint)`, then:
  - `tracker.observe(event)` for every `SessionEvent` the endpoint sends to its client (in its emit),
    after the send: turn ends (`SpeechStopped`), `ResponseDone` (first-audio latency from its
    `timings_ms`, per-stage breakdown, realtime factor, status) and `SessionError` (protocol errors by
    code) are taken from there;
  - `tracker.turn_ended()` when a turn ends by a client message (a typed text turn, a manual commit,
    an explicit response request), so first-audio latency is measured from that message;
  - `tracker.count_session(session)` after feeding input audio to a `Session` (its barge-ins and
    speculative responses);
  - `tracker.protocol_error(code)` for a client error the endpoint answers without a `SessionError`
    event (e.g. a bad first message that closes the connection).

Series:
- `voice_server_first_audio_seconds`: end of the user's turn (the server's `SpeechStopped`, i.e. after
  the VAD's end-of-turn silence, or the client message that ended it) -> the first *audible* audio of
  the response as the client plays it (`ResponseDone.timings_ms.first_audible`: the first 10 ms frame
  at -40 dBFS or more, placed on the client's playout clock, `voice_server/audio/levels.py`);
- `voice_server_first_audio_byte_seconds`: the same from the turn's end to the first audio byte sent
  (what this series measured before: it counts a synthesiser's leading silence as audio);
- `voice_server_reply_gap_seconds`: the end of the user's *speech* (before the end-of-turn silence)
  -> the first audible audio: the wait a person perceives, spoken turns only;
- `voice_server_stage_first_output_seconds{stage}`: submit -> each stage's first output of a response
  (from `ResponseDone.timings_ms`);
- `voice_server_realtime_factor`: wall time from `ResponseStarted` to `ResponseDone` over the seconds of
  audio sent, per completed response with audio (< 1: faster than real time);
- `voice_server_speculative_responses_total{outcome}`: responses started at a pause before the turn
  ended (`semantic_vad`), `outcome` `started` or `discarded` (the speaker went on: the work was thrown away);
- `voice_server_responses_total{status}`, `voice_server_barge_ins_total`,
  `voice_server_protocol_errors_total{endpoint,type}`;
- read from the coordinator at each scrape (`Metrics.watch`): `voice_server_pipeline_ready` (1 when
  `/health` answers 200), `voice_server_stage_restarts_total{stage}` (crashes its process was restarted
  after) and `voice_server_inflight_requests`; for each replica of a replicated stage (`replicas: N`),
  `voice_server_replica_ready{stage,process}`, `voice_server_replica_restarts_total{stage,process}` and
  `voice_server_replica_inflight{stage,process}` (the requests planned on it); none for a pipeline without one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from voice_server.session.events import (
    ResponseDone,
    ResponseStarted,
    SessionError,
    SessionEvent,
    SpeechStopped,
)

__all__ = ["CONTENT_TYPE_LATEST", "ConnectionMetrics", "Metrics"]

_LATENCY_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
_RTF_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25, 1.5, 2.0, 4.0)
_NOT_A_STAGE = ("first_audio_sent", "first_audible", "end_of_speech", "pause")
"""Keys of `ResponseDone.timings_ms` measured at the session, not by a stage."""


class Metrics:
    """The app's metrics: `app.state.metrics`; `render()` is the body of `GET /metrics`."""

    def __init__(self) -> None:
        # NOTE: a registry of its own (not prometheus_client's global one), so one process can build
        # several apps (tests) without duplicate-series errors.
        self.registry = CollectorRegistry()
        r = self.registry
        self.first_audio = Histogram(
            "voice_server_first_audio_seconds", "End of the user's turn to the first audible audio of the reply",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.first_audio_byte = Histogram(
            "voice_server_first_audio_byte_seconds", "End of the user's turn to the first audio byte sent",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.reply_gap = Histogram(
            "voice_server_reply_gap_seconds", "End of the user's speech to the first audible audio of the reply",
            buckets=_LATENCY_BUCKETS, registry=r)
        self.stage_first_output = Histogram(
            "voice_server_stage_first_output_seconds", "Request submit to a stage's first output, per response",
            ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.realtime_factor = Histogram(
            "voice_server_realtime_factor", "Response wall time over its audio duration (completed responses)",
            buckets=_RTF_BUCKETS, registry=r)
        self.active_sessions = Gauge("voice_server_active_sessions", "Sessions open", ["endpoint"], registry=r)
        self.barge_ins = Counter("voice_server_barge_ins", "Responses cut by the user speaking", registry=r)
        self.speculations = Counter(
            "voice_server_speculative_responses", "Responses started at a pause before the turn ended, by outcome",
            ["outcome"], registry=r)
        self.responses = Counter("voice_server_responses", "Responses ended, by status", ["status"], registry=r)
        self.protocol_errors = Counter(
            "voice_server_protocol_errors", "Client errors answered, by endpoint and error code",
            ["endpoint", "type"], registry=r)
        self.sessions_refused = Counter(
            "voice_server_sessions_refused", "WebSocket sessions closed at the handshake, by reason",
            ["endpoint", "reason"], registry=r)
        self.sessions_dropped = Counter(
            "voice_server_sessions_dropped", "Sessions the server closed, by reason (idle, slow_client, shutdown)",
            ["endpoint", "reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch(self, coordinator: Any) -> None:
        """Report the pipeline's state (`coordinator.health()`) at every scrape."""
        self.registry.register(_PipelineCollector(coordinator))

    def session_opened(self, endpoint: str) -> None:
        self.active_sessions.labels(endpoint).inc()

    def session_closed(self, endpoint: str) -> None:
        self.active_sessions.labels(endpoint).dec()

    def session_refused(self, endpoint: str, reason: str) -> None:
        self.sessions_refused.labels(endpoint, reason).inc()

    def session_dropped(self, endpoint: str, reason: str) -> None:
        self.sessions_dropped.labels(endpoint, reason).inc()

    def protocol_error(self, endpoint: str, code: str) -> None:
        self.protocol_errors.labels(endpoint, code).inc()

    def response_done(self, event: ResponseDone, turn_end_s: float | None, wall_s: float | None) -> None:
        """One response ended: its status, stage breakdown, and (when known: `turn_end_s`, how long before
        the response started its turn ended) first-audio latencies and wall time (realtime factor, for
        completed responses with audio)."""
        self.responses.labels(event.status).inc()
        timings = event.timings_ms
        for stage, ms in timings.items():
            if stage not in _NOT_A_STAGE:
                self.stage_first_output.labels(stage).observe(max(0.0, ms / 1000.0))
        if turn_end_s is not None:
            for histogram, key in ((self.first_audio, "first_audible"), (self.first_audio_byte, "first_audio_sent")):
                if key in timings:
                    histogram.observe(max(0.0, turn_end_s + timings[key] / 1000.0))
        if "end_of_speech" in timings and "first_audible" in timings:
            self.reply_gap.observe(max(0.0, (timings["first_audible"] - timings["end_of_speech"]) / 1000.0))
        if wall_s is not None and event.status == "completed" and event.num_audio_ms > 0:
            self.realtime_factor.observe(wall_s / (event.num_audio_ms / 1000.0))

    def track(self, endpoint: str) -> ConnectionMetrics:
        return ConnectionMetrics(self, endpoint)


class ConnectionMetrics:
    """One connection's bookkeeping between its events (see the module docstring for the calls); the endpoints
    see it as `ConnectionTracker` (`voice_server/session/connection.py`)."""

    def __init__(self, metrics: Metrics, endpoint: str) -> None:
        self.metrics, self.endpoint = metrics, endpoint
        self._turn_end_at: float | None = None
        self._responses: dict[str, dict[str, float]] = {}
        """Response id -> `started` and `turn_end` (monotonic times) while it runs."""
        self._counted = {"barge_ins": 0, "speculations": 0, "discarded": 0}

    def turn_ended(self) -> None:
        self._turn_end_at = time.monotonic()

    def protocol_error(self, code: str) -> None:
        self.metrics.protocol_error(self.endpoint, code)

    def count_session(self, session: Any) -> None:
        """Count the barge-ins and speculative responses `session` (a `Session`) made since the last call."""
        # NOTE: called for every input frame: the labelled counters are looked up only when a count moved.
        metrics, counted = self.metrics, self._counted
        for key, total, label in (("barge_ins", session.num_barge_ins, None),
                                  ("speculations", session.num_speculations, "started"),
                                  ("discarded", session.num_discarded_speculations, "discarded")):
            total = int(total)
            if total > counted[key]:
                counter = metrics.barge_ins if label is None else metrics.speculations.labels(label)
                counter.inc(total - counted[key])
            counted[key] = total

    def observe(self, event: SessionEvent) -> None:
        now = time.monotonic()
        if isinstance(event, SpeechStopped):
            self._turn_end_at = now
        elif isinstance(event, ResponseStarted):
            times = self._responses[event.response_id] = {"started": now}
            if self._turn_end_at is not None:
                # NOTE: a response without a new turn (a second `response.create`) has no turn end.
                times["turn_end"], self._turn_end_at = self._turn_end_at, None
        elif isinstance(event, ResponseDone):
            done = self._responses.pop(event.response_id, {})
            turn_end_s = done["started"] - done["turn_end"] if "turn_end" in done else None
            wall_s = now - done["started"] if "started" in done else None
            self.metrics.response_done(event, turn_end_s, wall_s)
        elif isinstance(event, SessionError):
            self.metrics.protocol_error(self.endpoint, event.code)


class _PipelineCollector(Collector):
    """The coordinator's health as series, read at scrape time (the supervisor keeps the counts)."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator

    def collect(self) -> Iterator[Metric]:
        health = self.coordinator.health()
        ready = GaugeMetricFamily("voice_server_pipeline_ready", "1 when every stage process is ready (/health 200)",
                                  value=1.0 if health["status"] == "ok" else 0.0)
        restarts = CounterMetricFamily("voice_server_stage_restarts", "Restarts of a stage's process after a crash",
                                       labels=["stage"])
        for stage, entry in health["stages"].items():
            restarts.add_metric([stage], float(entry.get("num_restarts", 0)))
        inflight = GaugeMetricFamily("voice_server_inflight_requests", "Requests in flight in the pipeline",
                                     value=float(health.get("num_inflight", 0)))
        yield from (ready, restarts, inflight)
        yield from _replica_families(health["stages"])


def _replica_families(stages: dict[str, Any]) -> Iterator[Metric]:
    """Per replica of each replicated stage (`/health`'s `replicas`): ready, restarts, requests in flight."""
    replicated = {stage: entry["replicas"] for stage, entry in stages.items() if entry.get("replicas")}
    if not replicated:
        return  # NOTE: no families at all, not empty ones: an unreplicated pipeline's scrape is unchanged
    labels = ["stage", "process"]
    ready = GaugeMetricFamily("voice_server_replica_ready", "1 while a replica of a replicated stage is ready",
                              labels=labels)
    restarts = CounterMetricFamily("voice_server_replica_restarts", "Restarts of a replica's process after a crash",
                                   labels=labels)
    inflight = GaugeMetricFamily("voice_server_replica_inflight", "Requests in flight planned on a replica",
                                 labels=labels)
    for stage, replicas in replicated.items():
        for process, entry in replicas.items():
            ready.add_metric([stage, process], 1.0 if entry["state"] == "ready" else 0.0)
            restarts.add_metric([stage, process], float(entry.get("num_restarts", 0)))
            # NOTE: absent while the pipeline starts (no request yet): 0.
            inflight.add_metric([stage, process], float(entry.get("num_inflight", 0)))
    yield from (ready, restarts, inflight)
