"""One kind of progress report for everything slow lensdiv does (analysis passes, toy training,
model families, teacher–student training): a live bar in a terminal, log lines elsewhere.

Progress goes to standard error, like every progress bar, so results on standard output stay
clean when piped. Where standard error is not a terminal (a log file, a pipe, CI), a bar would
draw nothing until the end; :class:`LineProgress` then writes one plain line at every tenth of the
work and at least every 30 seconds.
"""

from __future__ import annotations

import io
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

# A line at least every tenth of the work and every INTERVAL seconds (whichever comes first).
STEP = 0.1
INTERVAL = 30.0


def progress_bar(title: str, unit: str, *extra: Any, enabled: bool = True) -> Any:
    """A progress display: title, bar, done/total, ``unit``, ``extra`` columns, time elapsed.

    Column texts may use the task's fields (``{task.fields[loss]:.3f}``). In a terminal this is a
    rich ``Progress``; where standard error is not a terminal it is a :class:`LineProgress` with
    the same methods (``add_task``, ``update``, ``advance``, used as a context manager). In a
    notebook without ``ipywidgets`` rich would warn and draw nothing; the bar is then printed as
    text once.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if enabled and not console.is_jupyter and not console.is_terminal:
        return LineProgress(title, unit)
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


@dataclass
class _Task:
    """What a line reports about one task (``fields`` as in rich's ``Task.fields``)."""

    description: str
    total: int | float | None
    completed: int | float = 0.0
    fields: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    shown_step: int = 0  # tenths of the work already reported
    shown_at: float = 0.0
    shown_done: int | float = -1.0


class LineProgress:
    """Progress as plain log lines: one at every tenth of the work and at least every 30 s.

    A line reads ``analyzing lens, contrib: 4,096/16,384 tokens (25%), 1,234 tokens/s, 3s``.

    Args:
        title: What is running (rich markup and ``{task.fields[...]}`` allowed; printed plain).
        unit: Unit of the counts (may hold ``{task.fields[...]}`` too).
        stream: Where lines go (default: standard error).
        clock: Seconds, monotonic (tests pass a fake one).
        step: Report every ``step`` of the total (0.1 = every 10 %).
        interval: Report at least every ``interval`` seconds.
    """

    def __init__(
        self,
        title: str,
        unit: str,
        *,
        stream: io.TextIOBase | None = None,
        clock: Callable[[], float] = time.monotonic,
        step: float = STEP,
        interval: float = INTERVAL,
    ) -> None:
        self.title = title
        self.unit = unit
        self.stream = stream
        self.clock = clock
        self.step = step
        self.interval = interval
        self.tasks: list[_Task] = []

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, *exc: Any) -> None:
        for index, task in enumerate(self.tasks):
            if task.completed != task.shown_done:
                self._line(index, self.clock())

    def add_task(self, description: str, total: int | float | None = None, **fields: Any) -> int:
        """Start a task; returns its id for :meth:`update`."""
        now = self.clock()
        self.tasks.append(_Task(description, total, fields=dict(fields), started=now, shown_at=now))
        return len(self.tasks) - 1

    def update(
        self,
        task_id: int,
        *,
        advance: int | float | None = None,
        completed: int | float | None = None,
        total: int | float | None = None,
        **fields: Any,
    ) -> None:
        """Move a task on (as rich's ``Progress.update``) and write a line when one is due."""
        task = self.tasks[task_id]
        if total is not None:
            task.total = total
        if completed is not None:
            task.completed = completed
        if advance is not None:
            task.completed += advance
        task.fields.update(fields)
        now = self.clock()
        tenths = self._tenths(task)
        if tenths > task.shown_step or now - task.shown_at >= self.interval:
            self._line(task_id, now)

    def advance(self, task_id: int, advance: int | float = 1) -> None:
        """Move a task on by ``advance``."""
        self.update(task_id, advance=advance)

    def _tenths(self, task: _Task) -> int:
        if not task.total:
            return 0
        return int(min(task.completed / task.total, 1.0) / self.step + 1e-9)

    def _line(self, task_id: int, now: float) -> None:
        task = self.tasks[task_id]
        task.shown_step, task.shown_at, task.shown_done = self._tenths(task), now, task.completed
        title, unit = self._plain(self.title, task), self._plain(self.unit, task)
        unit_name = unit.split()[0] if unit.split() else "items"
        count = f"{_number(task.completed)}"
        if task.total:
            count += f"/{_number(task.total)}"
        text = f"{title}: {count} {unit}".rstrip()
        if task.total:
            text += f" ({task.completed / task.total:.0%})"
        elapsed = max(now - task.started, 0.0)
        if elapsed > 0 and task.completed:
            text += f", {task.completed / elapsed:,.0f} {unit_name}/s"
        text += f", {_duration(elapsed)}"
        stream = self.stream if self.stream is not None else sys.stderr
        print(text, file=stream, flush=True)

    @staticmethod
    def _plain(template: str, task: _Task) -> str:
        from rich.text import Text

        try:
            text = template.format(task=task)
        except (KeyError, IndexError, ValueError, AttributeError):
            text = template
        return " ".join(Text.from_markup(text).plain.split())


def _number(value: int | float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


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


def note(message: str) -> None:
    """One line about slow work to come (a cost estimate) on standard error, where progress
    shows (:func:`progress_shown`); nothing under ``--no-progress``."""
    if not progress_shown():
        return
    from rich.console import Console

    Console(stderr=True).print(message, highlight=False, soft_wrap=True, markup=False)
