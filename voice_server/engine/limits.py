"""Admission and relay limits, resolved once per launch from the config and the host.

What runs out first under a burst is file descriptors (each live relay overflow segment holds one
in its producer and one per mapped view in its consumer) and /dev/shm. The limits keep the engine
below both: the coordinator refuses requests beyond `max_inflight_requests` or when its relay is
full, and every producer's relay refuses puts beyond `max_relay_bytes` / `max_relay_segments`,
which fails that one request with an overload error instead of killing a stage with EMFILE.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from voice_server.config import PipelineConfig
from voice_server.relay.shm_segments import SHM_DIR

_GIB = 1 << 30


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def num_open_files_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


@dataclass(frozen=True)
class EngineLimits:
    max_inflight_requests: int
    max_relay_bytes: int
    """Per producer process (slab and overflow segments together)."""
    max_relay_segments: int
    """Live overflow segments per producer process."""
    request_timeout_s: float | None
    max_queued_outputs: int = 1024
    """Terminal outputs queued unread per request (`RequestTable`)."""

    def __post_init__(self) -> None:
        for name in ("max_inflight_requests", "max_relay_bytes", "max_relay_segments", "max_queued_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineLimits.{name} must be >= 1")

    @classmethod
    def resolve(cls, cfg: PipelineConfig) -> EngineLimits:
        """The config's values, with null ones sized from this host's descriptor limit and /dev/shm."""
        num_files = num_open_files_limit()
        # NOTE: a quarter of the descriptors for requests and an eighth per producer for overflow
        # segments leaves the rest for connections, ZMQ and mapped views (1024 -> 256 and 128).
        max_inflight = cfg.max_inflight_requests or _clamp(num_files // 4, 16, 4096)
        max_segments = cfg.max_relay_segments or _clamp(num_files // 8, 8, 1024)
        if cfg.max_relay_bytes is not None:
            max_bytes = cfg.max_relay_bytes
        else:
            # NOTE: half of what /dev/shm has free, shared by every producer (stages + coordinator).
            share = shm_free_bytes() // (2 * (len(cfg.processes) + 1))
            max_bytes = _clamp(share, cfg.relay_slab_bytes, 8 * _GIB)
        return cls(max_inflight, max_bytes, max_segments, cfg.request_timeout_s, cfg.max_queued_outputs)
