"""Control-plane messages: one frozen dataclass per message, msgpack on the wire, never pickle.

A message travels as the msgpack array `[tag, *fields]`; tensors inside payloads are encoded by
the relay codec (inline below the threshold, otherwise a shared-memory reference that the
receiver acks back to the producer's inbox with `Ack`).

Grouped by receiver:
- stage inbox (PUSH/PULL): NewRequest, StreamChunk, StreamDone, Ack
- coordinator inbox (PUSH/PULL): Output, Failure, Ready, StartupFailed, Progress, StatsReply, Ack
- broadcast from the coordinator (PUB/SUB): Abort, Probe, PeerDown, PeerMoved, StatsQuery
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.codec import RelayReadError, pack, unpack
from voice_server.relay.mooncake import RemoteRef
from voice_server.relay.shm import ShmRef, is_exhaustion

SlabRef = ShmRef | RemoteRef
"""A relay slot of another process's slab, mapped here or read across nodes: acked to its owner alike."""


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    stage: str
    payload: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    is_stream: bool = False
    """The input follows as StreamChunks until StreamDone (sent to a `stream_to` stage)."""
    timings: dict[str, float] = field(default_factory=dict)
    """`submit` and stage name -> CLOCK_MONOTONIC time of its first output for this request, as
    far as the sender knows (first-audio latency per stage; see `TerminalOutput.timings`)."""
    replicas: dict[str, str] = field(default_factory=dict)
    """The request's replica plan (`engine/replicas.py`): replicated stage -> the process serving it, which
    every hop forwards and follows; empty in a pipeline without replicas."""


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    stage: str
    seq: int
    payload: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamDone:
    request_id: str
    stage: str
    num_chunks: int


@dataclass(frozen=True)
class Ack:
    """Relay slots the receiver is done with; `owner` names the producer's slab generation."""

    owner: str
    slot_ids: list[int]


@dataclass(frozen=True)
class Output:
    """A terminal stage's output for the client; `is_final` marks that stage's last one."""

    request_id: str
    stage: str
    is_final: bool
    payload: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    request_id: str
    stage: str
    message: str
    is_overload: bool = False
    """The stage ran out of a bounded resource (relay bytes, segments, descriptors): retryable."""


@dataclass(frozen=True)
class Ready:
    process: str
    generation: int
    pid: int
    facts: dict[str, dict[str, bool | int | str]] = field(default_factory=dict)
    """Stage name -> its runner's start-up facts (`Runner.facts`), for `/health`."""


@dataclass(frozen=True)
class StartupFailed:
    process: str
    generation: int
    message: str


@dataclass(frozen=True)
class StatsReply:
    process: str
    generation: int
    nonce: int
    active: dict[str, list[str]]
    """Stage name -> request ids it holds."""
    num_live_slots: int
    num_used_bytes: int
    num_dropped_messages: int
    """Malformed or foreign control messages this process dropped."""
    aborted_at: dict[str, float]
    """Recently aborted request id -> CLOCK_MONOTONIC time this process dropped it."""
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    """Stage name -> its scheduler's and runner's counters (KV pages, queues, free decoders;
    `BaseScheduler.stats`, `Runner.stats`)."""


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


NUM_ABORTED_KEPT = 4096
"""Aborted request ids a process remembers, dropping their late messages; the coordinator refuses them as new ids
for as long (`Coordinator.submit`), since a stage could not tell a new request from a late one of the old."""


@dataclass(frozen=True)
class Probe:
    nonce: int


@dataclass(frozen=True)
class PeerDown:
    """A process died: drop its relay mappings, free slots it held, reconnect to its inbox."""

    process: str
    owner: str


@dataclass(frozen=True)
class PeerMoved:
    """A process is about to start on another node (`launcher: ray`, its node was lost): later connections to it go to
    its new inbox, and tensors for it go through the relay that reaches its node."""

    process: str
    address: str
    node: str


@dataclass(frozen=True)
class Progress:
    """A starting stage's current step (e.g. loading weights, warming up), for the log and `/health`."""

    process: str
    generation: int
    stage: str
    phase: str


@dataclass(frozen=True)
class StatsQuery:
    nonce: int


Message = (
    NewRequest | StreamChunk | StreamDone | Ack | Output | Failure | Ready | StartupFailed
    | StatsReply | Abort | Probe | PeerDown | StatsQuery | Progress | PeerMoved
)

_TYPES: tuple[type, ...] = (
    NewRequest, StreamChunk, StreamDone, Ack, Output, Failure, Ready, StartupFailed,
    StatsReply, Abort, Probe, PeerDown, StatsQuery, Progress, PeerMoved,
)
_TAGS: dict[type, int] = {cls: tag for tag, cls in enumerate(_TYPES)}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES
}


def _type_check(hint: Any) -> typing.Callable[[Any], bool]:
    """A predicate for one field annotation (the few shapes messages use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is str:
        return lambda v: isinstance(v, str)
    if origin is list:
        item = _type_check(args[0])
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        key, value = _type_check(args[0]), _type_check(args[1])
        return lambda v: isinstance(v, dict) and all(key(k) and value(x) for k, x in v.items())
    if origin is types.UnionType:
        alternatives = [_type_check(a) for a in args]
        return lambda v: any(check(v) for check in alternatives)
    if hint is Any:
        return lambda v: True
    raise TypeError(f"no wire check for {hint!r}")


# NOTE: a message from the wire is checked field by field before any handler sees it: a wrong type
# (a list as request id, a string as payload) must be dropped, not crash the receiver later.
_CHECKS: dict[type, tuple[tuple[str, typing.Callable[[Any], bool]], ...]] = {
    cls: tuple((name, _type_check(hint)) for name, hint in typing.get_type_hints(cls).items())
    for cls in _TYPES
}
_NUM_REQUIRED: dict[type, int] = {
    cls: sum(1 for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING)
    for cls in _TYPES
}


def acks_for(refs: list[SlabRef]) -> list[Ack]:
    """One Ack per producer slab for the relay slots a receiver is done with."""
    by_owner: dict[str, list[int]] = {}
    for ref in refs:
        by_owner.setdefault(ref.owner, []).append(ref.slot_id)
    return [Ack(owner, slot_ids) for owner, slot_ids in by_owner.items()]


class MessageError(ValueError):
    """Bytes on a control socket that are not a valid message; `refs` must still be acked.

    `request_id`/`stage` are set when a well-formed work or output message could not be read
    (its relay tensor could not be mapped): the receiver fails that request instead of losing a
    chunk silently. `is_overload` says the cause was a resource limit (e.g. no descriptors left).
    """

    def __init__(
        self, message: str, refs: list[SlabRef] | None = None, request_id: str | None = None,
        stage: str | None = None, is_overload: bool = False,
    ) -> None:
        super().__init__(message)
        self.refs = refs or []
        self.request_id, self.stage, self.is_overload = request_id, stage, is_overload


@dataclass
class Codec:
    """Encodes messages for one process: its slab for outgoing tensors, its reader for incoming."""

    slab: ProducerTransport | None
    """The process's slab, or a `RelayRouter` over it when some consumers are on other nodes."""
    reader: ConsumerTransport | None
    inline_threshold: int = 16384
    as_torch: bool = False
    MAX_TAG: ClassVar[int] = len(_TYPES) - 1

    def encode(self, msg: Message, consumer: str = "", taken: list[int] | None = None) -> bytes:
        """`msg` for `consumer`'s process (none: a broadcast); its relay slots are appended to `taken`."""
        cls = type(msg)
        values = [getattr(msg, name) for name in _FIELDS[cls]]
        slab = self.slab if consumer else None  # broadcasts never carry relay references
        return pack([_TAGS[cls], *values], slab, consumer, self.inline_threshold, taken)

    def decode(self, data: bytes) -> tuple[Message, list[SlabRef]]:
        try:
            obj, any_refs = unpack(data, self.reader, as_torch=self.as_torch)
        except RelayReadError as exc:  # well-formed, but a relay tensor could not be mapped
            refs = [r for r in exc.refs if isinstance(r, (ShmRef, RemoteRef))]
            request_id, stage = _work_identity(exc.obj)
            raise MessageError(
                f"cannot read relayed tensor: {exc.cause}", refs, request_id, stage, is_exhaustion(exc.cause)
            ) from exc
        except Exception as exc:  # malformed msgpack
            raise MessageError(f"undecodable control message: {exc}") from exc
        # NOTE: the engine relays through slabs only (shared memory, or read from a slab across nodes).
        refs = [r for r in any_refs if isinstance(r, (ShmRef, RemoteRef))]
        if not isinstance(obj, list) or not obj or type(obj[0]) is not int or not 0 <= obj[0] <= self.MAX_TAG:
            raise MessageError("control message without a valid tag", refs)
        cls = _TYPES[obj[0]]
        values = obj[1:]
        if not _NUM_REQUIRED[cls] <= len(values) <= len(_FIELDS[cls]):
            raise MessageError(f"{cls.__name__}: expected {len(_FIELDS[cls])} fields, got {len(values)}", refs)
        for value, (name, check) in zip(values, _CHECKS[cls]):
            if not check(value):
                raise MessageError(f"{cls.__name__}.{name}: unexpected {type(value).__name__}", refs)
        return cls(*values), refs


def _work_identity(obj: object) -> tuple[str | None, str | None]:
    """(request id, stage) of a decoded work or output message, else (None, None)."""
    if isinstance(obj, list) and len(obj) >= 3 and type(obj[0]) is int and 0 <= obj[0] < len(_TYPES):
        cls = _TYPES[obj[0]]
        if cls in (NewRequest, StreamChunk, StreamDone, Output) and isinstance(obj[1], str) \
                and isinstance(obj[2], str):
            return obj[1], obj[2]
    return None, None
