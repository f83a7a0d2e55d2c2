"""The token cache (``lensdiv.data.cache``): batches packed from cached ids are those of
tokenising, bit for bit; a warm cache never calls the tokenizer; a longer run extends it; edits
and other tokenizers miss it; bad data raises where it did; a disk that cannot take it, a
corrupt entry or two writers at once change nothing but speed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import lensdiv.data.cache as cache_mod
import lensdiv.data.packing as packing
import lensdiv.data.sources as sources
from lensdiv.cli import app
from lensdiv.core.errors import DataError
from lensdiv.data.cache import ENV, TokenCache, tokenizer_identity
from lensdiv.data.corpus import builtin_documents
from lensdiv.data.prefetch import ready_batches
from lensdiv.data.sources import DataSpec, source_of, token_batches
from lensdiv.data.tokenizer import byte_tokenizer
from tests.test_prefetch import _jsonl

# A bad line past what the cheap check reads (the file's first 64 KiB): met mid-way.
ROWS, BAD_AFTER = 420, 400


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh cache folder of this test (the environment restored after it)."""
    folder = tmp_path / "tokens"
    monkeypatch.setenv(ENV, str(folder))
    return folder


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The texts of each tokenizer call of the data path, in order."""
    seen: list[list[str]] = []
    encode = packing._encode

    def counting(tokenizer: Any, texts: list[str]) -> list[list[int]]:
        seen.append(list(texts))
        return encode(tokenizer, texts)

    monkeypatch.setattr(packing, "_encode", counting)
    return seen


def _plain(batches: Any) -> list[Any]:
    """Every batch as plain data, then the message of what stopped the stream, if anything."""
    out: list[Any] = []
    try:
        for b in batches:
            out.append((b.index, b.bos, b.tokens.tolist(), b.mask.tolist(), b.doc.tolist(),
                        str(b.tokens.dtype), str(b.doc.dtype)))
    except DataError as err:
        out.append(str(err))
    return out


def _uncached(spec: DataSpec, monkeypatch: pytest.MonkeyPatch, tokenizer: Any = None) -> list[Any]:
    with monkeypatch.context() as m:
        m.setenv(ENV, "off")
        return _plain(token_batches(spec, tokenizer or byte_tokenizer()))


def _docs(n: int, seed: int = 3) -> list[str]:
    it = builtin_documents(seed=seed)
    return [next(it) for _ in range(n)]


def _source(kind: str, tmp_path: Path) -> str:
    if kind == "builtin":
        return "builtin"
    if kind == "text":
        path = tmp_path / "one.txt"
        path.write_text("\n\n".join(_docs(30)), encoding="utf-8")
        return str(path)
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        rows = [json.dumps({"text": d}) for d in _docs(120)]
        rows.insert(5, json.dumps({"text": "   "}))  # a blank document: not counted
        path.write_text("\n".join(rows) + "\n", encoding="utf-8")
        return str(path)
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, doc in enumerate(_docs(40)):
        (folder / f"{i:03d}.txt").write_text(doc, encoding="utf-8")
    return str(folder)


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir()) if root.exists() else []


@pytest.mark.parametrize("kind", ["builtin", "text", "jsonl", "folder"])
def test_cached_batches_are_the_batches_bit_for_bit(
    kind: str, tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    source = _source(kind, tmp_path)
    end = 40000 if kind == "builtin" else 10**6  # the built-in corpus never ends
    specs = [
        DataSpec(source=source, seq_len=32, batch_size=3, max_tokens=1500),
        DataSpec(source=source, seq_len=32, batch_size=3, max_tokens=1500, bos="none"),
        DataSpec(source=source, seq_len=17, batch_size=2, max_tokens=900, skip_tokens=700),
        DataSpec(source=source, seq_len=64, batch_size=4, max_tokens=12000),  # extends
        DataSpec(source=source, seq_len=64, batch_size=4, max_tokens=end),  # to the end
        DataSpec(source=source, seq_len=32, batch_size=3, max_tokens=1500),  # shorter again
    ]
    for spec in specs:
        expected = _uncached(spec, monkeypatch)
        assert _plain(token_batches(spec, byte_tokenizer())) == expected  # cold or extending
        calls.clear()
        assert _plain(token_batches(spec, byte_tokenizer())) == expected  # warm
        assert _plain(ready_batches(spec, byte_tokenizer())) == expected  # on the reader thread
        assert not calls
    assert [p.name for p in _entries(root)] == [p.name for p in _entries(root)[:1]]  # one entry


def test_a_warm_cache_never_calls_the_tokenizer_and_a_longer_run_extends_it(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch, calls: list[list[str]]
) -> None:
    source = _source("jsonl", tmp_path)
    short = DataSpec(source=source, seq_len=32, batch_size=2, max_tokens=2000)
    list(token_batches(short, byte_tokenizer()))
    assert calls
    (entry,) = _entries(root)
    meta = json.loads((entry / "meta.json").read_text())
    assert not meta["complete"] and 0 < meta["n_docs"] < 120
    calls.clear()
    list(token_batches(short, byte_tokenizer()))
    assert calls == []
    # A longer run tokenises only the documents after the cached ones.
    longer = DataSpec(source=source, seq_len=32, batch_size=2, max_tokens=60000)
    expected = _uncached(longer, monkeypatch)
    calls.clear()
    assert _plain(token_batches(longer, byte_tokenizer())) == expected
    docs = [json.loads(line)["text"] for line in Path(source).read_text().splitlines()]
    docs = [d for d in docs if d.strip()]
    assert calls[0][0] == docs[meta["n_docs"]]
    assert sum(map(len, calls)) == len(docs) - meta["n_docs"]
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["complete"] and meta["n_docs"] == len(docs)
    calls.clear()
    assert _plain(token_batches(longer, byte_tokenizer())) == expected and calls == []
    assert [p.name for p in _entries(root)] == [entry.name]  # replaced, nothing left over


def test_an_edited_file_or_another_tokenizer_misses(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    path = tmp_path / "d.jsonl"
    _jsonl(path, 30)
    spec = DataSpec(source=str(path), seq_len=32, batch_size=2, max_tokens=10**5)
    list(token_batches(spec, byte_tokenizer()))
    _jsonl(path, 31)  # one more row: another size and time
    calls.clear()
    assert _plain(token_batches(spec, byte_tokenizer())) == _uncached(spec, monkeypatch)
    assert calls and len(_entries(root)) == 2
    # Padding and truncation a call left set on the tokenizer do not change its identity.
    padded = copy.deepcopy(byte_tokenizer())
    padded(["a", "bcd"], padding=True, truncation=True, max_length=2)
    assert tokenizer_identity(padded) == tokenizer_identity(byte_tokenizer())
    other = copy.deepcopy(byte_tokenizer())
    other.add_tokens(["the cat"])  # the same class and vocabulary file, other ids
    assert tokenizer_identity(other) != tokenizer_identity(byte_tokenizer())
    calls.clear()
    expected = _uncached(spec, monkeypatch, other)
    assert _plain(token_batches(spec, other)) == expected != _uncached(spec, monkeypatch)
    assert calls and len(_entries(root)) == 3
    calls.clear()
    assert _plain(token_batches(spec, other)) == expected and not calls


def test_inline_and_in_memory_data_bypass_the_cache(root: Path) -> None:
    tokenizer = byte_tokenizer()
    for data in ("text:some text here", ["a document", "another one"]):
        list(token_batches(DataSpec.from_data(data, seq_len=8, max_tokens=64), tokenizer))
    assert source_of(DataSpec.from_data("text:x")).cache_identity() is None
    assert _entries(root) == []


def test_bad_data_after_the_cached_prefix_still_raises(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = str(_jsonl(tmp_path / "d.jsonl", ROWS, BAD_AFTER))
    whole = DataSpec(source=source, seq_len=128, batch_size=8, max_tokens=10**6)
    short = DataSpec(source=source, seq_len=128, batch_size=8, max_tokens=20000)
    expected = _uncached(whole, monkeypatch)
    assert expected[-1].startswith(f"d.jsonl line {BAD_AFTER + 1} is not JSON")
    assert _plain(token_batches(short, byte_tokenizer())) == _uncached(short, monkeypatch)
    (entry,) = _entries(root)
    assert json.loads((entry / "meta.json").read_text())["n_docs"] < BAD_AFTER
    for _ in range(2):  # extending up to the bad line, then from a prefix that ends there
        assert _plain(token_batches(whole, byte_tokenizer())) == expected
        meta = json.loads((entry / "meta.json").read_text())
        assert meta["n_docs"] == BAD_AFTER and not meta["complete"]
    assert _plain(token_batches(short, byte_tokenizer())) == _uncached(short, monkeypatch)


def test_a_cache_that_cannot_be_written_warns_once_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(ENV, str(blocker / "tokens"))  # cannot be made: read-only for root too
    monkeypatch.setattr(cache_mod, "_warned", False)
    spec = DataSpec(seq_len=32, batch_size=2, max_tokens=3000)
    expected = _uncached(spec, monkeypatch)
    capsys.readouterr()
    assert _plain(token_batches(spec, byte_tokenizer())) == expected
    assert _plain(token_batches(spec, byte_tokenizer())) == expected
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot write the token cache" in lines[0], lines


@pytest.mark.parametrize("damage", ["truncated ids", "bad meta", "no offsets", "wrong sizes"])
def test_a_corrupt_entry_is_ignored_and_written_again(
    damage: str, root: Path, monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    spec = DataSpec(seq_len=32, batch_size=2, max_tokens=3000)
    expected = _uncached(spec, monkeypatch)
    list(token_batches(spec, byte_tokenizer()))
    (entry,) = _entries(root)
    if damage == "truncated ids":
        data = (entry / "ids.npy").read_bytes()
        (entry / "ids.npy").write_bytes(data[: len(data) // 2])
    elif damage == "bad meta":
        (entry / "meta.json").write_text("{not json")
    elif damage == "no offsets":
        (entry / "offsets.npy").unlink()
    else:
        np.save(entry / "offsets.npy", np.arange(5, dtype=np.int64))
    calls.clear()
    assert _plain(token_batches(spec, byte_tokenizer())) == expected
    assert calls  # tokenised again
    calls.clear()
    assert _plain(token_batches(spec, byte_tokenizer())) == expected
    assert not calls  # and the entry is good again


def test_racing_writers_leave_one_good_entry(root: Path) -> None:
    cache = TokenCache(root, {"kind": "test"}, tokenizer_identity(byte_tokenizer()) or {})
    ids = np.arange(100, dtype=np.int64)

    def writer(n_docs: int) -> Any:
        w = cache.writer(None)
        w.add(ids[: n_docs * 10], np.full(n_docs, 10), n_docs * 10)
        return w

    a, b = writer(5), writer(5)
    a.commit(complete=False)
    b.commit(complete=False)  # lost the race: drops its copy
    shorter, longer = writer(3), writer(8)
    longer.commit(complete=False)
    shorter.commit(complete=False)  # a shorter prefix never replaces a longer one
    prefix = cache.read()
    assert prefix is not None and prefix.n_docs == 8
    assert np.array_equal(prefix.ids, ids[:80]) and prefix.chars == 80
    assert [p.name for p in _entries(root)] == [cache.folder.name]  # no temporary folder left


def test_analyze_gives_the_same_results_with_and_without_the_cache(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _jsonl(tmp_path / "d.jsonl", 60)
    monkeypatch.setenv(ENV, str(root))  # --no-token-cache sets it: restored after the test
    sizes = {"max_tokens": 1024, "seq_len": 64, "batch_size": 4}
    list(token_batches(DataSpec(source=str(data), **sizes), byte_tokenizer()))  # warm it
    (entry,) = _entries(root)
    outs = []
    for name, flags in (("warm", []), ("off", ["--no-token-cache"])):
        out = tmp_path / name
        args = [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
        result = CliRunner().invoke(app, ["analyze", "toy", "--data", str(data), "-p", "lens",
                                          "--out", str(out), "--no-progress", *args, *flags])
        assert result.exit_code == 0, result.output
        outs.append(out)
    # The run read the entry warmed with the same tokenizer (training a toy model may add one
    # of the built-in corpus).
    ours = [e for e in _entries(root) if "jsonl" in (e / "meta.json").read_text()]
    assert ours == [entry]
    files = sorted(p.relative_to(outs[0]) for p in (outs[0] / "lens").rglob("*")
                   if p.suffix in (".csv", ".json"))
    assert files
    for f in files:
        assert (outs[1] / f).read_bytes() == (outs[0] / f).read_bytes()
    manifests = [json.loads((o / "manifest.json").read_text()) for o in outs]
    assert manifests[0]["data"] == manifests[1]["data"]
    assert manifests[0]["timings"]["tokens"] == manifests[1]["timings"]["tokens"]


def test_a_prefix_learns_that_the_stream_ended(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch, calls: list[Any]
) -> None:
    """One text file, cut by the budget: a longer run finds no more documents, and the entry
    is marked complete (so the next run does not read the file again)."""
    source = _source("text", tmp_path)
    list(token_batches(DataSpec(source=source, seq_len=32, max_tokens=500), byte_tokenizer()))
    (entry,) = _entries(root)
    assert not json.loads((entry / "meta.json").read_text())["complete"]
    spec = DataSpec(source=source, seq_len=32, max_tokens=10**6)
    expected = _uncached(spec, monkeypatch)
    calls.clear()
    assert _plain(token_batches(spec, byte_tokenizer())) == expected and not calls
    assert json.loads((entry / "meta.json").read_text())["complete"]
    monkeypatch.setattr(sources, "_read_text", lambda path: pytest.fail("read again"))
    assert _plain(token_batches(spec, byte_tokenizer())) == expected


def test_a_run_stopped_early_keeps_nothing(root: Path, calls: list[Any]) -> None:
    """A consumer that stops (a failing pass, Ctrl-C) leaves no entry and no temporary folder."""
    batches = token_batches(DataSpec(seq_len=32, batch_size=2, max_tokens=10**6), byte_tokenizer())
    next(batches)
    assert calls and any(p.name.startswith(".tmp-") for p in _entries(root))
    batches.close()
    assert _entries(root) == []
