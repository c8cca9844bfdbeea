"""Control-plane messages: one frozen dataclass per message, msgpack on the wire, never pickle.

A message travels as the msgpack array `[tag, *fields]`; tensors inside payloads are encoded by
the relay codec (inline below the threshold, otherwise a shared-memory reference that the
receiver acks back to the producer's inbox with `Ack`).

Grouped by receiver:
- stage inbox (PUSH/PULL): NewRequest, StreamChunk, StreamDone, Ack
- coordinator inbox (PUSH/PULL): Output, Failure, Ready, StartupFailed, StatsReply, Ack
- broadcast from the coordinator (PUB/SUB): Abort, Probe, PeerDown, StatsQuery
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from voice_server.relay.codec import pack, unpack
from voice_server.relay.shm import ShmReader, ShmRef, ShmSlab


@dataclass(frozen=True)
class NewRequest:
    request_id: str
    stage: str
    payload: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    stage: str
    seq: int
    payload: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class Failure:
    request_id: str
    stage: str
    message: str


@dataclass(frozen=True)
class Ready:
    process: str
    generation: int
    pid: int


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


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Probe:
    nonce: int


@dataclass(frozen=True)
class PeerDown:
    """A process died: drop its relay mappings, free slots it held, reconnect to its inbox."""

    process: str
    owner: str


@dataclass(frozen=True)
class StatsQuery:
    nonce: int


Message = (
    NewRequest | StreamChunk | StreamDone | Ack | Output | Failure | Ready | StartupFailed
    | StatsReply | Abort | Probe | PeerDown | StatsQuery
)

_TYPES: tuple[type, ...] = (
    NewRequest, StreamChunk, StreamDone, Ack, Output, Failure, Ready, StartupFailed,
    StatsReply, Abort, Probe, PeerDown, StatsQuery,
)
_TAGS: dict[type, int] = {cls: tag for tag, cls in enumerate(_TYPES)}
_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES
}


def acks_for(refs: list[ShmRef]) -> list[Ack]:
    """One Ack per producer slab for the relay slots a receiver is done with."""
    by_owner: dict[str, list[int]] = {}
    for ref in refs:
        by_owner.setdefault(ref.owner, []).append(ref.slot_id)
    return [Ack(owner, slot_ids) for owner, slot_ids in by_owner.items()]


class MessageError(ValueError):
    """Bytes on a control socket that are not a valid message; `refs` must still be acked."""

    def __init__(self, message: str, refs: list[ShmRef] | None = None) -> None:
        super().__init__(message)
        self.refs = refs or []


@dataclass
class Codec:
    """Encodes messages for one process: its slab for outgoing tensors, its reader for incoming."""

    slab: ShmSlab | None
    reader: ShmReader | None
    inline_threshold: int = 16384
    as_torch: bool = False
    MAX_TAG: ClassVar[int] = len(_TYPES) - 1

    def encode(self, msg: Message, consumer: str = "") -> bytes:
        cls = type(msg)
        values = [getattr(msg, name) for name in _FIELDS[cls]]
        slab = self.slab if consumer else None  # broadcasts never carry relay references
        return pack([_TAGS[cls], *values], slab, consumer, self.inline_threshold)

    def decode(self, data: bytes) -> tuple[Message, list[ShmRef]]:
        try:
            obj, any_refs = unpack(data, self.reader, as_torch=self.as_torch)
        except Exception as exc:  # malformed msgpack or a reference into a vanished segment
            raise MessageError(f"undecodable control message: {exc}") from exc
        # NOTE: the engine reads through ShmReader only, so every reference is an ShmRef.
        refs = [r for r in any_refs if isinstance(r, ShmRef)]
        if not isinstance(obj, list) or not obj or not isinstance(obj[0], int) or not 0 <= obj[0] <= self.MAX_TAG:
            raise MessageError("control message without a valid tag", refs)
        cls = _TYPES[obj[0]]
        if len(obj) - 1 != len(_FIELDS[cls]):
            raise MessageError(f"{cls.__name__}: expected {len(_FIELDS[cls])} fields, got {len(obj) - 1}", refs)
        return cls(*obj[1:]), refs
