"""Misbehaving WebSocket clients on raw TCP sockets (a library client would read, frame and close
properly): one that stops reading mid-response, one that sends half a frame and then hangs or cuts
the connection, one that disconnects mid-response without a close frame. Each opens a native `/ws`
session and starts a long spoken response first, so the server holds a request for it in the stages.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import threading
import time
from typing import Any

KINDS = ("stalled_reader", "half_frame_hang", "half_frame_cut", "abrupt_disconnect")


def frame(payload: bytes, opcode: int = 0x1) -> bytes:
    """One final, masked client frame (RFC 6455 5.2)."""
    head = bytes([0x80 | opcode])
    size = len(payload)
    if size < 126:
        head += bytes([0x80 | size])
    elif size < 1 << 16:
        head += bytes([0x80 | 126]) + struct.pack("!H", size)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", size)
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class RawSession:
    """A `/ws` session over a bare socket: the handshake, `session.start` and typed turns, no reading
    unless asked (`read_some`)."""

    def __init__(self, port: int, rcvbuf: int | None = None, max_tokens: int = 400, output_rate: int = 24000) -> None:
        self.is_closed = False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # NOTE: before connect, so the window stays small: a stall shows at once
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                           ).encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            assert chunk, "closed during the handshake"
            head += chunk
        assert head.startswith(b"HTTP/1.1 101"), head
        self.send_json({"type": "session.start", "input_rate": 16000, "output_rate": output_rate,
                        "params": {"sampling": {"max_tokens": max_tokens}}})

    def send_json(self, event: dict[str, Any]) -> None:
        self.sock.sendall(frame(json.dumps(event).encode()))

    def start_response(self) -> None:
        self.send_json({"type": "text", "text": "talk for a long time"})

    def read_some(self, num_bytes: int, timeout: float = 10.0) -> int:
        """Read until `num_bytes` arrived (events and audio alike); the count read."""
        total, deadline = 0, time.monotonic() + timeout
        while total < num_bytes and time.monotonic() < deadline:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            total += len(chunk)
        return total

    def send_half_frame(self) -> None:
        """The header and half the payload of a 4 KiB binary (audio) frame."""
        data = frame(b"\x00" * 4096, opcode=0x2)
        self.sock.sendall(data[:len(data) // 2])

    def cut(self) -> None:
        """Close the TCP connection without a WebSocket close frame (a reset: no FIN handshake either)."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def keep_sending_silence(self) -> None:
        """Stream 20 ms of microphone silence every 100 ms in a thread until the connection goes (a
        client whose playback is stuck while its microphone still streams: never idle)."""
        silence = frame(b"\x00" * 640, opcode=0x2)

        def run() -> None:
            while not self.is_closed:
                try:
                    self.sock.sendall(silence)
                except OSError:
                    return
                time.sleep(0.1)

        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        self.is_closed = True
        self.sock.close()


def start_bad_client(kind: str, port: int) -> RawSession:
    """Open a session of `kind` in the middle of its misbehaviour; `close()` it when done."""
    if kind == "stalled_reader":
        # NOTE: 48 kHz: twice the bytes per step, so the kernel's socket buffers fill in half the time
        client = RawSession(port, rcvbuf=4096, max_tokens=2000, output_rate=48000)
        client.start_response()  # NOTE: never read: the server's sends back up
        client.keep_sending_silence()
        return client
    client = RawSession(port)
    client.start_response()
    assert client.read_some(8192) >= 8192  # NOTE: the response is streaming audio by now
    if kind == "half_frame_hang":
        client.send_half_frame()
    elif kind == "half_frame_cut":
        client.send_half_frame()
        client.cut()
    elif kind == "abrupt_disconnect":
        client.cut()
    else:
        raise ValueError(kind)
    return client
