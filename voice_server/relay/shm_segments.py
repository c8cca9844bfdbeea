"""Segment files of the shared-memory relay: their names under /dev/shm, mapping them, sweeping leftovers.

Apart from the slab and the reader (`voice_server/relay/shm.py`) because the coordinator and the run
directory only list and sweep segments, by name; they never allocate in one or read from one.

Segments are plain files under /dev/shm named `vs-{launch_id}-{owner}-{n}`: n == 0 is the producer's
slab, n >= 1 are one-tensor overflow segments used when the slab is full. The owner unlinks them on ack
and on close. What a dead owner leaves, `sweep` removes, called by the coordinator
(`voice_server/engine/coordinator.py`), not the launcher: for a stage process that died (its owner
name carries the process generation), for the whole launch when the coordinator stops, and at start-up,
through `voice_server/engine/rundir.py: sweep_dead_launches`, for launches whose server was SIGKILLed.

NOTE: multiprocessing.shared_memory is not used: before Python 3.13 attaching registers the segment
with a resource tracker that unlinks it under its owner (CPython gh-82300).
"""

from __future__ import annotations

import contextlib
import mmap
import os

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "vs"


def segment_name(launch_id: str, owner: str, n: int) -> str:
    return f"{SEGMENT_PREFIX}-{launch_id}-{owner}-{n}"


def check_segment_ids(launch_id: str, owner: str | None) -> None:
    # NOTE: a dash-free launch id and a numeric suffix make `vs-{launch}-{owner}-{n}` parse unambiguously
    # even when the owner name itself contains dashes.
    if not launch_id or "-" in launch_id or "/" in launch_id:
        raise ValueError(f"launch_id must be non-empty without '-' or '/', got {launch_id!r}")
    if owner is not None and (not owner or "/" in owner):
        raise ValueError(f"owner must be non-empty without '/', got {owner!r}")


def _parse_owner(name: str, launch_id: str) -> str | None:
    prefix = f"{SEGMENT_PREFIX}-{launch_id}-"
    if not name.startswith(prefix):
        return None
    owner, _, n = name[len(prefix):].rpartition("-")
    return owner if owner and n.isdigit() else None


def list_segments(launch_id: str, owner: str | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    check_segment_ids(launch_id, owner)
    names = []
    for name in os.listdir(shm_dir):
        seg_owner = _parse_owner(name, launch_id)
        if seg_owner is not None and (owner is None or seg_owner == owner):
            names.append(name)
    return sorted(names)


def sweep(launch_id: str, owner: str | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink leftover segments of a launch (or of one dead owner in it); returns their names."""
    removed = []
    for name in list_segments(launch_id, owner, shm_dir):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass  # NOTE: its owner unlinked it meanwhile.
    return removed


def map_segment(path: str, size: int | None = None) -> tuple[mmap.mmap, int]:
    """Create (size given) or open a segment and map it whole; returns (mapping, inode).

    MAP_POPULATE fills the page tables up front so first touches do not fault page by page.
    """
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
            # NOTE: reserve the tmpfs pages now: a full /dev/shm then fails here with ENOSPC instead
            # of a SIGBUS at the first write through the mapping.
            os.posix_fallocate(fd, 0, size)
        stat = os.fstat(fd)
        populate = getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, stat.st_size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return mm, stat.st_ino
    except BaseException:
        if flags & os.O_CREAT:
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def close_mapping(mm: mmap.mmap) -> None:
    # NOTE: BufferError: arrays still view it; it is unmapped when the last one is garbage collected.
    with contextlib.suppress(BufferError):
        mm.close()


def unlink_owned(paths: set[str], pid: int) -> None:
    """Unlink `paths` (and empty the set) when called in process `pid`, the segments' owner."""
    if os.getpid() != pid:
        return  # NOTE: a forked child inherits the finalizer but does not own the segments.
    for path in list(paths):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    paths.clear()
