"""Data: read documents from text, JSONL, a folder, a hub data set or the built-in corpus, then
tokenise and pack them into fixed-length, right-padded sequences.

Packing: documents are joined by EOS and cut into rows of ``seq_len`` tokens; with the default BOS
policy every row starts with BOS. Only the last row may be padded, on the right, and its mask is
False there, so pad positions never enter a statistic (and, attention being causal, never
influence a real position).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import DataError
from lensdiv.data.corpus import builtin_documents

BUILTIN = "builtin"
_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class DataSpec:
    """Where the text comes from and how it is cut.

    Args:
        source: A ``.txt`` file, a ``.jsonl`` file, a folder of ``.txt`` files, ``hf:NAME[:CONFIG]``
            (a hub data set, or a local folder of data files), or ``"builtin"``.
        field: JSONL / data-set field holding the text.
        split: Data-set split for ``hf:`` sources.
        seq_len: Tokens per row, BOS included.
        max_tokens: Stop after this many real tokens.
        batch_size: Rows per forward pass.
        bos: ``"prepend"`` puts BOS at position 0 of every row; ``"none"`` does not.
        seed: Seed of the built-in corpus.
    """

    source: str = BUILTIN
    field: str = "text"
    split: str = "train"
    seq_len: int = 128
    max_tokens: int = 16384
    batch_size: int = 8
    bos: str = "prepend"  # validated below: "prepend" | "none"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "max_tokens", "batch_size"):
            if getattr(self, name) < (2 if name == "seq_len" else 1):
                raise DataError(
                    f"{name.replace('_', '-')} must be positive, got {getattr(self, name)}"
                )
        if self.bos not in ("prepend", "none"):
            raise DataError(
                f"bos policy must be 'prepend' or 'none', not {self.bos!r}",
                hint="use --bos prepend (default) or --bos none",
            )


def check_source(spec: DataSpec) -> str:
    """Validate the source cheaply (before any model is loaded); return its kind."""
    src = spec.source
    if src == BUILTIN:
        return "builtin"
    if src.startswith("hf:"):
        if len(src) <= 3:
            raise DataError(
                "empty hub data set name in 'hf:'", hint="use hf:NAME or hf:NAME:CONFIG"
            )
        return "hub"
    path = Path(src).expanduser()
    if not path.exists():
        raise DataError(
            f"data file {src!r} does not exist",
            hint="check the path (or omit --data for the built-in corpus)",
        )
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise DataError(
                f"folder {src!r} holds no .txt files",
                hint="put text in *.txt files, or pass a file",
            )
        for f in files:
            _check_file(f)
        return "folder"
    _check_file(path)
    return "jsonl" if path.suffix.lower() in (".jsonl", ".ndjson") else "text"


def _check_file(path: Path) -> None:
    try:
        head = path.open("rb").read(_SNIFF_BYTES)
    except OSError as err:
        raise DataError(f"cannot read {str(path)!r}: {err.strerror}") from None
    if not head.strip():
        raise DataError(f"data file {str(path)!r} is empty", hint="give it some text")
    if b"\x00" in head:
        raise DataError(
            f"data file {str(path)!r} looks binary (it contains NUL bytes)",
            hint="pass UTF-8 text, JSONL, or a folder of .txt files",
        )
    try:
        # A multi-byte character may be cut at the sniff boundary; ignore only that tail.
        head.decode("utf-8") if len(head) < _SNIFF_BYTES else head[:-4].decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(
            f"data file {str(path)!r} is not UTF-8 text",
            hint="convert it to UTF-8 (e.g. iconv -t utf-8)",
        ) from None


def documents(spec: DataSpec) -> Iterator[str]:
    """Yield the documents of the source, lazily."""
    kind = check_source(spec)
    if kind == "builtin":
        yield from builtin_documents(seed=spec.seed)
    elif kind == "hub":
        yield from _hub_documents(spec)
    elif kind == "folder":
        for f in sorted(Path(spec.source).expanduser().rglob("*.txt")):
            yield _read_text(f)
    elif kind == "jsonl":
        yield from _jsonl_documents(Path(spec.source).expanduser(), spec.field)
    else:
        yield _read_text(Path(spec.source).expanduser())


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{str(path)!r} is not UTF-8 text (byte {err.start})") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as fh:
            yield from _jsonl_rows(fh, path.name, field)
    except UnicodeDecodeError as err:
        raise DataError(f"{path.name} is not UTF-8 text (byte {err.start})") from None


def _jsonl_rows(lines: Iterable[str], name: str, field: str) -> Iterator[str]:
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{name} line {lineno} is not JSON: {err.msg}") from None
        if not isinstance(row, dict) or field not in row:
            keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(
                f"{name} line {lineno} has no field {field!r} (it has: {keys})",
                hint="choose the text field with --field",
            )
        yield str(row[field])


def read_task_jsonl(
    path: str | Path, required: tuple[str, ...], *, what: str, option: str
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each row of a task file (patching pairs, graded prompts).

    Raises:
        DataError: Missing, non-UTF-8 or empty file, bad JSON, a non-object or a missing key —
            one line naming the file and line, with a hint showing the expected row.
    """
    path = Path(path)
    example = "{" + ", ".join(f'"{key}": ...' for key in required) + "}"
    if not path.is_file():
        raise DataError(
            f"{what} file {str(path)!r} does not exist",
            hint=f"pass a JSONL file of {example} rows with -O {option}=FILE",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{what} file {str(path)!r} is not UTF-8 text") from None
    rows = []
    for number, raw in enumerate(text.split("\n"), start=1):  # not splitlines: JSON allows U+2028
        if not raw.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{where}: not valid JSON ({err.msg})", hint=f"each line must be one {example}"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in required:
            if key not in row:
                raise DataError(
                    f"{where}: missing key {key!r} (it has: {', '.join(row) or 'none'})",
                    hint=f"each line needs {example}",
                )
        rows.append((number, row))
    if not rows:
        raise DataError(f"{what} file {str(path)!r} is empty", hint=f"add {example} rows")
    return rows


def _hub_documents(spec: DataSpec) -> Iterator[str]:
    name, _, config = spec.source[3:].partition(":")
    try:
        import datasets
    except ImportError:
        raise DataError(
            "hub data sets need the 'datasets' package", hint="pip install 'lensdiv[hub]'"
        ) from None
    try:
        ds = datasets.load_dataset(name, config or None, split=spec.split, streaming=True)
        rows = iter(ds)
        first = next(rows)
    except StopIteration:
        raise DataError(f"hub data set {name!r} split {spec.split!r} is empty") from None
    except Exception as err:
        reason = " ".join(str(err).split())[:200]
        raise DataError(
            f"cannot load data set {name!r} (split {spec.split!r}): {reason}",
            hint="check the name, --split and your connection",
        ) from None
    if spec.field not in first:
        raise DataError(
            f"data set {name!r} has no field {spec.field!r} (it has: {', '.join(first)})",
            hint="choose the text field with --field",
        )
    yield str(first[spec.field])
    for row in rows:
        yield str(row[spec.field])


def token_batches(spec: DataSpec, tokenizer: Any) -> Iterator[Any]:
    """Tokenise and pack the documents of ``spec`` into :class:`~lensdiv.core.analyzer.Batch` es."""
    return pack(documents(spec), tokenizer, spec, source=spec.source)


def pack(
    docs: Iterable[str], tokenizer: Any, spec: DataSpec, *, source: str = "documents"
) -> Iterator[Any]:
    """Pack any stream of documents the way :func:`token_batches` does (``spec`` gives the sizes)."""
    import torch

    bos_id = tokenizer.bos_token_id if spec.bos == "prepend" else None
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_id or 0)
    width = spec.seq_len - (bos_id is not None)
    # Each row is a list of (token, document index); BOS belongs to the row's first document.
    rows: list[list[tuple[int, int]]] = []
    buffer: list[tuple[int, int]] = []
    budget = spec.max_tokens
    index = 0

    def emit(final: bool = False) -> Iterator[Batch]:
        nonlocal rows, index
        while rows and (len(rows) >= spec.batch_size or final):
            chunk, rows = rows[: spec.batch_size], rows[spec.batch_size :]
            length = max(len(r) for r in chunk)
            tokens = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), length), dtype=torch.bool)
            doc = torch.full((len(chunk), length), -1, dtype=torch.long)
            for i, r in enumerate(chunk):
                tokens[i, : len(r)] = torch.tensor([t for t, _ in r])
                doc[i, : len(r)] = torch.tensor([d for _, d in r])
                mask[i, : len(r)] = True
            yield Batch(tokens=tokens, mask=mask, bos=bos_id is not None, index=index, doc=doc)
            index += 1

    def take(content: list[tuple[int, int]]) -> None:
        nonlocal budget
        row = ([(bos_id, content[0][1])] if bos_id is not None else []) + content
        row = row[:budget]
        budget -= len(row)
        if len(row) > (bos_id is not None):
            rows.append(row)

    n_docs = 0
    for doc in docs:
        if not doc.strip():
            continue
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        ids = ids + ([eos_id] if eos_id is not None else [])
        buffer.extend((t, n_docs) for t in ids)
        n_docs += 1
        while len(buffer) >= width and budget > 0:
            take(buffer[:width])
            buffer = buffer[width:]
        yield from emit()
        if budget <= 0:
            break
    if budget > 0 and buffer:
        take(buffer)
    if index == 0 and not rows:
        raise DataError(
            f"data {source!r} produced no tokens",
            hint="check that the text (or --field) is not empty",
        )
    yield from emit(final=True)
