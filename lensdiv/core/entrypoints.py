"""Kinds come from entry points: one registration style for everything lensdiv can be extended
with. Analyzers are the ``lensdiv.plugins`` group (:mod:`lensdiv.core.registry`), kinds of lens
``lensdiv.lens_kinds`` (a :class:`~lensdiv.ops.translators.LensKind` object) and data sources
``lensdiv.data_sources`` (a :class:`~lensdiv.data.spec.Source` subclass). lensdiv declares its own
in its ``pyproject.toml`` exactly as a third-party package declares one::

    [project.entry-points."lensdiv.lens_kinds"]
    my-lens = "my_package.lenses:MY_LENS_KIND"

This module only finds and loads them (the standard library's :mod:`importlib.metadata`; no
torch, as ``lensdiv --help`` reads the data sources): lensdiv's own entries first, in the order its
``pyproject.toml`` declares them, then other packages' by name. An entry that fails to import is
reported, never raised: the others keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

#: The entry-point groups of lensdiv's kinds (the analyzers' group is ``registry.GROUP``).
LENS_KINDS_GROUP = "lensdiv.lens_kinds"
DATA_SOURCES_GROUP = "lensdiv.data_sources"


def provider(ep: metadata.EntryPoint) -> str:
    """The distribution (with its version) that declared ``ep``."""
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "unknown"


def is_builtin(ep: metadata.EntryPoint) -> bool:
    """Declared by lensdiv itself (its own distribution, or a module of the package)."""
    dist = getattr(ep, "dist", None)
    if dist is not None:
        return str(dist.name).lower().replace("_", "-") == "lensdiv"
    return ep.value.startswith("lensdiv.")


def ordered(entry_points: Iterable[metadata.EntryPoint]) -> list[metadata.EntryPoint]:
    """lensdiv's own entries in their declared order, then the others by name; an entry seen twice
    (one distribution on ``sys.path`` twice) once."""
    seen: set[tuple[str, str]] = set()
    unique = []
    for ep in entry_points:
        if (ep.name, ep.value) not in seen:
            seen.add((ep.name, ep.value))
            unique.append(ep)
    own = [ep for ep in unique if is_builtin(ep)]
    return own + sorted((ep for ep in unique if not is_builtin(ep)), key=lambda e: e.name)


@dataclass(frozen=True)
class Loaded:
    """One entry point, loaded: its name, the object it names, who declared it, whether lensdiv."""

    name: str
    value: Any
    provider: str
    builtin: bool


def load_group(
    group: str, entry_points: Iterable[metadata.EntryPoint] | None = None
) -> tuple[list[Loaded], list[str]]:
    """Every entry of ``group`` (or of ``entry_points``) loaded, in :func:`ordered` order, and one
    line per entry that could not be imported (``"NAME from PACKAGE (TARGET): ERROR"``)."""
    if entry_points is None:
        entry_points = metadata.entry_points(group=group)
    loaded: list[Loaded] = []
    problems: list[str] = []
    for ep in ordered(entry_points):
        try:
            value = ep.load()
        except Exception as err:  # a broken package must not take the others down
            problems.append(
                f"{group} entry {ep.name!r} from {provider(ep)} ({ep.value}): "
                f"{type(err).__name__}: {err}"
            )
            continue
        loaded.append(Loaded(ep.name, value, provider(ep), is_builtin(ep)))
    return loaded, problems


__all__ = [
    "DATA_SOURCES_GROUP",
    "LENS_KINDS_GROUP",
    "Loaded",
    "is_builtin",
    "load_group",
    "ordered",
    "provider",
]
