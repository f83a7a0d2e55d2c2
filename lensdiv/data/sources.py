"""Data sources: read documents from text, JSONL, a folder, a hub data set, the built-in corpus or
memory, then tokenise and pack them into fixed-length, right-padded sequences.

Each kind of source is one subclass of :class:`Source`, registered once with
:func:`register_source`: it says whether a :class:`DataSpec` names it, checks itself cheaply
before any model loads, yields its documents (or, for token rows, its batches) and describes
itself for the manifest and for the ``--data`` help. :func:`check_source`, :func:`documents`
and :func:`token_batches` find the source a spec names and ask it.

In the Python API, ``data`` may also be in memory: a list of strings (one document each),
``"text:..."`` (the string after ``text:`` is the one document; a plain string always names a
file, folder or ``hf:`` data set, so a typo in a path is an error, never analysed as text), or a
token tensor ``[batch, pos]`` (or ``[pos]``) whose rows are used as they are: no BOS is added,
nothing is packed, and ``seq_len`` does not apply.

Packing: documents are joined by EOS and cut into rows of ``seq_len`` tokens; with the default BOS
policy every row starts with BOS. Only the last row may be padded, on the right, and its mask is
False there, so pad positions never enter a statistic (and, attention being causal, never
influence a real position).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import inspect
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from lensdiv.core.errors import DataError
from lensdiv.core.settings import DEFAULTS
from lensdiv.data.cache import file_identity, token_cache
from lensdiv.data.corpus import CORPUS_VERSION, builtin_documents

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch

BUILTIN = "builtin"
_SNIFF_BYTES = 1 << 16


@dataclass(frozen=True)
class DataSpec:
    """Where the text comes from and how it is cut.

    Args:
        source: A ``.txt`` file, a ``.jsonl`` file, a folder of ``.txt`` files, ``hf:NAME[:CONFIG]``
            (a hub data set, or a local folder of data files), ``text:TEXT`` (one document given
            inline) or ``"builtin"``; for data in memory, a description (``memory:...``).
        field: JSONL / data-set field holding the text.
        split: Data-set split for ``hf:`` sources.
        seq_len: Tokens per row, BOS included.
        max_tokens: Stop after this many real tokens.
        batch_size: Rows per forward pass.
        bos: ``"prepend"`` puts BOS at position 0 of every row; ``"none"`` does not.
        seed: Seed of the built-in corpus.
        texts: Documents in memory (see :meth:`from_data`), instead of ``source``.
        tokens: A token tensor ``[batch, pos]`` in memory, rows used as they are.
        skip_tokens: Leave out the first batches of the stream, up to this many real tokens
            (whole batches): what follows is data that a run over the first ``skip_tokens``
            never saw (a fitted lens is evaluated there). ``max_tokens`` counts after them.
    """

    source: str = BUILTIN
    # the defaults of the run settings that say how data is read (declared in core/settings)
    field: str = DEFAULTS.field
    split: str = DEFAULTS.split
    seq_len: int = DEFAULTS.seq_len
    max_tokens: int = cast(int, DEFAULTS.max_tokens)  # a number there (None: a fit's budget)
    batch_size: int = DEFAULTS.batch_size
    bos: str = DEFAULTS.bos  # validated below: "prepend" | "none"
    seed: int = DEFAULTS.seed
    texts: tuple[str, ...] | None = dataclasses.field(default=None, repr=False, compare=False)
    tokens: Any = dataclasses.field(default=None, repr=False, compare=False)
    skip_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("source", "field", "split", "bos"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise DataError(
                    f"{name} must be text, not {value!r} ({type(value).__name__})",
                    hint=_FLAG_HINTS[name],
                )
        for name in ("seq_len", "max_tokens", "batch_size", "seed", "skip_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DataError(
                    f"{_flag(name)} must be a whole number, not {value!r} ({type(value).__name__})",
                    hint=_FLAG_HINTS[name],
                )
        if not -(2**63) <= self.seed < 2**63:
            raise DataError(
                f"--seed {self.seed} is out of range", hint="use a seed between -2^63 and 2^63 - 1"
            )
        if self.seq_len < 2:
            raise DataError(
                f"--seq-len {self.seq_len} is too short: a sequence needs at least 2 tokens (with "
                "the default BOS, BOS and one token) to predict anything",
                hint=f"use --seq-len 2 or more (default {DEFAULTS.seq_len})",
            )
        if self.max_tokens < 2:
            raise DataError(
                f"--max-tokens {self.max_tokens} is too few: at least 2 tokens are needed to "
                "predict one",
                hint=f"use --max-tokens 2 or more (default {DEFAULTS.max_tokens})",
            )
        if self.batch_size < 1:
            raise DataError(
                f"--batch-size must be at least 1, got {self.batch_size}",
                hint=_FLAG_HINTS["batch_size"],
            )
        if self.skip_tokens < 0:
            raise DataError(
                f"skip_tokens must be 0 or more, got {self.skip_tokens}",
                hint=_FLAG_HINTS["skip_tokens"],
            )
        if self.bos not in ("prepend", "none"):
            raise DataError(
                f"bos policy must be 'prepend' or 'none', not {self.bos!r}",
                hint="use --bos prepend (default) or --bos none",
            )
        if not self.field.strip():
            raise DataError("--field is empty", hint="name the JSONL / data-set field of the text")

    @classmethod
    def from_data(cls, data: Any, **settings: Any) -> DataSpec:
        """A spec for anything the API accepts as ``data``: ``None`` (the built-in corpus), a
        source string or path, ``"text:..."``, a list of strings, a token tensor, or a spec.

        Raises:
            DataError: Anything else, naming what was given and what is accepted.
        """
        if isinstance(data, DataSpec):
            return data
        if data is None:
            return cls(source=BUILTIN, **settings)
        if isinstance(data, os.PathLike):
            return cls(source=os.fspath(data), **settings)
        if isinstance(data, str):
            return cls(source=data, **settings)
        if type(data).__module__.startswith("torch") and hasattr(data, "dtype"):
            tokens = _token_rows(data)
            return cls(source=f"memory:tokens{list(tokens.shape)}", tokens=tokens, **settings)
        if isinstance(data, (list, tuple)):
            for i, doc in enumerate(data):
                if not isinstance(doc, str):
                    raise DataError(
                        f"data[{i}] is {doc!r} ({type(doc).__name__}); a list of data holds one "
                        "string per document",
                        hint="pass strings, or one token tensor [batch, pos]",
                    )
            if not any(doc.strip() for doc in data):
                raise DataError("the data list holds no text", hint="give it some documents")
            return cls(source=f"memory:{len(data)} documents", texts=tuple(data), **settings)
        raise DataError(
            f"cannot read data from {data!r} ({type(data).__name__})",
            hint="pass a file, folder or hf:NAME, 'text:...', a list of strings or a token tensor",
        )

    def describe(self) -> dict[str, Any]:
        """The settings as plain data for the manifest, as the source describes itself (in-memory
        data by size and checksum, see :meth:`Source.describe`)."""
        return source_of(self).describe()


LITERAL = "text:"

_FLAG_HINTS = {
    "source": "pass a file, folder, hf:NAME or 'text:...', or leave it out (built-in corpus)",
    "field": "name the JSONL / data-set field of the text, e.g. --field text",
    "split": "name the split of an hf: data set, e.g. --split train",
    "bos": "use --bos prepend (default) or --bos none",
    "seq_len": "e.g. --seq-len 128 (tokens per sequence, BOS included)",
    "max_tokens": "e.g. --max-tokens 16384",
    "batch_size": "e.g. --batch-size 8 (sequences per forward pass)",
    "seed": "e.g. --seed 0",
    "skip_tokens": "e.g. skip_tokens=16384 (the tokens a fit used)",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _token_rows(data: Any) -> Any:
    """A token tensor as ``[batch, pos]`` int64 on the CPU, after checking it is one."""
    import torch

    if data.dtype in (torch.bool,) or data.dtype.is_floating_point or data.dtype.is_complex:
        raise DataError(
            f"a token tensor must hold integer ids, not {str(data.dtype).replace('torch.', '')}",
            hint="pass token ids, e.g. model.to_tokens(text)",
        )
    tokens = data.detach().to("cpu", torch.long)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[1] < 2 or tokens.shape[0] < 1:
        raise DataError(
            f"a token tensor must be [batch, pos] with at least 2 positions, got shape "
            f"{list(data.shape)}",
            hint="pass token ids of shape [batch, pos] (or [pos] for one sequence)",
        )
    if int(tokens.min()) < 0:
        raise DataError(f"the token tensor holds a negative id ({int(tokens.min())})")
    return tokens


# -- the protocol: one class per kind of source, registered once ---------------------------------


@dataclass(frozen=True)
class Source(abc.ABC):
    """One kind of data source, bound to the spec that names it.

    A subclass sets the class attributes below, says in :meth:`claims` whether a spec names it,
    yields its documents in :meth:`documents`, and is registered with :func:`register_source`.
    :meth:`check`, :meth:`batches`, :meth:`cache_identity` (the token cache's key: by default
    the source is not cached) and :meth:`describe` have defaults that most sources keep.

    Args:
        spec: The spec that names this source (its sizes, field, split and seed apply).

    Attributes:
        kind: A short name, unique among registered sources (what :func:`check_source` returns).
        syntax: How ``--data`` (or ``data=`` of the Python API) names it, e.g. ``hf:NAME``.
        summary: What it reads, in a few words, for the ``--data`` help.
        command_line: ``False`` for data only the Python API can pass (data in memory).
    """

    spec: DataSpec
    kind: ClassVar[str]
    syntax: ClassVar[str]
    summary: ClassVar[str]
    command_line: ClassVar[bool] = True

    @classmethod
    @abc.abstractmethod
    def claims(cls, spec: DataSpec) -> bool:
        """Whether ``spec`` names this source: cheap (a prefix, a suffix, a field of the spec, is
        it a folder), never reading the data."""

    def check(self) -> None:  # noqa: B027  # optional, not abstract: most sources check nothing
        """Validate cheaply, before any model loads (the default accepts everything).

        Raises:
            DataError: The data is missing, empty or malformed, with a hint what to do.
        """

    @abc.abstractmethod
    def documents(self) -> Iterator[str]:
        """The documents, lazily, in order (called after :meth:`check`).

        Raises:
            DataError: Data met along the way is not text.
        """

    def batches(self, tokenizer: Any) -> Iterator[Batch]:
        """The checked documents packed into batches by :func:`pack`, lazily, from the token
        cache where it holds them (:mod:`lensdiv.data.cache`: the same batches, bit for bit); a
        source whose data is already tokens yields its own."""
        return _pack(_read(self), tokenizer, self.spec, self.spec.source, self.cache_identity)

    def cache_identity(self) -> dict[str, Any] | None:
        """What fixes this source's documents, as plain JSON data, for the token cache's key;
        ``None`` (the default) keeps it out of the cache.

        Return something only if the same identity always means the same documents in the same
        order (a file's path, size and modification time; a data set's name and split), and
        include every spec setting that changes them (``field``, ``split``, ``seed``), none that
        does not (``seq_len``, ``max_tokens``: the cache holds documents, not rows). Called
        when the first batch is asked for, before :meth:`check`.

        Raises:
            OSError: The data cannot be looked at (then it is read uncached, and checked).
        """
        return None

    def describe(self) -> dict[str, Any]:
        """The spec's settings as plain data for the manifest (data in memory adds its sha256)."""
        spec = self.spec
        fields = (f.name for f in dataclasses.fields(spec) if f.name not in ("texts", "tokens"))
        out = {name: getattr(spec, name) for name in fields}
        if not spec.skip_tokens:  # recorded only when used (results of earlier runs read alike)
            del out["skip_tokens"]
        return out


_SourceClass = TypeVar("_SourceClass", bound=type[Source])
_SOURCES: list[type[Source]] = []


def register_source(cls: _SourceClass) -> _SourceClass:
    """Register a kind of data source (usable as a class decorator).

    A spec is read by the last-registered source that claims it, so a source registered later
    can refine or replace one registered earlier (the built-in path sources claim any string).

    Raises:
        TypeError: ``cls`` is not a concrete :class:`Source` with ``kind``, ``syntax`` and
            ``summary``.
        ValueError: A source of the same kind is registered already.
    """
    if not (isinstance(cls, type) and issubclass(cls, Source)) or inspect.isabstract(cls):
        raise TypeError(f"{cls!r} is not a concrete subclass of Source")
    missing = [
        a for a in ("kind", "syntax", "summary") if not isinstance(getattr(cls, a, None), str)
    ]
    if missing:
        raise TypeError(f"data source {cls.__qualname__} does not set {', '.join(missing)}")
    for other in _SOURCES:
        if other.kind == cls.kind:
            raise ValueError(
                f"a data source of kind {cls.kind!r} is registered already ({other.__qualname__})"
            )
    _SOURCES.append(cls)
    return cls


def unregister_source(cls: type[Source]) -> None:
    """Forget a source registered with :func:`register_source`.

    Raises:
        ValueError: ``cls`` is not registered.
    """
    if cls not in _SOURCES:
        raise ValueError(f"data source {cls.__qualname__} is not registered")
    _SOURCES.remove(cls)


def registered_sources() -> tuple[type[Source], ...]:
    """Every registered source, in registration order (the order of the ``--data`` help)."""
    return tuple(_SOURCES)


def source_of(spec: DataSpec) -> Source:
    """The source ``spec`` names: the last-registered one that claims it, not yet checked.

    Raises:
        DataError: No registered source claims it.
    """
    for cls in reversed(_SOURCES):
        if cls.claims(spec):
            return cls(spec)
    raise DataError(f"no data source reads {spec.source!r}", hint=_FLAG_HINTS["source"])


def _read(source: Source) -> Iterator[str]:
    """Check ``source``, then yield its documents: both only when the first is asked for."""
    source.check()
    yield from source.documents()


# -- the built-in sources, most general first (a spec is read by the last one that claims it) ----


@register_source
class TextFile(Source):
    """A UTF-8 text file: one document. Claims every string no later source claims, so a typo
    in a path is an error here, never text."""

    kind = "text"
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


@register_source
class JsonlFile(Source):
    """A ``.jsonl`` (or ``.ndjson``) file: one document per row, the text in ``spec.field``."""

    kind = "jsonl"
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


@register_source
class TextFolder(Source):
    """A folder: every ``.txt`` file below it, in sorted order, one document each."""

    kind = "folder"
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


@register_source
class HubDataset(Source):
    """A hub data set ``hf:NAME[:CONFIG]`` (or a local folder of data files), streamed: split
    ``spec.split``, the text in ``spec.field``."""

    kind = "hub"
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


@register_source
class InlineText(Source):
    """``text:TEXT``: the text itself, one document (described by its start and checksum)."""

    kind = "literal"
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

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        if len(self.spec.source) > 80:
            out["source"] = f"{self.spec.source[:77]}..."
        return out | {"sha256": hashlib.sha256(self.spec.source.encode()).hexdigest()}


@register_source
class BuiltinCorpus(Source):
    """The built-in synthetic corpus, seeded by ``spec.seed`` (see :mod:`lensdiv.data.corpus`)."""

    kind = "builtin"
    syntax = BUILTIN
    summary = "the built-in corpus"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.source == BUILTIN

    def documents(self) -> Iterator[str]:
        return builtin_documents(seed=self.spec.seed)

    def cache_identity(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "seed": self.spec.seed, "corpus": CORPUS_VERSION}


@register_source
class MemoryDocuments(Source):
    """Documents in memory (``data=[...]`` of the Python API), one string each."""

    kind = "memory"
    syntax = "[TEXT, ...]"
    summary = "documents in memory"
    command_line = False

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.texts is not None

    def documents(self) -> Iterator[str]:
        return iter(self.spec.texts or ())

    def describe(self) -> dict[str, Any]:
        blob = "\x00".join(self.spec.texts or ()).encode()
        return super().describe() | {"sha256": hashlib.sha256(blob).hexdigest()}


@register_source
class TokenRows(Source):
    """A token tensor ``[batch, pos]`` in memory: each row one sequence (and one document), used
    as it is — no BOS added, nothing packed, ``seq_len`` does not apply."""

    kind = "tokens"
    syntax = "tensor[batch, pos]"
    summary = "token rows in memory"
    command_line = False

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.tokens is not None

    def documents(self) -> Iterator[str]:
        raise DataError("token data has no documents", hint="read it with token_batches")

    def batches(self, tokenizer: Any) -> Iterator[Batch]:
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
    yield from _read(source_of(spec))


def token_batches(spec: DataSpec, tokenizer: Any) -> Iterator[Batch]:
    """Tokenise and pack the documents of ``spec`` into :class:`~lensdiv.core.analyzer.Batch` es,
    lazily (a token tensor's rows are used as they are, ``batch_size`` rows a batch); with
    ``skip_tokens``, the batches after the first ``skip_tokens`` real tokens, numbered from 0."""
    if not spec.skip_tokens:
        return source_of(spec).batches(tokenizer)
    whole = dataclasses.replace(spec, max_tokens=spec.max_tokens + spec.skip_tokens, skip_tokens=0)
    return _after(source_of(whole).batches(tokenizer), spec.skip_tokens)


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
        raise DataError("the data source is empty", hint=_FLAG_HINTS["source"])
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
            f"{where}: field {field!r} holds {_json_kind(value)}, not text",
            hint="make it a string, drop the row, or choose the text field with --field",
        )
    return value


def _json_kind(value: Any) -> str:
    """``null``, ``a number (12345)``, ``an object``... as a JSON reader would say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


def read_task_jsonl(
    path: str | Path,
    required: tuple[str, ...],
    *,
    what: str,
    option: str,
    numbers: tuple[str, ...] = (),
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each row of a task file (patching pairs, graded prompts).

    Every required key must hold a string; those in ``numbers`` may hold a number instead (a
    grade, a token id) — never null, a boolean, a list or an object.

    Raises:
        DataError: Missing, non-UTF-8 or empty file, bad JSON, a non-object, a missing key or a
            value of the wrong kind — one line naming the file and line, with a hint showing the
            expected row.
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
            value = row[key]
            number_ok = key in numbers and isinstance(value, (int, float))
            if not isinstance(value, str) and (isinstance(value, bool) or not number_ok):
                kind = "text or a number" if key in numbers else "text"
                raise DataError(
                    f"{where}: {key!r} holds {_json_kind(value)}, not {kind}",
                    hint=f"each line needs {example} with {kind} in {key!r}",
                )
        rows.append((number, row))
    if not rows:
        raise DataError(f"{what} file {str(path)!r} is empty", hint=f"add {example} rows")
    return rows


def pack(
    docs: Iterable[str], tokenizer: Any, spec: DataSpec, *, source: str = "documents"
) -> Iterator[Batch]:
    """Pack any stream of documents the way :func:`token_batches` does (``spec`` gives the sizes):
    the one place where text is tokenised.

    Documents are read in chunks and each chunk is tokenised with one call of the tokenizer (a
    fast tokenizer encodes a list in native code, off the interpreter's lock); the ids are cut
    into rows with array operations. The batches are those of packing one document at a time:
    a document that fails to read (bad data met mid-way) raises after the batches of the
    documents before it, and only if the token budget was not spent before it.
    """
    return _pack(docs, tokenizer, spec, source, None)


def _pack(
    docs: Iterable[str],
    tokenizer: Any,
    spec: DataSpec,
    source: str,
    identity: Callable[[], dict[str, Any] | None] | None,
) -> Iterator[Batch]:
    """:func:`pack`, through the token cache of the source ``identity`` names (none if ``None``).

    The cached documents are packed from their ids (no tokenizer call) until the budget is
    spent or the stream is known to end there; only then are the documents after them read
    and tokenised (the cached ones are read and skipped), and the cache is extended with them.
    The packer cannot tell where its ids came from, so the batches are the same; an error of
    the stream is met where it would be met without the cache, as the cache never holds a
    document past one that failed.
    """
    packer = _Packer(tokenizer, spec)
    stream = iter(docs)
    cache = _cache_of(identity, tokenizer) if identity is not None else None
    writer = None
    if cache is not None:
        prefix = cache.read()
        if prefix is not None:
            yield from packer.add_prefix(prefix)
            if packer.budget <= 0 or prefix.complete:
                yield from packer.finish(source)
                return
            stream = _skip(stream, prefix.n_docs)
        writer = cache.writer(prefix)
    try:
        complete = False
        while packer.budget > 0:
            chunk, error, ended = _next_chunk(stream, packer.chars_wanted())
            if chunk:
                content, lengths = _arrays(_encode(tokenizer, chunk))
                chars = sum(map(len, chunk))
                if writer is not None:
                    writer.add(content, lengths, chars)
                yield from packer.add_ids(content, lengths, chars)
            if error is not None and packer.budget > 0:  # one document at a time would read it
                _commit(writer, identity, complete=False)
                raise error
            if ended:
                complete = error is None
                break
        _commit(writer, identity, complete=complete)
        yield from packer.finish(source)
    finally:  # closed early (the consumer stopped): nothing is kept
        if writer is not None:
            writer.abort()


def _commit(writer: Any, identity: Any, *, complete: bool) -> None:
    """Place the documents ``writer`` holds in the cache, unless the data changed while it was
    read (its documents may then mix two versions)."""
    if writer is None:
        return
    try:
        same = identity() == writer.cache.source
    except OSError:
        same = False
    if same:
        writer.commit(complete=complete)
    else:
        writer.abort()


def _cache_of(identity: Callable[[], dict[str, Any] | None], tokenizer: Any) -> Any:
    """The :class:`~lensdiv.data.cache.TokenCache` of a source and ``tokenizer``, or ``None``."""
    try:
        return token_cache(identity(), tokenizer)
    except OSError:  # the data cannot be looked at: read it uncached (its check says why)
        return None


def _skip(stream: Iterator[str], n_docs: int) -> Iterator[str]:
    """``stream`` after its first ``n_docs`` non-blank documents (those the cache holds)."""
    for doc in stream:
        if n_docs <= 0:
            yield doc
        elif doc.strip():
            n_docs -= 1


# A chunk of documents holds the text of about this many batches (at the ratio of characters
# to tokens seen so far; less when the budget left needs less), so that a reader on another
# thread (lensdiv.data.prefetch) stays a few chunks ahead of the model; the tokenizer's cost per
# call is negligible from a few documents on. Within these bounds, in characters:
_CHUNK_BATCHES = 2
_CHUNK_CHARS = (1 << 10, 1 << 20)
# Documents from the token cache are packed this many tokens at a time at least (the cost per
# chunk is a few array operations; a larger chunk reads more of the disk past the budget).
_CACHE_CHUNK_TOKENS = 1 << 16


def _encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """The ids of each text, as ``tokenizer(text, add_special_tokens=False)`` gives them, from
    one call (only the ids are asked for: the masks would be built for nothing)."""
    encoded = tokenizer(
        texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False
    )
    return list(encoded["input_ids"])


def _arrays(encoded: list[list[int]]) -> tuple[Any, Any]:
    """``(content, lengths)``: the ids of the documents one after the other, and of each (int64)."""
    import itertools

    import numpy as np

    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    content = np.fromiter(
        itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum())
    )
    return content, lengths


def _next_chunk(stream: Iterator[str], chars: int) -> tuple[list[str], Exception | None, bool]:
    """``(documents, error, ended)``: the next non-blank documents, about ``chars`` characters
    of them; the error the stream raised after them, if it did; whether the stream ended."""
    chunk: list[str] = []
    size = 0
    try:
        for doc in stream:
            if not doc.strip():
                continue
            chunk.append(doc)
            size += len(doc)
            if size >= chars:
                return chunk, None, False
    except Exception as err:  # raised where one document at a time would meet it (see pack)
        return chunk, err, True
    return chunk, None, True


class _Packer:
    """Rows of ``spec.seq_len`` tokens from tokenised documents (each followed by EOS, each row
    after BOS), ``spec.batch_size`` rows a batch, until ``spec.max_tokens`` real tokens."""

    def __init__(self, tokenizer: Any, spec: DataSpec) -> None:
        import numpy as np

        self.bos = tokenizer.bos_token_id if spec.bos == "prepend" else None
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos or 0)
        self.lead = int(self.bos is not None)  # positions of a row before its content
        self.width = spec.seq_len - self.lead  # content tokens of a full row
        self.batch_size = spec.batch_size
        self.batch_tokens = spec.batch_size * spec.seq_len
        self.budget = spec.max_tokens
        # Content not yet in a row (ids, and the document of each); rows not yet in a batch,
        # in blocks of rows of one length (ids, documents).
        self.ids = np.empty(0, dtype=np.int64)
        self.doc = np.empty(0, dtype=np.int64)
        self.blocks: list[tuple[Any, Any]] = []
        self.pending = 0
        self.n_docs = 0
        self.index = 0
        self.chars = 0
        self.tokens = 0

    def chars_wanted(self) -> int:
        """Characters of text for the next chunk, at the ratio seen so far (1 at first)."""
        ratio = self.chars / self.tokens if self.tokens else 1.0
        tokens = min(self.budget, _CHUNK_BATCHES * self.batch_tokens)
        low, high = _CHUNK_CHARS
        return int(min(max(tokens * ratio, low), high))

    def add(self, encoded: list[list[int]], texts: list[str]) -> Iterator[Batch]:
        """Append the documents' ids (each then EOS), cut full rows, yield full batches."""
        content, lengths = _arrays(encoded)
        yield from self.add_ids(content, lengths, sum(map(len, texts)))

    def add_prefix(self, prefix: Any) -> Iterator[Batch]:
        """:meth:`add_ids` of the documents of a cached prefix, a few batches' worth at a time,
        until they are all in or the budget is spent (the rest is never read from disk)."""
        import numpy as np

        offsets = prefix.offsets
        step = max(_CHUNK_BATCHES * self.batch_tokens, _CACHE_CHUNK_TOKENS)
        start = 0
        while start < prefix.n_docs and self.budget > 0:
            end = int(np.searchsorted(offsets, offsets[start] + step, side="left"))
            end = min(max(end, start + 1), prefix.n_docs)
            content = prefix.ids[offsets[start] : offsets[end]].astype(np.int64)
            yield from self.add_ids(content, np.diff(offsets[start : end + 1]), 0)
            start = end
        if start == prefix.n_docs:  # every document in: the next chunk's size goes on from here
            self.chars += prefix.chars

    def add_ids(self, content: Any, lengths: Any, chars: int) -> Iterator[Batch]:
        """Append documents given as ``content`` (int64, their ids one after the other) and
        ``lengths`` (ids of each), each then EOS, of ``chars`` characters in all; cut full rows,
        yield full batches."""
        import numpy as np

        if self.eos is not None:
            lengths = lengths + 1
            ends = np.cumsum(lengths) - 1
            ids = np.empty(int(lengths.sum()), dtype=np.int64)
            ids[ends] = self.eos
            real = np.ones(ids.size, dtype=bool)
            real[ends] = False
            ids[real] = content
        else:
            ids = content
        doc = np.repeat(np.arange(self.n_docs, self.n_docs + len(lengths)), lengths)
        self.n_docs += len(lengths)
        self.chars += chars
        self.tokens += ids.size
        self.ids = np.concatenate([self.ids, ids])
        self.doc = np.concatenate([self.doc, doc])
        self._cut()
        yield from self._emit(final=False)

    def _cut(self) -> None:
        """Full rows while the budget lasts; the row that meets the end of the budget is cut
        short there (and dropped if nothing but BOS is left of it)."""
        import numpy as np

        full = self.ids.size // self.width
        fit = min(full, self.budget // (self.width + self.lead))
        used = fit * self.width
        ids = self.ids[:used].reshape(fit, self.width)
        doc = self.doc[:used].reshape(fit, self.width)
        if self.lead:
            ids = np.concatenate([np.full((fit, 1), self.bos, dtype=np.int64), ids], axis=1)
            doc = np.concatenate([doc[:, :1], doc], axis=1)  # BOS: the row's first document
        self._keep(ids, doc)
        self.budget -= ids.size
        self.ids, self.doc = self.ids[used:], self.doc[used:]
        if full > fit and self.budget > 0:
            self._take(self.ids[: self.width], self.doc[: self.width])

    def _take(self, ids: Any, doc: Any) -> None:
        """One row of the content ``ids`` (BOS first), cut to the budget left."""
        import numpy as np

        if self.lead:
            ids = np.concatenate([[self.bos], ids]).astype(np.int64)
            doc = np.concatenate([doc[:1], doc])
        ids, doc = ids[: self.budget], doc[: self.budget]
        self.budget -= ids.size
        if ids.size > self.lead:
            self._keep(ids[None], doc[None])

    def _keep(self, ids: Any, doc: Any) -> None:
        if len(ids):
            self.blocks.append((ids, doc))
            self.pending += len(ids)

    def finish(self, source: str) -> Iterator[Batch]:
        """The last, partial row (if the budget allows) and the last batches.

        Raises:
            DataError: No row was made: the data held no tokens.
        """
        if self.budget > 0 and self.ids.size:
            self._take(self.ids, self.doc)
        if self.index == 0 and not self.pending:
            raise DataError(
                f"data {source!r} produced no tokens",
                hint="check that the text (or --field) is not empty",
            )
        yield from self._emit(final=True)

    def _emit(self, *, final: bool) -> Iterator[Batch]:
        """Batches of ``batch_size`` rows (and, when ``final``, the rows left), right-padded."""
        import torch

        # start-up: the --data help reads this module; torch loads when batches are made.
        from lensdiv.core.analyzer import Batch

        while self.pending >= self.batch_size or (final and self.pending):
            ids, doc, mask = self._next_rows(min(self.batch_size, self.pending))
            yield Batch(
                tokens=torch.from_numpy(ids),
                mask=torch.from_numpy(mask),
                bos=self.lead == 1,
                index=self.index,
                doc=torch.from_numpy(doc),
            )
            self.index += 1

    def _next_rows(self, n: int) -> tuple[Any, Any, Any]:
        """The next ``n`` rows: ids and documents right-padded to the longest, and the mask."""
        import numpy as np

        self.pending -= n
        ids, doc = self.blocks[0]
        if len(ids) >= n:  # rows of one length (all but the last row of the data)
            self.blocks[0] = ids[n:], doc[n:]
            if len(ids) == n:
                del self.blocks[0]
            return ids[:n], doc[:n], np.ones(ids[:n].shape, dtype=bool)
        rows: list[tuple[Any, Any]] = []
        while len(rows) < n:
            ids, doc = self.blocks.pop(0)
            take = min(n - len(rows), len(ids))
            rows += zip(ids[:take], doc[:take], strict=True)
            if take < len(ids):
                self.blocks.insert(0, (ids[take:], doc[take:]))
        sizes = np.array([r.size for r, _ in rows])
        length = int(sizes.max())
        out_ids = np.full((n, length), self.pad, dtype=np.int64)
        out_doc = np.full((n, length), -1, dtype=np.int64)
        for i, (r, d) in enumerate(rows):
            out_ids[i, : r.size], out_doc[i, : r.size] = r, d
        return out_ids, out_doc, np.arange(length) < sizes[:, None]
