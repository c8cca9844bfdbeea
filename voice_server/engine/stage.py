"""The stage process shell: the same I/O loop for every stage, whatever its scheduler or model.

It drains the broadcast socket (aborts first) and the inbox, feeds the schedulers, runs
`schedule -> execute -> update`, and routes what comes out: stream chunks to `stream_to` stages,
results to `next`, terminal outputs and errors to the coordinator. It never branches on the
scheduler type. What each received message does is `stage_intake.py`'s; where an emit goes, `routing.py`'s.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from voice_server.engine import ipc
from voice_server.engine.messages import Codec, Message, Probe, Progress, Ready, StartupFailed
from voice_server.engine.outbox import Outbox
from voice_server.engine.routing import route
from voice_server.engine.runtime import StageContext, StageRuntime, create_runner, create_scheduler
from voice_server.engine.stage_intake import StageIntake
from voice_server.engine.transports import open_transports
from voice_server.logs import flush_rate_limits, rate_key
from voice_server.relay.shm import RelayFullError, ShmReader, ShmSlab, is_exhaustion
from voice_server.scheduling import Emit

if TYPE_CHECKING:
    from voice_server.engine.process import ProcessSpec

log = logging.getLogger("voice_server.stage")
_IDLE_POLL_MS = 100


class StageShell:
    def __init__(self, spec: ProcessSpec) -> None:
        self.spec = spec
        self.cfg = spec.pipeline
        self.owner = ipc.relay_owner(spec.process, spec.generation)
        self.is_running = True
        self._parent_pid = os.getppid()
        self.ctx = zmq.Context()
        self._auth = spec.endpoints.start_auth(self.ctx)
        self.inbox = ipc.configure(self.ctx.socket(zmq.PULL))
        spec.endpoints.bind(self.inbox, spec.endpoints.inboxes[spec.process])
        self.sub = ipc.configure(self.ctx.socket(zmq.SUB))
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        spec.endpoints.connect(self.sub, spec.endpoints.broadcast)
        self.poller = zmq.Poller()
        self.poller.register(self.sub, zmq.POLLIN)
        self.poller.register(self.inbox, zmq.POLLIN)
        self._peers = ipc.Peers(self.ctx, spec.endpoints, spec.process)
        self.slab = ShmSlab(
            spec.launch_id, self.owner, self.cfg.relay_slab_bytes,
            max_bytes=spec.limits.max_relay_bytes, max_overflow_segments=spec.limits.max_relay_segments,
        )
        self.reader = ShmReader()
        self.relay_out, self.relay_in = open_transports(spec.endpoints, spec.process, self.slab, self.reader)
        self.codec = Codec(self.relay_out, self.relay_in, self.cfg.inline_threshold_bytes, as_torch=False)
        self.stages: dict[str, StageRuntime] = {}
        self.outbox = Outbox(self._peers, self.codec, self.slab, self.owner)
        self.intake = StageIntake(spec, self.stages, self.codec, self.outbox, self.slab, self.reader, self._peers)

    # -- lifecycle -------------------------------------------------------------------------------

    def stop(self) -> None:
        self.is_running = False

    def close(self) -> None:
        self.relay_out.close()  # NOTE: the slab, and the cross-host engine that serves it when there is one
        self.relay_in.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.destroy(linger=0)

    def run(self) -> None:
        try:
            for stage in self.cfg.processes[self.spec.process]:
                ctx = StageContext(stage, self.cfg, self.spec.budgets.get(stage.name), self.spec.launch_id,
                                   functools.partial(self._report, stage.name))
                runner = create_runner(ctx)
                self.stages[stage.name] = StageRuntime(stage, create_scheduler(stage, runner), runner)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            # NOTE: one line for the operator (the server repeats it); the traceback at debug level.
            log.error("startup failed: %s", message)
            log.debug("startup failure traceback", exc_info=True)
            self.outbox.send(ipc.COORDINATOR, StartupFailed(self.spec.process, self.spec.generation, message))
            time.sleep(0.2)  # NOTE: give ZMQ a moment to flush before the process exits
            return
        if not self._await_probe():
            return
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        facts = {name: s.runner.facts() for name, s in self.stages.items()}
        self.outbox.send(ipc.COORDINATOR, Ready(self.spec.process, self.spec.generation, os.getpid(), facts))
        while self.is_running:
            self._poll_once()

    def _report(self, stage: str, phase: str) -> None:
        self.outbox.send(ipc.COORDINATOR, Progress(self.spec.process, self.spec.generation, stage, phase))

    def _await_probe(self) -> bool:
        # NOTE: PUB/SUB slow joiner: aborts published before our subscription reaches the publisher
        # would be lost, so we only report ready once a broadcast probe has arrived.
        while self.is_running:
            if self.sub.poll(_IDLE_POLL_MS) and isinstance(self.intake.recv(self.sub), Probe):
                return True
            if os.getppid() != self._parent_pid:
                return False
        return False

    # -- loop ------------------------------------------------------------------------------------

    def _poll_once(self) -> None:
        # NOTE: one multipart message per destination per loop turn (a step's outputs for a batch of
        # requests, its acks, its failures) instead of one per output: the per-message cost is paid once.
        self.outbox.is_holding = True
        try:
            self._serve_once()
        finally:
            self.outbox.is_holding = False
            self.outbox.flush()

    def _serve_once(self) -> None:
        now = time.monotonic()
        waits = [w for s in self.stages.values() if (w := s.scheduler.next_wakeup(now)) is not None]
        # NOTE: round up, or a sub-millisecond batching wait would spin on zero-timeout polls.
        timeout_ms = math.ceil(min(waits) * 1000) if waits else _IDLE_POLL_MS
        if not self.poller.poll(timeout_ms):
            flush_rate_limits()  # NOTE: idle: write the summaries of suppressed repeats
        self.intake.drain(self.sub)  # aborts before work
        self.intake.drain(self.inbox)
        if os.getppid() != self._parent_pid:
            self.is_running = False
            return
        for runtime in self.stages.values():
            batch = runtime.scheduler.schedule(time.monotonic())
            if batch is not None:
                self._execute(runtime, batch)

    def _execute(self, runtime: StageRuntime, batch: Any) -> None:
        try:
            result = runtime.runner.execute(batch)
        except Exception as exc:
            log.error("stage %s: batch failed:\n%s", runtime.cfg.name, traceback.format_exc())
            self.intake.drain(self.sub)
            emits = runtime.scheduler.fail(batch, f"{type(exc).__name__}: {exc}")
        else:
            # NOTE: aborts that arrived while the batch ran leave the scheduler before `update`, so
            # an aborted request's step output is dropped instead of routed (and its pages freed).
            self.intake.drain(self.sub)
            emits = runtime.scheduler.update(batch, result)
        failed: set[str] = set()
        for emit in emits:
            if emit.request_id in failed:
                continue
            error = self._route_or_wait(runtime, emit)
            if error is not None:
                # NOTE: keyed without the request id, so a burst of them folds into one count per window.
                log.error("stage %s: cannot send output of %s: %s", runtime.cfg.name, emit.request_id, error,
                          extra=rate_key(f"stage {runtime.cfg.name}: cannot send output: {type(error).__name__}"))
                self.intake.fail_request(runtime, emit.request_id, f"output cannot be sent: {error}",
                                         is_exhaustion(error))
                failed.add(emit.request_id)

    # -- output routing --------------------------------------------------------------------------

    def _route_or_wait(self, runtime: StageRuntime, emit: Emit) -> Exception | None:
        """Send what `emit` becomes, waiting up to `max_relay_wait_s` for room in a full relay; the error
        that fails its request instead (an output msgpack cannot carry, no room in time, no descriptors)."""
        deadline: float | None = None
        while emit.request_id not in self.intake.aborted:  # NOTE: an abort may come in while it waits
            planned = route(self.cfg, runtime, emit)
            try:
                self._send_all(planned.messages)
            except RelayFullError as exc:
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.cfg.max_relay_wait_s
                if now >= deadline:
                    return RelayFullError(f"{exc}, still after {self.cfg.max_relay_wait_s:g} s (max_relay_wait_s)")
                # NOTE: back-pressure: room comes back with the consumers' acks (of what they have been
                # sent: flushed first). Meanwhile this stage reads its sockets (acks, aborts, new work for
                # later) but runs nothing.
                self.outbox.flush()
                if self.poller.poll(max(1, min(50, math.ceil((deadline - now) * 1000)))):
                    self.intake.drain(self.sub)
                    self.intake.drain(self.inbox)
                continue
            except (TypeError, ValueError, OverflowError, OSError) as exc:
                return exc
            planned.commit(runtime)
            if planned.is_final:
                self.outbox.ack(runtime.forget(emit.request_id))
            return None
        return None

    def _send_all(self, messages: tuple[tuple[str, Message], ...]) -> None:
        """Encode every message, then send them all; if one cannot be encoded, none is sent."""
        taken: list[int] = []
        try:
            frames = [(process, self.outbox.encode(process, msg, taken)) for process, msg in messages]
        except BaseException:
            self.slab.discard(taken)  # NOTE: the messages encoded before the failing one are never sent
            raise
        for process, data in frames:
            self.outbox.post(process, data)
