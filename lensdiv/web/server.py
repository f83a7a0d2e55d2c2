"""The ``lensdiv explore`` web app: a Starlette app over one :class:`~lensdiv.web.session.Session`.

Routes (JSON in, JSON out; every error is a 4xx with ``{"error": "one line"}``):

==========================  ===============================================================
``GET /``                   the page (``static/explore.html``; its CSS and JS from ``static/``)
``GET /api/info``           the model, its lenses, whether a runs folder is served
``POST /api/grid``          ``{text, lens, skip, part, top_k}`` → the prompt view
``POST /api/patch``         ``{clean, corrupt, target, layer, position}``, or a piece of the map:
                            ``{clean, corrupt, target, map: true, layer, start}``
``POST /api/attention``     ``{text, block, position[, first]}`` → one position's attention
``POST /api/says``          ``{text, row, position[, lens, tokens]}`` → what the model says about
                            ``h_row`` there: a patchscope's greedy continuation
``GET /api/runs``           the runs and studies under ``--runs``
``GET /runs/{path}``        a run's ``report.html`` or a study's ``study.html`` under ``--runs``
==========================  ===============================================================

The endpoints are module-level functions; what they share lives on ``app.state``: the
``session``, the one ``lock`` before the model, the number of requests ``waiting`` for it and the
``token``. Requests to the model wait on that lock, first come first served; a request whose
client went away while it waited (the page aborts a superseded one) is dropped before it reaches
the model, and past :data:`MAX_WAITING` waiting requests a new one is answered 503 at once.
With a token (the default, as Jupyter does) every request but the page's CSS and JS must carry
it (``?token=`` once, then a cookie, or the ``X-Lensdiv-Token`` header); a browser opening a
page without it gets a short page saying to open the printed URL, the API a JSON 403. Without a
token (``--no-token``, loopback only) the server answers only a loopback ``Host`` (no DNS
rebinding). A body is read up to :data:`MAX_BODY` and refused (413, the connection closed) as
soon as it passes it; a client that hangs up mid-request is not an error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from lensdiv.core.errors import LensdivError
from lensdiv.web.hosts import LOOPBACK
from lensdiv.web.session import Session

MAX_BODY = 256 * 1024  # bytes of one request
MAX_WAITING = 64  # requests waiting for the model before new ones get 503
TOO_LARGE = f"the request is over {MAX_BODY // 1024} KiB"
INTERNAL = "internal error: the server could not answer this request (its terminal has the details)"
COOKIE = "lensdiv_token"
HEADER = "x-lensdiv-token"
STATIC = Path(__file__).parent / "static"
PAGE = "explore.html"
# The page's CSS and JS (the package's own files: no secret, nothing local) load without the
# token: a notebook shows the page in a frame of another site, where the cookie is not sent.
PUBLIC = frozenset(f"/{p.name}" for p in STATIC.iterdir() if p.is_file() and p.name != PAGE)
# The page loads nothing from anywhere else (no CDN); the runs' pages are self-contained. Only
# local pages (a notebook's) may show it in a frame. (CSP has no syntax for an IPv6 address:
# browsers drop "http://[::1]:*" with a console error, so a notebook at [::1] cannot frame it.)
FRAMED_BY = "'self' http://127.0.0.1:* http://localhost:*"
_CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
    f"script-src 'self' 'unsafe-inline'; frame-ancestors {FRAMED_BY}"
)
_PAGE_HEADERS = {"Content-Security-Policy": _CSP, "Cache-Control": "no-store"}
log = logging.getLogger("lensdiv.explore")


NO_TOKEN_PAGE = """<!doctype html><html lang="en"><meta charset="utf-8">
<title>lensdiv explore: open the printed URL</title>
<body style="font-family:sans-serif;max-width:40em;margin:3em auto">
<h1>lensdiv explore</h1>
<p>This server answers only the URL that <code>lensdiv explore</code> printed when it started:
the one ending in <code>?token=…</code>. Open that URL (copy it from the terminal, or from the
notebook cell), not this bare address.</p></body></html>
"""


def error(status: int, message: str, *, close: bool = False) -> JSONResponse:
    """``{"error": message}``; ``close``: the connection closes after it (a body not read)."""
    headers = {"Connection": "close"} if close else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def host_name(header: str) -> str:
    """The host of a ``Host`` header: ``127.0.0.1:8765`` → ``127.0.0.1``, ``[::1]:8765`` →
    ``::1``."""
    header = header.strip()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def refuse(request: Request, message: str) -> Response:
    """A 403: for a browser opening a page, a short page saying where to go; else JSON."""
    browser = "text/html" in request.headers.get("accept", "")
    if request.method == "GET" and browser and not request.url.path.startswith("/api/"):
        return HTMLResponse(NO_TOKEN_PAGE, status_code=403, headers={"Connection": "close"})
    return error(403, message, close=True)


class Guard:
    """ASGI middleware: the token (``app.state.token``, when there is one) or a loopback
    ``Host``; the size limit of a request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        token: str | None = scope["app"].state.token
        set_cookie = False
        if token is None:
            host = host_name(request.headers.get("host") or "")
            if host not in LOOPBACK:
                message = f"Host {host!r} refused: this server answers 127.0.0.1 only"
                await error(403, message, close=True)(scope, receive, send)
                return
        else:
            given = (
                request.headers.get(HEADER)
                or request.cookies.get(COOKIE)
                or request.query_params.get("token")
            )
            public = scope["path"] in PUBLIC and scope["method"] in ("GET", "HEAD")
            if (not given or not hmac.compare_digest(given, token)) and not public:
                message = "missing or wrong token: open the URL lensdiv explore printed"
                await refuse(request, message)(scope, receive, send)
                return
            # The URL's token becomes a cookie (the page's later requests carry it).
            set_cookie = (
                given is not None
                and request.query_params.get("token") == token
                and (request.cookies.get(COOKIE) != token)
            )
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            await error(413, TOO_LARGE, close=True)(scope, receive, send)
            return
        if not set_cookie:
            await self.app(scope, receive, send)
            return

        async def send_with_cookie(message: Any) -> None:
            if message["type"] == "http.response.start":
                cookie = f"{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
                message["headers"] = [*message.get("headers", []), (b"set-cookie", cookie.encode())]
            await send(message)

        await self.app(scope, receive, send_with_cookie)


class Static(StaticFiles):
    """The page's CSS and JS, with the page's headers (its policy; never cached)."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(_PAGE_HEADERS)
        return response


# -- the endpoints ---------------------------------------------------------------------------


class TooLarge(LensdivError):
    """A request over :data:`MAX_BODY` (a 413)."""


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object, its body read chunk by chunk up to :data:`MAX_BODY` (a
    chunked body without a length is refused as soon as it passes the limit).

    Raises:
        TooLarge: Over :data:`MAX_BODY`.
        LensdivError: Not JSON, malformed, or not an object.
        ClientDisconnect: The client left before its body ended.
    """
    if "application/json" not in request.headers.get("content-type", ""):
        raise LensdivError("send JSON (Content-Type: application/json)")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise TooLarge(TOO_LARGE)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LensdivError(f"malformed JSON: {err}") from None
    if not isinstance(data, dict):
        raise LensdivError("the request must be a JSON object")
    return data


async def model_call(request: Request, method: Callable[[dict[str, Any]], Any]) -> Response:
    """``method(request's JSON)`` in a worker thread, holding the model's one lock."""
    state = request.app.state
    try:
        data = await read_json(request)
    except TooLarge as err:
        return error(413, str(err), close=True)  # the rest of the body is not read
    except LensdivError as err:
        return error(400, str(err))
    if state.waiting >= MAX_WAITING:
        return error(503, "the server is busy: try again")
    state.waiting += 1
    try:
        async with state.lock:
            if await request.is_disconnected():  # superseded: the page aborted it
                return Response(status_code=204)
            try:
                result = await run_in_threadpool(method, data)
            except LensdivError as err:
                return error(400, str(err))
    finally:
        state.waiting -= 1
    return JSONResponse(result)


async def grid(request: Request) -> Response:
    return await model_call(request, request.app.state.session.grid)


async def patch(request: Request) -> Response:
    return await model_call(request, request.app.state.session.patch)


async def attention(request: Request) -> Response:
    return await model_call(request, request.app.state.session.attention)


async def says(request: Request) -> Response:
    return await model_call(request, request.app.state.session.says)


async def info(request: Request) -> Response:
    return JSONResponse(request.app.state.session.describe())


async def runs(request: Request) -> Response:
    return JSONResponse({"runs": await run_in_threadpool(request.app.state.session.runs)})


async def saved(request: Request) -> Response:
    try:
        path = request.app.state.session.page(request.path_params["path"])
    except LensdivError as err:
        return error(404, str(err))
    return FileResponse(path, media_type="text/html; charset=utf-8")


async def page(request: Request) -> Response:
    return FileResponse(STATIC / PAGE, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)


async def not_found(request: Request, exc: Exception) -> Response:
    return error(404, f"no such page: {request.url.path}")


async def not_allowed(request: Request, exc: Exception) -> Response:
    return error(405, f"{request.method} is not allowed on {request.url.path}")


async def gone(request: Request, exc: Exception) -> Response:
    """The client hung up before its request ended: not an error (nobody reads the answer)."""
    log.debug("explore: %s %s: the client left mid-request", request.method, request.url.path)
    return Response(status_code=204)


async def crashed(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback; the answer says only that (never the exception's text,
    which may carry paths or data)."""
    log.exception("explore: %s %s failed", request.method, request.url.path)
    return error(500, INTERNAL)


ROUTES = [
    Route("/", page, methods=["GET"]),
    Mount(
        "/api",
        routes=[
            Route("/info", info, methods=["GET"]),
            Route("/grid", grid, methods=["POST"]),
            Route("/patch", patch, methods=["POST"]),
            Route("/attention", attention, methods=["POST"]),
            Route("/says", says, methods=["POST"]),
            Route("/runs", runs, methods=["GET"]),
        ],
    ),
    Route("/runs/{path:path}", saved, methods=["GET"]),
    Mount("/", Static(directory=STATIC)),  # explore.css, explore.js
]


def make_app(session: Session, *, token: str | None = None) -> Starlette:
    """The app serving ``session`` (``token``: required on every request; ``None`` on loopback)."""
    app = Starlette(
        routes=ROUTES,
        middleware=[Middleware(Guard)],
        exception_handlers={
            404: not_found,
            405: not_allowed,
            ClientDisconnect: gone,
            Exception: crashed,
        },
    )
    app.state.session = session
    app.state.lock = asyncio.Lock()  # the one lock before the model
    app.state.waiting = 0
    app.state.token = token
    return app


__all__ = ["MAX_BODY", "MAX_WAITING", "Guard", "make_app"]
