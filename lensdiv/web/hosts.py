"""The host names a loopback server answers: what ``serve`` binds to without a token and what
``server`` accepts in a request's ``Host`` header (a DNS-rebinding page names another host)."""

from __future__ import annotations

LOOPBACK = ("127.0.0.1", "localhost", "::1")
