"""Analyzer state: sums, maxima and minima merge into the state of the union of the shards."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from lensdiv.core.stats import Stats

# -- sums, maxima and minima (the original tests) ------------------------------------------------


def _fill(stats: Stats, items: list[torch.Tensor]) -> Stats:
    for x in items:
        stats.add("sum", x)
        stats.add("count", 1)
        stats.max("max", x)
        stats.min("min", x)
    return stats


def _snapshot(stats: Stats) -> dict[str, dict[str, torch.Tensor]]:
    return {kind: {k: v.clone() for k, v in store.items()} for kind, store in
            stats.state_dict().items()}


def _assert_state_equal(a: dict[str, Any], b: dict[str, Any], **tol: float) -> None:
    assert a.keys() == b.keys()
    for kind in a:
        assert a[kind].keys() == b[kind].keys(), kind
        for key in a[kind]:
            torch.testing.assert_close(a[kind][key], b[kind][key], **tol)


@pytest.fixture
def shards() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    data = [torch.randn(3, 4, generator=gen) * 10 for _ in range(7)]
    return data[:3], data[3:]


def test_stats_merge_equals_concatenated_data(shards: tuple[list, list]) -> None:
    first, second = shards
    merged = _fill(Stats(), first).merge(_fill(Stats(), second))
    whole = torch.stack(first + second).double()
    torch.testing.assert_close(merged["sum"], whole.sum(0), rtol=1e-12, atol=1e-12)
    assert merged["max"].equal(whole.amax(0))
    assert merged["min"].equal(whole.amin(0))
    assert float(merged["count"]) == len(first) + len(second)
    _assert_state_equal(merged.state_dict(), _fill(Stats(), first + second).state_dict(),
                        rtol=1e-12, atol=1e-12)


def test_stats_merge_keeps_keys_of_one_shard_and_mutates_nothing(shards: tuple) -> None:
    first, second = shards
    a, b = _fill(Stats(), first), _fill(Stats(), second)
    a.add("only_a", torch.ones(2))
    b.max("only_b", torch.full((2,), 5.0))
    before_a, before_b = _snapshot(a), _snapshot(b)
    merged = a.merge(b)
    _assert_state_equal(a.state_dict(), before_a, rtol=0, atol=0)
    _assert_state_equal(b.state_dict(), before_b, rtol=0, atol=0)
    assert merged["only_a"].equal(a["only_a"]) and merged["only_b"].equal(b["only_b"])
    # The merged state owns its tensors: updating it leaves both inputs alone.
    for name in ("only_a", "sum"):
        merged.add(name, torch.ones_like(merged[name]))
    merged.max("only_b", torch.full((2,), 50.0))
    _assert_state_equal(a.state_dict(), before_a, rtol=0, atol=0)
    _assert_state_equal(b.state_dict(), before_b, rtol=0, atol=0)


def test_stats_merge_with_empty_is_identity(shards: tuple) -> None:
    a = _fill(Stats(), shards[0])
    assert Stats().empty and not a.empty
    for merged in (a.merge(Stats()), Stats().merge(a)):
        _assert_state_equal(merged.state_dict(), a.state_dict(), rtol=0, atol=0)


def test_stats_state_dict_round_trip(shards: tuple) -> None:
    a = _fill(Stats(), shards[0])
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    loaded = Stats.from_state_dict(torch.load(buffer))
    _assert_state_equal(loaded.state_dict(), a.state_dict(), rtol=0, atol=0)
    assert loaded["sum"].dtype == torch.float64
    assert "sum" in loaded and "nothing" not in loaded and loaded.get("nothing", 7) == 7
    # A reloaded shard still merges like the original.
    b = _fill(Stats(), shards[1])
    _assert_state_equal(loaded.merge(b).state_dict(), a.merge(b).state_dict(), rtol=0, atol=0)

