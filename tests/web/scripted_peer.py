"""A scripted `/ws` peer for the browser demo's tests: a real uvicorn on 127.0.0.1 serving the demo's files
(`WebFiles`) and, at `/ws`, a script that plays the server's side of a conversation step by step, each step
waiting for what the page must send first (`Peer`); a deviation ends the script with the reason in
`ScriptedServer.record["error"]`, which the test reports."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import uvicorn
from serving import free_port
from starlette.applications import Starlette
from starlette.routing import Mount, WebSocketRoute
from starlette.websockets import WebSocket

from voice_server.audio import float32_to_pcm16, pcm16_to_bytes
from voice_server.server.web import WebFiles, default_web_dir

STEP_TIMEOUT_S = 60.0


def tone(num_ms: int) -> bytes:
    t = np.arange(24 * num_ms) / 24000
    return pcm16_to_bytes(float32_to_pcm16((0.1 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)))


class Peer:
    """The script's view of one connection: what the page sent, and a wait for its next JSON message."""

    def __init__(self, ws: WebSocket, record: dict[str, Any]) -> None:
        self.ws, self.record = ws, record
        record["frame_sizes"] = []
        record["audio"] = bytearray()
        record["messages"] = []

    async def receive(self) -> dict[str, Any] | None:
        """The page's next message: JSON as sent, an audio frame as {"type": "(audio)"} (its size recorded);
        None once the page closed the socket."""
        async with asyncio.timeout(STEP_TIMEOUT_S):
            message = await self.ws.receive()
        if message["type"] == "websocket.disconnect":
            return None
        if message.get("bytes") is not None:
            self.record["frame_sizes"].append(len(message["bytes"]))
            self.record["audio"] += message["bytes"]
            return {"type": "(audio)"}
        event = json.loads(message["text"])
        self.record["messages"].append(event)
        return dict(event)

    async def next(self, kind: str, until: Any = None) -> dict[str, Any]:
        """The page's next JSON message of `kind` (for which `until(message)` holds)."""
        while True:
            event = await self.receive()
            if event is None:
                raise AssertionError(f"the page closed the socket while the script waited for {kind}")
            if event["type"] == kind and (until is None or until(event)):
                return event

    async def frames(self, count: int) -> None:
        while len(self.record["frame_sizes"]) < count:
            if await self.receive() is None:
                raise AssertionError("the page closed the socket before sending audio")

    async def reports_for(self, seconds: float) -> list[int]:
        """The `played_ms` of the playback reports the page sends in the next `seconds`."""
        reports, deadline = [], time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(left):
                    event = await self.receive()
            except TimeoutError:
                break
            if event is not None and event["type"] == "playback":
                reports.append(event["played_ms"])
        return reports

    async def closed(self) -> None:
        while await self.receive() is not None:
            pass

    async def send(self, **event: Any) -> None:
        await self.ws.send_text(json.dumps(event))

    async def audio(self, num_ms: int, chunk_ms: int = 200) -> None:
        for _ in range(num_ms // chunk_ms):
            await self.ws.send_bytes(tone(chunk_ms))


class ScriptedServer:
    """uvicorn in a thread: the demo's files, and `script` at `/ws` (each connection)."""

    def __init__(self, script: Callable[[Peer], Awaitable[None]]) -> None:
        self.script = script
        self.record: dict[str, Any] = {}
        self.port = free_port()
        app = Starlette(routes=[WebSocketRoute("/ws", self.ws), Mount("/", WebFiles(default_web_dir()))])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    async def ws(self, websocket: WebSocket) -> None:
        await websocket.accept()
        try:
            await self.script(Peer(websocket, self.record))
        except Exception as exc:  # NOTE: reported by the test, whose waits would otherwise just time out
            self.record["error"] = f"{type(exc).__name__}: {exc}"
            await websocket.close(1011, "script failed")

    def waiter(self, demo: Any) -> Callable[[str], None]:
        """`demo.wait`, whose timeout also says how the script failed (else the wait would only time out)."""
        def wait(condition: str) -> None:
            try:
                demo.wait(condition)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nscript: {self.record.get('error')}") from None

        return wait

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
