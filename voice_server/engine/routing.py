"""Where a stage's output goes: the messages one `Emit` becomes, built before any is sent.

The shell encodes all of them (taking relay slots) and sends them only once every one encoded, then
commits the streams they opened and advanced (`Route.commit`). A full relay thus leaves no half-sent
emit behind: the shell can wait for room and build the same route again, with the same chunk numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from voice_server.config import PipelineConfig
from voice_server.engine.ipc import COORDINATOR
from voice_server.engine.messages import Failure, Message, NewRequest, Output, StreamChunk, StreamDone
from voice_server.engine.replicas import process_for
from voice_server.engine.runtime import StageRuntime
from voice_server.scheduling import Emit, EmitKind


@dataclass(frozen=True)
class Route:
    request_id: str
    messages: tuple[tuple[str, Message], ...]
    """(process, message) in the order they must be sent."""
    num_chunks_sent: dict[str, int]
    """Per downstream stream stage, the chunks sent once these messages are (a key: the stream is open)."""
    is_final: bool
    """The request leaves the stage once these are sent."""

    def commit(self, runtime: StageRuntime) -> None:
        """Every message was sent: the request's streams are where the route left them."""
        runtime.num_chunks_sent[self.request_id] = self.num_chunks_sent


def route(cfg: PipelineConfig, runtime: StageRuntime, emit: Emit) -> Route:
    """The messages `emit` becomes (nothing of `runtime` changes but the stage's first-output time)."""
    stage, rid = runtime.cfg, emit.request_id
    if emit.kind is EmitKind.ERROR:
        return Route(rid, ((COORDINATOR, Failure(rid, stage.name, emit.message)),), {}, True)
    params = runtime.params.get(rid, {})
    sent = dict(runtime.num_chunks_sent.get(rid, {}))
    timings = runtime.timings.setdefault(rid, {})
    plan = runtime.replicas.get(rid, {})
    timings.setdefault(stage.name, time.monotonic())  # NOTE: this stage's first output for the request
    messages: list[tuple[str, Message]] = []
    for target in stage.stream_to:
        process = process_for(cfg, plan, target)  # NOTE: the same replica for every chunk of the request
        if target not in sent:  # open the downstream stream even if it will stay empty
            messages.append((process, NewRequest(rid, target, {}, params, is_stream=True, timings=timings,
                                                 replicas=plan)))
            sent[target] = 0
        if emit.kind is EmitKind.STREAM:
            messages.append((process, StreamChunk(rid, target, sent[target], emit.payload, timings)))
            sent[target] += 1
        else:
            messages.append((process, StreamDone(rid, target, sent[target])))
    if emit.kind is EmitKind.RESULT and stage.next is not None:
        messages.append((process_for(cfg, plan, stage.next),
                         NewRequest(rid, stage.next, emit.payload, params, timings=timings, replicas=plan)))
    if stage.terminal:
        # NOTE: `_`-keys are for downstream stages only (e.g. the thinker's talker feed), and the runner's
        # `next_only_keys` for its `next` stage: not the client's.
        hidden = runtime.runner.next_only_keys if stage.next is not None else frozenset()
        payload = {k: v for k, v in emit.payload.items() if not k.startswith("_") and k not in hidden}
        messages.append((COORDINATOR, Output(rid, stage.name, emit.is_final, payload, timings)))
    return Route(rid, tuple(messages), sent, emit.is_final)
