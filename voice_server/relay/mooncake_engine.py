"""One Mooncake TransferEngine for the cross-host relay (`voice_server/relay/mooncake.py`): start, register, read.

Mooncake is imported here, when an engine is created, and nowhere else. The engine runs with P2P handshake
(no metadata server) and, by default, the TCP protocol. What it opens: two listening sockets on every
interface (module docstring of mooncake.py: unauthenticated), and about seven threads.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"
# NOTE: Mooncake's blocking read spins a core until the bytes are in, which on a small box starves the
# engine's own I/O threads (2 vCPUs: 64 MiB in ~100 ms instead of ~55 with the polling below); below 1 MiB
# the spin costs less than a sleep's wake-up.
POLL_BYTES = 1 << 20
_FIRST_POLL_S, _MAX_POLL_S = 50e-6, 1e-3
_RC_TIMEOUT = -2  # NOTE: transfer_check_status's "timed out": the engine may still write into the buffer.


def is_wildcard(host: str) -> bool:
    with contextlib.suppress(ValueError):  # NOTE: a host name
        return ipaddress.ip_address(host).is_unspecified
    return False


def transfer_timeout_s() -> float:
    """MC_TRANSFER_TIMEOUT as Mooncake reads it (30 s by default, at least 5)."""
    with contextlib.suppress(ValueError):
        return max(5.0, float(os.environ.get("MC_TRANSFER_TIMEOUT", "30")))
    return 30.0


class Engine:
    """An initialised TransferEngine on `host`; `session` is the "host:port" peers reach it at."""

    def __init__(self, host: str, protocol: str = "tcp", device_name: str = "") -> None:
        if is_wildcard(host):
            raise ValueError(f"a Mooncake engine's host must be an address peers can reach, not {host}")
        # NOTE: glog at INFO writes several lines per engine and per new peer to stderr; warnings and errors
        # (every failed read) still show. An explicit MC_LOG_LEVEL wins. Read when the library loads.
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise RuntimeError(f"the cross-host relay needs Mooncake Transfer Engine: pip install {PIP_PACKAGE}"
                               " (or mooncake-transfer-engine for CUDA builds)") from exc
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise OSError(errno.EIO, f"Mooncake engine on {host} ({protocol}) failed to initialise (rc {rc})")
        self.session = f"{f'[{host}]' if ':' in host else host}:{self._engine.get_rpc_port()}"

    @property
    def is_closed(self) -> bool:
        return self._engine is None

    def register(self, address: int, size: int) -> None:
        if self._engine is None:
            raise OSError(errno.EBADF, f"Mooncake engine {self.session} is closed")
        rc = self._engine.register_memory(address, size)
        if rc != 0:
            raise OSError(errno.EIO, f"Mooncake engine {self.session} cannot register {size} B at {address:#x} "
                                     f"(rc {rc}; -7: overlaps a registered region)")

    def unregister(self, address: int) -> None:
        if self._engine is None:
            return  # NOTE: closing dropped every registration.
        rc = self._engine.unregister_memory(address)
        if rc != 0:
            log.warning("Mooncake engine %s: unregistering %#x failed (rc %d)", self.session, address, rc)

    def read(self, session: str, address: int, remote_address: int, nbytes: int) -> None:
        """Read [remote_address, +nbytes) of the engine at `session` into local memory at `address`.

        Raises OSError: ETIMEDOUT when it gave up waiting (the transfer may still land in that memory),
        EIO when it failed (peer gone, region not registered there), EBADF when this engine is closed.
        """
        engine = self._engine
        if engine is None:
            raise OSError(errno.EBADF, f"Mooncake engine {self.session} is closed")
        start = time.monotonic()
        timeout = transfer_timeout_s() + nbytes / 1e9  # NOTE: Mooncake's own: plus 1 s per GB.
        if nbytes < POLL_BYTES:
            rc = engine.transfer_sync_read(session, address, remote_address, nbytes)
        else:
            rc = _poll_read(engine, session, address, remote_address, nbytes, start + timeout)
        if rc == 0:
            return
        is_timeout = rc == _RC_TIMEOUT or time.monotonic() - start >= timeout
        raise OSError(errno.ETIMEDOUT if is_timeout else errno.EIO,
                      f"Mooncake read of {nbytes} B from {session} {'timed out' if is_timeout else 'failed'} (rc {rc})")

    def close(self) -> None:
        # NOTE: the engine's destructor joins its handshake listener, which polls accept() with a 1 s
        # timeout, and holds the GIL meanwhile: closing stalls every thread of the process for up to ~1 s.
        # A read in flight in another thread keeps the engine alive until it returns.
        self._engine = None


def _poll_read(engine: Any, session: str, address: int, remote_address: int, nbytes: int, deadline: float) -> int:
    """0 once read, < 0 on failure; _RC_TIMEOUT when the read may still be in flight."""
    batch = engine.batch_transfer_async_read(session, [address], [remote_address], [nbytes])
    if batch == 0:
        return -1  # NOTE: not submitted (no connection to the peer).
    delay = _FIRST_POLL_S
    while (status := engine.transfer_check_status(batch)) == 0:
        if time.monotonic() > deadline:
            return _RC_TIMEOUT
        time.sleep(delay)
        delay = min(2 * delay, _MAX_POLL_S)
    return 0 if status == 1 else int(status)
