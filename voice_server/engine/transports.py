"""Which relay a process's tensors take: shared memory to processes on its node, Mooncake to the others.

On one host (no node map in the endpoints) a process's codec uses its `ShmSlab` and `ShmReader` directly, as
always. In a launch placed across nodes (`launcher: ray`) the codec gets a `RelayRouter` over the same slab, which
exports a slot to a consumer on another node as a `RemoteRef` its Mooncake engine reads from the slab, and a
`RelayReaders` that reads both kinds. The slot is the slab's either way, so acks, bounds and overload behave the
same (`voice_server/relay/router.py`). The Mooncake engines start on first use: a launch whose placement puts
every process on one node never opens one.
"""

from __future__ import annotations

import importlib.util
import logging

from voice_server.engine.ipc import Endpoints
from voice_server.relay.base import ConsumerTransport, ProducerTransport
from voice_server.relay.mooncake_engine import PIP_PACKAGE
from voice_server.relay.shm import ShmReader, ShmSlab

log = logging.getLogger("voice_server.relay")


def open_transports(
    endpoints: Endpoints, process: str, slab: ShmSlab, reader: ShmReader
) -> tuple[ProducerTransport, ConsumerTransport]:
    """The (producer, consumer) transports of `process`'s codec; closing them closes `slab` and `reader`."""
    if not endpoints.nodes:
        return slab, reader
    from voice_server.relay.mooncake import MooncakeExporter, MooncakeReader
    from voice_server.relay.router import RelayReaders, RelayRouter

    if importlib.util.find_spec("mooncake") is None:
        # NOTE: the fallback that needs nothing: tensors for other nodes travel inside the control messages
        # (ZMQ over TCP, CURVE), ~3x slower than Mooncake at 64 MiB (docs/BENCHMARKS.md, "Cross-host relay").
        log.warning("Mooncake is not installed (pip install %s): tensors between nodes travel in the control "
                    "messages", PIP_PACKAGE)
        return RelayRouter(slab, lambda consumer: endpoints.is_remote(process, consumer)), RelayReaders(reader)

    def is_remote(consumer: str) -> bool:
        return endpoints.is_remote(process, consumer)

    def exporter() -> MooncakeExporter:
        # NOTE: the host is read when the engine opens: a process that moved binds on its new node.
        return MooncakeExporter(endpoints.host(process))

    def remote_reader() -> MooncakeReader:
        return MooncakeReader(endpoints.host(process))

    return RelayRouter(slab, is_remote, exporter), RelayReaders(reader, remote_reader)


def relay_counters(producer: ProducerTransport | None, consumer: ConsumerTransport | None) -> dict[str, int]:
    """A process's relay traffic across nodes: tensors (and bytes) it exported to consumers on other nodes and read
    from producers on other nodes; empty on one host."""
    from voice_server.relay.router import RelayReaders, RelayRouter

    if not isinstance(producer, RelayRouter):
        return {}
    reader = consumer.remote_reader if isinstance(consumer, RelayReaders) else None
    return {
        "num_remote_puts": producer.num_remote_puts, "num_remote_put_bytes": producer.num_remote_bytes,
        "num_remote_reads": getattr(reader, "num_reads", 0),
        "num_remote_read_bytes": getattr(reader, "num_read_bytes", 0),
    }
