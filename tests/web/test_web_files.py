"""`GET /` and the files under it (`voice_server/server/web.py`): the demo's page and modules with the
content types a browser insists on (module scripts and worklets must be JavaScript), its headers, and
a clear 404 when the folder is missing. A real uvicorn on 127.0.0.1 serves the app; no stage runs (the
files never touch the coordinator)."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from serving import free_port
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from voice_server.server.app import create_app
from voice_server.server.web import CONTENT_SECURITY_POLICY, default_web_dir

ROOT = Path(__file__).resolve().parents[2]
JAVASCRIPT = ("text/javascript", "application/javascript")


class NoCoordinator:
    """Stands in for the coordinator: serving files never asks it anything but readiness (and its
    health, which `/metrics` reports)."""

    is_ready = False

    def health(self) -> dict[str, Any]:
        return {"status": "starting", "pipeline": "none", "stages": {}}


class ThreadServer:
    """`create_app(...)` under uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, **app_args: Any) -> None:
        self.port = free_port()
        config = uvicorn.Config(create_app(NoCoordinator(), **app_args), host="127.0.0.1",  # type: ignore[arg-type]
                                port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def get(self, path: str) -> tuple[int, dict[str, str], bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def files() -> Iterator[ThreadServer]:
    srv = ThreadServer()
    yield srv
    srv.close()


def test_the_default_web_dir_is_the_repositorys(files: ThreadServer) -> None:
    assert default_web_dir() == ROOT / "web"


def test_the_page_is_served_at_the_root_with_its_headers(files: ThreadServer) -> None:
    status, headers, body = files.get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'<script type="module" src="app.js">' in body and body == (ROOT / "web/index.html").read_bytes()
    assert headers["cache-control"] == "no-cache" and headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert headers["x-content-type-options"] == "nosniff"
    assert files.get("/index.html")[0] == 200


@pytest.mark.parametrize("name", ["app.js", "protocol.js", "audio.js", "chat.js", "chart.js", "tools.js", "camera.js",
                                  "capture-worklet.js", "playback-worklet.js"])
def test_scripts_and_worklets_are_javascript(files: ThreadServer, name: str) -> None:
    status, headers, body = files.get(f"/{name}")
    assert status == 200 and headers["content-type"].split(";")[0] in JAVASCRIPT, headers
    assert body == (ROOT / "web" / name).read_bytes()


def test_every_module_the_page_imports_is_served(files: ThreadServer) -> None:
    # NOTE: a module missing from the server fails the whole page in the browser; check the imports.
    for script in (ROOT / "web").glob("*.js"):
        for line in script.read_text().splitlines():
            if line.startswith("import ") and " from " in line:
                target = line.rsplit(" from ", 1)[1].strip(" ;\"'").removeprefix("./")
                assert files.get(f"/{target}")[0] == 200, (script.name, target)


def test_the_stylesheet_is_css_and_unknown_paths_are_404(files: ThreadServer) -> None:
    status, headers, _ = files.get("/style.css")
    assert status == 200 and headers["content-type"].startswith("text/css")
    assert files.get("/no-such-file.js")[0] == 404
    assert files.get("/../pyproject.toml")[0] == 404
    assert files.get("/%2e%2e/pyproject.toml")[0] == 404


def test_the_servers_own_routes_come_before_the_demo(files: ThreadServer) -> None:
    status, headers, _ = files.get("/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    # A WebSocket to an unknown path is refused at the handshake, as without the demo's mount.
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{files.port}/no-such-socket", open_timeout=5)
    assert refused.value.response.status_code == 403


def test_a_missing_web_dir_answers_404_saying_where_it_looked(tmp_path: Path) -> None:
    srv = ThreadServer(web_dir=tmp_path / "gone")
    try:
        status, headers, body = srv.get("/")
        assert status == 404 and headers["content-type"].startswith("text/plain")
        assert f"no index.html in {tmp_path / 'gone'}" in body.decode()
        assert srv.get("/app.js")[0] == 404
    finally:
        srv.close()


def test_web_dir_serves_another_folder(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("<!doctype html><title>mine</title>")
    srv = ThreadServer(web_dir=tmp_path)
    try:
        status, _, body = srv.get("/")
        assert status == 200 and b"mine" in body
    finally:
        srv.close()


def test_serve_takes_web_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    from voice_server import cli

    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "serve", lambda *args: calls.append(args) or 0)
    assert cli.main(["serve", "--web-dir", "somewhere/web"]) == 0
    assert calls[0][-1] == "somewhere/web"
    assert cli.main(["serve"]) == 0 and calls[1][-1] is None
