"""The explore server's bounds on what clients hold: connections, time, file descriptors, log.

uvicorn bounds the rest with its own settings (:func:`uvicorn_settings`): requests in progress
(``limit_concurrency``), idle keep-alive connections (``timeout_keep_alive``), the size of a
request's head (``h11_max_incomplete_event_size``) and the shutdown (``timeout_graceful_shutdown``).
It does not bound a request that never finishes arriving, nor the number of connections it
accepts, so :class:`Bounded` — uvicorn's h11 protocol with two additions — does:

- a *read deadline*: a request's head and body must arrive within :attr:`Limits.read_timeout`
  seconds of its first byte (of the connection, for the first request), or the connection is
  closed (the app, if it was reading the body, sees the client leave);
- a *connection cap*: past :attr:`Limits.max_connections` open connections, the oldest *idle*
  one — no request in progress: its head not complete yet, or kept alive between requests — is
  closed for each new one, so half-open connections cannot exhaust the file descriptors nor
  keep a real request out (a request whose head has arrived is never closed for this).

What they close is logged at most once a minute (:class:`OncePerWindow`, which also quiets
asyncio's and uvicorn's own repeated lines such as "Too many open files"): a warning past the cap,
an info line (not shown by default) for a deadline, which browsers' unused spare connections
reach too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_CONNECTIONS = 512
READ_TIMEOUT = 10.0  # seconds for a request's head and body to arrive
HEAD_BYTES = 16 * 1024  # the most a request's line and headers may take
LOG_WINDOW = 60.0  # seconds between two lines of the same kind
# The listening socket's queue, and how many connections asyncio accepts at a time: a request
# waits behind at most about twice this many (a flood of them included) before it is read.
BACKLOG = 256
QUIETED = ("asyncio", "uvicorn.error", "lensdiv.explore")
log = logging.getLogger("lensdiv.explore")


class OncePerWindow(logging.Filter):
    """A logging filter passing each kind of line (its logger and format) once per ``window``
    seconds; the next one passed says how many like it were dropped."""

    def __init__(self, window: float = LOG_WINDOW) -> None:
        super().__init__()
        self.window = window
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last, dropped = self.seen.get(key, (-float("inf"), 0))
        if now - last < self.window:
            self.seen[key] = (last, dropped + 1)
            return False
        self.seen[key] = (now, 0)
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it in the last {self.window:.0f} s)"
        return True


def quiet_repeats(window: float = LOG_WINDOW) -> None:
    """Put one :class:`OncePerWindow` on each logger of :data:`QUIETED` (idempotent)."""
    for name in QUIETED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OncePerWindow) for f in logger.filters):
            logger.addFilter(OncePerWindow(window))


def raise_fd_limit() -> int:
    """Raise this process' soft limit on open files to its hard limit; the soft limit after."""
    try:
        import resource
    except ImportError:  # not POSIX
        return MAX_CONNECTIONS * 4
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return soft if soft != resource.RLIM_INFINITY else 1 << 16


@dataclass
class Limits:
    """One server's bounds and the bookkeeping :class:`Bounded` shares between connections."""

    max_connections: int = MAX_CONNECTIONS
    read_timeout: float = READ_TIMEOUT
    idle: dict[Any, None] = field(default_factory=dict)  # oldest first
    closed: dict[str, int] = field(default_factory=dict)  # why → how many (for tests, logs)

    def close(self, protocol: Any, why: str, level: int = logging.WARNING) -> None:
        self.closed[why] = self.closed.get(why, 0) + 1
        self.idle.pop(protocol, None)
        protocol.transport.close()
        # One line a minute per reason (OncePerWindow on this logger).
        log.log(level, "explore: closing connections " + why + " (%s so far)", self.closed[why])

    def oldest_idle(self, besides: Any) -> Iterator[Any]:
        return (p for p in self.idle if p is not besides)


class Bounded(H11Protocol):
    """uvicorn's h11 protocol with a read deadline per request and a cap on idle connections
    (made per server by :func:`protocol`, which sets :attr:`limits`)."""

    limits: Limits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's own signature (a Transport), narrower than asyncio's BaseTransport
        self.deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        limits = self.limits
        if len(self.connections) > limits.max_connections:
            victim = next(limits.oldest_idle(self), self)
            why = f"over the cap of {limits.max_connections} (the oldest idle one)"
            limits.close(victim, why)
            if victim is self:
                return
        limits.idle[self] = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # closed by the cap or the deadline: nothing to read
            return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:  # the head of a request, not complete yet
            self._arm()
            return
        self.limits.idle.pop(self, None)  # a request in progress is never closed for the cap
        if state is not h11.SEND_BODY:  # all of it arrived (or the connection ends)
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.limits.idle[self] = None  # kept alive: uvicorn's timeout_keep_alive closes it

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.limits.idle.pop(self, None)
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.deadline is None:
            self.deadline = self.loop.call_later(self.limits.read_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _too_slow(self) -> None:
        self.deadline = None
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            why = f"whose request did not arrive within {self.limits.read_timeout:g} s"
            # INFO: browsers open connections ahead of need and leave some unused
            self.limits.close(self, why, logging.INFO)


def protocol(limits: Limits) -> type[Bounded]:
    """A :class:`Bounded` class of its own for one server's ``limits``."""
    return type("Bounded", (Bounded,), {"limits": limits})


def uvicorn_settings(limits: Limits) -> dict[str, Any]:
    """The keyword arguments of ``uvicorn.Config`` that bound the server with ``limits``."""
    return {
        "http": protocol(limits),
        # requests in progress: past it uvicorn answers 503 (connections stay below it)
        "limit_concurrency": 2 * limits.max_connections,
        "timeout_keep_alive": 5,
        "h11_max_incomplete_event_size": HEAD_BYTES,
        "timeout_graceful_shutdown": 2,
        "backlog": BACKLOG,
    }


def bounded(max_connections: int = MAX_CONNECTIONS, read_timeout: float = READ_TIMEOUT) -> Limits:
    """The limits of one server: the file descriptors raised as far as allowed, the cap kept
    under a quarter of them, repeated log lines quieted."""
    fds = raise_fd_limit()
    quiet_repeats()
    return Limits(max_connections=max(8, min(max_connections, fds // 4)), read_timeout=read_timeout)
