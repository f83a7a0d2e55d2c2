"""What names the data: :class:`DataSpec` (what ``--data`` and ``data=`` name, and how it is cut)
and the :class:`Source` protocol with its registry, through which a spec finds the one source
that reads it (:func:`source_of`).

Each kind of source is one subclass of :class:`Source`, declared once as a ``lensdiv.data_sources``
entry point (read on first use; :func:`register_source` adds one in a running session): it says whether a :class:`DataSpec` names it, checks itself cheaply
before any model loads, yields its documents (or, for token rows, its batches) and describes
itself for the manifest and for the ``--data`` help. The built-in sources are in
:mod:`lensdiv.data.sources` and :mod:`lensdiv.data.pydocs`; packing is in
:mod:`lensdiv.data.packing`.

In the Python API, ``data`` may also be in memory: a list of strings (one document each),
``"text:..."`` (the string after ``text:`` is the one document; a plain string always names a
file, folder or ``hf:`` data set, so a typo in a path is an error, never analysed as text), or a
token tensor ``[batch, pos]`` (or ``[pos]``) whose rows are used as they are: no BOS is added,
nothing is packed, and ``seq_len`` does not apply.

Importing this module does not import torch (``lensdiv --help`` reads the registry).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from lensdiv.core.entrypoints import DATA_SOURCES_GROUP, load_group
from lensdiv.core.errors import DataError, PluginWarning
from lensdiv.core.settings import DEFAULTS
from lensdiv.data.packing import pack_cached

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch
    from lensdiv.core.bridge import Tokenizer

BUILTIN = "builtin"


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
                    hint=FLAG_HINTS[name],
                )
        for name in ("seq_len", "max_tokens", "batch_size", "seed", "skip_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise DataError(
                    f"{_flag(name)} must be a whole number, not {value!r} ({type(value).__name__})",
                    hint=FLAG_HINTS[name],
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
                hint=FLAG_HINTS["batch_size"],
            )
        if self.skip_tokens < 0:
            raise DataError(
                f"skip_tokens must be 0 or more, got {self.skip_tokens}",
                hint=FLAG_HINTS["skip_tokens"],
            )
        if self.bos not in ("prepend", "none"):
            raise DataError(
                f"bos policy must be 'prepend' or 'none', not {self.bos!r}",
                hint="use --bos prepend (default) or --bos none",
            )
        if not self.field.strip():
            raise DataError("--field is empty", hint="name the JSONL / data-set field of the text")

    @classmethod
    def from_data(cls, data: Any, *, default: str = BUILTIN, **settings: Any) -> DataSpec:
        """A spec for anything the API accepts as ``data``: ``None`` (the source ``default``
        names: the built-in corpus, or what the run's model reads by default, see
        :mod:`lensdiv.run.defaults`), a source string or path, ``"text:..."``, a list of
        strings, a token tensor, or a spec.

        Raises:
            DataError: Anything else, naming what was given and what is accepted.
        """
        if isinstance(data, DataSpec):
            return data
        if data is None:
            return cls(source=default, **settings)
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

FLAG_HINTS = {
    "source": "pass a file, folder, hf:NAME, pydoc or 'text:...', or leave it out (the default)",
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
        yields its documents in :meth:`documents`, and is declared as a ``lensdiv.data_sources`` entry
    point (or registered in a session with :func:`register_source`).
        :meth:`check`, :meth:`batches`, :meth:`cache_identity` (the token cache's key: by default
        the source is not cached), :meth:`text_bytes`, :meth:`most_tokens` and :meth:`describe` have
        defaults that most sources keep.

        Args:
            spec: The spec that names this source (its sizes, field, split and seed apply).

        Attributes:
            kind: A short name, unique among registered sources (what :func:`check_source` returns).
            syntax: How ``--data`` (or ``data=`` of the Python API) names it, e.g. ``hf:NAME``.
            summary: What it reads, in a few words, for the ``--data`` help.
            command_line: ``False`` for data only the Python API can pass (data in memory).
            order: Where the ``--data`` help lists it among the entry points; a source of higher
                order is asked first whether it claims a spec (the file sources, which claim any
                string, have the lowest). A package's source keeps the default, after lensdiv's.
            tokenizes: ``False`` for a source of tokens that :meth:`batches` reads without the
                tokenizer's encoder (a run then neither reads ahead nor copies the tokenizer).
    """

    spec: DataSpec
    kind: ClassVar[str]
    syntax: ClassVar[str]
    summary: ClassVar[str]
    command_line: ClassVar[bool] = True
    order: ClassVar[int] = 1000
    tokenizes: ClassVar[bool] = True

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

    def batches(self, tokenizer: Tokenizer) -> Iterator[Batch]:
        """The checked documents packed into batches by :func:`~lensdiv.data.packing.pack`, lazily, from the token
        cache where it holds them (:mod:`lensdiv.data.cache`: the same batches, bit for bit); a
        source whose data is already tokens yields its own."""
        return pack_cached(
            checked_documents(self), tokenizer, self.spec, self.spec.source, self.cache_identity
        )

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

    def text_bytes(self) -> int | None:
        """The bytes of text this source holds, when known without reading it (files: their
        sizes; text in memory: its length), else ``None`` (the default: a hub data set, the
        built-in corpus). :func:`~lensdiv.data.sources.known_tokens` counts the tokens of a
        small source before a run."""
        return None

    def most_tokens(self) -> int:
        """The most real tokens this source's batches can hold, known without reading the data
        (a progress bar's total until the data's end is known): ``max_tokens``, unless the
        source knows better (token rows in memory know exactly)."""
        return self.spec.max_tokens

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
_LOADED: list[bool] = []  # one True once the entry points are read


def _check_source(cls: object, have: list[type[Source]]) -> str:
    """Why ``cls`` cannot be a data source next to ``have`` (``""``: it can)."""
    if not (isinstance(cls, type) and issubclass(cls, Source)) or inspect.isabstract(cls):
        return f"{cls!r} is not a concrete subclass of Source"
    missing = [
        a for a in ("kind", "syntax", "summary") if not isinstance(getattr(cls, a, None), str)
    ]
    if missing:
        return f"data source {cls.__qualname__} does not set {', '.join(missing)}"
    for other in have:
        if other.kind == cls.kind:
            return (
                f"a data source of kind {cls.kind!r} is registered already ({other.__qualname__})"
            )
    return ""


def _sources() -> list[type[Source]]:
    """The registered sources: the ``lensdiv.data_sources`` entry points by :attr:`Source.order`
    (then as :func:`~lensdiv.core.entrypoints.ordered` gives them), read on first use; an entry
    that fails to import or is not a source is left out with one :class:`PluginWarning` line."""
    if not _LOADED:
        _LOADED.append(True)
        loaded, problems = load_group(DATA_SOURCES_GROUP)
        loaded.sort(key=lambda entry: getattr(entry.value, "order", 1000))
        found: list[type[Source]] = []
        for entry in loaded:
            problem = _check_source(entry.value, found + _SOURCES)
            if problem:
                problems.append(f"data source {entry.name!r} from {entry.provider}: {problem}")
            else:
                found.append(entry.value)
        _SOURCES[:0] = found  # before any registered in this session already
        for line in problems:
            warnings.warn(line, PluginWarning, stacklevel=3)
    return _SOURCES


def register_source(cls: _SourceClass) -> _SourceClass:
    """Register a kind of data source in this session (a notebook, a test; usable as a class
    decorator); a package declares its sources as ``lensdiv.data_sources`` entry points instead.

    A spec is read by the last-registered source that claims it, so a source registered later
    can refine or replace one registered earlier (the built-in path sources claim any string).

    Raises:
        TypeError: ``cls`` is not a concrete :class:`Source` with ``kind``, ``syntax`` and
            ``summary``.
        ValueError: A source of the same kind is registered already.
    """
    have = _sources()
    problem = _check_source(cls, have)
    if problem:
        raise (ValueError if "registered already" in problem else TypeError)(problem)
    have.append(cls)
    return cls


def unregister_source(cls: type[Source]) -> None:
    """Forget a source registered with :func:`register_source`.

    Raises:
        ValueError: ``cls`` is not registered.
    """
    have = _sources()
    if cls not in have:
        raise ValueError(f"data source {cls.__qualname__} is not registered")
    have.remove(cls)


def registered_sources() -> tuple[type[Source], ...]:
    """Every registered source, in registration order (the order of the ``--data`` help)."""
    return tuple(_sources())


def source_of(spec: DataSpec) -> Source:
    """The source ``spec`` names: the last-registered one that claims it, not yet checked.

    Raises:
        DataError: No registered source claims it.
    """
    for cls in reversed(_sources()):
        if cls.claims(spec):
            return cls(spec)
    raise DataError(f"no data source reads {spec.source!r}", hint=FLAG_HINTS["source"])


def checked_documents(source: Source) -> Iterator[str]:
    """Check ``source``, then yield its documents: both only when the first is asked for."""
    source.check()
    yield from source.documents()


# -- the built-in sources, most general first (a spec is read by the last one that claims it) ----
