"""One kind of progress bar for everything slow lensdiv does (analysis passes, toy training,
model families, teacher–student training)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any


def progress_bar(title: str, unit: str, *extra: Any, enabled: bool = True) -> Any:
    """A rich ``Progress``: title, bar, done/total, ``unit``, ``extra`` columns, time elapsed.

    Column texts may use the task's fields (``{task.fields[loss]:.3f}``). In a notebook without
    ``ipywidgets`` rich would warn and draw nothing; the bar is then printed as text once.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if console.is_jupyter and not _has_ipywidgets():
        console = Console(force_jupyter=False, force_terminal=False)
    return Progress(
        TextColumn(title),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        *extra,
        TimeElapsedColumn(),
        console=console,
        disable=not enabled,
    )


def _has_ipywidgets() -> bool:
    from importlib.util import find_spec

    return find_spec("ipywidgets") is not None


# Whether bars may show at all: `--no-progress` (``progress=False``) turns off every bar of the
# run, also those of work an analyzer starts itself (loading a reference model, training a toy).
_SHOWN: ContextVar[bool] = ContextVar("lensdiv_progress_shown", default=True)


def progress_shown() -> bool:
    """False inside :func:`progress_allowed` ``(False)``: callers then draw no bar."""
    return _SHOWN.get()


@contextmanager
def progress_allowed(enabled: bool) -> Iterator[None]:
    """Within this block, bars show only if ``enabled`` (and the surrounding block allows)."""
    token = _SHOWN.set(_SHOWN.get() and enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)
