"""The token cache: a source's documents tokenised once, read as ids from disk afterwards.

The fastest tokenizers reach well under a million tokens a second per core, far less than the
rest of the data path (packing ids into rows runs at several million), and an analysis is often
run many times over the same tokens: again with other analyzers, on each model of a family that
shares one tokenizer, on each shard of a job array. So the first run that tokenises a source
keeps the ids, and the runs after it pack from them without tokenising (as nanoGPT's ``.bin``
files and OLMo's memory-mapped arrays do).

An entry holds a tokenised *prefix of the document stream* of one source with one tokenizer,
in a folder named by its :func:`entry_key` under :func:`cache_root`:

- ``ids.npy``: uint32, the ids of each non-blank document one after the other, as
  ``tokenizer(texts, add_special_tokens=False)`` gives them (no BOS, no EOS: packing adds them);
- ``offsets.npy``: int64, ``n_docs + 1``: document ``i`` is ``ids[offsets[i]:offsets[i + 1]]``;
- ``meta.json``: the format version, the source's and the tokenizer's identities, ``n_docs``,
  ``tokens``, ``chars`` (characters of those documents: the next chunk's size when a run goes on
  past the prefix) and ``complete`` (whether the stream ended there).

Invariants: the batches packed from an entry are those of tokenising the stream, bit for bit
(:func:`lensdiv.data.packing.pack` reads it, see there); an entry never holds a document past
one that failed to read; a run that needs more than an entry holds tokenises only the documents
after it and replaces the entry by the longer prefix. Entries are written to a temporary folder
and renamed into place, so processes writing the same entry at once (ranks of ``torchrun``,
tasks of a job array) leave one whole entry: the loser of the race drops its copy. Writing never
fails a run (a read-only or full disk warns once and the run goes on uncached); an entry that
cannot be read (a truncated array, a bad ``meta.json``) is ignored and written again.

Only sources whose documents are fixed by what :meth:`~lensdiv.data.spec.Source.cache_identity`
returns are cached (files by path, size and modification time; a hub data set by name, config,
split and field, assumed not to change under that name); text given inline, documents or tokens
in memory are not. ``LENSDIV_TOKEN_CACHE=off`` turns the cache off (``lensdiv analyze
--no-token-cache`` sets it); ``LENSDIV_TOKEN_CACHE=DIR`` moves it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.bridge import Tokenizer
from lensdiv.core.files import cache_root as lensdiv_cache

FORMAT_VERSION = 1
ENV = "LENSDIV_TOKEN_CACHE"
_OFF = ("off", "0", "false", "no", "none")
_IDS, _OFFSETS, _META = "ids.npy", "offsets.npy", "meta.json"
_warned = False


def cache_root() -> Path | None:
    """The folder of token cache entries, or ``None`` when the cache is off.

    ``$LENSDIV_TOKEN_CACHE`` (``off`` turns it off), else ``tokens/`` in lensdiv's cache folder
    (``$LENSDIV_CACHE``, else ``~/.cache/lensdiv``: where toy models are cached too).
    """
    value = os.environ.get(ENV, "").strip()
    if value.lower() in _OFF:
        return None
    if value:
        return Path(value).expanduser()
    return lensdiv_cache() / "tokens"


def tokenizer_identity(tokenizer: Tokenizer) -> dict[str, Any] | None:
    """What fixes the ids ``tokenizer`` gives a text, or ``None`` if nothing reliable does.

    A fast tokenizer is its native tokenizer's serialisation (vocabulary, merges, normaliser,
    pre-tokeniser, added tokens; not the padding and truncation of its last call) plus its
    class; another tokenizer its class, name, vocabulary and plain init arguments (a
    lower-casing flag changes ids, not the vocabulary). The special ids packing uses are part
    of it too.
    """
    try:
        if tokenizer in _FIXED:
            return _FIXED[tokenizer]
    except TypeError:  # not weakly referable
        pass
    kind = type(tokenizer)
    out: dict[str, Any] = {
        "class": f"{kind.__module__}.{kind.__qualname__}",
        "specials": [getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad")],
        "split_special_tokens": getattr(tokenizer, "split_special_tokens", None),
    }
    try:
        state = backend_state(tokenizer)
        if state is not None:
            out["backend_sha256"] = hashlib.sha256(state.encode()).hexdigest()
            return _plain(out)
        vocab = tokenizer.get_vocab() if callable(getattr(tokenizer, "get_vocab", None)) else None
        if not isinstance(vocab, dict) or not vocab:
            return None
        blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
        init = getattr(tokenizer, "init_kwargs", None) or {}
        out |= {
            "name_or_path": str(getattr(tokenizer, "name_or_path", "")),
            "vocab_size": len(vocab),
            "vocab_sha256": hashlib.sha256(blob).hexdigest(),
            "init": {
                k: v for k, v in sorted(init.items()) if isinstance(v, (str, int, float, bool))
            },
        }
        return _plain(out)
    except Exception:  # an exotic tokenizer: not cached rather than cached wrongly
        return None


# The identities of tokenizers that nothing changes (the data reader's private copies, see
# fix_identity): read once, not serialised again at every run.
_FIXED: weakref.WeakKeyDictionary[Any, dict[str, Any] | None] = weakref.WeakKeyDictionary()


def fix_identity(tokenizer: Tokenizer) -> None:
    """Read ``tokenizer``'s identity now and keep it for as long as it lives: only for a
    tokenizer that nothing changes afterwards (a private copy called without padding or
    truncation)."""
    _FIXED.pop(tokenizer, None)
    _FIXED[tokenizer] = tokenizer_identity(tokenizer)


def backend_state(tokenizer: Tokenizer) -> str | None:
    """A fast tokenizer's native serialisation without the padding and truncation its last call
    left set (each call sets its own; packing asks for neither), or ``None`` for another
    tokenizer. The serialisation is deterministic (the vocabulary in id order), so it is hashed
    as it is: the usual case, nothing set, costs one serialisation (a few tens of milliseconds
    for a 50k-token vocabulary; parsing it as JSON would cost several times that).

    Raises:
        Exception: Whatever an exotic backend raises.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    state: str = backend.to_str()
    if _UNSET not in state[: 8 * len(_UNSET)]:  # set by a call: read without them
        from tokenizers import Tokenizer

        plain = Tokenizer.from_str(state)
        plain.no_truncation()
        plain.no_padding()
        state = plain.to_str()
    return state


_UNSET = '"truncation":null,"padding":null'


def _plain(value: dict[str, Any]) -> dict[str, Any] | None:
    """``value`` if it is plain JSON (what a key can hash), else ``None``."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError):
        return None


def entry_key(source: dict[str, Any], tokenizer: dict[str, Any]) -> str:
    """sha256 of the format version and the source's and tokenizer's identities."""
    blob = json.dumps(
        {"version": FORMAT_VERSION, "source": source, "tokenizer": tokenizer}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Prefix:
    """The cached documents of one entry: ``ids`` (uint32, memory-mapped), ``offsets`` (int64,
    ``n_docs + 1``), their characters and whether the stream ended after them."""

    ids: Any
    offsets: Any
    chars: int
    complete: bool

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1


@dataclass(frozen=True)
class TokenCache:
    """The entry of one (source, tokenizer) in the folder ``root``."""

    root: Path
    source: dict[str, Any]
    tokenizer: dict[str, Any]

    @property
    def folder(self) -> Path:
        return self.root / entry_key(self.source, self.tokenizer)

    def read(self) -> Prefix | None:
        """The cached prefix, or ``None`` if there is none or it cannot be trusted (a missing
        file, a truncated array, a ``meta.json`` of another format or of other identities)."""
        import numpy as np

        folder = self.folder
        try:
            meta = json.loads((folder / _META).read_text(encoding="utf-8"))
            if (
                meta.get("version") != FORMAT_VERSION
                or meta.get("source") != self.source
                or meta.get("tokenizer") != self.tokenizer
            ):
                return None
            n_docs, tokens = int(meta["n_docs"]), int(meta["tokens"])
            offsets = np.load(folder / _OFFSETS, allow_pickle=False)
            ids = np.load(folder / _IDS, mmap_mode="r", allow_pickle=False)
            if (
                ids.dtype != np.uint32
                or ids.ndim != 1
                or ids.size != tokens
                or offsets.dtype != np.int64
                or offsets.shape != (n_docs + 1,)
                or offsets[0] != 0
                or offsets[-1] != tokens
                or (n_docs and bool((np.diff(offsets) < 0).any()))
            ):
                return None
            return Prefix(ids, offsets, int(meta["chars"]), bool(meta["complete"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def writer(self, prefix: Prefix | None) -> Writer:
        """A :class:`Writer` of a longer entry, starting from ``prefix`` (``None``: from the
        first document)."""
        return Writer(self, prefix)

    def _place(self, tmp: Path, meta: dict[str, Any]) -> bool:
        """Rename ``tmp`` into place; whether it went there (a racing writer may have won)."""
        folder = self.folder
        try:
            os.rename(tmp, folder)
            return True
        except OSError:  # an entry is there (or appeared just now)
            pass
        current = self.read()
        n_docs, complete = meta["n_docs"], meta["complete"]
        if current is not None and (
            current.complete
            or current.n_docs > n_docs
            or (current.n_docs == n_docs and not complete)
        ):
            return False  # as good as ours: keep it
        aside = Path(tempfile.mkdtemp(prefix=".old-", dir=self.root))
        try:
            os.rename(folder, aside / "entry")  # atomic: of racing writers, one moves it
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)
            return False
        try:
            os.rename(tmp, folder)
            return True
        except OSError:  # another writer placed its entry in between: keep that one
            return False
        finally:
            shutil.rmtree(aside, ignore_errors=True)


class Writer:
    """A new entry, written as the run tokenises: the ids go straight to a file in a temporary
    folder (memory stays that of a chunk however long the run), the document lengths are kept,
    and :meth:`commit` renames the folder into place (or :meth:`abort` removes it).

    Never raises: a disk that cannot take it (read-only, full) warns once, one line, and the
    rest of the run goes on without writing.
    """

    def __init__(self, cache: TokenCache, prefix: Prefix | None) -> None:
        self.cache = cache
        self.prefix = prefix
        self.tmp: Path | None = None
        self.fh: Any = None
        self.lengths: list[Any] = []
        self.tokens = self.chars = 0
        self.failed = False

    def _open(self) -> bool:
        """Start the entry's folder with the prefix's ids, on the first need (a run that meets
        nothing new copies nothing); whether it is open."""
        import numpy as np

        if self.fh is not None or self.failed:
            return self.fh is not None
        root, prefix = self.cache.root, self.prefix
        try:
            root.mkdir(parents=True, exist_ok=True)
            _sweep(root)
            self.tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
            self.tmp.chmod(0o755)  # readable by whoever shares the cache, as a plain folder
            self.fh = (self.tmp / _IDS).open("wb")
            self.fh.write(_npy_header(0))
            if prefix is not None:
                for lo in range(0, prefix.ids.size, _COPY_TOKENS):
                    self.fh.write(prefix.ids[lo : lo + _COPY_TOKENS].tobytes())
                self.lengths.append(np.diff(prefix.offsets))
                self.tokens, self.chars = int(prefix.ids.size), prefix.chars
        except OSError as err:
            self._fail(err)
        return self.fh is not None

    def add(self, content: Any, lengths: Any, chars: int) -> None:
        """Append documents: ``content`` (their ids one after the other), ``lengths`` (ids of
        each), ``chars`` (their characters)."""
        import numpy as np

        if not len(lengths) or not self._open():
            return
        if content.size and (int(content.min()) < 0 or int(content.max()) >= 1 << 32):
            self._fail(None)  # ids beyond uint32: this tokenizer is not cached
            return
        try:
            self.fh.write(content.astype("<u4").tobytes())
        except OSError as err:
            self._fail(err)
            return
        self.lengths.append(np.asarray(lengths, dtype=np.int64))
        self.tokens += int(content.size)
        self.chars += chars

    def commit(self, *, complete: bool) -> None:
        """Place the entry, unless it tells nothing new: no document past the prefix it
        started from, and no end of the stream the prefix did not know of."""
        import numpy as np

        prefix = self.prefix
        learnt_end = complete and prefix is not None and not prefix.complete
        if self.fh is None and not (learnt_end and self._open()):
            self.abort()
            return
        lengths = np.concatenate(self.lengths)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        meta = {
            "version": FORMAT_VERSION,
            "source": self.cache.source,
            "tokenizer": self.cache.tokenizer,
            "n_docs": len(lengths),
            "tokens": self.tokens,
            "chars": self.chars,
            "complete": bool(complete),
        }
        tmp = self.tmp
        assert tmp is not None  # an open file lives in the temporary folder
        try:
            self.fh.seek(0)
            self.fh.write(_npy_header(self.tokens))
            self.fh.close()
            self.fh = None
            np.save(tmp / _OFFSETS, offsets)
            (tmp / _META).write_text(json.dumps(meta, indent=1), encoding="utf-8")  # last
            if self.cache._place(tmp, meta):
                self.tmp = None
        except OSError as err:
            self._fail(err)
        self.abort()

    def abort(self) -> None:
        """Drop what was written (nothing if the entry was placed)."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None

    def _fail(self, err: OSError | None) -> None:
        """Give up writing (warning once if the disk said no)."""
        if err is not None:
            reason = err.strerror or err
            _warn_once(f"cannot write the token cache in {self.cache.root} ({reason})")
        self.failed = True
        self.abort()


# Cached ids copied into a longer entry this many at a time (bounded memory).
_COPY_TOKENS = 1 << 24
# Temporary folders of writers that died (a killed process) are removed after this long.
_STALE_S = 24 * 3600
_NPY_HEADER_BYTES = 128


def _npy_header(n: int) -> bytes:
    """The ``.npy`` header of a 1-D little-endian uint32 array of ``n`` items, of fixed size, so
    that it is written before the ids (with 0) and again after them (with their number)."""
    text = f"{{'descr': '<u4', 'fortran_order': False, 'shape': ({n},), }}"
    text = text.ljust(_NPY_HEADER_BYTES - 10 - 1) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode("latin1")


def _sweep(root: Path) -> None:
    """Remove what writers that died left in ``root`` (temporary folders a day old)."""
    import time

    now = time.time()
    for path in [*root.glob(".tmp-*"), *root.glob(".old-*")]:
        try:
            if now - path.stat().st_mtime > _STALE_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def token_cache(identity: dict[str, Any] | None, tokenizer: Tokenizer) -> TokenCache | None:
    """The cache entry of a source of ``identity`` read with ``tokenizer``, or ``None`` when the
    cache is off or either cannot be identified."""
    if identity is None:
        return None
    root = cache_root()
    if root is None:
        return None
    ident = tokenizer_identity(tokenizer)
    source = _plain(identity)
    if ident is None or source is None:
        return None
    return TokenCache(root, source, ident)


def file_identity(path: Path) -> dict[str, Any]:
    """A file as its resolved path, size and modification time (ns): any edit changes it.

    Raises:
        OSError: The file cannot be looked at (the source's own check says why).
    """
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"warning: {message}; going on without it", file=sys.stderr)
