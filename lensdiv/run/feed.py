"""How a run's batches reach its engine: the :class:`Feed` protocol, and the one-process feed.

A run is one :class:`~lensdiv.run.engine.Engine` fed pass by pass. What differs between one
process, the ranks of a ``torchrun`` group and the shards of a job array is only *which*
batches this process feeds and *what becomes of the states* after each pass; a feed is that
choice, and the runner asks it instead of branching on it:

==========================================  ==============================  ======================
feed                                        this process feeds              after each pass
==========================================  ==============================  ======================
:class:`LocalFeed` (one process)            every batch                     nothing
:class:`~lensdiv.run.distributed.DataParallelFeed`  batch ``i`` if ``i mod world == rank``, in lock-step rounds  states all-reduced
:class:`~lensdiv.run.shards.ShardFeed`      batch ``j`` if ``j mod n == i``  states saved for ``lensdiv merge``
==========================================  ==============================  ======================

A feed also decides how a run stops early: a local feed stops between two batches when Ctrl-C
or SIGTERM arrives; the ranks of a group agree first, so that they all stop at the same round.

To add a way to split a run (one model of a study, the prompts of a lens fit, ...): subclass
:class:`Feed`, implement its five methods — usually :meth:`Feed.run_pass` through
:func:`feed_locally` over this process's share — and mark the class ``@final``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, final

from lensdiv.core.analyzer import Batch
from lensdiv.core.stats import Stats
from lensdiv.run.engine import Engine
from lensdiv.run.interrupts import interruption, signals_received

OnBatch = Callable[[Batch], None]


class Feed(abc.ABC):
    """How one run's batches reach its engine and what becomes of the states after each pass.

    Every method is abstract: a feed says everything about how it splits a run.
    """

    @property
    @abc.abstractmethod
    def finalizes(self) -> bool:
        """Whether this process finalizes the analyzers and writes their results."""

    @abc.abstractmethod
    def start(self) -> None:
        """Once this process has its model, before the run's manifest is written: the
        processes of a group wait here for each other, so a run that has a manifest has every
        process ready to feed."""

    @abc.abstractmethod
    def run_pass(
        self,
        engine: Engine,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: OnBatch | None = None,
    ) -> None:
        """Feed pass ``index`` of this process's share of ``batches`` into ``states``, then
        settle the states (reduce them, save them, or nothing).

        ``on_batch`` is called for every batch of the run that is done (progress), also those
        another process ran. A signal (Ctrl-C, SIGTERM) stops the pass between two batches by
        raising the interruption it stands for, after the states are settled.
        """

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the manifest records of how the work is split (``{}`` for nothing)."""

    @abc.abstractmethod
    def close(self, manifest: dict[str, Any]) -> None:
        """After the last group of analyzers: complete the manifest (per-process timings)."""


def feed_locally(
    engine: Engine,
    index: int,
    batches: Iterable[Batch],
    states: Mapping[str, Stats],
    on_batch: OnBatch | None = None,
) -> None:
    """Pass ``index`` over ``batches`` in this process alone; a signal received during the run
    (the runner records them: :func:`~lensdiv.run.interrupts.signals_received`) stops it after
    the batch in hand (``KeyboardInterrupt`` or :class:`~lensdiv.run.interrupts.Terminated`)."""

    def stop_if_signalled() -> None:
        if signals_received():
            raise interruption(signals_received()[0])

    def after(batch: Batch) -> None:
        if on_batch is not None:
            on_batch(batch)
        stop_if_signalled()

    stop_if_signalled()  # arrived while the pass was being prepared
    engine.feed(index, batches, states, on_batch=after)
    stop_if_signalled()  # arrived after the last batch


def every_nth(batches: Iterable[Batch], index: int, count: int) -> Iterator[Batch]:
    """Batch ``j`` of the stream when ``j mod count == index``."""
    for position, batch in enumerate(batches):
        if position % count == index:
            yield batch


def take_step(stream: Iterable[Batch], tokens: int) -> Iterator[Batch]:
    """The next whole batches of ``stream`` until they hold ``tokens`` real tokens (fewer, or
    none, when the stream ends first): the pass of an analyzer whose passes read the data
    onward, one training step (:meth:`~lensdiv.core.analyzer.Analyzer.pass_tokens`). Reads no
    batch beyond the step, so the next call goes on where this one stopped."""
    source, seen = iter(stream), 0
    while seen < tokens:
        batch = next(source, None)
        if batch is None:
            return
        seen += batch.n_tokens
        yield batch


@final
class LocalFeed(Feed):
    """One process feeds every batch; the states finalize here."""

    @property
    def finalizes(self) -> bool:
        return True

    def start(self) -> None:
        """Nothing to wait for."""

    def run_pass(
        self,
        engine: Engine,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: OnBatch | None = None,
    ) -> None:
        feed_locally(engine, index, batches, states, on_batch)

    def describe(self) -> dict[str, Any]:
        return {}

    def close(self, manifest: dict[str, Any]) -> None:
        """Nothing to add."""
