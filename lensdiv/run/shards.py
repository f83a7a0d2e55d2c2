"""Shards without a launcher: ``--shard i/n`` runs one share of the batches and saves the
analyzers' mergeable states; :func:`lensdiv.run.merge.merge_runs` (``lensdiv merge``) combines
the shards and finalizes, so a cluster job array (SLURM ``--array``, Kubernetes indexed jobs)
scales a run with no coordination between its jobs.

A shard reads the same data as the whole run (packing is sequential) and runs batch ``j`` when
``j mod n == i``. It writes ``manifest.json`` (model facts included, so the merge needs no
model) and, per analyzer, ``<analyzer>/state.safetensors`` + ``state.json`` (:meth:`Stats.save`,
no pickle); it finalizes nothing.

Multi-pass analyzers (``linmap``, ``patch``, ``submod``) are refused with ``--shard``: their
second pass needs the merged result of the first (a fit) in every shard, which is a second job
array per pass and a merge between each. ``torchrun`` does exactly that exchange with
collectives, so they run there (:mod:`lensdiv.run.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, final

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.errors import LensdivError
from lensdiv.core.stats import Stats
from lensdiv.run.engine import Engine
from lensdiv.run.feed import Feed, OnBatch, every_nth, feed_locally


def parse_shard(shard: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"3/16"`` (or ``(3, 16)``) → ``(3, 16)``: shard 3 of 16, counted from 0.

    Raises:
        LensdivError: Not ``I/N`` with ``0 ≤ I < N``.
    """
    if shard is None:
        return None
    if isinstance(shard, str):
        first, slash, second = shard.partition("/")
        if not slash or not first.strip().isdigit() or not second.strip().isdigit():
            raise LensdivError(
                f"bad shard {shard!r}", hint="write --shard I/N, e.g. --shard 3/16 (I from 0)"
            )
        index, count = int(first), int(second)
    else:
        index, count = int(shard[0]), int(shard[1])
    if count < 1 or not 0 <= index < count:
        raise LensdivError(
            f"shard {index}/{count} does not exist",
            hint=f"shards of {count} are numbered 0..{count - 1}" if count > 0 else "N must be > 0",
        )
    return index, count


def check_shardable(analyzers: Iterable[Analyzer], info: ModelInfo) -> None:
    """Refuse analyzers that need more than one pass (see the module docstring).

    Raises:
        LensdivError: One line naming the analyzer and pointing to ``torchrun``.
    """
    for a in analyzers:
        passes = a.n_passes(info)
        if a.pass_tokens(info) is not None:  # a training: each step needs the one before
            raise LensdivError(
                f"analyzer {a.name!r} trains, one pass per step, and each step needs the "
                "merged gradient of all the data before it, which shards cannot share",
                hint="train it under torchrun instead: torchrun --nproc-per-node N -m lensdiv ...",
            )
        if passes > 1:
            raise LensdivError(
                f"analyzer {a.name!r} needs {passes} passes over the data, and each pass needs "
                "the merged states of the one before, which shards without a launcher cannot "
                "share",
                hint="run it under torchrun instead: torchrun --nproc-per-node N -m lensdiv "
                "analyze ... (or leave it out of the sharded run)",
            )


@final
class ShardFeed(Feed):
    """Shard ``index`` of ``count``: its share of the batches; the states saved, not finalized.

    Args:
        index, count: Which shard.
        out: The run's folder (states go to ``out/<analyzer>/``); ``None`` saves nothing.
        entries: The manifest's analyzer entries (each says where its state is once saved).
    """

    def __init__(
        self, index: int, count: int, out: Path | None, entries: dict[str, dict[str, Any]]
    ) -> None:
        self.index, self.count = index, count
        self.out = out
        self.entries = entries

    @property
    def finalizes(self) -> bool:
        """A shard only saves its states: ``lensdiv merge`` finalizes."""
        return False

    def start(self) -> None:
        """Nothing to wait for: shards run on their own."""

    def run_pass(
        self,
        engine: Engine,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: OnBatch | None = None,
    ) -> None:
        """This shard's batches, then every state saved (a failed save fails its analyzer)."""
        feed_locally(engine, index, every_nth(batches, self.index, self.count), states, on_batch)
        for a in engine.active:
            if self.out is not None:
                try:
                    states[a.name].save(self.out / a.name)
                except (OSError, LensdivError) as err:
                    engine.fail(a, err, "saving the state")
                    continue
            self.entries[a.name].update(status="saved", state=a.name)

    def describe(self) -> dict[str, Any]:
        return {"shard": {"index": self.index, "count": self.count}}

    def close(self, manifest: dict[str, Any]) -> None:
        """Nothing to add: each state's entry was written when it was saved."""
