"""Connection hygiene against a real `voice-server serve`: raw sockets are the attackers.

Slowloris and silent connections are closed after the request-head timeout, idle keep-alive
connections after the keep-alive timeout, connections beyond the cap at once, and /health keeps
answering; under a low descriptor limit a flood never exhausts the server's descriptors, and
repeated log lines stay bounded. Timings are printed; the assertions leave wide slack for a slow
2-core machine.
"""

from __future__ import annotations

import itertools
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from harness import wait_for  # noqa: E402
from serving import ServerProcess, health_status  # noqa: E402

ServeProcess = Callable[..., ServerProcess]
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 4096  # never completes


class Swarm:
    """Many client connections watched together: when did the server close each one?"""

    def __init__(self, port: int, num_conns: int, is_blocking_connect: bool = True) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.opened_at: list[float] = []
        self.closed_at: list[float | None] = []
        self.received: list[bytes] = []
        self._num_sent: list[int] = []
        self._selector = selectors.DefaultSelector()
        for _ in range(num_conns):
            if is_blocking_connect:
                self.add(socket.create_connection(("127.0.0.1", port), timeout=5))
            else:  # NOTE: a flood does not wait for the kernel's accept queue; its SYNs are retried
                sock = socket.socket()
                sock.setblocking(False)
                sock.connect_ex(("127.0.0.1", port))
                self.add(sock)

    def add(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, len(self.socks))
        self.socks.append(sock)
        self.opened_at.append(time.monotonic())
        self.closed_at.append(None)
        self.received.append(b"")
        self._num_sent.append(0)

    @property
    def num_open(self) -> int:
        return sum(c is None for c in self.closed_at)

    def lifetimes(self) -> list[float | None]:
        return [None if c is None else c - o for o, c in zip(self.opened_at, self.closed_at)]

    def run(self, duration_s: float, trickle: bytes = b"", interval_s: float = 0.5) -> None:
        """Watch for `duration_s` (or until all are closed); send each open connection the next
        byte of `trickle` every `interval_s`."""
        deadline = time.monotonic() + duration_s
        next_send = time.monotonic()
        while self.num_open and time.monotonic() < deadline:
            if trickle and time.monotonic() >= next_send:
                self._send_next(trickle)
                next_send += interval_s
            for key, _ in self._selector.select(0.05):
                self._read(key.data)

    def close(self) -> None:
        for i, sock in enumerate(self.socks):
            if self.closed_at[i] is None:
                self._selector.unregister(sock)
            sock.close()
        self._selector.close()

    def _send_next(self, trickle: bytes) -> None:
        for i, sock in enumerate(self.socks):
            if self.closed_at[i] is not None or self._num_sent[i] >= len(trickle):
                continue
            try:
                self._num_sent[i] += sock.send(trickle[self._num_sent[i]:self._num_sent[i] + 1])
            except BlockingIOError:
                pass
            except OSError:
                self._mark_closed(i)

    def _read(self, i: int) -> None:
        try:
            data = self.socks[i].recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.received[i] += data
        else:
            self._mark_closed(i)

    def _mark_closed(self, i: int) -> None:
        self.closed_at[i] = time.monotonic()
        self._selector.unregister(self.socks[i])


class HealthPoller:
    """Polls /health on fresh connections from a thread and records the answers."""

    def __init__(self, port: int, interval_s: float = 0.2) -> None:
        self.port = port
        self.interval_s = interval_s
        self.statuses: list[int | None] = []
        self._is_running = True
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._is_running = False
        self._thread.join(10)

    def _run(self) -> None:
        while self._is_running:
            self.statuses.append(health_status(self.port, timeout=3.0))
            time.sleep(self.interval_s)


def keep_alive_get(sock: socket.socket) -> int:
    """GET /health on a keep-alive connection; return the status once the whole body arrived."""
    sock.settimeout(5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the response"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split(b" ")[1])


def summary(lifetimes: list[float | None]) -> str:
    closed = sorted(x for x in lifetimes if x is not None)
    if not closed:
        return f"0/{len(lifetimes)} closed"
    return f"{len(closed)}/{len(lifetimes)} closed after {closed[0]:.2f}-{closed[-1]:.2f} s"


def test_slowloris_is_closed_and_health_answers_throughout(serve_process: ServeProcess) -> None:
    # NOTE: 512 descriptors: the default cap (256) is above the 200 attackers, so every one of them
    # is accepted and must be closed by the head timeout, not refused.
    server = serve_process("--request-head-timeout", "2", num_fds=512)
    server.wait_healthy()
    with HealthPoller(server.port) as poller:
        swarm = Swarm(server.port, 200)
        swarm.run(duration_s=10, trickle=SLOW_HEAD, interval_s=0.5)
        time.sleep(0.5)
    lifetimes = swarm.lifetimes()
    swarm.close()
    print(f"slowloris: {summary(lifetimes)}; /health answers: {poller.statuses}")
    # NOTE: none outlived the 10 s watch (`None`), and none was closed before the timeout. No tighter upper
    # bound: the timer starts when the server accepts, which for 200 connects at once comes seconds after
    # the client's connect when the CPU is shared (6.13 s with another test file on the other core).
    assert None not in lifetimes, summary(lifetimes)
    assert all(t >= 1.5 for t in lifetimes if t is not None), summary(lifetimes)
    assert len(poller.statuses) >= 10 and set(poller.statuses) == {200}
    assert server.proc.poll() is None


def test_silent_and_idle_keep_alive_connections_are_closed(serve_process: ServeProcess) -> None:
    server = serve_process("--request-head-timeout", "1.5", "--keep-alive-timeout", "4")
    server.wait_healthy()
    keep = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert keep_alive_get(keep) == 200
    swarm = Swarm(server.port, 100)  # connect and send nothing
    swarm.add(keep)  # idle after one request: the keep-alive timeout applies, not the head timeout
    swarm.run(duration_s=10)
    lifetimes = swarm.lifetimes()
    swarm.close()
    silent, keep_alive = lifetimes[:-1], lifetimes[-1]
    print(f"silent: {summary(silent)}; keep-alive closed {keep_alive} s after its response")
    # NOTE: as for slowloris: closed within the 10 s watch and not before the timeout, whenever the accept came
    assert None not in silent and all(t >= 1.0 for t in silent if t is not None), summary(silent)
    assert keep_alive is not None and 3.5 <= keep_alive <= 8.0


def test_connections_beyond_the_cap_are_refused_at_once(serve_process: ServeProcess) -> None:
    server = serve_process("--max-connections", "20", "--request-head-timeout", "30", "--keep-alive-timeout", "30")
    server.wait_healthy()
    time.sleep(0.3)  # the probes' connections are gone
    keep = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert keep_alive_get(keep) == 200
    idle = Swarm(server.port, 19)  # with `keep`: 20 open, the cap
    idle.run(duration_s=0.5)
    extra = Swarm(server.port, 10)
    extra.run(duration_s=5)
    refused = extra.lifetimes()
    print(f"beyond the cap: {summary(refused)}")
    assert None not in refused and all(t < 1.0 for t in refused if t is not None), summary(refused)
    assert all(r.startswith(b"HTTP/1.1 503 ") for r in extra.received)
    assert idle.num_open == 19
    assert keep_alive_get(keep) == 200  # connections under the cap keep working
    idle.close()
    keep.close()
    # The server frees the closed connections' places under the cap (a probe refused meanwhile adds no
    # log line: the 10 refusals above have used up the rate limiter's window).
    assert wait_for(lambda: health_status(server.port) == 200, timeout=10, interval=0.05)
    num_logged = server.stderr.count("refused a connection")
    assert 1 <= num_logged <= 5, server.stderr  # NOTE: identical lines are rate-limited to 5 per window
    extra.close()


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_under_a_low_descriptor_limit_does_not_starve_the_server(serve_process: ServeProcess) -> None:
    # NOTE: 256 descriptors -> default cap 128 and backlog 16 (asyncio accepts a backlog's worth at
    # once): the starvation (5,000 connections, 1,024 descriptors) at a smaller scale.
    server = serve_process("--request-head-timeout", "2", "--keep-alive-timeout", "60", num_fds=256)
    server.wait_healthy()
    keep = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    assert keep_alive_get(keep) == 200
    time.sleep(0.3)
    num_fds_idle = num_fds(server.proc.pid)
    num_bytes_before = server.num_stderr_bytes
    flood = Swarm(server.port, 400, is_blocking_connect=False)
    samples = []
    # NOTE: at least 7 s (the flood, its head timeout of 2 s and slack); longer only on a machine so
    # loaded that the server has not yet closed what it accepted.
    deadline = time.monotonic() + 30
    for i in itertools.count():
        flood.run(duration_s=0.1)
        samples.append(num_fds(server.proc.pid))
        if i == 10:
            assert keep_alive_get(keep) == 200  # an existing connection is served during the flood
        num_closed = sum(t is not None for t in flood.lifetimes())
        if (i >= 70 and samples[-1] <= num_fds_idle + 2) or time.monotonic() > deadline:
            break
    num_refused = sum(r.startswith(b"HTTP/1.1 503 ") for r in flood.received)
    flood.close()
    log_bytes = server.num_stderr_bytes - num_bytes_before
    # NOTE: with the accept queue full the kernel answers further SYNs with syncookies and then
    # drops their ACKs: those clients think they are connected, but the server never sees them.
    print(
        f"flood of 400 silent connections under 256 descriptors: server descriptors {num_fds_idle} idle, "
        f"peak {max(samples)}, {samples[-1]} after {len(samples) / 10:g} s; the server closed {num_closed} "
        f"({num_refused} refused with 503, the rest by the head timeout); log grew {log_bytes} bytes"
    )
    # NOTE: how many SYNs the kernel lets through in time varies with load; 64 closed (half the cap, four
    # accept queues) shows the flood reached the server.
    assert num_closed >= 64
    assert max(samples) < 256
    assert samples[-1] <= num_fds_idle + 2  # every flood connection the server accepted is gone
    assert "out of system resource" not in server.stderr and "Too many open files" not in server.stderr
    assert keep_alive_get(keep) == 200
    assert health_status(server.port) == 200
    assert log_bytes < 8192, server.stderr[-4000:]
    keep.close()


def test_repeated_log_lines_are_rate_limited(serve_process: ServeProcess) -> None:
    server = serve_process()
    server.wait_healthy()
    num_bytes_before = server.num_stderr_bytes
    swarm = Swarm(server.port, 300)
    for sock in swarm.socks:
        sock.send(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn logs "Invalid HTTP request received." for each
    swarm.run(duration_s=10)
    swarm.close()
    log = server.stderr
    num_lines = log.count("Invalid HTTP request received.")
    log_bytes = server.num_stderr_bytes - num_bytes_before
    print(f"300 bad requests: {num_lines} log lines, {log_bytes} bytes")
    assert swarm.num_open == 0
    assert 1 <= num_lines <= 5, log[-4000:]
    assert log_bytes < 4096
    assert health_status(server.port) == 200
    assert server.stop() == 0
    assert "suppressed 295 repeats of: Invalid HTTP request received." in server.stderr  # written at exit
