"""Data plane: tensors cross processes without serialisation (see base.py for the transport contract)."""

from __future__ import annotations

from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.codec import RelayRef, pack, unpack
from voice_server.relay.dist import DistReceiver, DistRef, DistSender
from voice_server.relay.mooncake import MooncakeExporter, MooncakeReader, RemoteRef
from voice_server.relay.router import RelayReaders, RelayRouter
from voice_server.relay.segment_observer import SegmentObserver
from voice_server.relay.shm import ShmReader, ShmRef, ShmSlab
from voice_server.relay.shm_segments import sweep

__all__ = [
    "ConsumerTransport", "DistReceiver", "DistRef", "DistSender", "MooncakeExporter", "MooncakeReader",
    "ProducerTransport", "RelayReaders", "RelayRef", "RelayRouter", "RemoteRef", "SegmentObserver", "ShmReader",
    "ShmRef", "ShmSlab", "pack", "sweep", "unpack",
]
