"""Provenance: the versions of everything that can change a number, recorded in every result."""

from __future__ import annotations

import functools
import platform


def versions(*extra: str) -> dict[str, str]:
    """Versions of everything that can change a number (plus the ``extra`` distributions)."""
    out = {"python": platform.python_version()}
    for dist in ("lensdiv", "torch", "transformer-lens", "transformers", "numpy", *extra):
        out[dist] = _version(dist)
    return out


@functools.cache
def _version(dist: str) -> str:
    """A distribution's version, read once a process (reading a package's metadata costs a few
    milliseconds, and every run records five)."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"
