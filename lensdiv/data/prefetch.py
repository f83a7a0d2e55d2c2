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
caller's thread, without reading ahead.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from lensdiv.data.sources import DataSpec, token_batches

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Batch

# Batches ready before the one being fed: a few chunks of the packer (each about two batches),
# so the reader is busy while the model is.
DEPTH = 8
THREAD_NAME = "lensdiv-data"
_POLL_S = 0.1  # how often a reader waiting for room checks whether it was told to stop

_T = TypeVar("_T")
_ITEM, _END, _ERROR = range(3)


def ready_batches(
    spec: DataSpec, tokenizer: Any, depth: int | None = None
) -> Generator[Batch, None, None]:
    """``token_batches(spec, tokenizer)``, made on a background thread ``depth`` batches ahead
    (:data:`DEPTH` when ``None``; ``0`` reads in the caller's thread)."""
    depth = DEPTH if depth is None else depth
    private = _private_copy(tokenizer) if depth > 0 else None
    if private is None:
        yield from token_batches(spec, tokenizer)
        return
    yield from read_ahead(token_batches(spec, private), depth)


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


def _private_copy(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that shares no state with it, or ``None`` if it cannot be made."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # an exotic tokenizer: read without a thread rather than share it
        return None
