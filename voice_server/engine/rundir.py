"""A launch's private run directory: control sockets, and a lock that says the launch is alive.

Layout: `{base}/{launch_id}/` (mode 0700) holds the `ipc://` control sockets and a `lock` file
that the server process keeps locked (flock) for the launch's lifetime. The base is
`$VOICE_SERVER_RUN_DIR`, else `$XDG_RUNTIME_DIR/voice-server`, else `/tmp/voice-server-{uid}`.

Why: sockets in a directory only the launching user can enter keep other users off the control
plane (abstract-namespace sockets are open to anyone on the host). The lock lets the next server
recognise a launch whose server was SIGKILLed (its lock is free) and sweep what it left: its relay
segments in /dev/shm and its run directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat

from voice_server.relay.shm_segments import sweep

log = logging.getLogger("voice_server.rundir")
LOCK_NAME = "lock"


def base_dir() -> str:
    explicit = os.environ.get("VOICE_SERVER_RUN_DIR")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "voice-server")
    return f"/tmp/voice-server-{os.getuid()}"


def _private_dir(path: str) -> None:
    """Create `path` with mode 0700, or check that an existing one is ours and private."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    # NOTE: in a shared /tmp someone else may have created the name first (or a symlink to
    # elsewhere): using it would hand them our sockets.
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"run directory {path} must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(set VOICE_SERVER_RUN_DIR to use another place)"
        )


def _try_lock(path: str, is_new: bool = False) -> int | None:
    """An fd holding the exclusive lock on `path`, or None if a live process holds it."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if is_new else 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class RunDir:
    """Created and locked by the server process; `close` removes it."""

    def __init__(self, launch_id: str, base: str | None = None) -> None:
        self.base = base or base_dir()
        _private_dir(self.base)
        self.path = os.path.join(self.base, launch_id)
        # NOTE: built under a hidden name and renamed once locked, so a concurrent sweep never sees
        # this launch's directory without its lock held.
        staging = os.path.join(self.base, f".{launch_id}")
        os.mkdir(staging, 0o700)
        self._lock_fd: int | None = _try_lock(os.path.join(staging, LOCK_NAME), is_new=True)
        os.rename(staging, self.path)

    def socket(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def sweep_dead_launches(base: str | None = None) -> list[str]:
    """Remove the relay segments and run directories of launches whose server is gone."""
    base = base or base_dir()
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    swept = []
    for launch_id in names:
        path = os.path.join(base, launch_id)
        if launch_id.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            fd = _try_lock(os.path.join(path, LOCK_NAME))
        except FileNotFoundError:
            fd = -1  # NOTE: no lock file: a half-removed directory, so no live server either
        if fd is None:
            continue  # a live server holds the lock
        try:
            with contextlib.suppress(ValueError):  # a name that is not a launch id
                removed = sweep(launch_id)
                if removed:
                    log.warning("swept %d relay segments left by dead launch %s", len(removed), launch_id)
            shutil.rmtree(path, ignore_errors=True)
            swept.append(launch_id)
        finally:
            if fd >= 0:
                os.close(fd)
    return swept
