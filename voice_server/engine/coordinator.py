"""The coordinator: lives in the server process (asyncio), knows the topology, never the models.

It launches the stage processes, admits requests within the engine's limits, routes a new request
to the entry stage, merges terminal outputs (text and audio, in arrival order) into one async
iterator per request, ends requests at their deadline, and broadcasts aborts. Supervision (restarts
with backoff) is the Supervisor's; the coordinator cleans up after a dead process: fails the
requests in flight, sweeps its shared memory and tells the other processes. Its helpers: the
messages from the stages are handled in `coordinator_intake.py`, a request and its streamed input leave
through `submission.py`, and the requests in flight are kept in `request_table.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from voice_server.config import PipelineConfig, plan_budget
from voice_server.engine import ipc
from voice_server.engine.coordinator_intake import CoordinatorIntake
from voice_server.engine.launcher import Launcher, ProcessHandle, ProcessState, create_backend
from voice_server.engine.limits import EngineLimits
from voice_server.engine.messages import (
    NUM_ABORTED_KEPT,
    Abort,
    Codec,
    Message,
    NewRequest,
    PeerDown,
    PeerMoved,
    Probe,
    StatsQuery,
    StatsReply,
)
from voice_server.engine.outbox import Outbox
from voice_server.engine.replicas import ReplicaPlanner, process_for
from voice_server.engine.request_table import RequestTable
from voice_server.engine.requests import (
    DeadlineExceeded,
    InputStream,
    OverloadError,
    RequestError,
    RequestStream,
    SlowConsumerError,
    UnavailableError,
)
from voice_server.engine.rundir import RunDir, sweep_dead_launches
from voice_server.engine.submission import InputSender, encode_for
from voice_server.engine.supervisor import StartupError, Supervisor
from voice_server.engine.transports import open_transports, relay_counters
from voice_server.relay.shm import ShmReader, ShmSlab
from voice_server.relay.shm_segments import sweep

__all__ = [
    "Coordinator", "DeadlineExceeded", "InputStream", "OverloadError", "RequestError", "SlowConsumerError",
    "StartupError", "UnavailableError",
]

log = logging.getLogger("voice_server.coordinator")


class Coordinator:
    def __init__(self, cfg: PipelineConfig, launch_id: str | None = None) -> None:
        self.cfg = cfg
        self.budgets = plan_budget(cfg)  # NOTE: refuses an over-committed device before any spawn
        self.launch_id = launch_id or secrets.token_hex(4)
        self.owner = ipc.relay_owner(ipc.COORDINATOR, 0)
        self._nonces = itertools.count()
        self._aborted_ids: OrderedDict[str, None] = OrderedDict()
        """Ids of requests aborted everywhere, the most recent NUM_ABORTED_KEPT: the stages drop messages for them."""
        self._is_started = False
        self._is_stopping = False
        self.is_start_done = False
        """`start` has returned: every stage became ready once (while False, `/health` says `starting`)."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cleanups: list[tuple[Callable[[], object], bool]] = []
        """What stop() undoes, in reverse order; True marks a blocking step (run off the loop)."""

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._replicas = ReplicaPlanner(self.cfg, self._is_process_ready)
        self._requests = RequestTable(self._loop, self.cfg.terminal_stages, self._abort_everywhere,
                                      self.cfg.max_queued_outputs, on_end=self._replicas.release)
        self._is_started = True
        try:
            self._open()
            self._spawn_task(self._intake.run())
            await self.supervisor.start_all()
        except BaseException:
            await self.stop()
            raise
        self._spawn_task(self.supervisor.run())
        self.is_start_done = True

    def _open(self) -> None:
        """Create what a launch holds; each piece registers its own cleanup as it comes into being."""
        sweep_dead_launches()  # NOTE: what a SIGKILLed server left behind
        self._cleanups.append((lambda: sweep(self.launch_id), False))
        self.limits = EngineLimits.resolve(self.cfg)
        self.run_dir = RunDir(self.launch_id)
        self._cleanups.append((self.run_dir.close, False))
        backend = create_backend(self.cfg, self.launch_id)
        self._cleanups.append((backend.close, True))  # NOTE: after terminate_all (cleanups run in reverse)
        backend.start(self.cfg.startup_timeout_s)  # NOTE: with Ray: joins the cluster, places every process
        self.endpoints = ipc.Endpoints.create(self.cfg, self.run_dir, backend.node_hosts())
        if self.endpoints.nodes:
            # NOTE: the config's check assumed one node per placement; now the nodes are known.
            self.budgets = plan_budget(self.cfg, self.endpoints.nodes)
        self._moved: set[str] = set()
        self.launcher = Launcher(self.cfg, self.launch_id, self.budgets, self.endpoints, self.limits, backend,
                                 self._on_moved)
        self._ctx = zmq.Context()
        self._cleanups.append((lambda: self._ctx.destroy(linger=0), False))
        auth = self.endpoints.start_auth(self._ctx)
        if auth is not None:
            self._cleanups.append((auth.stop, False))
        # NOTE: one underlying context for both, so the ZAP handler covers the asyncio inbox too.
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        self._inbox = ipc.configure(self._actx.socket(zmq.PULL))
        self._cleanups.append((lambda: self._inbox.close(linger=0), False))
        self.endpoints.bind(self._inbox, self.endpoints.inboxes[ipc.COORDINATOR])
        self._pub = ipc.configure(self._ctx.socket(zmq.PUB))
        self.endpoints.bind(self._pub, self.endpoints.broadcast)
        self._peers = ipc.Peers(self._ctx, self.endpoints, ipc.COORDINATOR)
        self.slab = ShmSlab(
            self.launch_id, self.owner, self.cfg.relay_slab_bytes,
            max_bytes=self.limits.max_relay_bytes, max_overflow_segments=self.limits.max_relay_segments,
        )
        self.reader = ShmReader()
        # NOTE: closing the transports closes the slab and reader they wrap (they are those two on one host).
        self.relay_out, self.relay_in = open_transports(self.endpoints, ipc.COORDINATOR, self.slab, self.reader)
        self._cleanups.append((self.relay_out.close, False))
        self._cleanups.append((self.relay_in.close, False))
        self.codec = Codec(self.relay_out, self.relay_in, self.cfg.inline_threshold_bytes)
        self.outbox = Outbox(self._peers, self.codec, self.slab, self.owner)
        self.supervisor = Supervisor(self.cfg, self.launcher, self._on_down, lambda: self._broadcast(Probe(0)),
                                     self._announce_moves)
        self._intake = CoordinatorIntake(
            self._inbox, self.codec, self.outbox, self._requests, self.supervisor, self.slab)
        self._inputs = InputSender(
            self._peers, self.codec, self.outbox, self._loop, lambda: self._is_stopping)
        self._cleanups.append((self.supervisor.stop, False))
        # NOTE: runs first on stop (cleanups run in reverse): no process may outlive the launch.
        self._cleanups.append((self.launcher.terminate_all, True))  # NOTE: joins processes

    async def stop(self) -> None:
        if self._is_stopping or not self._is_started:
            return
        self._is_stopping = True
        self._requests.fail_all(UnavailableError("the server is shutting down"))
        self._requests.is_closed = True
        for task in list(self._tasks):
            task.cancel()
        while self._cleanups:
            cleanup, is_blocking = self._cleanups.pop()
            try:
                if is_blocking:
                    await self._loop.run_in_executor(None, cleanup)
                else:
                    cleanup()
            except Exception:
                log.exception("cleanup step failed while stopping")

    @property
    def is_ready(self) -> bool:
        """Every stage can take a request: its process, or one replica of it, is ready."""
        return self.is_start_done and not self._is_stopping and self.supervisor.unavailable_reason() is None

    def _is_process_ready(self, process: str) -> bool:
        return self.launcher.handles[process].state is ProcessState.READY

    def health(self) -> dict[str, Any]:
        """Public view (no PIDs, no launch id): each stage's state and restart history; `status` is
        `starting` until every stage became ready once (stages `starting` or `ready` meanwhile), then
        `ok` or `unavailable`."""
        if not self.is_start_done:
            # NOTE: the HTTP server listens while the stages load; before `start` ran there is no
            # supervisor yet, so every stage is reported as starting.
            stages = self.supervisor.describe() if hasattr(self, "supervisor") else {
                s.name: {"process": s.process_name, "state": "starting"} for s in self.cfg.stages}
            status = "unavailable" if self._is_stopping else "starting"
            return {"status": status, "pipeline": self.cfg.name, "stages": stages}
        return {
            "status": "ok" if self.is_ready else "unavailable", "pipeline": self.cfg.name,
            "num_inflight": len(self._requests), "max_inflight": self.limits.max_inflight_requests,
            "stages": self.supervisor.describe(self._replicas.num_inflight),
        }

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self, payload: dict[str, Any], params: dict[str, Any] | None = None, request_id: str | None = None,
        timeout_s: float | None = None, stream_input: bool = False,
    ) -> RequestStream:
        """Send a request to the entry stage; iterate the result for its terminal outputs.

        Refuses at once, never queues: UnavailableError when a stage cannot serve, OverloadError
        beyond the admission limits. `timeout_s` (default `request_timeout_s`) is the deadline.
        With `stream_input`, more input follows while the request runs (a user's audio while they
        speak): the stream's `.input` (an `InputStream`) sends it to the entry stage as chunks, then
        its end; `payload` is what the entry stage gets first (e.g. the conversation so far).
        """
        self._check_available()
        params = params or {}
        for name, value in (("payload", payload), ("params", params)):
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise RequestError(f"request {name} must be a mapping with string keys")
        if len(self._requests) >= self.limits.max_inflight_requests:
            raise OverloadError(
                f"server busy: {len(self._requests)} requests in flight (max_inflight_requests)"
            )
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        if request_id in self._aborted_ids:
            raise ValueError(f"request id {request_id!r} was aborted or failed: a new request needs a new id")
        entry = self.cfg.entry_stage
        submitted = {"submit": time.monotonic()}
        plan = self._replicas.plan(request_id)
        try:
            request = NewRequest(request_id, entry, payload, params, is_stream=stream_input, timings=submitted,
                                 replicas=plan)
            process = process_for(self.cfg, plan, entry)
            sock, data = encode_for(self._peers, self.codec, process, request, "request payload")
        except BaseException:
            self._replicas.release(request_id)  # NOTE: refused: it never reached a replica
            raise
        stream = self._requests.open(request_id, timeout_s if timeout_s is not None else self.limits.request_timeout_s)
        sock.send(data)
        if stream_input:
            is_live = self._requests.live_check(request_id)
            stream.input = InputStream(request_id, entry, lambda msg: self._inputs.send(msg, process, is_live))
        return stream

    @property
    def num_dropped_messages(self) -> int:
        """Messages from the stages dropped as malformed or unexpected (each is logged, never fatal)."""
        return self._intake.num_dropped_messages if hasattr(self, "_intake") else 0

    @property
    def io_counters(self) -> dict[str, int]:
        """ZMQ messages received from the stages and sent to them, and the control messages (frames) in them."""
        return {**self._intake.counters, **self.outbox.counters, **relay_counters(self.relay_out, self.relay_in)}

    def _check_available(self) -> None:
        if self._is_stopping or not self._is_started:
            raise UnavailableError("the server is not running")
        reason = self.supervisor.unavailable_reason()
        if reason is not None:
            raise UnavailableError(f"pipeline unavailable: {reason}")

    async def abort(self, request_id: str) -> bool:
        """Stop a request everywhere (barge-in, disconnect); its stream ends without error."""
        return self._requests.abort(request_id)

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    async def stats(self, timeout_s: float = 2.0) -> dict[str, StatsReply]:
        """Ask every ready stage process for its active requests and relay usage."""
        nonce = next(self._nonces)
        replies = self._intake.stats_replies[nonce] = {}
        expected = {h.name for h in self.launcher.handles.values() if h.state is ProcessState.READY}
        self._broadcast(StatsQuery(nonce))
        deadline = time.monotonic() + timeout_s
        while set(replies) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return self._intake.stats_replies.pop(nonce)

    # -- sockets ---------------------------------------------------------------------------------

    def _abort_everywhere(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._aborted_ids[request_id] = None
        while len(self._aborted_ids) > NUM_ABORTED_KEPT:
            self._aborted_ids.popitem(last=False)
        self._broadcast(Abort(request_ids))

    def _broadcast(self, msg: Message) -> None:
        self._pub.send(self.codec.encode(msg))

    # -- after a stage process died ----------------------------------------------------------------

    def _on_down(self, handle: ProcessHandle, generation: int, reason: str) -> None:
        name = handle.name
        owner = ipc.relay_owner(name, generation)
        stages = ", ".join(s.name for s in self.cfg.processes[name])
        sweep(self.launch_id, owner)
        error = RequestError(f"stage process '{name}' ({stages}) died: {reason}")
        if self._replicas.is_replica(name):
            # NOTE: a replica holds only the requests planned on it; the other replicas keep serving theirs.
            self._requests.fail_some(self._replicas.requests_on(name), error)
        else:
            # NOTE: every stage is reachable from the entry, so every request in flight may touch it.
            self._requests.fail_all(error)
        self._broadcast(PeerDown(name, owner))
        self.reader.forget_owner(owner)
        self.slab.release_consumer(name)
        self._peers.reset(name)

    # -- processes placed again on another node (`launcher: ray`) --------------------------------------

    def _on_moved(self, process: str, address: str, node: str) -> None:
        self._moved.add(process)
        self._broadcast(PeerMoved(process, address, node))

    def _announce_moves(self, process: str) -> None:
        """`process` is ready: tell it (all, on the broadcast) every move since the launch began.

        NOTE: a process spawned before another moved holds the old address in its spec, and a broadcast sent
        while it started (before its probe) never reached it; once ready it hears every later broadcast."""
        for moved in sorted(self._moved):
            self._broadcast(PeerMoved(moved, self.endpoints.inboxes[moved], self.endpoints.nodes[moved]))

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
