"""Signals during a run: Ctrl-C (SIGINT) and SIGTERM stop the analysis, never the saving.

Inside :func:`handle_signals` (what :func:`lensdiv.run.runner.analyze` runs in), SIGINT raises
``KeyboardInterrupt`` and SIGTERM (what schedulers and ``timeout`` send) raises
:class:`Terminated`, a ``KeyboardInterrupt`` too, so the runner keeps what is done the same way
for both. Inside :func:`shielded` (finishing results, writing files and the manifest) a signal is
only recorded: the runner finishes what it is writing, sees :func:`signals_received` and stops.
Pressing Ctrl-C twice in quick succession therefore never leaves a half-written file or a
manifest that still says "running". A ``soft`` shield (a pass over the data) defers the first
signal to the end of the batch in hand, so every analyzer's state holds whole batches, and
gives way to a second one.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop like Ctrl-C, keeping what is done (exit code 143)."""

    signum = signal.SIGTERM


@dataclass
class _Signals:
    received: list[int] = field(default_factory=list)
    depth: int = 0  # nesting of shielded() blocks
    soft: int = 0  # how many of them are soft
    soft_from: int = 0  # signals received before the outermost soft shield began


_ACTIVE: _Signals | None = None


def signal_name(signum: int) -> str:
    """``"SIGINT"``, ``"SIGTERM"``."""
    return signal.Signals(signum).name


def exit_code(signum: int) -> int:
    """The shell's code for a process stopped by ``signum``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(signum)


def interruption(signum: int) -> KeyboardInterrupt:
    """The exception a signal stands for."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def signum_of(err: BaseException) -> int:
    """The signal behind an interruption (``KeyboardInterrupt`` without one: SIGINT)."""
    return int(getattr(err, "signum", signal.SIGINT))


def _say(text: str) -> None:
    # os.write: a handler may run while the main thread is inside print(); a buffered write
    # from here could then fail with "reentrant call".
    with suppress(OSError):
        os.write(2, text.encode())


def _handler(signum: int, frame: Any) -> None:
    state = _ACTIVE
    if state is None:  # a stale handler outside a run: behave like Python's default
        raise interruption(signum)
    state.received.append(signum)
    if state.depth == 0:
        raise interruption(signum)
    if state.depth == state.soft:  # only soft shields: the first signal waits for the batch
        if len(state.received) - state.soft_from > 1:
            raise interruption(signum)
        _say(f"\n{signal_name(signum)}: stopping after this batch (again: stop at once)\n")
        return
    if len(state.received) == 1:
        _say(f"\n{signal_name(signum)}: finishing the results and files in hand, then stopping\n")
    else:
        _say("\nstill writing results; stopping as soon as every file is complete\n")


@contextmanager
def handle_signals() -> Iterator[None]:
    """SIGINT and SIGTERM become interruptions inside this block (main thread only; a nested
    block, or one in another thread, leaves the handlers as they are)."""
    global _ACTIVE
    if _ACTIVE is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[signum] = signal.signal(signum, _handler)
        except (ValueError, OSError):  # an embedding that owns its signals
            continue
    _ACTIVE = _Signals()
    try:
        yield
    finally:
        _ACTIVE = None
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def shielded(*, soft: bool = False) -> Iterator[None]:
    """Signals that arrive inside are recorded, not raised (see :func:`signals_received`); in
    a ``soft`` shield (and no strict one), a second signal is raised at once."""
    state = _ACTIVE
    if state is None:
        yield
        return
    if soft and state.soft == 0:
        state.soft_from = len(state.received)
    state.depth += 1
    state.soft += soft
    try:
        yield
    finally:
        state.depth -= 1
        state.soft -= soft


def signals_received() -> list[int]:
    """Signals received so far inside :func:`handle_signals` (in order)."""
    return list(_ACTIVE.received) if _ACTIVE is not None else []
