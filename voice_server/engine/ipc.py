"""Socket addresses, control-plane authentication and small ZMQ helpers shared by the coordinator
and the stage shell.

Only the processes of one launch may talk on its control plane:
- `control_transport: ipc`: the sockets are files in the launch's private run directory (mode 0700,
  see `rundir.py`), so no other user can connect. Nothing about them is published over HTTP.
- `control_transport: tcp`: every socket uses ZMQ CURVE with keys made at launch and handed to the
  stage processes at spawn; a ZAP handler in each process admits only the launch's client key.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.auth.thread

from voice_server.config import PipelineConfig
from voice_server.engine.rundir import RunDir

COORDINATOR = "coord"
"""Process name of the server process (for relay owners and ack routing)."""
_ZAP_DOMAIN = "voice-server"
_WILDCARDS = ("0.0.0.0", "::")
_MAX_IPC_PATH_LEN = 107  # NOTE: sun_path is 108 bytes with its terminating NUL


@dataclass(frozen=True)
class CurveKeys:
    """One server key pair (every bound socket) and one client key pair (every connecting socket)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def create(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)


@dataclass(frozen=True)
class Endpoints:
    inboxes: dict[str, str]
    """Process name (and COORDINATOR) -> the address its PULL inbox binds."""
    broadcast: str
    """The coordinator's PUB socket."""
    curve: CurveKeys | None = None
    """Keys of the launch (tcp only): never sent over the wire, only to children at spawn."""
    nodes: dict[str, str] = field(default_factory=dict)
    """Process name (and COORDINATOR) -> the cluster node it runs on, with `launcher: ray`; empty when every process
    runs on this host. The relay sends tensors through shared memory between processes of one node only."""

    @classmethod
    def create(cls, cfg: PipelineConfig, run_dir: RunDir, hosts: NodeHosts | None = None) -> Endpoints:
        names = [COORDINATOR, *cfg.processes]
        if hosts is not None:
            # NOTE: a placed process binds its inbox on its own node, at a port that node says is free; the
            # coordinator's sockets stay on `tcp_host`, which the other nodes must reach: a wildcard there means
            # this node's address in the cluster (an address to connect to, not only to bind).
            host = hosts.driver_node_ip() if cfg.tcp_host in _WILDCARDS else cfg.tcp_host
            own = _free_ports(host, 2)
            inboxes = {COORDINATOR: f"tcp://{host_literal(host)}:{own[0]}"}
            nodes = {COORDINATOR: hosts.driver_node_id()}
            for name in cfg.processes:
                inboxes[name] = hosts.inbox_address(name)
                nodes[name] = hosts.node_id(name)
            broadcast = f"tcp://{host_literal(host)}:{own[1]}"
            return cls(inboxes, broadcast, CurveKeys.create(), nodes)
        if cfg.control_transport == "ipc":
            paths = {n: run_dir.socket(f"in-{n}") for n in names}
            pub = run_dir.socket("pub")
            too_long = [p for p in [*paths.values(), pub] if len(p.encode()) > _MAX_IPC_PATH_LEN]
            if too_long:
                raise ValueError(
                    f"control socket path {too_long[0]} is longer than {_MAX_IPC_PATH_LEN} bytes; "
                    "set VOICE_SERVER_RUN_DIR to a shorter directory"
                )
            return cls({n: f"ipc://{p}" for n, p in paths.items()}, f"ipc://{pub}")
        ports = _free_ports(cfg.tcp_host, len(names) + 1)
        addresses = [f"tcp://{host_literal(cfg.tcp_host)}:{port}" for port in ports]
        return cls(dict(zip(names, addresses)), addresses[-1], CurveKeys.create())

    def is_remote(self, process: str, peer: str) -> bool:
        """Whether `peer` runs on another node than `process` (never, without a node map)."""
        return bool(self.nodes) and self.nodes.get(process) != self.nodes.get(peer)

    def host(self, process: str) -> str:
        """The IP `process` binds on (the host part of its inbox address): where its cross-host relay listens."""
        address = self.inboxes[process]
        return address.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")

    def move(self, process: str, address: str, node: str) -> None:
        """`process` came back on another node (`PeerMoved`): later connections go to its new inbox."""
        self.inboxes[process] = address
        self.nodes[process] = node

    def bind(self, sock: zmq.Socket, address: str) -> None:
        if self.curve is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.curve.server_secret
            sock.curve_publickey = self.curve.server_public
            sock.zap_domain = _ZAP_DOMAIN.encode()
        sock.bind(address)

    def connect(self, sock: zmq.Socket, address: str) -> None:
        if self.curve is not None:
            sock.curve_serverkey = self.curve.server_public
            sock.curve_publickey = self.curve.client_public
            sock.curve_secretkey = self.curve.client_secret
        sock.connect(address)

    def start_auth(self, ctx: zmq.Context) -> zmq.auth.thread.ThreadAuthenticator | None:
        """Start the ZAP handler of a process that binds sockets (tcp only): admits the launch's key."""
        if self.curve is None:
            return None
        # NOTE: the authenticator logs each refused handshake; its own logger keeps that separable.
        auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("voice_server.zap"))
        auth.start()
        auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=_LaunchKey(self.curve.client_public))
        return auth


class NodeHosts(Protocol):
    """Where the processes of a placed launch run (`engine/ray_hosts.py`)."""

    def driver_node_id(self) -> str: ...

    def driver_node_ip(self) -> str: ...

    def node_id(self, process: str) -> str: ...

    def inbox_address(self, process: str) -> str: ...


class _LaunchKey:
    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: Any) -> bool:
        # NOTE: pyzmq hands the client key in Z85 text; ours is Z85 from curve_keypair too.
        return bool((key.encode() if isinstance(key, str) else key) == self.client_public)


def host_literal(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _free_ports(host: str, num: int) -> list[int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks = [socket.socket(family) for _ in range(num)]
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
    sock.setsockopt(zmq.IPV6, 1)  # NOTE: lets `tcp_host` be an IPv6 address; IPv4 still works
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
    """PUSH sockets from process `own` to every other process's inbox, all connected on construction; one
    to a process that died is dropped (`reset`) and connected again on first use.

    NOTE: connected on first use, a path first taken under load (an ack to a process this one had never
    sent to) opened a socket mid-run: descriptors then grew after start-up, which a burst's descriptor check
    could not tell from a leak, and that first message waited for the connection. ZMQ connects in the
    background, so an inbox not bound yet (a stage still starting) is reached once it is."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, own: str) -> None:
        self.ctx, self.endpoints = ctx, endpoints
        self._socks: dict[str, zmq.Socket] = {}
        for process in endpoints.inboxes:
            if process != own:
                self.get(process)

    def get(self, process: str) -> zmq.Socket:
        sock = self._socks.get(process)
        if sock is None:
            sock = configure(self.ctx.socket(zmq.PUSH))
            self.endpoints.connect(sock, self.endpoints.inboxes[process])
            self._socks[process] = sock
        return sock

    def reset(self, process: str) -> None:
        """Drop what is queued for a process that died; the next send reconnects to its successor."""
        sock = self._socks.pop(process, None)
        if sock is not None:
            sock.close(linger=0)
