"""Packing: the one place where text is tokenised. Documents are read in chunks, each chunk
tokenised with one batched tokenizer call, and the ids cut with numpy into fixed-length rows,
``batch_size`` rows a batch, through the token cache (:mod:`lensdiv.data.cache`) where a source
names its documents.

Documents are joined by EOS and cut into rows of ``seq_len`` tokens; with the default BOS policy
every row starts with BOS. Only the last row may be padded, on the right, and its mask is False
there, so pad positions never enter a statistic (and, attention being causal, never influence a
real position). Importing this module does not import torch or numpy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lensdiv.core.errors import DataError
from lensdiv.data.cache import Prefix, TokenCache, Writer, token_cache

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch
    from lensdiv.core.bridge import Tokenizer


@runtime_checkable
class Cut(Protocol):
    """How documents are cut into batches: the sizes of a :class:`~lensdiv.data.spec.DataSpec`."""

    @property
    def seq_len(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def bos(self) -> str: ...


def pack(
    docs: Iterable[str], tokenizer: Tokenizer, spec: Cut, *, source: str = "documents"
) -> Iterator[Batch]:
    """Pack any stream of documents the way :func:`token_batches` does (``spec`` gives the sizes):
    the one place where text is tokenised.

    Documents are read in chunks and each chunk is tokenised with one call of the tokenizer (a
    fast tokenizer encodes a list in native code, off the interpreter's lock); the ids are cut
    into rows with array operations. The batches are those of packing one document at a time:
    a document that fails to read (bad data met mid-way) raises after the batches of the
    documents before it, and only if the token budget was not spent before it.
    """
    return pack_cached(docs, tokenizer, spec, source, None)


def pack_cached(
    docs: Iterable[str],
    tokenizer: Tokenizer,
    spec: Cut,
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
    writer: Writer | None = None
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


def _commit(
    writer: Writer | None,
    identity: Callable[[], dict[str, Any] | None] | None,
    *,
    complete: bool,
) -> None:
    """Place the documents ``writer`` holds in the cache, unless the data changed while it was
    read (its documents may then mix two versions)."""
    if writer is None or identity is None:
        return
    try:
        same = identity() == writer.cache.source
    except OSError:
        same = False
    if same:
        writer.commit(complete=complete)
    else:
        writer.abort()


def _cache_of(
    identity: Callable[[], dict[str, Any] | None], tokenizer: Tokenizer
) -> TokenCache | None:
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


def _encode(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
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

    def __init__(self, tokenizer: Tokenizer, spec: Cut) -> None:
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

    def add_prefix(self, prefix: Prefix) -> Iterator[Batch]:
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
