"""Headless Chromium driven over its DevTools protocol, for tests of the HTML lensdiv writes.

Debian's ``chromium`` package (``.ci/run`` installs it) runs headless with a fresh profile; the
protocol, on a port bound to 127.0.0.1 only, reports console errors, uncaught exceptions and
every request the page makes, evaluates JavaScript, hovers and takes screenshots.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

# Everything that could reach out or stall on a refused connection is off.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
)


def find_chromium() -> str | None:
    """The Chromium executable: ``$LENSDIV_CHROMIUM``, else ``chromium`` on the PATH."""
    given = os.environ.get("LENSDIV_CHROMIUM")
    if given:
        return given
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium page. Use as a context manager; :meth:`open` a file, then read
    :attr:`errors` (console errors and uncaught exceptions) and :attr:`requests` (URLs asked for).
    """

    def __init__(self, executable: str, width: int = 1400, height: int = 900) -> None:
        import websocket  # test dependency (pyproject's dev extra)

        self.profile = tempfile.mkdtemp(prefix="lensdiv-chromium-")
        self.proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = self._port()
        page = self._page(port)
        self.ws = websocket.create_connection(page, timeout=60, suppress_origin=True)
        self._id = 0
        self.errors: list[str] = []
        self.requests: list[str] = []
        self._events: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)

    # -- protocol ------------------------------------------------------------------------------
    def _port(self) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + 30
        while time.time() < deadline:
            if marker.is_file() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}")
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its DevTools port in 30 s")

    @staticmethod
    def _page(port: int) -> str:
        deadline = time.time() + 30
        while time.time() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            if pages:
                return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.1)
        raise RuntimeError("chromium has no page to drive")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events meanwhile are recorded)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))
            self._record(message)

    def _record(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        self._events.append(message)
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append("exception: " + str(
                details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            texts = [str(a.get("value", a.get("description", ""))) for a in params.get("args", [])]
            self.errors.append("console." + params["type"] + ": " + " ".join(texts))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.errors.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            self.requests.append(str(params.get("request", {}).get("url", "")))

    def _wait_for(self, method: str, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(e.get("method") == method for e in self._events):
                return
            self.ws.settimeout(max(deadline - time.time(), 0.1))
            self._record(json.loads(self.ws.recv()))
        raise TimeoutError(f"no {method} within {timeout} s")

    # -- what tests use ------------------------------------------------------------------------
    def open(self, path: Path | str) -> None:
        """Load a local file (or a URL, given as a string) and wait until it (and everything it
        loads) is there; errors and requests are counted afresh."""
        self._events.clear()
        self.errors.clear()
        self.requests.clear()
        url = path if isinstance(path, str) else path.resolve().as_uri()
        self.call("Page.navigate", url=url)
        self._wait_for("Page.loadEventFired")
        self.evaluate("new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited if it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def hover(self, selector: str) -> None:
        """Move the mouse over the middle of the first element matching ``selector``."""
        box = self.evaluate(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)});"
            " e.scrollIntoView({block: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=box[0], y=box[1])

    def screenshot(self, path: Path, *, full_page: bool = False) -> Path:
        """A PNG of the viewport (or of the whole page)."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.evaluate("[document.documentElement.scrollWidth,"
                                 " document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1})
        data = self.call("Page.captureScreenshot", **params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
