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

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.errors import LensdivError
from lensdiv.core.stats import Stats
from lensdiv.run.distributed import Feed
from lensdiv.run.engine import Engine


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
        if passes > 1:
            raise LensdivError(
                f"analyzer {a.name!r} needs {passes} passes over the data, and each pass needs "
                "the merged states of the one before, which shards without a launcher cannot "
                "share",
                hint="run it under torchrun instead: torchrun --nproc-per-node N -m lensdiv "
                "analyze ... (or leave it out of the sharded run)",
            )


def shard_batches(batches: Iterable[Batch], index: int, count: int) -> Iterator[Batch]:
    """Batch ``j`` of the stream when ``j mod count == index``."""
    for position, batch in enumerate(batches):
        if position % count == index:
            yield batch


class ShardFeed(Feed):
    """Shard ``index`` of ``count``: its share of the batches; the states saved, not finalized.

    Args:
        index, count: Which shard.
        out: The run's folder (states go to ``out/<analyzer>/``); ``None`` saves nothing.
        manifest: The run's manifest (each analyzer's entry says where its state is).
    """

    finalizes = False

    def __init__(self, index: int, count: int, out: Path | None, manifest: dict[str, Any]) -> None:
        self.index, self.count = index, count
        self.out = out
        self.entries = manifest["analyzers"]

    def share(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        """This shard's batches."""
        return shard_batches(batches, self.index, self.count)

    def settle(self, engine: Engine, states: Mapping[str, Stats]) -> None:
        """Save every state (a failed save fails its analyzer)."""
        for a in list(engine.active):
            if self.out is not None:
                try:
                    states[a.name].save(self.out / a.name)
                except (OSError, LensdivError) as err:
                    engine.fail(a, err, "saving the state")
                    continue
            self.entries[a.name].update(status="saved", state=a.name)

    def manifest(self) -> dict[str, Any]:
        return {"shard": {"index": self.index, "count": self.count}}
