"""Starting the explore server: in the foreground (``lensdiv explore``) or on a background thread
(:func:`explore`, for notebooks), on a socket bound here so that a taken port is one line and
port 0 picks a free one before the URL is printed."""

from __future__ import annotations

import html
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lensdiv.core.errors import LensdivError, OptionError
from lensdiv.web.hosts import LOOPBACK

EXTRA = "explore"  # pip install 'lensdiv[explore]'
ANY = ("0.0.0.0", "::", "")  # every interface: the URL names this machine instead
NO_TOKEN_WARNING = (
    "lensdiv explore: --no-token: any user or program on this machine can use this server"
)


def require() -> None:
    """Starlette and uvicorn are importable, or one line naming the extra to install."""
    missing = []
    for name in ("starlette", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise LensdivError(
            f"lensdiv explore needs {' and '.join(missing)}",
            hint=f"pip install 'lensdiv[{EXTRA}]'",
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one).

    Raises:
        OptionError: The address cannot be bound (port taken, unknown host).
    """
    if not 0 <= port <= 65535:
        raise OptionError(f"--port {port} is not a port (0-65535)")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)  # limits.BACKLOG (uvicorn listens again with it)
    except OSError as err:
        raise OptionError(
            f"cannot listen on {host}:{port}: {err.strerror or err}",
            hint="pick another --port (--port 0 takes a free one)",
        ) from None
    return sock


class Explorer:
    """A running explore server: :attr:`url` (with its token), :meth:`url_for` a path of its API,
    :meth:`stop`; shows the page inline in a notebook.

    Made by :func:`explore`; also a context manager (stops on exit).
    """

    def __init__(self, server: Any, sock: socket.socket, url: str, thread: threading.Thread | None):
        self.server, self.socket, self.url, self.thread = server, sock, url, thread

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and close its socket (idempotent)."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.socket.close()

    def url_for(self, path: str) -> str:
        """The URL of ``path`` on this server (``"api/grid"``), with its token."""
        base, _, query = self.url.partition("?")
        return base + path.lstrip("/") + (f"?{query}" if query else "")

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def __enter__(self) -> Explorer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"Explorer({self.url!r}, {'running' if self.running else 'stopped'})"

    def _repr_html_(self) -> str:
        src = html.escape(self.url, quote=True)
        return (
            f'<iframe src="{src}" style="width:100%;height:720px;border:1px solid #ddd" '
            f'title="lensdiv explore"></iframe><div><a href="{src}" target="_blank">'
            f"{html.escape(self.url)}</a> (stop it with <code>.stop()</code>)</div>"
        )


def prepare(
    model: Any,
    lenses: Any = (),
    runs: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    products: str = "auto",
    token: bool = True,
    log_level: str = "warning",
) -> tuple[Any, socket.socket, str]:
    """Load the model and lenses, bind the socket: the uvicorn server, its socket and URL.

    ``token``: every request must carry a fresh secret token (the URL's ``?token=``), as in
    Jupyter; ``False`` (``--no-token``, loopback only) says on stderr that anyone on this machine
    can use the server.
    """
    require()
    import uvicorn

    # start-up: starlette, uvicorn and torch load only when a server starts (lensdiv.explore
    # is a public name of `import lensdiv`, which must stay cheap).
    from lensdiv.models.load import load_model  # start-up: torch
    from lensdiv.web.limits import bounded, uvicorn_settings  # start-up: uvicorn
    from lensdiv.web.server import make_app  # start-up: starlette
    from lensdiv.web.session import Session  # start-up: torch

    lenses = [lenses] if isinstance(lenses, str) else list(lenses)
    folder = Path(runs) if runs is not None else None
    if folder is not None and not folder.is_dir():
        raise OptionError(f"--runs {str(folder)!r} is not a folder")
    if not token and host not in LOOPBACK:
        raise OptionError(
            f"--no-token serves a loopback address only, not {host!r}",
            hint="drop --no-token (the printed URL carries the token) or use --host 127.0.0.1",
        )
    sock = bind(host, port)  # before the model loads: a taken port fails at once
    try:
        if isinstance(model, str):
            model = load_model(
                model, device=device, dtype=dtype, trust_remote_code=trust_remote_code
            )
        session = Session(model, lenses, folder, products=products)
    except BaseException:
        sock.close()
        raise
    secret = secrets.token_urlsafe(24) if token else None
    if secret is None:
        print(NO_TOKEN_WARNING, file=sys.stderr)
    app = make_app(session, token=secret)
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", **uvicorn_settings(bounded()))
    server = uvicorn.Server(config)
    return server, sock, url_of(host, sock.getsockname()[1], secret)


def machine_name() -> str:
    """This machine's name as others reach it: its fully qualified name, or its host name where
    that resolves to loopback only (``localhost`` in many containers)."""
    for name in (socket.getfqdn(), socket.gethostname()):
        if name and not name.startswith(("localhost", "127.")) and name not in LOOPBACK:
            return name
    return socket.gethostname() or "localhost"


def url_of(host: str, port: int, token: str | None) -> str:
    """The URL to open: bound to every interface, this machine's name (reachable from
    elsewhere, unlike ``0.0.0.0``); the token in its query."""
    if host in ANY:
        host = machine_name()
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def explore(
    model: Any = "toy",
    lenses: Any = (),
    runs: str | Path | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    products: str = "auto",
    token: bool = True,
    **load: Any,
) -> Explorer:
    """Serve the explore page for ``model`` from a background thread (for notebooks).

    Args:
        model: A loaded ``TransformerBridge`` or a model spec (``"toy"``, a hub name, a folder).
        lenses: Fitted lenses to offer beside the logit lens (``"tuned:PATH"`` ...).
        runs: A folder whose saved runs and studies the page lists.
        host, port: Where to listen (port 0: a free one).
        products: The grid's unembedding products: ``"auto"`` (bfloat16 for the
            vocabulary-wide sums where the hardware has fast bfloat16 and the unembedding is
            large; every number shown re-read in float32), ``"float32"`` (all exact) or
            ``"bf16"`` (:mod:`lensdiv.ops.cells`).
        token: Every request carries a secret token (in :attr:`Explorer.url`, which the inline
            page opens); ``False``: none (loopback only; anyone on this machine can use it).
        load: ``device``, ``dtype``, ``trust_remote_code`` when ``model`` is a spec.

    Returns:
        An :class:`Explorer`: displayed in a notebook it is the page in an iframe; ``.url``;
        ``.stop()`` stops the server.

    Example:
        >>> app = lensdiv.explore("toy")   # doctest: +SKIP
        >>> app                            # the page, inline
        >>> app.stop()
    """
    server, sock, url = prepare(
        model, lenses, runs, host=host, port=port, products=products, token=token, **load
    )
    return start(server, sock, url)


def start(server: Any, sock: socket.socket, url: str) -> Explorer:
    """Run the uvicorn ``server`` on ``sock`` from a daemon thread, once it listens."""
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="lensdiv-explore"
    )
    thread.start()
    deadline = time.time() + 30
    while not server.started and thread.is_alive() and time.time() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        sock.close()
        raise LensdivError(f"the explore server did not start on {url}")
    return Explorer(server, sock, url, thread)
