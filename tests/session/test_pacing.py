"""`Pacer`: audio goes out so that the client never holds more than `lead_s`, in the order it was put,
messages without audio right behind the audio before them; a pause holds everything; a flush drops what
it picks and keeps the rest in order."""

from __future__ import annotations

import asyncio
import time

import pytest

from voice_server.session.pacing import Pacer


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_audio_goes_out_lead_ahead_of_the_playout_and_in_order() -> None:
    async def go() -> None:
        sent: list[tuple[float, str]] = []

        async def send(message: str) -> None:
            sent.append((time.monotonic(), message))

        pacer: Pacer[str] = Pacer(send, lead_s=0.1)
        start = time.monotonic()
        for i in range(10):
            pacer.put(f"a{i}", 0.05)  # NOTE: 10 x 50 ms of audio
        pacer.put("done")
        while len(sent) < 11:
            await asyncio.sleep(0.01)
        assert [m for _, m in sent] == [*(f"a{i}" for i in range(10)), "done"]
        at = {m: t - start for t, m in sent}
        assert at["a0"] < 0.03 and at["a1"] < 0.03  # NOTE: the lead's worth goes at once
        # NOTE: piece i plays from 50 i ms, and the client holds at most 100 ms with it: it goes at 50 i - 50 ms
        # at the earliest.
        for i in range(2, 10):
            assert at[f"a{i}"] >= (50 * i - 50) / 1000 - 0.005, (i, at)
        assert at["done"] - at["a9"] < 0.03  # NOTE: right behind the audio before it
        assert pacer.play_end_at - start == pytest.approx(0.5, abs=0.03)

    run(go())


def test_a_pause_holds_everything_and_a_flush_drops_what_it_picks() -> None:
    async def go() -> None:
        sent: list[str] = []

        async def send(message: str) -> None:
            sent.append(message)

        pacer: Pacer[str] = Pacer(send, lead_s=0.0)
        pacer.put("a0", 0.2)
        await asyncio.sleep(0.02)
        pacer.pause()
        for message in ("a1", "t1", "a2", "done"):
            pacer.put(message, 0.2 if message.startswith("a") else 0.0)
        await asyncio.sleep(0.4)
        assert sent == ["a0"]  # NOTE: paused: not even the text behind it
        assert pacer.flush(lambda m: m.startswith("a")) == pytest.approx(0.4)
        await asyncio.sleep(0.05)
        assert sent == ["a0", "t1", "done"] and not pacer.is_paused and pacer.queued_s == 0
        pacer.put("a3", 0.01)
        await asyncio.sleep(0.05)
        assert sent[-1] == "a3"
        await pacer.close()

    run(go())


def test_close_drops_the_queue_and_stops() -> None:
    async def go() -> None:
        sent: list[str] = []

        async def send(message: str) -> None:
            sent.append(message)

        pacer: Pacer[str] = Pacer(send, lead_s=0.0)
        for i in range(5):
            pacer.put(f"a{i}", 0.5)
        await asyncio.sleep(0.02)
        await pacer.close()
        await asyncio.sleep(0.05)
        assert sent == ["a0"]

    run(go())
    with pytest.raises(ValueError, match="lead_s"):
        Pacer(lambda m: asyncio.sleep(0), lead_s=-1)
