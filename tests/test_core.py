"""Core machinery without analyses: stats, results, options, registry, data packing and capture.

Everything here checks an identity (merge of shards = state of the union, JSON round trip = the
original, packed rows = the tokenised documents) or agreement with an independent computation
(``run_with_cache``, ``model(tokens)``); no expected number is hard-coded.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import EntryPoint
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch
from rich.console import Console

from lensdiv.analyzers.lens import LogitLens
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.errors import DataError, OptionError, PluginError
from lensdiv.core.registry import GROUP, collect
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.corpus import builtin_documents
from lensdiv.data.sources import DataSpec, documents, token_batches
from lensdiv.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_tokenizer
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze

# -- tiny analyzers: targets of the fake entry points below (``tests.test_core:Name``) ----------


@dataclass(frozen=True)
class Alpha(Analyzer):
    """An analyzer with one option of every parseable kind."""

    name = "alpha"
    aliases = ("al", "Alfa")
    description = "test analyzer alpha"

    flag: bool = False
    count: int = 1
    scale: float = 1.0
    mode: Literal["fast", "slow"] = "fast"
    layers: tuple[int, ...] = ()
    limit: int | None = 3
    label: str = "x"

    def hooks(self, info: ModelInfo) -> list[str]:
        return []

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(analyzer=self.name)


@dataclass(frozen=True)
class AlphaTwin(Alpha):
    """Claims the same name as :class:`Alpha` (a duplicate from another package)."""

    aliases = ()


@dataclass(frozen=True)
class Beta(Alpha):
    """A second, independent analyzer."""

    name = "beta"
    aliases = ("b",)


@dataclass(frozen=True)
class Clash(Alpha):
    """Claims an alias :class:`Alpha` already has."""

    name = "clash"
    aliases = ("al",)


class NotAnAnalyzer:
    """Registered by mistake: not an ``Analyzer`` subclass."""

    name = "stray"


def _ep(name: str, target: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"tests.test_core:{target}", group=GROUP)


# -- Stats ---------------------------------------------------------------------------------------


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


# -- Results -------------------------------------------------------------------------------------


def _same(a: Any, b: Any) -> bool:
    """Structural equality in which NaN equals NaN (and arrays compare elementwise)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            np.array_equal(a, b, equal_nan=True))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def assert_results_equal(a: Result, b: Result) -> None:
    assert a.analyzer == b.analyzer and a.summary == b.summary
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        ta, tb = a.tables[name], b.tables[name]
        assert (ta.name, ta.description) == (tb.name, tb.description)
        assert _same(dict(ta.columns), dict(tb.columns)), name
    assert list(a.arrays) == list(b.arrays)
    for name in a.arrays:
        assert _same(a.arrays[name], b.arrays[name]), name
    assert a.plots == b.plots
    assert _same(dict(a.meta), dict(b.meta))


@pytest.fixture
def result() -> Result:
    nan, inf = float("nan"), float("inf")
    return Result(
        analyzer="demo",
        summary="Two tables, two arrays, three plots.",
        tables={
            "main": Table("main", {"layer": [0, 1, 2], "value": [0.5, nan, -inf],
                                   "state": ["h0", "h1", "h2"]}, "Per-layer demo values"),
            "extra": Table("extra", {"k": [0, 1], "v": [1.25, nan]}),
        },
        arrays={"map": np.array([[1.0, nan], [inf, -2.5]]), "curve": [0.1, 0.2, nan]},
        plots=(
            Plot("line", "demo_line", "Values", "main", x="layer", y=("value",), logy=True),
            Plot("line", "demo_two", "Extra", "extra", x="k", y=("v",), xlabel="k", ylabel="v"),
            Plot("heatmap", "demo_map", "Map", "map"),
        ),
        meta={"options": {"top_k": 5, "flag": True, "none": None}, "seed": 0, "nan": nan,
              "tensor": torch.tensor([1.0, 2.0]), "path": Path("/tmp/x"), "tuple": (1, "a")},
    )


def test_result_json_round_trip_is_exact(result: Result) -> None:
    text = result.to_json()
    back = Result.from_json(text)
    assert_results_equal(back, result)
    assert back.to_json() == text
    values = back.tables["main"]["value"]
    assert math.isnan(values[1]) and values[2] == -math.inf
    assert np.isnan(back.arrays["map"][0, 1]) and back.arrays["map"][1, 0] == math.inf
    assert math.isnan(back.meta["nan"])
    # Numpy / torch / path values became plain JSON data, so a second trip changes nothing.
    assert back.meta["tensor"] == [1.0, 2.0] and back.meta["path"] == "/tmp/x"
    assert_results_equal(Result.from_dict(json.loads(json.dumps(back.to_dict()))), result)


def test_result_save_and_load(result: Result, tmp_path: Path) -> None:
    written = result.save(tmp_path / "demo")
    folder = tmp_path / "demo"
    expected = {f"{t}.csv" for t in result.tables} | {f"{p.name}.png" for p in result.plots}
    assert {p.name for p in written} == expected | {"result.json"}
    assert written[-1].name == "result.json"  # written last: it marks the folder complete
    assert {p.name for p in folder.iterdir()} == expected | {"result.json"}  # no temp files left
    for plot in result.plots:
        assert (folder / f"{plot.name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, table in result.tables.items():
        with open(folder / f"{name}.csv", newline="") as fh:
            rows = list(csv.reader(fh))
        assert rows[0] == list(table.columns)
        body = zip(*table.columns.values(), strict=True)
        assert rows[1:] == [[str(v) for v in row] for row in body]
    assert_results_equal(Result.load(folder), result)
    assert_results_equal(Result.load(folder / "result.json"), result)


def test_result_renders(result: Result) -> None:
    console = Console(file=io.StringIO(), width=100)
    console.print(result)
    text = console.file.getvalue()
    assert "demo" in text and result.summary in text
    assert result.tables["main"].description in text  # the main table with its title
    assert max(len(line) for line in text.splitlines()) <= 100
    # A table without a description is titled by its name.
    console = Console(file=io.StringIO(), width=100)
    console.print(result.tables["extra"])
    assert "extra" in console.file.getvalue()
    assert "demo" in result._repr_mimebundle_(include=(), exclude=())["text/plain"]


def test_result_to_pandas(result: Result) -> None:
    pytest.importorskip("pandas")
    frame = result.to_pandas()
    assert list(frame.columns) == list(result.tables["main"].columns)
    assert len(frame) == len(result.tables["main"])
    assert frame["layer"].tolist() == [0, 1, 2] and frame["state"].tolist() == ["h0", "h1", "h2"]
    np.testing.assert_array_equal(frame["value"].to_numpy(), result.tables["main"]["value"])
    extra = result.to_pandas("extra")
    np.testing.assert_array_equal(extra["v"].to_numpy(), result.tables["extra"]["v"])


def test_table_rejects_ragged_columns() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        Table("bad", {"a": [1, 2], "b": [1]})


# -- Analyzer options ----------------------------------------------------------------------------


def test_from_options_parses_strings_to_field_types() -> None:
    got = Alpha.from_options({"flag": "yes", "count": "3", "scale": "0.25", "mode": "slow",
                              "layers": "1,2,5", "limit": "none", "label": "hello"})
    assert got == Alpha(flag=True, count=3, scale=0.25, mode="slow", layers=(1, 2, 5),
                        limit=None, label="hello")
    assert type(got.count) is int and type(got.scale) is float and type(got.flag) is bool
    assert all(type(v) is int for v in got.layers)
    assert Alpha.from_options({"flag": "False", "limit": "7"}) == Alpha(flag=False, limit=7)
    assert Alpha.from_options({"count": 4, "layers": (0,)}) == Alpha(count=4, layers=(0,))
    assert Alpha.from_options() == Alpha()
    assert Alpha().options() == {"flag": False, "count": 1, "scale": 1.0, "mode": "fast",
                                 "layers": (), "limit": 3, "label": "x"}


def test_from_options_unknown_option_suggests() -> None:
    with pytest.raises(OptionError, match="(?i)did you mean 'count'"):
        Alpha.from_options({"cuont": "2"})
    with pytest.raises(OptionError) as err:
        LogitLens.from_options({"topk": "3"})
    assert "did you mean 'top_k'" in str(err.value).lower() and "exclude_bos" in str(err.value)


@pytest.mark.parametrize(
    "key, value",
    [("count", "three"), ("scale", "wide"), ("flag", "maybe"), ("mode", "medium"),
     ("layers", "1,x"), ("limit", "lots")],
)
def test_from_options_bad_value(key: str, value: str) -> None:
    with pytest.raises(OptionError, match=key):
        Alpha.from_options({key: value})


@dataclass(frozen=True)
class Optionals(Alpha):
    """Options whose type is wrapped in ``| None``."""

    name = "optionals"
    aliases = ()

    ids: tuple[int, ...] | None = None
    kind: Literal["x", "y"] | None = None


def test_from_options_parses_optional_tuple() -> None:
    assert Optionals.from_options({"ids": "1,2"}).ids == (1, 2)


def test_from_options_parses_optional_scalars() -> None:
    assert Optionals.from_options({"ids": "none"}).ids is None
    assert Optionals.from_options({"limit": "null"}).limit is None


def test_from_options_validation_error_becomes_option_error() -> None:
    with pytest.raises(OptionError, match="top_k"):
        LogitLens.from_options({"top_k": "0"})


# -- Registry ------------------------------------------------------------------------------------


def test_registry_duplicate_names_are_refused_naming_both() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("alpha", "AlphaTwin"), _ep("beta", "Beta")])
    duplicates = [p for p in registry.problems if "duplicate" in p]
    assert len(duplicates) == 1
    assert re.search(r"tests\.test_core:Alpha\b", duplicates[0])
    assert "tests.test_core:AlphaTwin" in duplicates[0]
    with pytest.raises(PluginError, match="alpha"):
        registry.resolve("alpha")
    assert registry.resolve("beta") is Beta


def test_registry_same_target_twice_is_not_a_duplicate() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("alpha", "Alpha")])
    assert registry.problems == []
    assert registry.resolve("alpha") is Alpha


def test_registry_broken_plugins_are_reported_and_others_work() -> None:
    registry = collect([
        EntryPoint(name="broken", value="tests.no_such_module_here:Thing", group=GROUP),
        _ep("stray", "NotAnAnalyzer"),
        _ep("gamma", "Beta"),  # entry-point name differs from the class's name
        _ep("alpha", "Alpha"),
        _ep("beta", "Beta"),
    ])
    problems = "\n".join(registry.problems)
    assert len(registry.problems) == 3
    assert "broken" in problems and "ModuleNotFoundError" in problems
    assert "stray" in problems and "not a lensdiv.Analyzer" in problems
    assert "gamma" in problems
    for name in ("broken", "stray", "gamma"):
        entry = registry.entries[name]
        assert entry.cls is None and entry.error and "failed to load" in entry.description
        with pytest.raises(PluginError, match="failed to load"):
            registry.resolve(name)
    assert registry.resolve("alpha") is Alpha and registry.resolve("beta") is Beta
    assert registry.entries["alpha"].description == Alpha.description


def test_registry_unknown_name_suggests() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("beta", "Beta")])
    with pytest.raises(PluginError, match="(?i)did you mean 'alpha'"):
        registry.resolve("alpah")
    with pytest.raises(PluginError, match="unknown analyzer"):
        registry.resolve("zzzzzz")


def test_registry_aliases() -> None:
    registry = collect([_ep("beta", "Beta"), _ep("alpha", "Alpha")])
    for name in ("alpha", "al", "AL", " alfa ", "Alpha"):
        assert registry.resolve(name) is Alpha, name
    assert registry.resolve("b") is Beta
    assert set(registry.names()) == {"alpha", "al", "alfa", "beta", "b"}


def test_registry_alias_clash_is_reported() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("clash", "Clash")])
    assert any("'al'" in p for p in registry.problems)
    assert registry.resolve("al") is Alpha and registry.resolve("clash") is Clash


def test_installed_registry_holds_the_builtins() -> None:
    from lensdiv.core.registry import get_analyzer, list_plugins

    entries = {e.name: e for e in list_plugins()}
    assert entries["lens"].cls is LogitLens and entries["lens"].provider.startswith("lensdiv ")
    assert get_analyzer("logit-lens") is LogitLens


# -- Data ----------------------------------------------------------------------------------------

DOCS = [
    "The cat sleeps.",
    "Café, naïve, 日本語 and an emoji 🎉 cross byte boundaries.",
    "A somewhat longer document that certainly spans more than one packed row of tokens. " * 2,
    "x",
    "Line one\nline two\n\ttabbed",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_tokenizer()


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)),
                    encoding="utf-8")
    return path


def _stream(tokenizer: Any, docs: list[str]) -> list[int]:
    out: list[int] = []
    for doc in docs:
        out += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return out


def _rows(batches: list[Batch]) -> list[list[int]]:
    return [row[mask].tolist() for b in batches for row, mask in zip(b.tokens, b.mask, strict=True)]


def _check_packing(batches: list[Batch], spec: DataSpec, stream: list[int]) -> list[list[int]]:
    """The packing invariants; returns the rows' real tokens."""
    assert batches
    assert [b.index for b in batches] == list(range(len(batches)))
    for b in batches:
        assert b.tokens.dtype == torch.long and b.mask.dtype == torch.bool
        assert b.tokens.shape == b.mask.shape and 1 <= b.tokens.shape[0] <= spec.batch_size
        assert b.bos == (spec.bos == "prepend")
        # mask is False exactly at pads (the byte tokenizer never emits PAD inside text) ...
        assert torch.equal(b.mask, b.tokens != PAD_ID)
        # ... and pads only ever trail a row.
        lengths = b.mask.sum(1)
        assert torch.equal(b.mask, torch.arange(b.tokens.shape[1]) < lengths[:, None])
    assert all(b.tokens.shape[0] == spec.batch_size for b in batches[:-1])
    rows = _rows(batches)
    assert all(len(r) == spec.seq_len for r in rows[:-1])
    assert 1 <= len(rows[-1]) <= spec.seq_len
    assert sum(len(r) for r in rows) == sum(b.n_tokens for b in batches) <= spec.max_tokens
    if spec.bos == "prepend":
        assert all(r[0] == BOS_ID and BOS_ID not in r[1:] for r in rows)
        content = [t for r in rows for t in r[1:]]
    else:
        content = [t for r in rows for t in r]
    assert content == stream[: len(content)]
    return rows


@pytest.mark.parametrize("bos", ["prepend", "none"])
@pytest.mark.parametrize("seq_len, batch_size", [(16, 3), (7, 2), (64, 8)])
def test_packing_reproduces_documents(jsonl: Path, tokenizer: Any, bos: str, seq_len: int,
                                      batch_size: int) -> None:
    spec = DataSpec(source=str(jsonl), seq_len=seq_len, batch_size=batch_size, max_tokens=10**6,
                    bos=bos)  # type: ignore[arg-type]
    stream = _stream(tokenizer, DOCS)
    batches = list(token_batches(spec, tokenizer))
    rows = _check_packing(batches, spec, stream)
    content = [t for r in rows for t in (r[1:] if bos == "prepend" else r)]
    assert content == stream  # nothing lost when the budget is not binding
    # Independent of the encoder: splitting at EOS and decoding gives the documents back.
    pieces, piece = [], []
    for t in content:
        if t == EOS_ID:
            pieces.append(piece)
            piece = []
        else:
            piece.append(t)
    assert piece == []
    assert [tokenizer.decode(p) for p in pieces] == DOCS


def test_packing_records_the_document_of_every_position(jsonl: Path, tokenizer: Any) -> None:
    spec = DataSpec(source=str(jsonl), seq_len=16, batch_size=3, max_tokens=10**6)
    batches = list(token_batches(spec, tokenizer))
    docs = torch.cat([b.doc[b.mask] for b in batches]).tolist()
    tokens = torch.cat([b.tokens[b.mask] for b in batches]).tolist()
    assert all((b.doc[~b.mask] == -1).all() for b in batches)
    assert docs == sorted(docs) and set(docs) == set(range(len(DOCS)))  # in order, none lost
    content = [(t, d) for t, d in zip(tokens, docs, strict=True) if t != BOS_ID]
    for i, text in enumerate(DOCS):  # each document's positions hold exactly its tokens + EOS
        ids = [t for t, d in content if d == i]
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"] + [EOS_ID]


@pytest.mark.parametrize("max_tokens", [1, 2, 17, 40, 100])
def test_packing_respects_token_budget(jsonl: Path, tokenizer: Any, max_tokens: int) -> None:
    spec = DataSpec(source=str(jsonl), seq_len=16, batch_size=2, max_tokens=max_tokens)
    stream = _stream(tokenizer, DOCS)
    if max_tokens < 2:  # a row that would hold only BOS is no row at all
        with pytest.raises(DataError, match="no tokens"):
            list(token_batches(spec, tokenizer))
        return
    _check_packing(list(token_batches(spec, tokenizer)), spec, stream)


def test_folder_and_text_sources(tmp_path: Path, tokenizer: Any) -> None:
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text(DOCS[1], encoding="utf-8")
    (folder / "a.txt").write_text(DOCS[0], encoding="utf-8")
    (folder / "sub" / "c.txt").write_text(DOCS[2], encoding="utf-8")
    (folder / "ignored.md").write_text("not text", encoding="utf-8")
    assert list(documents(DataSpec(source=str(folder)))) == [DOCS[0], DOCS[1], DOCS[2]]
    spec = DataSpec(source=str(folder / "b.txt"), seq_len=8, batch_size=2, max_tokens=10**6)
    assert list(documents(spec)) == [DOCS[1]]
    _check_packing(list(token_batches(spec, tokenizer)), spec, _stream(tokenizer, [DOCS[1]]))


def test_next_tokens_excludes_last_real_token_and_pads() -> None:
    tokens = torch.tensor([[0, 10, 11, 12, 13], [0, 20, 21, PAD_ID, PAD_ID], [0, 30, PAD_ID,
                                                                              PAD_ID, PAD_ID]])
    mask = tokens != PAD_ID
    batch = Batch(tokens=tokens, mask=mask)
    targets, valid = batch.next_tokens()
    lengths = mask.sum(1)
    for i in range(tokens.shape[0]):
        for j in range(tokens.shape[1]):
            assert bool(valid[i, j]) == (j + 1 < int(lengths[i])), (i, j)
            if valid[i, j]:
                assert targets[i, j] == tokens[i, j + 1]
    assert batch.n_tokens == int(mask.sum())
    assert torch.equal(batch.positions(), mask)
    no_bos = batch.positions(exclude_bos=True)
    assert torch.equal(no_bos[:, 1:], mask[:, 1:]) and not no_bos[:, 0].any()
    assert torch.equal(Batch(tokens, mask, bos=False).positions(exclude_bos=True), mask)


def test_next_tokens_of_packed_batches(jsonl: Path, tokenizer: Any) -> None:
    spec = DataSpec(source=str(jsonl), seq_len=16, batch_size=3, max_tokens=10**6)
    for batch in token_batches(spec, tokenizer):
        targets, valid = batch.next_tokens()
        assert valid.sum() == batch.n_tokens - batch.tokens.shape[0]  # one per row
        assert not (valid & ~batch.mask).any()
        assert torch.equal(targets[:, :-1][valid[:, :-1]], batch.tokens[:, 1:][valid[:, :-1]])


def test_builtin_corpus_is_seeded(tokenizer: Any) -> None:
    def docs(seed: int) -> list[str]:
        return list(islice(builtin_documents(seed=seed), 20))

    assert docs(0) == docs(0)
    assert docs(0) != docs(1)
    assert [d.encode() for d in islice(documents(DataSpec(seed=3)), 20)] == [
        d.encode() for d in docs(3)]

    def tokens(seed: int) -> torch.Tensor:
        spec = DataSpec(seed=seed, seq_len=32, max_tokens=32 * 6, batch_size=4)
        return torch.cat([b.tokens for b in token_batches(spec, tokenizer)])

    assert torch.equal(tokens(0), tokens(0))
    assert not torch.equal(tokens(0), tokens(1))
    spec = DataSpec(seed=2, seq_len=32, max_tokens=32 * 6, batch_size=4)
    batches = list(token_batches(spec, tokenizer))
    _check_packing(batches, spec, _stream(tokenizer, list(islice(builtin_documents(seed=2), 50))))
    assert sum(b.n_tokens for b in batches) == 32 * 6


def _bad_source(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.txt"
    if kind == "missing":
        return path
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "blank":
        path.write_bytes(b"  \n\n\t ")
    elif kind == "binary":
        path.write_bytes(b"GIF89a\x00\x01\x02 some text")
    elif kind == "latin1":
        path.write_bytes("caf\u00e9 au lait".encode("latin-1"))
    elif kind == "latin1_late":  # the bad byte lies beyond the sniffed head of the file
        path.write_bytes(b"a" * (1 << 17) + "caf\u00e9".encode("latin-1"))
    elif kind == "empty_folder":
        path = tmp_path / "folder"
        path.mkdir()
        (path / "notes.md").write_text("no txt here")
    return path


@pytest.mark.parametrize(
    "kind, words",
    [("missing", "does not exist"), ("empty", "empty"), ("blank", "empty"),
     ("binary", "binary"), ("latin1", "UTF-8"), ("latin1_late", "UTF-8"),
     ("empty_folder", "no .txt")],
)
def test_bad_sources_raise_data_error(tmp_path: Path, tokenizer: Any, kind: str,
                                      words: str) -> None:
    spec = DataSpec(source=str(_bad_source(tmp_path, kind)), seq_len=8)
    with pytest.raises(DataError, match=words):
        list(token_batches(spec, tokenizer))


def test_jsonl_errors_name_line_and_field(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n\n{"body": "no text here"}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        list(token_batches(DataSpec(source=str(path), seq_len=8), tokenizer))
    assert "line 3" in str(err.value) and "'text'" in str(err.value) and "body" in str(err.value)
    path.write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    with pytest.raises(DataError, match="line 2"):
        list(token_batches(DataSpec(source=str(path), seq_len=8), tokenizer))


def test_jsonl_late_bad_encoding_raises_data_error(tmp_path: Path, tokenizer: Any) -> None:
    path = tmp_path / "late.jsonl"
    good = (json.dumps({"text": "a" * 100}) + "\n").encode() * 1000  # > the 64 KiB sniff
    path.write_bytes(good + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="UTF-8"):
        list(token_batches(DataSpec(source=str(path), seq_len=8, max_tokens=10**7), tokenizer))


def test_jsonl_field_option(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"body": "one", "text": "x"}\n{"body": "two"}\n', encoding="utf-8")
    assert list(documents(DataSpec(source=str(path), field="body"))) == ["one", "two"]


@pytest.mark.parametrize("bad", [{"seq_len": 1}, {"max_tokens": 0}, {"batch_size": 0}])
def test_bad_spec_raises_data_error(bad: dict[str, Any]) -> None:
    with pytest.raises(DataError):
        DataSpec(**bad)


def test_hub_source_from_local_folder(tmp_path: Path, tokenizer: Any) -> None:
    pytest.importorskip("datasets")
    folder = tmp_path / "hubdata"
    folder.mkdir()
    (folder / "data.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS), encoding="utf-8")
    spec = DataSpec(source=f"hf:{folder}", seq_len=16, batch_size=3, max_tokens=10**6)
    assert list(documents(spec)) == DOCS
    _check_packing(list(token_batches(spec, tokenizer)), spec, _stream(tokenizer, DOCS))
    with pytest.raises(DataError, match="no field 'body'"):
        list(documents(DataSpec(source=f"hf:{folder}", field="body")))


# -- capture -------------------------------------------------------------------------------------


def _names(model: Any) -> list[str]:
    names = ["blocks.0.hook_resid_pre"]
    for layer in range(model.cfg.n_layers):
        names += [f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mlp_out",
                  f"blocks.{layer}.hook_resid_post"]
    return names


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    toks = torch.randint(4, 260, (2, 10), generator=gen)
    toks[:, 0] = BOS_ID
    return toks


@contextlib.contextmanager
def _count_hook_calls(model: Any) -> Iterator[dict[int, int]]:
    """Count calls per hook point of every hook ``capture`` attaches (keyed by hook point id)."""
    calls: dict[int, int] = {}
    original = model.hooks

    def counting(fwd_hooks: list = [], *args: Any, **kwargs: Any) -> Any:  # noqa: B006
        wrapped = []
        for name, fn in fwd_hooks:
            key = id(model.hook_dict[name])

            def hook(tensor: torch.Tensor, *, hook: Any, _fn: Any = fn, _key: int = key) -> Any:
                calls[_key] = calls.get(_key, 0) + 1
                return _fn(tensor, hook=hook)

            wrapped.append((name, hook))
        return original(*args, fwd_hooks=wrapped, **kwargs)

    model.hooks = counting
    try:
        yield calls
    finally:
        del model.hooks  # back to the class's method


def test_capture_matches_run_with_cache(tiny_model: Any, tokens: torch.Tensor) -> None:
    names = _names(tiny_model)
    logits, store = capture(tiny_model, tokens, names, need_logits=False)
    assert logits is None
    with torch.no_grad():
        ref_logits, cache = tiny_model.run_with_cache(tokens, names_filter=names)
    assert set(store) == set(names)
    for name in names:
        assert not store[name].requires_grad
        torch.testing.assert_close(store[name], cache[name], atol=1e-6, rtol=0)
    logits, store2 = capture(tiny_model, tokens, names, need_logits=True)
    with torch.no_grad():
        direct = tiny_model(tokens)
    torch.testing.assert_close(logits, direct, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-6, rtol=0)
    for name in names:
        torch.testing.assert_close(store2[name], store[name], atol=1e-6, rtol=0)


def test_capture_alias_fires_once(tiny_model: Any, tokens: torch.Tensor) -> None:
    pairs = [("blocks.0.hook_resid_pre", "blocks.0.hook_in"),
             ("blocks.0.hook_resid_post", "blocks.0.hook_out")]
    for alias, canonical in pairs:
        assert tiny_model.hook_dict[alias] is tiny_model.hook_dict[canonical]
    names = [n for pair in pairs for n in pair] + ["blocks.0.hook_resid_pre"]  # and a repeat
    with _count_hook_calls(tiny_model) as calls:
        _, store = capture(tiny_model, tokens, names, need_logits=False)
    assert "hooks" not in vars(tiny_model)
    for alias, canonical in pairs:
        assert calls[id(tiny_model.hook_dict[alias])] == 1
        assert store[alias] is store[canonical]
    with torch.no_grad():
        _, cache = tiny_model.run_with_cache(tokens, names_filter=[p[0] for p in pairs])
    for alias, _ in pairs:
        torch.testing.assert_close(store[alias], cache[alias], atol=1e-6, rtol=0)


def test_capture_with_grad(tiny_model: Any, tokens: torch.Tensor) -> None:
    name = "blocks.0.hook_resid_post"
    logits, store = capture(tiny_model, tokens, [name], need_logits=True, grad=True)
    assert store[name].requires_grad and logits is not None and logits.requires_grad
    (grad,) = torch.autograd.grad(logits[:, -1].logsumexp(-1).sum(), store[name])
    assert grad.shape == store[name].shape and grad[:, -1].abs().sum() > 0
    assert torch.is_grad_enabled()  # capture restored the global grad mode


# -- Runner: multi-pass analyzers and analyzers with their own examples ---------------------------


@dataclass(frozen=True)
class CenteredNorm(Analyzer):
    """Two passes: the mean residual in pass 0, the mean distance to it in pass 1."""

    name = "centered"
    passes = 2

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Any) -> None:
        h = step.resid(0)[step.batch.mask].double()
        if step.pass_index == 0:
            state.add("sum", h.sum(0))
            state.add("n", h.shape[0])
        else:
            state.add("dist", (h - state.mean).norm(dim=-1).sum())
            state.add("n1", h.shape[0])

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        state.mean = state["sum"] / state["n"]  # type: ignore[attr-defined]

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        value = float(state["dist"] / state["n1"])
        return Result(self.name, "", tables={"t": Table("t", {"dist": [value]})})


@dataclass(frozen=True)
class OwnExamples(Analyzer):
    """Measures on its own two examples, not the corpus."""

    name = "own"

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def examples(self, model: Any, info: ModelInfo) -> list[Batch]:
        tokens = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 2]])
        mask = torch.tensor([[True] * 4, [True, True, True, False]])
        return [Batch(tokens, mask, extra={"label": ["a", "b"]})]

    def update(self, state: Stats, step: Any) -> None:
        state.add("tokens", step.batch.n_tokens)
        state.add("labels", len(step.batch.extra["label"]))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "", tables={"t": Table("t", {"n": [int(state["tokens"])]})})


def test_two_pass_analyzer_sees_the_data_twice(native_model: Any) -> None:
    run = analyze(native_model, plugins=[CenteredNorm(), "contrib"], max_tokens=300,
                  seq_len=32, progress=False)
    assert run.ok
    spec = DataSpec(max_tokens=300, seq_len=32)
    rows = [t[m] for b in token_batches(spec, native_model.tokenizer)
            for t, m in zip(b.tokens, b.mask, strict=True)]
    with torch.no_grad():
        h = torch.cat([capture(native_model, r[None], ["blocks.0.hook_resid_pre"],
                               need_logits=False)[1]["blocks.0.hook_resid_pre"][0] for r in rows])
    h = h.double()
    want = (h - h.mean(0)).norm(dim=-1).mean()
    assert run["centered"].table()["dist"][0] == pytest.approx(float(want), rel=1e-6)
    assert run.manifest["timings"]["tokens"] == 300


def test_own_examples_replace_the_corpus(native_model: Any) -> None:
    run = analyze(native_model, plugins=[OwnExamples(), "contrib"], max_tokens=256,
                  seq_len=32, progress=False)
    assert run.ok
    assert run["own"].table()["n"][0] == 7
    assert run["own"].meta["data"] == "own examples" and run["own"].meta["tokens"] == 7
    assert run["contrib"].meta["tokens"] == 256


def test_option_docs_come_from_fields_types_and_docstring() -> None:
    from lensdiv.analyzers.skip import LayerSkip

    docs = {row["name"]: row for row in LayerSkip.option_docs()}
    assert list(docs) == [f.name for f in LayerSkip.option_fields()]
    assert docs["part"]["type"] == "block|attn|mlp" and docs["part"]["default"] == "block"
    assert docs["mode"]["help"].startswith("``future``") and "no recompute" in docs["mode"]["help"]
    assert docs["splits"]["type"] == "int" and docs["splits"]["default"] == "4"


def test_saving_plots_leaves_the_matplotlib_backend_alone(tmp_path: Path) -> None:
    """A notebook's inline backend must survive ``save_plots`` (and toy training's loss plot)."""
    import matplotlib

    from lensdiv.core.results import Plot, Result, Table

    previous = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        result = Result(
            "x",
            tables={"t": Table("t", {"a": [1, 2], "b": [3.0, 4.0]})},
            plots=(Plot("line", "p", "title", "t", x="a", y=("b",), logx=True, logy=True),),
        )
        assert [p.name for p in result.save_plots(tmp_path)] == ["p.png"]
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)
