"""Socket addresses and small ZMQ helpers shared by the coordinator and the stage shell.

With `control_transport: ipc` addresses derive from the launch id so two servers on one host never
collide; they live in the Linux abstract socket namespace (`ipc://@...`): nothing to clean up on
disk and no 107-byte path limit. With `tcp` the coordinator picks free ports on `tcp_host` at launch
(the path stages placed on other hosts will take).
"""

from __future__ import annotations

import ctypes
import signal
import socket
import sys
from dataclasses import dataclass

import zmq

from voice_server.config import PipelineConfig

COORDINATOR = "coord"
"""Process name of the server process (for relay owners and ack routing)."""


@dataclass(frozen=True)
class Endpoints:
    inboxes: dict[str, str]
    """Process name (and COORDINATOR) -> the address its PULL inbox binds."""
    broadcast: str
    """The coordinator's PUB socket."""

    @classmethod
    def create(cls, cfg: PipelineConfig, launch_id: str) -> Endpoints:
        names = [COORDINATOR, *cfg.processes]
        if cfg.control_transport == "ipc":
            return cls({n: f"ipc://@vs-{launch_id}-{n}" for n in names}, f"ipc://@vs-{launch_id}-pub")
        ports = _free_ports(cfg.tcp_host, len(names) + 1)
        addresses = [f"tcp://{cfg.tcp_host}:{port}" for port in ports]
        return cls(dict(zip(names, addresses)), addresses[-1])


def _free_ports(host: str, num: int) -> list[int]:
    socks = [socket.socket() for _ in range(num)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


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
    """Ask Linux to SIGTERM this process when its parent dies, so a killed server leaves no orphans.

    NOTE: Linux ties this to the parent *thread* that started the child: start stage processes from
    a thread that lives as long as the server (the event loop's).
    """
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


class Peers:
    """PUSH sockets to other processes' inboxes, connected on first use."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints) -> None:
        self.ctx, self.endpoints = ctx, endpoints
        self._socks: dict[str, zmq.Socket] = {}

    def get(self, process: str) -> zmq.Socket:
        sock = self._socks.get(process)
        if sock is None:
            sock = configure(self.ctx.socket(zmq.PUSH))
            sock.connect(self.endpoints.inboxes[process])
            self._socks[process] = sock
        return sock

    def reset(self, process: str) -> None:
        """Drop what is queued for a process that died; the next send reconnects to its successor."""
        sock = self._socks.pop(process, None)
        if sock is not None:
            sock.close(linger=0)
