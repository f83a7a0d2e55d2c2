"""The Feed protocol: a new way to split a run plugs into the runner in a few lines."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, final

import pytest

from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import LensdivError
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec
from lensdiv.run.engine import Engine
from lensdiv.run.feed import Feed, LocalFeed, OnBatch, feed_locally
from lensdiv.run.runner import analyze
from tests.helpers import assert_results_equal, same

# 4 full batches of 2 rows of 16 tokens.
SPEC = DataSpec(seq_len=16, max_tokens=16 * 8, batch_size=2)


@final
class Preview(Feed):
    """A toy feed: only the first ``n`` batches of every pass (a quick look at a long run)."""

    def __init__(self, n: int) -> None:
        self.n = n

    @property
    def finalizes(self) -> bool:
        return True

    def start(self) -> None:
        pass

    def run_pass(self, engine: Engine, index: int, batches: Iterable[Batch],
                 states: Mapping[str, Stats], on_batch: OnBatch | None = None) -> None:
        feed_locally(engine, index, itertools.islice(batches, self.n), states, on_batch)

    def describe(self) -> dict[str, Any]:
        return {"preview": {"batches": self.n}}

    def close(self, manifest: dict[str, Any]) -> None:
        manifest["preview"]["closed"] = True


def test_a_toy_feed_runs_through_the_runner(native_model: Any, tmp_path: Path) -> None:
    run = analyze(native_model, data=SPEC, plugins="lens,contrib", feed=Preview(2),
                  out=tmp_path, progress=False)
    # The first two batches are exactly the first 64 tokens of the same packing.
    first_two = analyze(native_model, data=DataSpec(seq_len=16, max_tokens=16 * 4, batch_size=2),
                        plugins="lens,contrib", progress=False)
    assert run.manifest["timings"]["tokens"] == first_two.manifest["timings"]["tokens"] == 64
    for name in ("lens", "contrib"):  # the same numbers (meta says how much data was asked)
        a, b = run[name], first_two[name]
        assert a.summary == b.summary and list(a.tables) == list(b.tables)
        for table in a.tables:
            assert same(dict(a.tables[table].columns), dict(b.tables[table].columns)), table
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["preview"] == {"batches": 2, "closed": True}
    assert manifest["status"] == "complete"


def test_the_local_feed_is_what_one_process_uses(native_model: Any) -> None:
    by_default = analyze(native_model, data=SPEC, plugins="lens", progress=False)
    local = analyze(native_model, data=SPEC, plugins="lens", feed=LocalFeed(), progress=False)
    assert_results_equal(local["lens"], by_default["lens"])


def test_a_feed_and_a_shard_are_two_ways_to_split_a_run(native_model: Any) -> None:
    with pytest.raises(LensdivError, match="two ways to split one run"):
        analyze(native_model, data=SPEC, plugins="lens", feed=LocalFeed(), shard="0/2",
                progress=False)


def test_feed_declares_every_method_abstract() -> None:
    assert Feed.__abstractmethods__ == {"finalizes", "start", "run_pass", "describe", "close"}
    with pytest.raises(TypeError):
        Feed()  # type: ignore[abstract]
