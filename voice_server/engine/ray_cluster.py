"""Joining a Ray cluster from the server, and Ray's node-label selector: shared by the launch
(`voice_server/engine/ray_hosts.py`) and `check-config` (`voice_server/engine/ray_launch.py: check_cluster`)."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Mapping

import ray


def connect_cluster(address: str, timeout_s: float) -> None:
    """Join the cluster at `address` (with an address, ray.init only connects, never starts a cluster).

    NOTE: ray.init waits minutes for a GCS that does not answer: a `host:port` address is tried first. On the main
    thread it replaces SIGTERM's handler with `sys.exit`, and it sets `PYTHONBREAKPOINT` (its debugger) in the
    environment: the server's handler (the event loop's, `server/runner.py`) and environment are put back.
    """
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in host:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=max(0.1, timeout_s)).close()
        except OSError as exc:
            raise RuntimeError(f"cannot reach the Ray cluster at {address}: {exc}") from exc
    is_main = threading.current_thread() is threading.main_thread()
    handler, env = signal.getsignal(signal.SIGTERM) if is_main else None, dict(os.environ)
    try:
        ray.init(address=address)
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)
        for key in [k for k in os.environ if k not in env]:
            del os.environ[key]
        os.environ.update(env)


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Ray's label selector, for the message of what cannot be placed."""
    for key, expr in selector.items():
        is_negated = expr.startswith("!")
        expr = expr.removeprefix("!")
        values = {v.strip() for v in expr[3:-1].split(",")} if expr.startswith("in(") and expr.endswith(")") else {expr}
        if (labels.get(key) in values) == is_negated:
            return False
    return True
