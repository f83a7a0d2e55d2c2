"""The built-in data sources: read documents from a text file, a JSONL file, a folder, a hub data
set, ``text:``, the built-in corpus or memory; and what callers use (:func:`check_source`,
:func:`documents`, :func:`token_batches`), which find the source a spec names and ask it.

The spec and the source protocol are in :mod:`lensdiv.data.spec`, packing in
:mod:`lensdiv.data.packing`; their public names are importable from here too. Importing this module
does not import torch (``lensdiv --help`` reads its registry).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lensdiv.core.errors import DataError
from lensdiv.data.cache import file_identity
from lensdiv.data.corpus import CORPUS_VERSION, builtin_documents
from lensdiv.data.packing import pack
from lensdiv.data.spec import (
    BUILTIN,
    FLAG_HINTS,
    LITERAL,
    DataSpec,
    Source,
    checked_documents,
    register_source,
    registered_sources,
    source_of,
    unregister_source,
)
from lensdiv.data.tasks import json_kind, read_task_jsonl

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch
    from lensdiv.core.bridge import Tokenizer

__all__ = [
    "BUILTIN",
    "DataSpec",
    "Source",
    "check_source",
    "documents",
    "known_tokens",
    "most_tokens",
    "pack",
    "read_task_jsonl",
    "register_source",
    "registered_sources",
    "source_of",
    "token_batches",
    "unregister_source",
]

_SNIFF_BYTES = 1 << 16


class TextFile(Source):
    """A UTF-8 text file: one document. Claims every string no later source claims, so a typo
    in a path is an error here, never text."""

    kind = "text"
    order = 10
    syntax = "FILE"
    summary = "a UTF-8 text file"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return True

    def check(self) -> None:
        _check_file(_existing_path(self.spec.source))

    def documents(self) -> Iterator[str]:
        yield _read_text(Path(self.spec.source).expanduser())

    def cache_identity(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "file": file_identity(Path(self.spec.source).expanduser())}

    def text_bytes(self) -> int | None:
        return _sizes([Path(self.spec.source).expanduser()])


class JsonlFile(Source):
    """A ``.jsonl`` (or ``.ndjson``) file: one document per row, the text in ``spec.field``."""

    kind = "jsonl"
    order = 20
    syntax = "FILE.jsonl"
    summary = "one JSON object a line"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return Path(spec.source).suffix.lower() in (".jsonl", ".ndjson")

    def check(self) -> None:
        path = _existing_path(self.spec.source)
        head = _check_file(path)
        # The rows read at once anyway: a wrong --field or a non-text value on the first lines
        # fails here, before any model loads (later lines fail when they are reached).
        whole = head.split(b"\n")[:-1] if len(head) == _SNIFF_BYTES else head.split(b"\n")
        lines = b"\n".join(whole).decode("utf-8", errors="replace").split("\n")
        for _ in _jsonl_rows(lines, path.name, self.spec.field):
            pass

    def documents(self) -> Iterator[str]:
        return _jsonl_documents(Path(self.spec.source).expanduser(), self.spec.field)

    def cache_identity(self) -> dict[str, Any] | None:
        path = Path(self.spec.source).expanduser()
        return {"kind": self.kind, "file": file_identity(path), "field": self.spec.field}

    def text_bytes(self) -> int | None:
        return _sizes([Path(self.spec.source).expanduser()])  # the JSON around the text too


class TextFolder(Source):
    """A folder: every ``.txt`` file below it, in sorted order, one document each."""

    kind = "folder"
    order = 30
    syntax = "DIR"
    summary = "a folder of .txt files"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        try:
            return bool(spec.source.strip()) and Path(spec.source).expanduser().is_dir()
        except (OSError, RuntimeError):  # a name too long, an unknown ~user: the file check says
            return False

    def check(self) -> None:
        files = self._files()
        if not files:
            raise DataError(
                f"folder {self.spec.source!r} holds no .txt files",
                hint="put text in *.txt files, or pass a file",
            )
        for f in files:
            _check_file(f)

    def documents(self) -> Iterator[str]:
        for f in self._files():
            yield _read_text(f)

    def _files(self) -> list[Path]:
        return sorted(Path(self.spec.source).expanduser().rglob("*.txt"))

    def cache_identity(self) -> dict[str, Any] | None:
        files = self._files()
        return {"kind": self.kind, "files": [file_identity(f) for f in files]} if files else None

    def text_bytes(self) -> int | None:
        return _sizes(self._files())


class HubDataset(Source):
    """A hub data set ``hf:NAME[:CONFIG]`` (or a local folder of data files), streamed: split
    ``spec.split``, the text in ``spec.field``."""

    kind = "hub"
    order = 40
    syntax = "hf:NAME[:CONFIG]"
    summary = "a hub data set"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.source.startswith("hf:")

    def check(self) -> None:
        if len(self.spec.source) <= 3:
            raise DataError(
                "empty hub data set name in 'hf:'", hint="use hf:NAME or hf:NAME:CONFIG"
            )

    def documents(self) -> Iterator[str]:
        spec = self.spec
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
        yield _text(first[spec.field], f"data set {name!r} row 1", spec.field)
        for number, row in enumerate(rows, 2):
            yield _text(row.get(spec.field), f"data set {name!r} row {number}", spec.field)

    def cache_identity(self) -> dict[str, Any] | None:
        """The name, config, split and field; a local folder of data files also by its files'
        sizes and modification times (a hub data set is assumed not to change under its name:
        ``LENSDIV_TOKEN_CACHE=off`` reads it again)."""
        spec = self.spec
        name, _, config = spec.source[3:].partition(":")
        out: dict[str, Any] = {"kind": self.kind, "name": name, "config": config}
        out |= {"split": spec.split, "field": spec.field}
        local = Path(name).expanduser()
        if name and local.exists():
            files = (
                [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
            )
            out["files"] = [file_identity(f) for f in files]
        return out


class InlineText(Source):
    """``text:TEXT``: the text itself, one document (described by its start and checksum)."""

    kind = "literal"
    order = 50
    syntax = "text:TEXT"
    summary = "the text itself"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.source.startswith(LITERAL)

    def check(self) -> None:
        if not self.spec.source[len(LITERAL) :].strip():
            raise DataError("'text:' holds no text", hint="write the text after text:")

    def documents(self) -> Iterator[str]:
        yield self.spec.source[len(LITERAL) :]

    def text_bytes(self) -> int | None:
        return len(self.spec.source[len(LITERAL) :].encode())

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if len(self.spec.source) > 80:
            out["source"] = f"{self.spec.source[:77]}..."
        return out | {"sha256": hashlib.sha256(self.spec.source.encode()).hexdigest()}


class BuiltinCorpus(Source):
    """The built-in synthetic corpus, seeded by ``spec.seed`` (see :mod:`lensdiv.data.corpus`)."""

    kind = "builtin"
    order = 60
    syntax = BUILTIN
    summary = "the built-in corpus"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.source == BUILTIN

    def documents(self) -> Iterator[str]:
        return builtin_documents(seed=self.spec.seed)

    def cache_identity(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "seed": self.spec.seed, "corpus": CORPUS_VERSION}


class MemoryDocuments(Source):
    """Documents in memory (``data=[...]`` of the Python API), one string each."""

    kind = "memory"
    order = 70
    syntax = "[TEXT, ...]"
    summary = "documents in memory"
    command_line = False

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.texts is not None

    def documents(self) -> Iterator[str]:
        return iter(self.spec.texts or ())

    def text_bytes(self) -> int | None:
        return sum(len(text.encode()) for text in self.spec.texts or ())

    def describe(self) -> dict[str, Any]:
        blob = "\x00".join(self.spec.texts or ()).encode()
        return super().describe() | {"sha256": hashlib.sha256(blob).hexdigest()}


class TokenRows(Source):
    """A token tensor ``[batch, pos]`` in memory: each row one sequence (and one document), used
    as it is — no BOS added, nothing packed, ``seq_len`` does not apply."""

    kind = "tokens"
    order = 80
    syntax = "tensor[batch, pos]"
    summary = "token rows in memory"
    command_line = False
    tokenizes = False

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.tokens is not None

    def documents(self) -> Iterator[str]:
        raise DataError("token data has no documents", hint="read it with token_batches")

    def batches(self, tokenizer: Tokenizer) -> Iterator[Batch]:
        """``batch_size`` rows a batch, up to ``max_tokens`` real tokens (the last row kept is
        cut short, its tail masked); BOS is marked when every row of a batch starts with it."""
        import torch

        # start-up: the --data help reads this module; torch loads when batches are made.
        from lensdiv.core.analyzer import Batch

        spec = self.spec
        rows = spec.tokens
        width = rows.shape[1]
        bos_id = getattr(tokenizer, "bos_token_id", None)
        budget = spec.max_tokens
        for index, lo in enumerate(range(0, rows.shape[0], spec.batch_size)):
            if budget <= 1:
                break
            tokens = rows[lo : lo + spec.batch_size].clone()
            keep = min(tokens.shape[0], -(-budget // width))
            tokens = tokens[:keep]
            mask = torch.ones_like(tokens, dtype=torch.bool)
            used = tokens.numel()
            if used > budget:
                mask[-1, width - (used - budget) :] = False
            budget -= int(mask.sum())
            doc = torch.arange(lo, lo + keep)[:, None].expand_as(tokens).clone()
            bos = bos_id is not None and bool((tokens[:, 0] == bos_id).all())
            yield Batch(tokens=tokens, mask=mask, bos=bos, index=index, doc=doc)

    def most_tokens(self) -> int:
        """Exactly the real tokens :meth:`batches` yields (the same arithmetic, no tensors)."""
        n_rows, width = (int(n) for n in self.spec.tokens.shape)
        budget = total = self.spec.max_tokens
        for lo in range(0, n_rows, self.spec.batch_size):
            if budget <= 1:
                break
            keep = min(self.spec.batch_size, n_rows - lo, -(-budget // width))
            budget -= min(keep * width, budget)
        return total - budget

    def describe(self) -> dict[str, Any]:
        blob = self.spec.tokens.cpu().numpy().tobytes()
        return super().describe() | {"sha256": hashlib.sha256(blob).hexdigest()}


# -- what callers use ------------------------------------------------------------------------------


def check_source(spec: DataSpec) -> str:
    """Validate the source cheaply (before any model is loaded); return its kind.

    Raises:
        DataError: The source is missing, empty, binary or malformed, with a hint.
    """
    source = source_of(spec)
    source.check()
    return source.kind


def documents(spec: DataSpec) -> Iterator[str]:
    """Yield the documents of the source, lazily (checked when the first is asked for)."""
    yield from checked_documents(source_of(spec))


def token_batches(spec: DataSpec, tokenizer: Tokenizer) -> Iterator[Batch]:
    """Tokenise and pack the documents of ``spec`` into :class:`~lensdiv.core.analyzer.Batch` es,
    lazily (a token tensor's rows are used as they are, ``batch_size`` rows a batch); with
    ``skip_tokens``, the batches after the first ``skip_tokens`` real tokens, numbered from 0."""
    if not spec.skip_tokens:
        return source_of(spec).batches(tokenizer)
    whole = dataclasses.replace(spec, max_tokens=spec.max_tokens + spec.skip_tokens, skip_tokens=0)
    return _after(source_of(whole).batches(tokenizer), spec.skip_tokens)


def most_tokens(spec: DataSpec) -> int:
    """The most real tokens :func:`token_batches` can yield, known without reading the data
    (exact for a token tensor; see :meth:`Source.most_tokens`)."""
    if not spec.skip_tokens:
        return source_of(spec).most_tokens()
    whole = dataclasses.replace(spec, max_tokens=spec.max_tokens + spec.skip_tokens, skip_tokens=0)
    return max(0, min(spec.max_tokens, source_of(whole).most_tokens() - spec.skip_tokens))


#: The most bytes of text :func:`known_tokens` tokenises to count a source's tokens before a run
#: (seconds with a fast tokenizer; the token cache keeps the ids for the run).
COUNT_BYTES = 16 << 20


def known_tokens(
    spec: DataSpec, tokenizer: Tokenizer, *, most_bytes: int = COUNT_BYTES
) -> int | None:
    """The real tokens :func:`token_batches` yields for ``spec`` (at most ``max_tokens``), when
    that is cheap to know before a run, else ``None``.

    Token rows in memory are counted by arithmetic; a source that holds at most ``most_bytes``
    bytes of text (:meth:`Source.text_bytes`: files, text in memory) is packed and its batches
    counted — through the token cache, so a run that follows reads its ids from there. Data
    that fails to read is left for the run to meet (``None``).
    """
    source = source_of(spec)
    if spec.tokens is not None:
        return most_tokens(spec)
    try:
        size = source.text_bytes()
    except OSError:  # the run's own check says why
        return None
    if size is None or size > most_bytes:
        return None
    try:
        return sum(batch.n_tokens for batch in token_batches(spec, tokenizer))
    except DataError:
        return None


def _sizes(paths: list[Path]) -> int | None:
    """The summed sizes of ``paths`` in bytes (``None`` if one cannot be looked at)."""
    try:
        return sum(path.stat().st_size for path in paths)
    except OSError:
        return None


def _after(batches: Iterator[Batch], skip: int) -> Iterator[Batch]:
    """The batches after the first ``skip`` real tokens (whole batches), renumbered from 0."""
    seen, index = 0, 0
    for batch in batches:
        if seen < skip:
            seen += batch.n_tokens
            continue
        batch.index = index
        index += 1
        yield batch


def _existing_path(source: str) -> Path:
    """``source`` as a path that exists (a file or a folder).

    Raises:
        DataError: ``source`` is empty or names nothing; a string that looks like text is told
            how to pass text.
    """
    if not source.strip():
        raise DataError("the data source is empty", hint=FLAG_HINTS["source"])
    path = Path(source).expanduser()
    if not path.exists():
        looks_like_text = "\n" in source or (" " in source and not any(c in source for c in "/\\"))
        raise DataError(
            f"data file {source[:80]!r} does not exist",
            hint="to analyse this string itself, pass data='text:...' (or a list of strings)"
            if looks_like_text
            else "check the path (or omit --data for the built-in corpus)",
        )
    return path


def _check_file(path: Path) -> bytes:
    """The first bytes of ``path``, after checking it is non-empty UTF-8 text."""
    try:
        with path.open("rb") as fh:
            head = fh.read(_SNIFF_BYTES)
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
    return head


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{str(path)!r} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:  # removed or unreadable since the run began
        raise DataError(f"cannot read {str(path)!r}: {err.strerror or err}") from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    try:
        with path.open(encoding="utf-8") as fh:
            yield from _jsonl_rows(fh, path.name, field)
    except UnicodeDecodeError as err:
        raise DataError(f"{path.name} is not UTF-8 text (byte {err.start})") from None
    except OSError as err:  # removed or unreadable since the run began
        raise DataError(f"cannot read {str(path)!r}: {err.strerror or err}") from None


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
        yield _text(row[field], f"{name} line {lineno}", field)


def _text(value: Any, where: str, field: str) -> str:
    """A document's text, refusing what is not text (null, a number, an object)."""
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {field!r} holds {json_kind(value)}, not text",
            hint="make it a string, drop the row, or choose the text field with --field",
        )
    return value
