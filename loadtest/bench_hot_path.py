"""Messages on the hot path: how many ZMQ messages the engine sends per speaking user, and how many control
messages (frames) they carry, on the embedded CPU default.

`users` speak at once into the pipeline's coordinator (no WebSocket: the engine alone), each a streamed turn
of `--seconds` of voice-like audio in 20 ms int16 frames at real-time pace, as a session sends them, then
the turn's end; every turn's outputs are read to its end (transcript, reply text, reply audio). The table
prints, per process, the frames and the ZMQ messages that carried them, in and out. Before multipart
batching every frame was one message, so `frames` is the count before and `messages` the count now.

    OMP_NUM_THREADS=1 .venv/bin/python loadtest/bench_hot_path.py --users 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "loadtest")]

from table import cpu_description, format_table  # noqa: E402

from voice_server.audio import float32_to_pcm16  # noqa: E402
from voice_server.audio.synthetic import voice  # noqa: E402
from voice_server.config import load_pipeline  # noqa: E402
from voice_server.engine.coordinator import Coordinator  # noqa: E402

FRAME_MS = 20
RATE = 16000


async def one_turn(coordinator: Coordinator, seconds: float, seed: int) -> int:
    """One user's turn, streamed at real-time pace; the number of outputs it got back."""
    audio = float32_to_pcm16(voice(RATE, int(seconds * 1000), seed).astype(np.float32))
    await asyncio.sleep(random.Random(seed).uniform(0, FRAME_MS / 1000))
    stream = coordinator.submit({"messages": []}, stream_input=True)
    assert stream.input is not None
    frame = RATE * FRAME_MS // 1000
    started = time.monotonic()
    for index in range(0, len(audio), frame):
        stream.input.send({"audio": audio[index:index + frame]})
        await asyncio.sleep(max(0.0, started + (index + frame) / RATE - time.monotonic()))
    stream.input.end()
    return len([o async for o in stream])


async def measure(users: int, seconds: float) -> list[dict[str, Any]]:
    coordinator = Coordinator(load_pipeline(str(ROOT / "configs" / "default.yaml")))
    await coordinator.start()
    try:
        await one_turn(coordinator, 1.0, 0)  # NOTE: warm: sockets connected, first-use costs paid
        before = {name: dict(reply.counters[next(iter(reply.counters))]) for name, reply in
                  (await coordinator.stats()).items()}
        coordinator_before = dict(coordinator.io_counters)
        num_outputs = await asyncio.gather(*(one_turn(coordinator, seconds, seed) for seed in range(1, users + 1)))
        after = {name: reply.counters[next(iter(reply.counters))] for name, reply in
                 (await coordinator.stats()).items()}
        coordinator_after = dict(coordinator.io_counters)
    finally:
        await coordinator.stop()
    rows = []
    processes = [("coordinator", coordinator_before, coordinator_after)]
    processes += [(name, before[name], after[name]) for name in sorted(after)]
    for name, old, new in processes:
        def delta(key: str, old: dict[str, Any] = old, new: dict[str, Any] = new) -> int:
            return int(new[key] - old[key])
        rows.append({
            "users": users, "process": name,
            "frames_in": delta("num_frames_in"), "messages_in": delta("num_messages_in"),
            "frames_out": delta("num_frames_out"), "messages_out": delta("num_messages_out"),
            "frames_in_per_user_s": round(delta("num_frames_in") / (users * seconds), 1),
            "messages_in_per_user_s": round(delta("num_messages_in") / (users * seconds), 1),
        })
    print(f"{users} users: {sum(num_outputs)} outputs", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", default="1,8", help="comma-separated numbers of users speaking at once")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each user's turn")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for users in (int(u) for u in args.users.split(",")):
        rows += asyncio.run(measure(users, args.seconds))
    print(format_table(rows))
    print(cpu_description())


if __name__ == "__main__":
    main()
