"""Folders lensdiv writes to (results, its cache of toy models and tokens): where the cache is,
and can they be written at all?

Checked before any expensive work, so a run never trains or analyses for minutes only to find
it cannot keep what it computed.
"""

from __future__ import annotations

import os
from pathlib import Path


def folder_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be (or become) a folder this process writes into, or ``None``.

    Nothing is created: the nearest existing ancestor must be a writable folder (``os.access``
    also answers "no" on a read-only file system).
    """
    folder = Path(path).expanduser()
    probe = folder
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():  # a dangling link: the folder cannot be created through it
            return f"{probe} is a broken symbolic link"
        probe = probe.parent
    if not probe.is_dir():
        where = "it is a file" if probe == folder else f"{probe} is a file"
        return f"{where}, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        read_only = _read_only(probe)
        return f"{probe} is {'on a read-only file system' if read_only else 'not writable'}"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # statvfs is POSIX only
        return False


def cache_root() -> Path:
    """lensdiv's cache folder (toy models, tokenised data): ``$LENSDIV_CACHE``, else
    ``$XDG_CACHE_HOME/lensdiv``, else ``~/.cache/lensdiv``."""
    if os.environ.get("LENSDIV_CACHE"):
        return Path(os.environ["LENSDIV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lensdiv"


def model_cache_root() -> Path:
    """Where GGUF files and the models dequantized from them are kept (the real models of the
    catalog among them): ``$LENSDIV_MODEL_CACHE`` when set, else :func:`cache_root`. A separate
    variable lets a test session keep these large entries in one persistent folder while its
    toy models and tokens go to a temporary ``$LENSDIV_CACHE``."""
    if os.environ.get("LENSDIV_MODEL_CACHE"):
        return Path(os.environ["LENSDIV_MODEL_CACHE"]).expanduser()
    return cache_root()
