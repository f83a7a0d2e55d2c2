"""Analyzer state: every kind's merge rule, passes (freeze), copies, and the state on disk.

Merges are checked against the rule computed independently (``a + b``, ``torch.maximum``, set
union, rows by key) and for the algebra the runner relies on: the empty state is the identity,
order does not matter, inputs are never modified.
"""

from __future__ import annotations

import copy
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lensdiv.core.errors import StateError
from lensdiv.core.stats import MERGE_KINDS, STATE_FILE, TENSOR_FILE, Stats, merge_all
from tests.helpers import same

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



# -- helpers for every kind ------------------------------------------------------------------------


def _every_kind(seed: int, keys: range) -> Stats:
    """A shard holding every kind of entry; ``keys`` are the examples it saw."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, generator=gen)
    state = Stats()
    state.add("sum", x)
    state.add("count", len(keys))
    state.max("max", x)
    state.min("min", x)
    state.fix("map", torch.arange(6.0).reshape(2, 3))  # a fit every shard agrees on
    state.fix("setting", {"top_k": 5, "layers": (0, 1)})
    state.include("grades", *(str(k % 3) for k in keys))
    for k in keys:
        state.append("per_example", k, {"key": k, "value": float(x[0, k % 4])})
    return state


def _assert_same_state(a: Stats, b: Stats) -> None:
    """Exactly equal: names, kinds, values (dtype and device too; NaN equals NaN), frozen names."""
    assert a.names() == b.names()
    assert a.frozen == b.frozen
    for name in a.names():
        assert a.kind(name) == b.kind(name), name
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), name
            torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=name)
        else:
            assert same(x, y), name


WRITERS: dict[str, Callable[[Stats, str], None]] = {
    "sum": lambda s, name: s.add(name, torch.ones(3, 4)),
    "max": lambda s, name: s.max(name, torch.ones(3, 4)),
    "min": lambda s, name: s.min(name, torch.ones(3, 4)),
    "fixed": lambda s, name: s.fix(name, "another value"),
    "set": lambda s, name: s.include(name, "another"),
    "rows": lambda s, name: s.append(name, 99, {"another": True}),
}
assert set(WRITERS) == set(MERGE_KINDS)


# -- each kind's merge rule ------------------------------------------------------------------------


def test_sum_max_min_merge_elementwise() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(1, range(3, 5))
    merged = a.merge(b)
    assert torch.equal(merged["sum"], a["sum"] + b["sum"])
    assert float(merged["count"]) == 5
    assert torch.equal(merged["max"], torch.maximum(a["max"], b["max"]))
    assert torch.equal(merged["min"], torch.minimum(a["min"], b["min"]))
    assert not torch.equal(merged["max"], a["max"]) and not torch.equal(merged["max"], b["max"])
    assert {merged[k].dtype for k in ("sum", "count", "max", "min")} == {torch.float64}


def test_fixed_values_that_agree_are_kept() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(1, range(3, 5))
    merged = a.merge(b)
    assert torch.equal(merged["map"], torch.arange(6.0).reshape(2, 3))
    assert merged["setting"] == {"top_k": 5, "layers": [0, 1]}  # JSON data: tuples are lists
    # Tensors agree up to the float64 round-off of the same computation.
    x, y = Stats(), Stats()
    x.fix("w", torch.tensor([0.1 + 0.2], dtype=torch.float64))
    y.fix("w", torch.tensor([0.3], dtype=torch.float64))
    assert x.merge(y)["w"].item() == 0.1 + 0.2


@pytest.mark.parametrize(
    "mine, theirs",
    [
        (torch.eye(2), 2 * torch.eye(2)),
        (torch.eye(2), torch.eye(3)),
        (torch.eye(2), [[1.0, 0.0], [0.0, 1.0]]),
        (torch.arange(3), torch.arange(3) + 1),
        ({"k": 1}, {"k": 2}),
        ("a", "b"),
    ],
    ids=["tensor-values", "tensor-shapes", "tensor-vs-json", "ints", "json", "strings"],
)
def test_fixed_values_that_disagree_raise(mine: Any, theirs: Any) -> None:
    a, b = Stats(), Stats()
    a.fix("f", mine)
    b.fix("f", theirs)
    with pytest.raises(StateError, match="disagree on 'f'"):
        a.merge(b)
    with pytest.raises(StateError, match="disagree on 'f'"):
        b.merge(a)
    with pytest.raises(StateError, match="'f' changed"):
        a.fix("f", theirs)


@pytest.mark.parametrize(
    "value",
    [torch.eye(2), 3, 2.5, "x", None, (1, 2), [1, (2, 3)], {"a": (1, 2)}, np.array([1.0, 2.0]),
     np.float64(0.5)],
    ids=["tensor", "int", "float", "str", "none", "tuple", "nested", "dict", "ndarray", "np-float"],
)
def test_fixing_an_equal_value_again_is_fine(value: Any) -> None:
    state = Stats()
    state.fix("f", value)
    state.fix("f", value)
    state.fix("f", copy.deepcopy(value))


def test_fixed_nan_agrees_with_itself() -> None:
    """As in tensors (``equal_nan``): a setting that is NaN on every shard agrees."""
    state = Stats()
    state.fix("f", math.nan)
    state.fix("g", {"x": [1.0, math.nan]})
    state.fix("f", math.nan)
    merged = state.merge(state.copy())
    assert math.isnan(merged["f"]) and math.isnan(merged["g"]["x"][1])
    other = Stats()
    other.put("f", 1.0)
    with pytest.raises(StateError, match="disagree on 'f'"):
        state.merge(other)


def test_sets_merge_by_union() -> None:
    a, b = Stats(), Stats()
    a.include("g", "x", "y")
    b.include("g", "y", "z")
    b.include("h")
    merged = a.merge(b)
    assert merged["g"] == frozenset({"x", "y", "z"}) and merged["h"] == frozenset()
    assert merged.kind("h") == "set"


def test_rows_merge_by_key_and_read_back_in_key_order() -> None:
    a, b = Stats(), Stats()
    a.append("r", 3, {"v": (3, "c")})
    a.append("r", 0, {"v": 0})
    b.append("r", 1, [1.5])
    merged = a.merge(b)
    assert merged["r"] == [{"v": 0}, [1.5], {"v": [3, "c"]}]  # key order; tuples became lists
    assert b.merge(a)["r"] == merged["r"]
    with pytest.raises(StateError, match="row 0 of 'r' recorded twice"):
        a.append("r", 0, {"v": "again"})
    c = Stats()
    c.append("r", 0, "again")
    for x, y in ((a, c), (c, a)):
        with pytest.raises(StateError, match="row 0 of 'r' is in both states"):
            x.merge(y)


def test_names_of_one_shard_are_kept() -> None:
    a, b = Stats(), Stats()
    a.include("only_a", "x")
    b.append("only_b", 0, 1)
    b.fix("fit_b", [1, 2])
    merged = a.merge(b)
    assert merged.names() == ["fit_b", "only_a", "only_b"]
    assert merged["only_a"] == {"x"} and merged["only_b"] == [1] and merged["fit_b"] == [1, 2]


# -- the algebra of merge --------------------------------------------------------------------------


@pytest.mark.parametrize("frozen", [False, True])
def test_merge_with_an_empty_state_is_the_identity(frozen: bool) -> None:
    state = _every_kind(0, range(4))
    if frozen:
        state.freeze()
    for merged in (state.merge(Stats()), Stats().merge(state)):
        _assert_same_state(merged, state)
    _assert_same_state(merge_all([state]), state)
    assert merge_all([]).empty


def test_merge_is_commutative() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(1, range(3, 7))
    _assert_same_state(a.merge(b), b.merge(a))
    c = _every_kind(2, range(7, 9))
    _assert_same_state(merge_all([a, b, c]), a.merge(b).merge(c))


def test_merge_never_mutates_its_inputs() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(1, range(3, 5))
    before_a, before_b = copy.deepcopy(a), copy.deepcopy(b)
    merged = a.merge(b)
    _assert_same_state(a, before_a)
    _assert_same_state(b, before_b)
    # The merged state owns its entries: writing to it leaves both inputs alone.
    merged.zeros("sum", (3, 4)).add_(1.0)
    merged.add("count", 1)
    merged.max("max", torch.full((3, 4), 100.0))
    merged.min("min", torch.full((3, 4), -100.0))
    merged["map"].add_(1.0)
    merged.include("grades", "new")
    merged.append("per_example", 99, {"key": 99})
    _assert_same_state(a, before_a)
    _assert_same_state(b, before_b)


# -- passes: frozen entries --------------------------------------------------------------------------


def test_frozen_entries_are_kept_once() -> None:
    pass0 = _every_kind(0, range(3)).merge(_every_kind(1, range(3, 5)))
    pass0.freeze()
    assert pass0.frozen == set(pass0.names())
    first, second = pass0.copy(), pass0.copy()  # every shard of pass 1 starts from the same copy
    assert first.frozen == pass0.frozen
    first.add("later", 1.0)
    second.add("later", 2.0)
    second.include("later_set", "b")
    merged = first.merge(second)
    assert merged.frozen == pass0.frozen
    for name in pass0.names():  # one copy, not the sum of two
        x, y = merged[name], pass0[name]
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name
    assert float(merged["later"]) == 3.0 and merged["later_set"] == {"b"}


def test_states_of_different_passes_do_not_merge() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(0, range(3))
    a.freeze()
    b.add("later", 1.0)
    b.freeze()
    with pytest.raises(StateError, match="different passes"):
        a.merge(b)


@pytest.mark.parametrize("kind", MERGE_KINDS)
def test_a_later_write_to_a_frozen_name_raises(kind: str) -> None:
    state = _every_kind(0, range(3))
    state.freeze()
    name = {"sum": "sum", "max": "max", "min": "min", "fixed": "setting", "set": "grades",
            "rows": "per_example"}[kind]
    assert state.kind(name) == kind
    before = copy.deepcopy(state)
    match = "changed" if kind == "fixed" else "earlier pass"
    with pytest.raises(StateError, match=match):
        WRITERS[kind](state, name)
    if kind == "sum":
        with pytest.raises(StateError, match="earlier pass"):
            state.zeros(name, (3, 4))
    _assert_same_state(state, before)
    WRITERS[kind](state, "new_name")  # a later pass writes new names
    assert state.kind("new_name") == kind and "new_name" not in state.frozen


# -- kinds and shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize("second", MERGE_KINDS)
@pytest.mark.parametrize("first", MERGE_KINDS)
def test_a_name_belongs_to_one_kind(first: str, second: str) -> None:
    state = Stats()
    WRITERS[first](state, "x")
    if first == second:
        return
    with pytest.raises(StateError, match=f"'x' is a {first}, not a {second}"):
        WRITERS[second](state, "x")
    assert state.kind("x") == first
    other = Stats()
    WRITERS[second](other, "x")
    with pytest.raises(StateError, match=f"'x' is a {first} in one state and a {second}"):
        state.merge(other)


def test_zeros_is_a_sum_updated_in_place() -> None:
    state = Stats()
    acc = state.zeros("acc", (2, 3))
    assert acc.dtype == torch.float64 and not acc.any()
    acc += 1.0
    assert state.zeros("acc", (2, 3)) is acc and float(state["acc"].sum()) == 6.0
    state.add("acc", torch.ones(2, 3))
    assert float(state["acc"].sum()) == 12.0 and state.kind("acc") == "sum"
    with pytest.raises(StateError, match=r"'acc' has shape \(2, 3\), not \(3, 2\)"):
        state.zeros("acc", (3, 2))
    with pytest.raises(StateError, match="is a sum, not a max"):
        state.max("acc", 1.0)


@pytest.mark.parametrize("kind", ["sum", "max", "min"])
def test_shards_with_different_shapes_do_not_merge(kind: str) -> None:
    a, b = Stats(), Stats()
    write = {"sum": Stats.add, "max": Stats.max, "min": Stats.min}[kind]
    write(a, "x", torch.ones(3))
    write(b, "x", torch.ones(2))
    with pytest.raises(StateError, match=r"'x' has shape \(3,\) in one state and \(2,\)"):
        a.merge(b)


def test_the_first_update_fixes_the_shape() -> None:
    state = Stats()
    state.max("m", torch.ones(3))
    with pytest.raises(StateError):
        state.max("m", torch.ones(2, 3))
    state.add("s", torch.ones(3))
    with pytest.raises(StateError):
        state.add("s", torch.ones(2, 3))


# -- drop, signature, copy, to -----------------------------------------------------------------------


def test_drop() -> None:
    state = _every_kind(0, range(3))
    state.freeze()
    names = state.names()
    state.drop("sum")
    assert "sum" not in state and "sum" not in state.frozen and state.get("sum") is None
    assert state.names() == [n for n in names if n != "sum"]
    state.drop("never there")  # nothing to forget is fine
    state.max("sum", 1.0)  # the name is free again, for any kind
    assert state.kind("sum") == "max" and "sum" not in state.frozen
    for name in state.names():
        state.drop(name)
    assert state.empty and state.frozen == set()


def test_signature_lists_the_tensors_shards_reduce() -> None:
    a, b = _every_kind(0, range(3)), _every_kind(1, range(3, 5))
    expected = [("max", "max", (3, 4)), ("min", "min", (3, 4)), ("sum", "count", ()),
                ("sum", "sum", (3, 4))]
    assert a.signature() == b.signature() == expected  # fixed, sets and rows are not reduced
    assert Stats().signature() == []
    b.add("extra", torch.ones(5))
    assert b.signature() == sorted([*expected, ("sum", "extra", (5,))])


def test_copy_is_equal_and_independent() -> None:
    state = _every_kind(0, range(3))
    state.freeze()
    state.add("later", torch.ones(2))
    before = copy.deepcopy(state)
    twin = state.copy()
    _assert_same_state(twin, state)
    for name in ("sum", "max", "min", "map", "later"):
        assert twin[name].data_ptr() != state[name].data_ptr(), name
    twin.zeros("later", (2,)).add_(5.0)
    twin["map"].mul_(0.0)
    twin.include("new_set", "x")
    twin.append("new_rows", 0, 1)
    _assert_same_state(state, before)


def test_to_moves_every_tensor_and_keeps_the_rest() -> None:
    state = _every_kind(0, range(3))
    state.freeze()
    before = copy.deepcopy(state)
    moved = state.to("meta")
    assert moved.names() == state.names() and moved.frozen == state.frozen
    for name in state.names():
        value = moved[name]
        if isinstance(value, torch.Tensor):
            assert value.device.type == "meta" and value.shape == state[name].shape, name
            assert value.dtype == state[name].dtype, name
        else:
            assert same(value, state[name]), name
    _assert_same_state(state, before)  # the original stays where it was
    here = state.to(torch.device("cpu"))
    _assert_same_state(here, state)
    assert here["sum"].data_ptr() != state["sum"].data_ptr()


# -- on disk ----------------------------------------------------------------------------------------


def _state_for_disk() -> Stats:
    nan, inf = math.nan, math.inf
    state = _every_kind(0, range(3))
    state.fix("ints", torch.arange(4))
    state.fix("mask", torch.tensor([True, False]))
    state.fix("half", torch.tensor(2.5, dtype=torch.float32))
    state.fix("transposed", torch.arange(6.0).reshape(2, 3).T)  # not contiguous
    state.fix("odd", {"nan": nan, "inf": inf, "-inf": -inf, "none": None, "flag": True,
                      "text": "café 日本", "nested": [[1, 2.5], {"x": nan}]})
    state.fix("nan", nan)
    state.include("empty")
    state.append("special_rows", 5, [nan, -inf, None])
    state.max("with_nan", torch.tensor([nan, 1.0]))
    state.freeze()
    state.add("later", torch.ones(2))  # a pass-1 entry: not frozen
    return state


def test_save_load_round_trip(tmp_path: Path) -> None:
    state = _state_for_disk()
    folder = tmp_path / "state"
    written = state.save(folder)
    assert written == [folder / TENSOR_FILE, folder / STATE_FILE]
    assert sorted(p.name for p in folder.iterdir()) == sorted([TENSOR_FILE, STATE_FILE])
    back = Stats.load(folder)
    _assert_same_state(back, state)
    assert back["ints"].dtype == torch.int64 and back["half"].dtype == torch.float32
    # A reloaded shard keeps merging like the original.
    shard = state.copy()
    shard.add("later", torch.ones(2))
    _assert_same_state(back.merge(shard), state.merge(shard))
    # Saving again replaces the files and leaves no temporary ones.
    back.add("later", torch.ones(2))
    back.save(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([TENSOR_FILE, STATE_FILE])
    assert float(Stats.load(folder)["later"].sum()) == 4.0


def test_save_load_of_an_empty_state(tmp_path: Path) -> None:
    Stats().save(tmp_path)
    assert Stats.load(tmp_path).empty


def _damage(folder: Path, how: str) -> None:
    tensors, plain = folder / TENSOR_FILE, folder / STATE_FILE
    if how == "absent":
        tensors.unlink()
        plain.unlink()
        folder.rmdir()
    elif how == "no json":
        plain.unlink()
    elif how == "no tensors":
        tensors.unlink()
    elif how == "bad json":
        plain.write_text('{"lensdiv_state": 1, ')
    elif how == "json of something else":
        plain.write_text(json.dumps([1, 2, 3]))
    elif how == "other format":
        plain.write_text(json.dumps({"lensdiv_state": 99}))
    elif how == "bad tensors":
        tensors.write_bytes(b"\x00garbage, not safetensors" * 3)
    elif how == "truncated tensors":
        tensors.write_bytes(tensors.read_bytes()[:40])
    elif how == "unknown entry":
        save_file({"mean/x": torch.zeros(2)}, str(tensors))


@pytest.mark.parametrize(
    "how",
    ["absent", "no json", "no tensors", "bad json", "json of something else", "other format",
     "bad tensors", "truncated tensors", "unknown entry"],
)
def test_a_damaged_or_absent_state_raises(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "state"
    _every_kind(0, range(3)).save(folder)
    _damage(folder, how)
    with pytest.raises(StateError) as err:
        Stats.load(folder)
    assert str(folder) in str(err.value)


def test_states_of_different_passes_do_not_merge_in_either_order() -> None:
    a, b = Stats(), Stats()
    a.add("n", 1)
    b.add("n", 10)
    b.freeze()
    b.add("m", 1)
    for x, y in ((a, b), (b, a)):
        with pytest.raises(StateError, match="different passes"):
            x.merge(y)


def test_copies_share_nothing() -> None:
    state = Stats()
    state.append("r", 0, {"v": [1]})
    state.fix("f", {"v": [1]})
    state.include("s", "a")
    copy = state.copy()
    copy["r"][0]["v"].append(2)
    copy["f"]["v"].append(2)
    copy.include("s", "b")
    assert state["r"] == [{"v": [1]}] and state["f"] == {"v": [1]} and state["s"] == {"a"}


def test_fix_never_aliases_a_live_statistic() -> None:
    state = Stats()
    state.add("a", torch.ones(3))
    state.fix("b", state["a"])
    state.add("a", torch.ones(3))
    assert state["b"].tolist() == [1.0, 1.0, 1.0]


def test_put_is_the_deprecated_name_of_fix() -> None:
    state = Stats()
    with pytest.warns(DeprecationWarning, match="Stats.fix"):
        state.put("f", {"k": 1})
    assert state.kind("f") == "fixed" and state["f"] == {"k": 1}
