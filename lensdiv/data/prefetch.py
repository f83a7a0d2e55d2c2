"""Batches made ahead on a background thread, so that reading and tokenising the data overlaps
the forward passes instead of alternating with them.

:func:`ready_batches` is :func:`~lensdiv.data.sources.token_batches` read ahead: a daemon thread
reads, tokenises and packs (the tokenizer works off the interpreter's lock) while the caller
feeds the model, at most :data:`DEPTH` batches ahead. The batches, their order and their
contents are those of :func:`~lensdiv.data.sources.token_batches`. What the data raises on the
way (a bad JSONL line: :class:`~lensdiv.core.errors.DataError`) is raised by the caller's
iteration where it would have been without the thread: after the batches before it. Closing
the iterator, or leaving it by an exception (Ctrl-C), tells the thread to stop: it ends after
the item in hand and closes the data.

The thread tokenises with a private copy of the tokenizer, so that nothing the caller does with
the model's own tokenizer meanwhile (encoding with truncation or padding changes the settings a
fast tokenizer keeps) reaches the data; a tokenizer that cannot be copied is used in the
caller's thread, without reading ahead, as are token rows already in memory and data of at most
:data:`READ_AHEAD_TOKENS` tokens. The copy is kept for the next run while the tokenizer
stays the same (see :func:`_private_copy`).
"""

from __future__ import annotations

import copy
import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from lensdiv.data.cache import backend_state, fix_identity
from lensdiv.data.sources import DataSpec, source_of, token_batches

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch
    from lensdiv.core.bridge import Tokenizer

# Batches ready before the one being fed: a few chunks of the packer (each about two batches),
# so the reader is busy while the model is.
DEPTH = 8
THREAD_NAME = "lensdiv-data"
# Data of at most this many tokens is read in the caller's thread: tokenising it takes less than
# copying a tokenizer does (6.5 s for Gemma 3's 262k tokens, 1.5 s for SmolLM2's 49k; measured),
# and nothing of it would overlap the model anyway.
READ_AHEAD_TOKENS = 1 << 16
_POLL_S = 0.1  # how often a reader waiting for room checks whether it was told to stop

_T = TypeVar("_T")
_ITEM, _END, _ERROR = range(3)


def ready_batches(
    spec: DataSpec,
    tokenizer: Tokenizer,
    depth: int | None = None,
    on_end: Callable[[int], None] | None = None,
) -> Generator[Batch, None, None]:
    """``token_batches(spec, tokenizer)``, made on a background thread ``depth`` batches ahead
    (:data:`DEPTH` when ``None``; ``0`` reads in the caller's thread).

    ``on_end(tokens)``, if given, is called with the real tokens of all the batches as soon as
    the data is known to end — on the reader thread, up to ``depth`` batches before the caller
    reaches the end (not if the data fails or the stream is closed first).
    """
    depth = DEPTH if depth is None else depth
    source = source_of(spec)
    if not source.tokenizes or source.most_tokens() <= READ_AHEAD_TOKENS:
        depth = 0  # rows in memory, or too little text to hide: no thread, no copy
    private = _private_copy(tokenizer) if depth > 0 else None
    if private is None:
        yield from _tallied(token_batches(spec, tokenizer), on_end)
        return
    yield from read_ahead(_tallied(token_batches(spec, private), on_end), depth)


def _tallied(batches: Iterator[Batch], on_end: Callable[[int], None] | None) -> Iterator[Batch]:
    """``batches``, then ``on_end`` told their real tokens."""
    if on_end is None:
        yield from batches
        return
    tokens = 0
    for batch in batches:
        tokens += batch.n_tokens
        yield batch
    on_end(tokens)


def read_ahead(items: Iterable[_T], depth: int) -> Generator[_T, None, None]:
    """``items`` in order, taken from a daemon thread that stays at most ``depth`` items ahead.

    The thread starts at the first ``next``. An exception it meets is raised here after the
    items before it; closing this iterator (or an exception through it) stops the thread after
    the item in hand, and the thread closes ``items``.
    """
    box: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    thread = threading.Thread(
        target=_produce, args=(iter(items), box, stop), name=THREAD_NAME, daemon=True
    )
    thread.start()
    try:
        while True:
            kind, value = box.get()
            if kind == _ITEM:
                yield value
            elif kind == _END:
                return
            else:
                raise value
    finally:
        stop.set()


def _produce(
    items: Iterator[Any], box: queue.Queue[tuple[int, Any]], stop: threading.Event
) -> None:
    try:
        for item in items:
            if not _put(box, (_ITEM, item), stop):
                return
        _put(box, (_END, None), stop)
    except BaseException as err:  # handed over: raised in the reader's thread, in its place
        _put(box, (_ERROR, err), stop)
    finally:
        close = getattr(items, "close", None)  # a generator: its files close now
        if close is not None:
            close()


def _put(box: queue.Queue[tuple[int, Any]], entry: tuple[int, Any], stop: threading.Event) -> bool:
    """Wait for room in ``box`` unless told to stop; whether ``entry`` went in."""
    while not stop.is_set():
        try:
            box.put(entry, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _private_copy(tokenizer: Tokenizer) -> Any:
    """A copy of ``tokenizer`` that shares no state with it, or ``None`` if it cannot be made.

    A fast tokenizer's copy is made once and kept while the tokenizer lives and is the same:
    copying one of 50k tokens costs a few hundred milliseconds, a run's largest fixed cost
    after the model's own. "The same" is its native serialisation (vocabulary, merges, added
    tokens, normaliser, pre-tokeniser) and the settings packing reads; the copy is only ever
    called without padding or truncation, so it does not change between runs.
    """
    try:
        key = _copy_key(tokenizer)
        kept = _COPIES.get(tokenizer) if key is not None else None
    except Exception:  # not weakly referable, or an exotic backend: copied every time
        key = kept = None
    if kept is not None and kept[0] == key:
        return kept[1]
    try:
        private = copy.deepcopy(tokenizer)
    except Exception:  # an exotic tokenizer: read without a thread rather than share it
        return None
    if key is not None:
        _COPIES[tokenizer] = (key, private)
        fix_identity(private)  # the token cache's key of the copy, read once
    return private


_COPIES: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], Any]] = weakref.WeakKeyDictionary()


def _copy_key(tokenizer: Tokenizer) -> tuple[Any, ...] | None:
    """What a kept copy must match: ``None`` for a tokenizer without a native serialisation."""
    state = backend_state(tokenizer)
    if state is None:
        return None
    names = ("bos_token_id", "eos_token_id", "pad_token_id", "split_special_tokens")
    return (type(tokenizer), state, *(getattr(tokenizer, n, None) for n in names))
