"""The coordinator: lives in the server process (asyncio), knows the topology, never the models.

It launches the stage processes, routes a new request to the entry stage, merges terminal outputs
(text and audio, in arrival order) into one async iterator per request, broadcasts aborts, and
supervises: a dead stage process fails the requests in flight, its shared memory is swept, and it
is restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
import uuid
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from voice_server.config import PipelineConfig, plan_budget
from voice_server.engine import ipc
from voice_server.engine.launcher import Launcher, ProcessState
from voice_server.engine.messages import (
    Abort,
    Ack,
    Codec,
    Failure,
    Message,
    MessageError,
    NewRequest,
    Output,
    PeerDown,
    Probe,
    Ready,
    StartupFailed,
    StatsQuery,
    StatsReply,
    acks_for,
)
from voice_server.engine.requests import RequestError, RequestState, RequestStream, TerminalOutput
from voice_server.relay.shm import ShmReader, ShmRef, ShmSlab, sweep

log = logging.getLogger("voice_server.coordinator")
_PROBE_INTERVAL_S = 0.02
_RESTART_WINDOW_S = 60.0


class StartupError(RuntimeError):
    """A stage process failed to load or did not report ready in time."""


class Coordinator:
    def __init__(self, cfg: PipelineConfig, launch_id: str | None = None, max_restarts_per_minute: int = 5) -> None:
        self.cfg = cfg
        self.budgets = plan_budget(cfg)  # NOTE: refuses an over-committed device before any spawn
        self.launch_id = launch_id or secrets.token_hex(4)
        self.endpoints = ipc.Endpoints.create(cfg, self.launch_id)
        self.launcher = Launcher(cfg, self.launch_id, self.budgets, self.endpoints)
        self.max_restarts_per_minute = max_restarts_per_minute
        self.owner = ipc.relay_owner(ipc.COORDINATOR, 0)
        self._requests: dict[str, RequestState] = {}
        self._stats: dict[int, dict[str, StatsReply]] = {}
        self._nonces = itertools.count()
        self._is_stopping = False
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._actx = zmq.asyncio.Context()
        self._ctx = zmq.Context()
        self._inbox = ipc.configure(self._actx.socket(zmq.PULL))
        self._inbox.bind(self.endpoints.inboxes[ipc.COORDINATOR])
        self._pub = ipc.configure(self._ctx.socket(zmq.PUB))
        self._pub.bind(self.endpoints.broadcast)
        self._peers = ipc.Peers(self._ctx, self.endpoints)
        self.slab = ShmSlab(self.launch_id, self.owner, self.cfg.relay_slab_bytes)
        self.reader = ShmReader()
        self.codec = Codec(self.slab, self.reader, self.cfg.inline_threshold_bytes)
        self._spawn_task(self._recv_loop())
        try:
            for name in self.launcher.handles:
                self._spawn(name)
            await self._wait_ready(list(self.launcher.handles))
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        if self._is_stopping:
            return
        self._is_stopping = True
        for handle in self.launcher.handles.values():
            if handle.process is not None and handle.process.pid is not None:  # started
                self._loop.remove_reader(handle.process.sentinel)
        for request_id in list(self._requests):
            self._finish(request_id, RequestError("the server is shutting down"))
        await self._loop.run_in_executor(None, self.launcher.terminate_all)
        for task in list(self._tasks):
            task.cancel()
        self._inbox.close(linger=0)
        self._ctx.destroy(linger=0)
        self._actx.destroy(linger=0)
        self.slab.close()
        self.reader.close()
        sweep(self.launch_id)

    @property
    def is_ready(self) -> bool:
        return all(h.state is ProcessState.READY for h in self.launcher.handles.values())

    def health(self) -> dict[str, Any]:
        stages = {}
        for stage in self.cfg.stages:
            handle = self.launcher.handles[stage.process_name]
            stages[stage.name] = {
                "process": handle.name, "state": handle.state.value, "pid": handle.pid,
                "generation": handle.generation, "num_restarts": handle.num_restarts,
            }
        return {
            "status": "ok" if self.is_ready else "unavailable", "pipeline": self.cfg.name,
            "launch_id": self.launch_id, "stages": stages,
        }

    # -- requests --------------------------------------------------------------------------------

    def submit(
        self, payload: dict[str, Any], params: dict[str, Any] | None = None, request_id: str | None = None
    ) -> RequestStream:
        """Send a request to the entry stage; iterate the result for its terminal outputs."""
        if self._is_stopping:
            raise RequestError("the server is shutting down")
        failed = [h.name for h in self.launcher.handles.values() if h.state is ProcessState.FAILED]
        if failed:
            raise RequestError(f"pipeline unavailable: stage process(es) {', '.join(failed)} failed")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in flight")
        entry = self.cfg.entry_stage
        process = self.cfg.stage(entry).process_name
        try:
            data = self.codec.encode(NewRequest(request_id, entry, payload, params or {}), consumer=process)
        except (TypeError, ValueError, OverflowError) as exc:  # NOTE: pack frees its relay slots itself
            raise RequestError(f"request payload cannot be sent: {exc}") from exc
        queue: asyncio.Queue[TerminalOutput | RequestError | None] = asyncio.Queue()
        self._requests[request_id] = RequestState(queue, set(self.cfg.terminal_stages))
        self._peers.get(process).send(data)
        return RequestStream(self, request_id, queue)

    async def abort(self, request_id: str) -> bool:
        """Stop a request everywhere (barge-in, disconnect); its stream ends without error."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        while not request.queue.empty():  # NOTE: after a barge-in nothing more may reach the client
            request.queue.get_nowait()
        self._finish(request_id, None)
        self._broadcast(Abort([request_id]))
        return True

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    async def stats(self, timeout_s: float = 2.0) -> dict[str, StatsReply]:
        """Ask every ready stage process for its active requests and relay usage."""
        nonce = next(self._nonces)
        replies = self._stats[nonce] = {}
        expected = {h.name for h in self.launcher.handles.values() if h.state is ProcessState.READY}
        self._broadcast(StatsQuery(nonce))
        deadline = time.monotonic() + timeout_s
        while set(replies) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return self._stats.pop(nonce)

    def _finish(self, request_id: str, outcome: RequestError | None) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            request.queue.put_nowait(outcome)

    # -- sockets ---------------------------------------------------------------------------------

    def _send(self, process: str, msg: Message) -> None:
        self._peers.get(process).send(self.codec.encode(msg, consumer=process))

    def _broadcast(self, msg: Message) -> None:
        self._pub.send(self.codec.encode(msg))

    def _ack(self, refs: list[ShmRef]) -> None:
        for ack in acks_for(refs):
            self._send(ipc.owner_process(ack.owner), ack)

    async def _recv_loop(self) -> None:
        while True:
            data = await self._inbox.recv()  # type: ignore[misc]  # zmq.asyncio returns a future
            try:
                msg, refs = self.codec.decode(data)
            except MessageError as exc:
                log.warning("dropped a message: %s", exc)
                self._ack(exc.refs)
                continue
            try:
                self._dispatch(msg, refs)
            except Exception:
                log.exception("coordinator failed to handle %s", type(msg).__name__)

    def _dispatch(self, msg: Message, refs: list[ShmRef]) -> None:
        if isinstance(msg, Output):
            # NOTE: the client may hold outputs indefinitely, so relay-backed arrays are copied and
            # their slots returned at once.
            payload = _detach(msg.payload) if refs else msg.payload
            self._ack(refs)
            request = self._requests.get(msg.request_id)
            if request is None:
                return  # aborted or failed already
            request.queue.put_nowait(TerminalOutput(msg.request_id, msg.stage, payload, msg.is_final))
            if msg.is_final:
                request.pending_terminals.discard(msg.stage)
                if not request.pending_terminals:
                    self._finish(msg.request_id, None)
            return
        self._ack(refs)
        if isinstance(msg, Failure):
            if msg.request_id in self._requests:
                self._finish(msg.request_id, RequestError(f"stage '{msg.stage}': {msg.message}"))
                self._broadcast(Abort([msg.request_id]))  # other stages drop what they hold
        elif isinstance(msg, Ack):
            if msg.owner == self.owner:
                self.slab.ack(msg.slot_ids)
        elif isinstance(msg, Ready):
            handle = self.launcher.handles.get(msg.process)
            if handle is not None and handle.generation == msg.generation:
                handle.state = ProcessState.READY
        elif isinstance(msg, StartupFailed):
            handle = self.launcher.handles.get(msg.process)
            if handle is not None and handle.generation == msg.generation:
                handle.state, handle.last_error = ProcessState.FAILED, msg.message
        elif isinstance(msg, StatsReply) and msg.nonce in self._stats:
            self._stats[msg.nonce][msg.process] = msg

    # -- supervision -----------------------------------------------------------------------------

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _spawn(self, name: str) -> None:
        handle = self.launcher.spawn(name)
        handle.state = ProcessState.STARTING
        assert handle.process is not None
        self._loop.add_reader(handle.process.sentinel, self._on_exit, name, handle.generation)

    async def _wait_ready(self, names: list[str]) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while True:
            handles = [self.launcher.handles[n] for n in names]
            failed = [h for h in handles if h.state is ProcessState.FAILED]
            if failed:
                raise StartupError("; ".join(f"stage process '{h.name}': {h.last_error}" for h in failed))
            pending = [h.name for h in handles if h.state is not ProcessState.READY]
            if not pending:
                return
            if time.monotonic() > deadline:
                raise StartupError(
                    f"stage process(es) {', '.join(pending)} not ready after {self.cfg.startup_timeout_s:g} s"
                )
            self._broadcast(Probe(next(self._nonces)))
            await asyncio.sleep(_PROBE_INTERVAL_S)

    def _on_exit(self, name: str, generation: int) -> None:
        handle = self.launcher.handles[name]
        if handle.process is not None:
            self._loop.remove_reader(handle.process.sentinel)
        if self._is_stopping or generation != handle.generation:
            return
        exitcode = None
        if handle.process is not None:
            handle.process.join(1.0)  # NOTE: the sentinel can fire just before the child is reapable
            exitcode = handle.process.exitcode
        if handle.state is ProcessState.STARTING:
            handle.state = ProcessState.FAILED
            handle.last_error = handle.last_error or f"exited with code {exitcode} before it was ready"
            return
        self._spawn_task(self._recover(name, generation, exitcode))

    async def _recover(self, name: str, generation: int, exitcode: int | None) -> None:
        handle = self.launcher.handles[name]
        handle.state = ProcessState.RESTARTING
        owner = ipc.relay_owner(name, generation)
        stages = ", ".join(s.name for s in self.cfg.processes[name])
        log.error("stage process '%s' (%s) died with exit code %s; restarting", name, stages, exitcode)
        sweep(self.launch_id, owner)
        # NOTE: every stage is reachable from the entry, so every request in flight may touch it.
        failed = list(self._requests)
        error = RequestError(f"stage process '{name}' ({stages}) died with exit code {exitcode}")
        for request_id in failed:
            self._finish(request_id, error)
        if failed:
            self._broadcast(Abort(failed))
        self._broadcast(PeerDown(name, owner))
        self.reader.forget_owner(owner)
        self.slab.release_consumer(name)
        self._peers.reset(name)
        now = time.monotonic()
        handle.crash_times = [t for t in handle.crash_times if now - t < _RESTART_WINDOW_S] + [now]
        if len(handle.crash_times) > self.max_restarts_per_minute:
            handle.state = ProcessState.FAILED
            handle.last_error = f"crashed {len(handle.crash_times)} times in a minute"
            log.error("stage process '%s' is crash-looping; not restarting", name)
            return
        handle.num_restarts += 1
        self._spawn(name)
        try:
            await self._wait_ready([name])
        except StartupError as exc:
            handle.state, handle.last_error = ProcessState.FAILED, str(exc)
            log.error("restart of '%s' failed: %s", name, exc)


def _detach(obj: Any) -> Any:
    """Copy every array out of relay memory."""
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_detach(v) for v in obj]
    return obj
