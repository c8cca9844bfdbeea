"""Socket addresses and small ZMQ helpers shared by the coordinator and the stage shell.

Addresses derive from the launch id so two servers on one host never collide. They live in the
Linux abstract socket namespace (`ipc://@...`): nothing to clean up on disk and no 107-byte path
limit worries.
"""

from __future__ import annotations

import ctypes
import signal
import sys

import zmq

COORDINATOR = "coord"
"""Process name of the server process (for relay owners and ack routing)."""


def inbox_address(launch_id: str, process: str) -> str:
    return f"ipc://@vs-{launch_id}-{process}"


def broadcast_address(launch_id: str) -> str:
    return f"ipc://@vs-{launch_id}-pub"


def relay_owner(process: str, generation: int) -> str:
    """Slab owner name; the generation keeps a restarted process's segments apart from the dead one's."""
    return f"{process}.{generation}"


def owner_process(owner: str) -> str:
    return owner.split(".", 1)[0]


def configure(sock: zmq.Socket) -> zmq.Socket:
    # NOTE: no high-water mark: PUB would drop silently (an abort must never be lost) and PUSH
    # would block the loop. Backpressure belongs above the socket (schedulers, session layer).
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies, so a killed server leaves no orphans."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
