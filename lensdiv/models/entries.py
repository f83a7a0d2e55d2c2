"""Cache entries: a folder of files written whole or not at all, and verified before it is read.

The toy models and the models dequantized from GGUF files are cached the same way: the files
are written to a temporary folder beside the entry, a completion marker records the sha256 of
each, and the folder is renamed into place. An entry is read only when its marker is there and
every file matches its checksum; anything else (a partial write, a flipped bit, a deleted
file) is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

#: The completion marker of an entry: ``{"sha256": {file name: digest}}``.
COMPLETE = "COMPLETE.json"


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_entry(folder: Path) -> str | None:
    """``None`` if the cache entry is complete and intact, else what is wrong with it."""
    marker = folder / COMPLETE
    if not marker.is_file():
        return "no completion marker (partial write)"
    try:
        expected = json.loads(marker.read_text())["sha256"]
    except (ValueError, KeyError, OSError):
        return "unreadable completion marker"
    for name, digest in expected.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} does not match its checksum"
    return None


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A temporary folder beside ``final`` to write an entry into; removed if the block fails
    (disk full, Ctrl-C), so no half-written entry is left behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def commit_entry(tmp: Path, final: Path, files: Sequence[str]) -> Path:
    """Write the completion marker of ``files`` in ``tmp`` and rename it to ``final``.

    Another process (a torchrun rank, a test worker) may have built the same entry meanwhile:
    entries are deterministic in their key, so its complete and intact entry is this one and
    stays (it may be being read); a broken entry (partial, or a file that fails its checksum:
    the one being rebuilt) is replaced.
    """
    (tmp / COMPLETE).write_text(json.dumps({"sha256": {f: sha256_file(tmp / f) for f in files}}))
    if (final / COMPLETE).is_file() and verify_entry(final) is None:
        shutil.rmtree(tmp, ignore_errors=True)
        return final
    shutil.rmtree(final, ignore_errors=True)
    try:
        os.replace(tmp, final)
    except OSError:  # another process renamed its entry into place in between
        shutil.rmtree(tmp, ignore_errors=True)
        if not (final / COMPLETE).is_file():
            raise
    return final


def build_entry(final: Path, fill: Callable[[Path], Sequence[str]]) -> Path:
    """Build the entry ``final``: ``fill(tmp)`` writes its files into a temporary folder and
    returns the names of those to checksum; the folder is then marked complete and renamed into
    place."""
    with staging(final) as tmp:
        return commit_entry(tmp, final, fill(tmp))
