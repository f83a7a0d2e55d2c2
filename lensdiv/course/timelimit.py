"""The time limit of a check: a student's function stopped after a number of seconds, in a
script, a Jupyter kernel's main thread (``SIGALRM``) or any other thread (a daemon thread sent
the exception), so that an accidentally quadratic answer does not hang the cell."""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from collections.abc import Callable
from typing import Any


class TimeLimit(BaseException):
    """The student's function ran past the check's time limit (a ``BaseException``, so that a
    student's ``except Exception`` does not swallow it)."""


def limited(work: Callable[[], Any], seconds: float) -> Any:
    """``work()``, stopped by :class:`TimeLimit` after ``seconds``.

    In the main thread (a script; a Jupyter kernel runs its cells there) by ``SIGALRM``: the
    work is interrupted at its next Python line (a native call, one big matmul, finishes
    first); a timer already set (by a test runner) is restored with the time it has left.
    Elsewhere (another thread, Windows) the work runs in a daemon thread that is sent the
    exception on timeout, so it ends at its next Python line and never outlives the process.
    """
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _with_alarm(work, seconds)
    return _with_thread(work, seconds)


def _with_alarm(work: Callable[[], Any], seconds: float) -> Any:
    def ring(signum: int, frame: Any) -> None:
        raise TimeLimit(f"past {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, ring)
    left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        return work()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left > 0:  # someone else's timer: what it had left
            remaining = max(left - (time.monotonic() - started), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, interval)


def _with_thread(work: Callable[[], Any], seconds: float) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = work()
        except BaseException as err:  # handed to the caller, TimeLimit included
            box["error"] = err

    worker = threading.Thread(target=run, name="lensdiv-course-check", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        ident = worker.ident
        if ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(TimeLimit)
            )
        worker.join(1.0)
        raise TimeLimit(f"past {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
