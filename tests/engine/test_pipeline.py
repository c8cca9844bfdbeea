"""The numeric test pipeline end to end: real stage processes, ZMQ sockets and shared memory."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from harness import Pipeline

from voice_server.engine.coordinator import OverloadError, RequestError

FRAME_LEN = 4096  # configs/test_numeric.yaml; 16 KiB float32 frames travel through the relay
_ID = "abort-latency"


def expected_frames(signal: np.ndarray) -> list[np.ndarray]:
    return [signal[i:i + FRAME_LEN] * np.float32(2.0) + np.float32(1.0) for i in range(0, len(signal), FRAME_LEN)]


def check_outputs(outputs: list[Any], signal: np.ndarray) -> None:
    frames = [o for o in outputs if not o.is_final]
    want = expected_frames(signal)
    assert [o.payload["index"] for o in frames] == list(range(len(want)))
    for out, ref in zip(frames, want):
        assert out.stage == "sink"
        np.testing.assert_array_equal(out.payload["frame"], ref)
        assert out.payload["sum"] == pytest.approx(float(ref.sum(dtype=np.float64)))
    assert outputs[-1].is_final and outputs[-1].payload == {"num_frames": len(want)}


def test_streams_ordered_chunks_through_three_stages(numeric: Pipeline) -> None:
    rng = np.random.default_rng(0)
    signal = rng.standard_normal(FRAME_LEN * 10 + 123).astype(np.float32)
    check_outputs(numeric.collect({"signal": signal}), signal)


def test_outputs_carry_each_stages_first_output_time(numeric: Pipeline) -> None:
    # NOTE: the first-audio latency accounting: submit, then each stage's first output, on one clock.
    before = time.monotonic()
    outputs = numeric.collect({"signal": np.ones(FRAME_LEN * 3, dtype=np.float32)})
    after = time.monotonic()
    stamps = [o.timings for o in outputs]
    assert all(set(t) == {"submit", "framer", "transform", "sink"} for t in stamps), stamps
    first = stamps[0]
    assert before <= first["submit"] <= first["framer"] <= first["transform"] <= first["sink"] <= after
    assert all(t == first for t in stamps), "a stage's first-output time never moves"


def test_a_step_sends_one_message_per_destination(numeric: Pipeline) -> None:
    def framer_counters() -> dict[str, int]:
        return numeric.run(numeric.coordinator.stats())["framer"].counters["framer"]

    before = framer_counters()
    signal = np.arange(FRAME_LEN * 40, dtype=np.float32)
    check_outputs(numeric.collect({"signal": signal}), signal)
    after = framer_counters()
    num_frames = after["num_frames_out"] - before["num_frames_out"]
    num_messages = after["num_messages_out"] - before["num_messages_out"]
    # NOTE: the framer's one step emits 40 chunks, the stream's opening and its end (42 control messages) to
    # the transform: one multipart message; the ack of the relayed signal to the coordinator is another,
    # and the reply to the first stats query (sent after it read its counters) the third.
    assert num_frames >= 42 and num_messages <= 3, (num_frames, num_messages)


def test_small_frames_travel_inline(numeric: Pipeline) -> None:
    signal = np.linspace(-1, 1, 100, dtype=np.float32)
    check_outputs(numeric.collect({"signal": signal}), signal)


def test_32_concurrent_requests_complete_with_correct_results(numeric: Pipeline) -> None:
    rng = np.random.default_rng(1)
    signals = [rng.standard_normal(FRAME_LEN * int(rng.integers(1, 6)) + i).astype(np.float32) for i in range(32)]

    async def one(signal: np.ndarray) -> list[Any]:
        return [o async for o in numeric.coordinator.submit({"signal": signal})]

    async def all_of_them() -> list[list[Any]]:
        return await asyncio.gather(*(one(s) for s in signals))

    results = numeric.run(all_of_them())
    for outputs, signal in zip(results, signals):
        check_outputs(outputs, signal)
    assert numeric.coordinator.num_inflight == 0


def test_bad_input_fails_that_request_only(numeric: Pipeline) -> None:
    with pytest.raises(RequestError, match="signal must be a 1-D float array"):
        numeric.collect({"signal": "not audio"})
    with pytest.raises(RequestError, match="framer"):
        numeric.collect({"signal": np.zeros((2, 2), np.float32)})
    signal = np.ones(FRAME_LEN + 1, np.float32)
    check_outputs(numeric.collect({"signal": signal}), signal)


def test_abort_reaches_every_stage_quickly_and_frees_relay_slots(numeric: Pipeline) -> None:
    signal = np.ones(FRAME_LEN * 200, np.float32)
    coordinator = numeric.coordinator

    async def scenario() -> tuple[float, dict[str, Any], int]:
        stream = coordinator.submit({"signal": signal}, {"chunk_delay_ms": 10}, request_id=_ID)
        await stream.__anext__()
        await stream.__anext__()
        sent_at = time.monotonic()
        assert await coordinator.abort(stream.request_id)
        stats = await wait_aborted(coordinator, stream.request_id)
        tail = [o async for o in stream]  # the stream ends quietly after an abort
        return sent_at, stats, len(tail)

    sent_at, stats, num_tail = numeric.run(scenario())
    assert num_tail == 0
    assert set(stats) == {"framer", "transform", "sink"}
    # NOTE: measured from the stages' own timestamps (CLOCK_MONOTONIC is system-wide), not a sleep.
    latency_ms = {name: (reply.aborted_at[_ID] - sent_at) * 1000 for name, reply in stats.items()}
    print(f"abort latency per stage (ms): {latency_ms}")
    assert all(0 <= ms < 1000 for ms in latency_ms.values()), latency_ms
    for reply in stats.values():
        assert all(ids == [] for ids in reply.active.values()), reply
        assert reply.num_live_slots == 0, reply
    assert coordinator.slab.num_live_slots == 0
    # The pipeline still serves after the abort.
    small = np.ones(10, np.float32)
    check_outputs(numeric.collect({"signal": small}), small)
    # The aborted id is refused as a new request's: the stages drop what comes for it, so it would never end.
    with pytest.raises(ValueError, match="'abort-latency' was aborted or failed: a new request needs a new id"):
        coordinator.submit({"signal": small}, request_id=_ID)


async def wait_aborted(coordinator: Any, request_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Stats once every stage reports it dropped `request_id` and holds no request or relay slot."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await coordinator.stats()
        if all(request_id in r.aborted_at and r.num_live_slots == 0
               and all(ids == [] for ids in r.active.values()) for r in stats.values()):
            return stats
        assert time.monotonic() < deadline, stats
        await asyncio.sleep(0.01)


def test_client_leaving_early_aborts_the_request(numeric: Pipeline) -> None:
    coordinator = numeric.coordinator
    big = {"signal": np.ones(FRAME_LEN * 100, np.float32)}

    async def aclose() -> str:
        stream = coordinator.submit(big, {"chunk_delay_ms": 5})
        await stream.__anext__()
        await stream.aclose()
        return stream.request_id

    async def break_out() -> str:
        async def consume() -> str:
            stream = coordinator.submit(big, {"chunk_delay_ms": 5})
            async for _ in stream:
                break  # `async for` never closes the iterator: the dropped stream must abort it
            return stream.request_id
        return await consume()

    async def cancelled() -> str:
        stream = coordinator.submit(big, {"chunk_delay_ms": 5})

        async def consume() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        return stream.request_id

    async def dropped_unread() -> str:
        return coordinator.submit(big, {"chunk_delay_ms": 5}).request_id

    for how in (aclose, break_out, cancelled, dropped_unread):
        request_id = numeric.run(how())
        numeric.run(wait_aborted(coordinator, request_id))
        assert coordinator.num_inflight == 0, how.__name__


def test_malformed_control_messages_are_dropped_without_harm(numeric: Pipeline) -> None:
    import msgpack
    import zmq

    ctx = zmq.Context()
    try:
        for process in ("framer", "transform", "coord"):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(numeric.coordinator.endpoints.inboxes[process])
            for junk in (b"", b"\xc1garbage", msgpack.packb([99, "x"]), msgpack.packb([0, "only-one-field"]),
                         msgpack.packb({"not": "a list"})):
                sock.send(junk)
            sock.close()
    finally:
        ctx.term()
    signal = np.arange(FRAME_LEN * 2, dtype=np.float32)
    check_outputs(numeric.collect({"signal": signal}), signal)
    assert numeric.coordinator.is_ready


def test_unencodable_payload_is_refused_without_leaking(numeric: Pipeline) -> None:
    coordinator = numeric.coordinator

    async def scenario() -> str:
        try:
            coordinator.submit({"signal": np.ones(FRAME_LEN * 4, np.float32), "bad": object()})
        except RequestError as exc:
            return str(exc)
        return ""

    assert "cannot be sent" in numeric.run(scenario())
    assert coordinator.num_inflight == 0
    assert coordinator.slab.num_live_slots == 0  # the big signal's slot was taken, then given back


def inject(numeric: Pipeline, process: str, message: list[Any]) -> None:
    """Send a hand-made control message to a stage's inbox, as a process of this launch could."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(numeric.coordinator.endpoints.inboxes[process])
        sock.send(msgpack.packb(message))
        sock.close()
    finally:
        ctx.term()


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        ({}, "upstream stream incomplete: expected chunk"),  # a chunk far ahead: the ones between are lost
        # A chunk whose relayed tensor cannot be mapped (its segment is gone) must not just vanish.
        ({"frame": msgpack.ExtType(2, msgpack.packb(
            ["framer.0", "vs-nolaunch-framer.0-9", 0, 64, 0, "float32", [16], True]))},
         "cannot read relayed tensor"),
    ],
)
def test_a_hole_in_an_upstream_stream_fails_the_request(numeric: Pipeline, payload: dict[str, Any],
                                                         needle: str) -> None:
    coordinator = numeric.coordinator

    async def scenario() -> str:
        stream = coordinator.submit({"signal": np.ones(FRAME_LEN * 100, np.float32)}, {"chunk_delay_ms": 10})
        await stream.__anext__()
        inject(numeric, "transform", [1, stream.request_id, "transform", 50, payload])  # 1: StreamChunk
        try:
            async for _ in stream:
                pass
        except RequestError as exc:
            assert not isinstance(exc, OverloadError)
            return str(exc)
        return ""

    assert needle in numeric.run(scenario())
    assert coordinator.num_inflight == 0
