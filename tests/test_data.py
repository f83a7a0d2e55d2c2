"""Data: sources (files, folders, JSONL, hub folders, the built-in corpus, a source of one's own),
packing and errors.

Packing is checked by identities: the packed rows' real tokens are the tokenised documents, in
order, each followed by EOS; splitting at EOS and decoding gives the documents back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

import lensdiv
from lensdiv.cli.common import Data
from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import DataError
from lensdiv.data.corpus import builtin_documents
from lensdiv.data.sources import (
    DataSpec,
    Source,
    check_source,
    documents,
    read_task_jsonl,
    register_source,
    registered_sources,
    source_of,
    token_batches,
    unregister_source,
)
from lensdiv.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, byte_tokenizer

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
    if max_tokens < 2:  # a row that would hold only BOS predicts nothing: refused up front
        with pytest.raises(DataError, match="--max-tokens 1 is too few"):
            DataSpec(source=str(jsonl), seq_len=16, batch_size=2, max_tokens=max_tokens)
        return
    spec = DataSpec(source=str(jsonl), seq_len=16, batch_size=2, max_tokens=max_tokens)
    stream = _stream(tokenizer, DOCS)
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


# -- data in memory, and values that are not text -------------------------------------------------


def test_documents_in_memory_pack_like_the_same_text_on_disk(tmp_path: Path, tokenizer: Any) -> None:
    spec = DataSpec.from_data(DOCS, seq_len=16, batch_size=3)
    assert spec.source == f"memory:{len(DOCS)} documents" and spec.texts == tuple(DOCS)
    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc, encoding="utf-8")
    on_disk = DataSpec(source=str(tmp_path), seq_len=16, batch_size=3)
    assert _rows(list(token_batches(spec, tokenizer))) == _rows(list(token_batches(on_disk, tokenizer)))
    inline = DataSpec.from_data("text:" + DOCS[1], seq_len=16, batch_size=3)
    assert list(documents(inline)) == [DOCS[1]]
    described = DataSpec.from_data(DOCS).describe()
    assert "texts" not in described and len(described["sha256"]) == 64
    assert described != DataSpec.from_data(DOCS[::-1]).describe()


def test_token_tensors_are_used_row_by_row(tokenizer: Any) -> None:
    tokens = torch.arange(4, 4 + 5 * 12).reshape(5, 12)
    spec = DataSpec.from_data(tokens, batch_size=2, max_tokens=50)
    batches = list(token_batches(spec, tokenizer))
    assert [b.tokens.shape[0] for b in batches] == [2, 2, 1]
    assert sum(b.n_tokens for b in batches) == 50  # the budget cuts the last row short
    real = torch.cat([b.tokens[b.mask] for b in batches])
    assert torch.equal(real, tokens.reshape(-1)[:50])
    assert all(not b.bos for b in batches)
    assert torch.equal(batches[0].doc[:, 0], torch.tensor([0, 1]))
    one_row = DataSpec.from_data(torch.tensor([BOS_ID, 5, 6, 7]))
    (batch,) = token_batches(one_row, tokenizer)
    assert batch.tokens.tolist() == [[BOS_ID, 5, 6, 7]] and batch.bos


@pytest.mark.parametrize(
    "data,needle",
    [
        (42, "cannot read data from 42"),
        (b"bytes", "cannot read data from b'bytes'"),
        (["ok", 3], "data[1] is 3"),
        ([" ", ""], "holds no text"),
        (torch.rand(2, 4), "integer ids"),
        (torch.zeros(2, 1, dtype=torch.long), "at least 2 positions"),
        (torch.full((1, 3), -1), "negative id"),
        ("text:   ", "holds no text"),
    ],
)
def test_data_that_cannot_be_read(data: Any, needle: str) -> None:
    with pytest.raises(DataError, match=None) as err:
        check_source(DataSpec.from_data(data))
    assert needle in str(err.value)


def test_a_plain_string_is_never_taken_for_text() -> None:
    with pytest.raises(DataError, match="text:") as err:
        check_source(DataSpec.from_data("the cat sat on the mat"))
    assert "does not exist" in str(err.value)


@pytest.mark.parametrize("value,kind", [(None, "null"), (7, "a number (7)"), ([1], "a list"),
                                        ({"a": 1}, "an object"), (True, "a boolean (true)")])
def test_jsonl_values_must_be_text(tmp_path: Path, tokenizer: Any, value: Any, kind: str) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(DataError) as err:  # found by the cheap check, before any model loads
        check_source(DataSpec(source=str(path)))
    assert f"d.jsonl line 2: field 'text' holds {kind}, not text" in str(err.value)


def test_task_files_check_value_kinds(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "p", "grade": 2}) + "\n")
    assert read_task_jsonl(path, ("prompt", "grade"), what="t", option="x.tasks",
                           numbers=("grade",))[0][1]["grade"] == 2
    with pytest.raises(DataError, match="'grade' holds a number \\(2\\), not text"):
        read_task_jsonl(path, ("prompt", "grade"), what="t", option="x.tasks")
    path.write_text(json.dumps({"prompt": "p", "grade": None}) + "\n")
    with pytest.raises(DataError, match="'grade' holds null, not text or a number"):
        read_task_jsonl(path, ("prompt", "grade"), what="t", option="x.tasks", numbers=("grade",))


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"seq_len": 1}, "--seq-len 1 is too short"),
        ({"max_tokens": 1}, "--max-tokens 1 is too few"),
        ({"batch_size": True}, "--batch-size must be a whole number, not True"),
        ({"seed": 2**64}, "--seed"),
        ({"field": " "}, "--field is empty"),
    ],
)
def test_spec_values_name_the_flag(bad: dict[str, Any], needle: str) -> None:
    # Values of the wrong type (8.5, None) are in tests/test_errors.py, outside the type checker.
    with pytest.raises(DataError) as err:
        DataSpec(**bad)
    assert needle in str(err.value)


# -- a data source of one's own: subclass Source, say what names it, yield documents, register ----


class Lines(Source):
    """``lines:A|B|C``: one document per ``|``-separated part."""

    kind, syntax, summary = "lines", "lines:A|B", "documents separated by |"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.source.startswith("lines:")

    def check(self) -> None:
        if not self.spec.source[len("lines:"):].strip("| "):
            raise DataError("'lines:' holds no lines", hint="write lines:A|B")

    def documents(self) -> Iterator[str]:
        return iter(self.spec.source[len("lines:"):].split("|"))


@pytest.fixture
def lines_source() -> Iterator[type[Source]]:
    register_source(Lines)
    yield Lines
    unregister_source(Lines)


def test_a_source_of_ones_own(lines_source: type[Source], tokenizer: Any, native_model: Any) -> None:
    spec = DataSpec(source="lines:" + "|".join(DOCS), seq_len=16, batch_size=3, max_tokens=10**6)
    assert check_source(spec) == "lines" and list(documents(spec)) == DOCS
    batches = list(token_batches(spec, tokenizer))
    _check_packing(batches, spec, _stream(tokenizer, DOCS))
    assert spec.describe()["source"] == spec.source and "sha256" not in spec.describe()
    with pytest.raises(DataError, match="'lines:' holds no lines"):
        check_source(DataSpec(source="lines:|"))
    # ... and through the whole API: the same numbers as the same documents in memory.
    settings: dict[str, Any] = {"plugins": "lens", "seq_len": 16, "batch_size": 3,
                                "max_tokens": 10**6, "progress": False}
    own = lensdiv.analyze(native_model, data=spec.source, **settings)
    memory = lensdiv.analyze(native_model, data=DOCS, **settings)
    assert own.ok and own.manifest["data"]["source"] == spec.source
    mine, theirs = own.results["lens"].to_dict(), memory.results["lens"].to_dict()
    assert mine["meta"]["tokens"] == theirs["meta"]["tokens"] == sum(b.n_tokens for b in batches)
    assert mine["tables"] == theirs["tables"] and mine["summary"] == theirs["summary"]


def test_sources_register_once_and_unregister(lines_source: type[Source]) -> None:
    assert registered_sources()[-1] is Lines
    with pytest.raises(ValueError, match="kind 'lines' is registered already"):
        register_source(type("Again", (Lines,), {}))
    with pytest.raises(TypeError, match="not a concrete subclass"):
        register_source(Source)  # type: ignore[type-abstract]  # the point of the test
    unregister_source(Lines)
    with pytest.raises(DataError, match="does not exist"):  # a path again, as before
        check_source(DataSpec(source="lines:a|b"))
    with pytest.raises(ValueError, match="not registered"):
        unregister_source(Lines)
    register_source(Lines)  # for the fixture to take away


def test_builtin_sources_and_the_data_help() -> None:
    kinds = [s.kind for s in registered_sources()]
    assert kinds[:8] == ["text", "jsonl", "folder", "hub", "literal", "builtin", "memory", "tokens"]
    assert kinds[8:] == ["pydoc"]  # after the path sources, which claim any string
    help_text = Data.__metadata__[0].help
    for source in registered_sources():
        assert (source.syntax in help_text) == source.command_line
    assert help_text.endswith(
        "Default: pydoc for a real model (a catalog name, a .gguf file), else the built-in corpus."
    )


# -- packing in chunks is packing one document at a time -------------------------------------------


def _pack_one_at_a_time(docs: Iterator[str], tokenizer: Any, spec: DataSpec) -> Iterator[Batch]:
    """The packing of lensdiv 0.1 (one tokenizer call per document, rows as lists of ``(token,
    document)``): the oracle that the chunked, array-based :func:`pack` must equal exactly."""
    bos = tokenizer.bos_token_id if spec.bos == "prepend" else None
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    width = spec.seq_len - (bos is not None)
    rows: list[list[tuple[int, int]]] = []
    buffer: list[tuple[int, int]] = []
    budget, index, n_docs = spec.max_tokens, 0, 0

    def emit(final: bool) -> Iterator[Batch]:
        nonlocal rows, index
        while rows and (len(rows) >= spec.batch_size or final):
            chunk, rows = rows[: spec.batch_size], rows[spec.batch_size:]
            length = max(len(r) for r in chunk)
            tokens = torch.full((len(chunk), length), pad, dtype=torch.long)
            doc = torch.full((len(chunk), length), -1, dtype=torch.long)
            for i, r in enumerate(chunk):
                tokens[i, : len(r)] = torch.tensor([t for t, _ in r])
                doc[i, : len(r)] = torch.tensor([d for _, d in r])
            yield Batch(tokens=tokens, mask=doc >= 0, bos=bos is not None, index=index, doc=doc)
            index += 1

    def take(content: list[tuple[int, int]]) -> None:
        nonlocal budget
        row = (([(bos, content[0][1])] if bos is not None else []) + content)[:budget]
        budget -= len(row)
        if len(row) > (bos is not None):
            rows.append(row)

    for text in docs:
        if not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        buffer += [(t, n_docs) for t in ids]
        n_docs += 1
        while len(buffer) >= width and budget > 0:
            take(buffer[:width])
            buffer = buffer[width:]
        yield from emit(False)
        if budget <= 0:
            break
    if budget > 0 and buffer:
        take(buffer)
    if index == 0 and not rows:
        raise DataError("data 'documents' produced no tokens",
                        hint="check that the text (or --field) is not empty")
    yield from emit(True)


def _outcome(batches: Iterator[Batch]) -> list[Any]:
    """Every batch as plain data, then what stopped the stream (an error's message)."""
    out: list[Any] = []
    try:
        for b in batches:
            out.append((b.index, b.bos, b.tokens.dtype, b.tokens.tolist(), b.mask.dtype,
                        b.mask.tolist(), b.doc.tolist() if b.doc is not None else None))
    except DataError as err:
        out.append(str(err))
    return out


def _failing_at(docs: list[str], bad: int | None) -> Iterator[str]:
    for i, doc in enumerate(docs):
        if i == bad:
            raise DataError(f"rows.jsonl line {i + 1} is not JSON: Expecting value")
        yield doc


@pytest.mark.parametrize("seed", range(4))
def test_packing_in_chunks_equals_one_document_at_a_time(tokenizer: Any, seed: int) -> None:
    """The same batches, bit for bit, on random streams: blank and tiny documents, budgets that
    cut rows short or end the data, a document that fails to read before or after the budget
    runs out (raised after the same batches, or not at all)."""
    import random

    from lensdiv.data.sources import pack

    rng = random.Random(seed)
    pool = [*islice(builtin_documents(seed=seed), 60), *DOCS, "", "  \n", "é", "<eos> literal"]
    for _ in range(60):
        docs = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        spec = DataSpec(seq_len=rng.choice([2, 3, 5, 16, 64]), batch_size=rng.choice([1, 2, 3, 8]),
                        max_tokens=rng.choice([2, 3, 17, 100, 1000, 10**6]),
                        bos=rng.choice(["prepend", "none"]))
        bad = rng.randint(0, len(docs)) if rng.random() < 0.3 else None
        expected = _outcome(_pack_one_at_a_time(_failing_at(docs, bad), tokenizer, spec))
        assert _outcome(pack(_failing_at(docs, bad), tokenizer, spec)) == expected, (spec, bad)


def test_one_tokenizer_call_per_chunk_equals_one_per_document(tokenizer: Any) -> None:
    """A fast tokenizer's batch call gives each text the ids of its own call: lensdiv's byte
    tokenizer, and a GPT-2-style byte-level BPE (regex pre-tokenizer, merges) trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lensdiv.data.packing import _encode

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator([*islice(builtin_documents(seed=1), 200), *DOCS], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")
    texts = [*DOCS, *islice(builtin_documents(seed=2), 50), "<|endoftext|> inside", " lead"]
    for tok in (tokenizer, bpe):
        assert _encode(tok, texts) == [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


# -- pydoc: Python's documentation, a real corpus in every Python --------------------------------


def test_pydoc_parts_are_fixed_and_disjoint() -> None:
    from pydoc_data.topics import topics

    from lensdiv.data.pydocs import HELDOUT_EVERY, pydoc_topics

    train, held = pydoc_topics("train"), pydoc_topics("heldout")
    keys = sorted(topics)
    assert [k for k, _ in held] == keys[::HELDOUT_EVERY]
    assert [k for k, _ in train] == [k for i, k in enumerate(keys) if i % HELDOUT_EVERY]
    assert {k for k, _ in train}.isdisjoint(k for k, _ in held)
    assert list(documents(DataSpec(source="pydoc"))) == [t for _, t in train]
    assert list(documents(DataSpec(source="pydoc:train"))) == [t for _, t in train]
    assert list(documents(DataSpec(source="pydoc:heldout"))) == [t for _, t in held]
    assert check_source(DataSpec(source="pydoc:heldout")) == "pydoc"
    with pytest.raises(DataError, match="does not exist"):  # other names are still paths
        check_source(DataSpec(source="pydoc:test"))


def test_pydoc_describes_itself_and_is_cached(tokenizer: Any) -> None:
    import platform

    spec = DataSpec(source="pydoc:heldout", seq_len=32, max_tokens=2000, batch_size=4)
    source = source_of(spec)
    facts = source.describe()
    assert facts["python"] == platform.python_version() and facts["part"] == "heldout"
    assert "Python Software Foundation" in facts["corpus"] and len(facts["sha256"]) == 64
    assert source.text_bytes() == sum(len(d.encode()) for d in documents(spec))
    identity = source.cache_identity()
    assert identity is not None and identity["part"] == "heldout"
    assert identity != source_of(DataSpec(source="pydoc")).cache_identity()
    first = [b.tokens for b in token_batches(spec, tokenizer)]
    again = [b.tokens for b in token_batches(spec, tokenizer)]  # from the token cache
    assert sum(int((t != PAD_ID).sum()) for t in first) == 2000
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_default_data_depends_on_the_model(tmp_path: Path) -> None:
    from lensdiv.run.defaults import default_data

    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF")
    assert default_data("toy") == default_data("toy:d2") == "builtin"
    assert default_data("smollm2-135m") == default_data(gguf_file) == "pydoc"
    assert default_data(str(gguf_file), "gemma3-270m") == "pydoc"
    assert default_data("gemma3-270m", "toy") == "builtin"  # a study reads one corpus
    assert default_data(str(tmp_path / "missing")) == "builtin"  # its load says why
    assert DataSpec.from_data(None, default="pydoc").source == "pydoc"
    assert DataSpec.from_data("builtin", default="pydoc").source == "builtin"
