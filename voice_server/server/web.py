"""`GET /` and the files under it: the browser voice-chat demo (`web/` at the repository's top level).

The demo is static (plain ES modules, no build step), served from `web_dir`: by default the `web/`
folder next to the `voice_server` package (a source checkout or an editable install), else what
`serve --web-dir` names. A missing folder is not an error for the server (a wheel install has no
`web/`): every path under `/` then answers 404 with a line saying where the demo was looked for.

Every demo response carries `Cache-Control: no-cache` (the browser revalidates by ETag, so an edited
file shows on reload while unchanged ones cost a 304) and a Content-Security-Policy that allows only
this origin's scripts, styles, worklets and WebSocket.
"""

from __future__ import annotations

from pathlib import Path

from starlette.datastructures import MutableHeaders
from starlette.responses import PlainTextResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocketClose

import voice_server

# NOTE: `connect-src 'self'` covers ws:// and wss:// of the page's own host (CSP level 3, which every
# browser with AudioWorklet implements); worklet modules are scripts, so `script-src 'self'` covers them.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "media-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def default_web_dir() -> Path:
    """`web/` beside the package: the repository's top level in a checkout or an editable install."""
    return Path(voice_server.__file__).resolve().parents[1] / "web"


class WebFiles:
    """The ASGI app mounted at `/` after every other route: the demo's files, or a 404 naming `web_dir`.

    NOTE: a WebSocket to an unknown path reaches this mount too (a mount at `/` matches everything);
    it is closed as the router would close it, since `StaticFiles` takes HTTP only.
    """

    def __init__(self, web_dir: Path) -> None:
        self.web_dir = web_dir
        self.files = StaticFiles(directory=web_dir, html=True, check_dir=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await WebSocketClose()(scope, receive, send)
            return
        if not (self.web_dir / "index.html").is_file():
            response = PlainTextResponse(
                f"the browser demo is not installed: no index.html in {self.web_dir} (serve --web-dir DIR)\n",
                status_code=404)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.files(scope, receive, send_with_headers)
