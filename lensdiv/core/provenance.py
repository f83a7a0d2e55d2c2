"""Provenance: the versions of everything that can change a number, recorded in every result."""

from __future__ import annotations

import platform


def versions(*extra: str) -> dict[str, str]:
    """Versions of everything that can change a number (plus the ``extra`` distributions)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("lensdiv", "torch", "transformer-lens", "transformers", "numpy", *extra):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out
