"""A client's input streamed to the entry stage while the request runs (`submit(stream_input=True)`).

The entry stage is the numeric sink: it takes a streamed request (NEW, then CHUNKs `{frame, index}`
in order, then DONE) and answers each chunk with its sum and, at the end, the number of chunks. Its
relay is small so that chunks the sink holds can fill the coordinator's relay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from harness import Pipeline, shm_segments

from voice_server.config import pipeline_from_dict
from voice_server.engine.coordinator import Coordinator, InputStream, OverloadError, RequestError

RELAY_BYTES = 1 << 20
BIG_FRAME_LEN = 16384  # 64 KiB float32: through the relay (inline below 16 KiB)


@pytest.fixture(scope="module")
def sink() -> Iterator[Pipeline]:
    raw = {
        "name": "stream-input", "relay_slab_bytes": RELAY_BYTES, "max_relay_bytes": RELAY_BYTES,
        "max_relay_segments": 2,
        "stages": [{"name": "sink", "factory": "voice_server.stages.numeric:create_sink", "terminal": True,
                    "memory_fraction": 0.01}],
    }
    pipeline = Pipeline(pipeline_from_dict(raw))
    yield pipeline
    pipeline.close()
    assert shm_segments(pipeline.coordinator.launch_id) == []


def frames(num: int, frame_len: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(frame_len).astype(np.float32) for _ in range(num)]


async def wait_idle(coordinator: Coordinator, timeout_s: float = 10.0) -> dict[str, Any]:
    """Stats once the stage holds no request and no relay slot, and the coordinator's relay is empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await coordinator.stats()
        if coordinator.slab.num_live_slots == 0 and all(
                r.num_live_slots == 0 and all(ids == [] for ids in r.active.values()) for r in stats.values()):
            return stats
        assert time.monotonic() < deadline, (coordinator.slab.num_live_slots, stats)
        await asyncio.sleep(0.01)


def test_chunks_reach_the_entry_stage_in_order_while_outputs_stream_back(sink: Pipeline) -> None:
    coordinator = sink.coordinator
    # Inline and relayed chunks mixed: both kinds keep their order.
    chunks = [f for i, f in enumerate(frames(12, 100)) if i % 2] + frames(6, BIG_FRAME_LEN, seed=1)

    async def scenario() -> tuple[list[Any], list[Any]]:
        stream = coordinator.submit({}, stream_input=True)
        assert isinstance(stream.input, InputStream)
        first = []
        for index, frame in enumerate(chunks):
            assert stream.input.send({"frame": frame, "index": index})
            if index == 2:
                # The request answers while its input is still arriving.
                first = [await stream.__anext__() for _ in range(3)]
        assert stream.input.num_chunks == len(chunks)
        assert stream.input.end()
        rest = [o async for o in stream]
        assert not stream.input.send({"frame": chunks[0], "index": 0}) and not stream.input.end()
        return first, rest

    first, rest = sink.run(scenario())
    outputs = first + rest
    assert [o.payload["index"] for o in outputs[:-1]] == list(range(len(chunks)))
    for out, frame in zip(outputs, chunks):
        np.testing.assert_array_equal(out.payload["frame"], frame)
        assert out.payload["sum"] == pytest.approx(float(frame.sum(dtype=np.float64)))
    assert outputs[-1].is_final and outputs[-1].payload == {"num_frames": len(chunks)}
    sink.run(wait_idle(coordinator))


def test_a_whole_request_has_no_input_stream(sink: Pipeline) -> None:
    async def submit() -> Any:
        stream = sink.coordinator.submit({})
        await stream.aclose()
        return stream.input

    assert sink.run(submit()) is None


def test_abort_mid_stream_frees_everything_and_later_sends_do_nothing(sink: Pipeline) -> None:
    coordinator = sink.coordinator
    chunks = frames(8, BIG_FRAME_LEN, seed=2)

    async def scenario() -> tuple[int, list[Any], bool, bool]:
        stream = coordinator.submit({}, stream_input=True)
        assert stream.input is not None
        for index, frame in enumerate(chunks[:4]):
            stream.input.send({"frame": frame, "index": index})
        for _ in range(4):  # the stage holds all four chunks (and their relay slots) now
            await stream.__anext__()
        num_held = coordinator.slab.num_live_slots
        assert await coordinator.abort(stream.request_id)
        tail = [o async for o in stream]
        is_sent = stream.input.send({"frame": chunks[4], "index": 4})
        is_ended = stream.input.end()
        return num_held, tail, is_sent, is_ended

    num_held, tail, is_sent, is_ended = sink.run(scenario())
    assert num_held == 4 and tail == []
    assert not is_sent and not is_ended
    sink.run(wait_idle(coordinator))


def test_sends_for_a_failed_request_do_nothing(sink: Pipeline) -> None:
    async def scenario() -> tuple[bool, bool]:
        stream = sink.coordinator.submit({}, stream_input=True)
        assert stream.input is not None
        stream.input.send({"index": 0})  # no frame: the sink's batch raises, the request fails
        with pytest.raises(RequestError, match="stage 'sink'"):
            [o async for o in stream]
        return stream.input.send({"frame": np.ones(4, np.float32), "index": 1}), stream.input.end()

    assert sink.run(scenario()) == (False, False)
    sink.run(wait_idle(sink.coordinator))


def test_a_bad_chunk_is_refused_before_sending_and_the_input_stays_whole(sink: Pipeline) -> None:
    frame = np.ones(8, np.float32)

    async def scenario() -> list[Any]:
        stream = sink.coordinator.submit({}, stream_input=True)
        assert stream.input is not None
        assert stream.input.send({"frame": frame, "index": 0})
        for bad in ("audio", [frame], {1: frame}, None):
            with pytest.raises(RequestError, match="mapping with string keys"):
                stream.input.send(bad)  # type: ignore[arg-type]
        with pytest.raises(RequestError, match="input chunk cannot be sent"):
            stream.input.send({"frame": object(), "index": 1})
        assert stream.input.num_chunks == 1  # nothing was sent, no chunk number was used
        assert stream.input.send({"frame": frame, "index": 1})
        stream.input.end()
        return [o async for o in stream]

    outputs = sink.run(scenario())
    assert [o.payload.get("index") for o in outputs] == [0, 1, None]
    assert outputs[-1].payload == {"num_frames": 2}
    sink.run(wait_idle(sink.coordinator))


def test_a_full_relay_refuses_a_chunk_as_overload_and_the_request_goes_on(sink: Pipeline) -> None:
    coordinator = sink.coordinator
    frame = np.ones(BIG_FRAME_LEN, np.float32)

    async def scenario() -> tuple[int, list[Any]]:
        stream = coordinator.submit({}, stream_input=True)
        assert stream.input is not None
        num_sent = 0
        # NOTE: the sink holds every chunk until the request leaves it: 64 KiB chunks fill a 1 MiB relay.
        with pytest.raises(OverloadError, match="server busy"):
            for index in range(2 * RELAY_BYTES // frame.nbytes):
                stream.input.send({"frame": frame, "index": index})
                num_sent += 1
        assert stream.input.num_chunks == num_sent
        stream.input.end()
        return num_sent, [o async for o in stream]

    num_sent, outputs = sink.run(scenario())
    assert 0 < num_sent < 2 * RELAY_BYTES // frame.nbytes
    assert outputs[-1].payload == {"num_frames": num_sent}
    sink.run(wait_idle(coordinator))
