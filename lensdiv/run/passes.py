"""A group's passes: every batch of each pass fed through the run's feed, with a progress bar
over tokens whose total the data corrects once its end is known (what :mod:`lensdiv.run.runner`
runs for each group before it finalizes)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import ExitStack
from typing import Any

from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import LensdivError, OptionError
from lensdiv.core.progress import progress_bar
from lensdiv.run.engine import Engine, describe
from lensdiv.run.feed import Feed, LocalFeed, take_step
from lensdiv.run.interrupts import shielded

# The batches of a group, told whom to call with their real tokens once the data is known to end.
Reader = Callable[[Callable[[int], None]], Iterable[Batch]]


def own_batches(batches: list[Batch], on_end: Callable[[int], None]) -> Iterator[Batch]:
    """An analyzer's own examples (their tokens are known: ``on_end`` has nothing to add)."""
    return iter(batches)


class Tally:
    """A pass's progress bar over tokens. Its total is the most tokens the data can hold until
    the data's reader reaches their end and says how many there are (:meth:`ended`, on the
    reader's thread); the bar takes them at the next batch. Only a :class:`LocalFeed` feeds
    every batch in this process: a shard or a rank counts its share, its total set at the end."""

    def __init__(self, bar: Any, task: Any, feed: Feed, per_row: int = 0) -> None:
        self.bar, self.task = bar, task
        self.every = isinstance(feed, LocalFeed)
        self.counted = 0
        self.total: int | None = None
        self.per_row = per_row  # interventions per sequence (the bar's ``interventions`` field)
        self.interventions = 0

    def ended(self, tokens: int) -> None:
        self.total = tokens

    def advance(self, batch: Batch) -> None:
        self.counted += batch.n_tokens
        known: dict[str, Any] = (
            {"total": self.total} if self.total is not None and self.every else {}
        )
        if self.per_row:
            self.interventions += self.per_row * int(batch.tokens.shape[0])
            known["interventions"] = self.interventions
        self.bar.update(self.task, advance=batch.n_tokens, **known)

    def done(self) -> None:
        """The pass ended without an error: this process read all its data."""
        if self.total is not None or not self.every:
            self.bar.update(self.task, total=self.counted)


def feed_passes(
    engine: Engine, batches: Reader, total: int, progress: bool, feed: Feed
) -> tuple[dict[str, Any], BaseException | None]:
    """Feed a group's every pass through ``feed`` (a training's passes take the next steps of
    one stream), a progress bar over the tokens of each.

    Returns the states and what stopped the passes early (Ctrl-C, SIGTERM, bad data met
    mid-way, memory), if anything; the states then hold whole batches.
    """
    import torch

    stopped: BaseException | None = None
    n_passes = engine.n_passes
    states: dict[str, Any] = {}
    onward = engine.pass_tokens is not None  # a training: one stream, cut into steps
    shared: Iterable[Batch] | None = None
    try:
        # Ctrl-C and SIGTERM take effect between batches (a second one at once), so every
        # state holds whole batches: a signal is recorded, and the feed stops the pass at the
        # next batch (a process group's ranks agree first, so a signal that reaches one rank
        # while it prepares a pass and another while it feeds stops both at the same round).
        with shielded(soft=True), ExitStack() as stack:
            # A training's stream and its one progress bar outlive its passes (closed here).
            def close_shared() -> None:
                if isinstance(shared, Generator):
                    shared.close()

            stack.callback(close_shared)
            states = engine.init()
            for index in range(n_passes):
                members = engine.begin_pass(index, states)
                if not members:
                    break
                if onward:
                    if shared is None:
                        bar = stack.enter_context(
                            progress_of(progress, ", ".join(a.name for a in members))
                        )
                        steps = Tally(bar, bar.add_task("training", total=total), feed)
                        shared = batches(steps.ended)
                    assert engine.pass_tokens is not None
                    part = take_step(shared, engine.pass_tokens)
                    feed.run_pass(engine, index, part, states, steps.advance)
                    continue
                label = ", ".join(a.name for a in members)
                if n_passes > 1:
                    label += f" (pass {index + 1}/{n_passes})"
                per_row = sum(a.interventions(engine.info, index) for a in members)
                detail = ""
                if per_row:  # interventional analyzers: how many, besides the tokens
                    detail = (
                        f" {per_row:,} interventions/sequence, "
                        "{task.fields[interventions]:,} done"
                    )
                with progress_of(progress, label, detail) as bar:
                    task = bar.add_task("analyzing", total=total, interventions=0)
                    tally = Tally(bar, task, feed, per_row)
                    stream = batches(tally.ended)
                    try:
                        feed.run_pass(engine, index, stream, states, tally.advance)
                    finally:  # a pass stopped early: the data's reader thread stops too
                        if isinstance(stream, Generator):
                            stream.close()
                    tally.done()
    except (KeyboardInterrupt, LensdivError) as err:
        stopped = err
    except (MemoryError, torch.cuda.OutOfMemoryError) as err:
        stopped = OptionError(
            f"out of memory in the forward pass ({describe(err)[:120]})",
            hint="lower --batch-size or --seq-len, or use a smaller --dtype",
        )
    return states, stopped


def progress_of(enabled: bool, label: str, detail: str = "") -> Any:
    """A progress bar over tokens, with tokens/s; ``detail`` follows the bold label (it may
    read the task's fields: ``{task.fields[interventions]:,}``)."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class SpeedColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} tok/s" if speed else "… tok/s", style="cyan")

    return progress_bar(f"[bold]{label}[/bold]{detail}", "tokens", SpeedColumn(), enabled=enabled)
