"""The plugin registry: every analyzer, built-in or third-party, comes from the ``lensdiv.plugins``
entry-point group (like pytest's ``pytest11``). Each entry remembers the distribution that supplied
it; duplicate names are refused naming both providers; a plugin that fails to import is reported
and the others keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, Any

from lensdiv.core.analyzer import Analyzer
from lensdiv.core.errors import PluginError, did_you_mean

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Analyzer

GROUP = "lensdiv.plugins"


@dataclass
class PluginEntry:
    """One registered analyzer.

    Args:
        name: Entry-point name (the plugin name).
        target: ``module:Class``.
        provider: Distribution that registered it, with version.
        cls: The analyzer class, once loaded.
        error: Why it could not be loaded, if it could not.
    """

    name: str
    target: str
    provider: str
    cls: type[Analyzer] | None = None
    error: str | None = None
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def description(self) -> str:
        """The analyzer's one-line description (or the load error)."""
        if self.cls is None:
            return f"failed to load: {self.error}"
        return self.cls.description


@dataclass
class Registry:
    """All plugins found, plus problems met while collecting them."""

    entries: dict[str, PluginEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        """Plugin names and aliases that resolve."""
        out = []
        for entry in self.entries.values():
            out += [entry.name, *entry.aliases]
        return out

    def resolve(self, name: str) -> type[Analyzer]:
        """Return the analyzer class registered under ``name`` or one of its aliases."""
        key = name.strip().lower()
        for entry in self.entries.values():
            if key == entry.name or key in entry.aliases:
                if entry.cls is None:
                    raise PluginError(
                        f"plugin {entry.name!r} from {entry.provider} failed to load: {entry.error}",
                        hint="reinstall or fix that package; other plugins still work",
                    )
                return entry.cls
        raise PluginError(
            f"unknown analyzer {name!r}{did_you_mean(key, self.names())}",
            hint="`lensdiv plugins list` shows what is installed",
        )


def _provider(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else "unknown"


def collect(entry_points: Iterable[metadata.EntryPoint] | None = None) -> Registry:
    """Load every analyzer of the ``lensdiv.plugins`` group (or of ``entry_points``)."""

    if entry_points is None:
        entry_points = metadata.entry_points(group=GROUP)
    registry = Registry()
    seen_aliases: dict[str, str] = {}
    for ep in sorted(entry_points, key=lambda e: e.name):
        name = ep.name.strip().lower()
        entry = PluginEntry(name=name, target=ep.value, provider=_provider(ep))
        if name in registry.entries:
            other = registry.entries[name]
            if other.target == entry.target:  # the same distribution seen twice on sys.path
                continue
            registry.problems.append(
                f"duplicate analyzer name {name!r}: registered by {other.provider} "
                f"({other.target}) and by {entry.provider} ({entry.target}); both refused"
            )
            other.cls, other.error = None, f"name also registered by {entry.provider}"
            continue
        try:
            cls = ep.load()
            if not (isinstance(cls, type) and issubclass(cls, Analyzer)):
                raise TypeError(f"{ep.value} is not a lensdiv.Analyzer subclass")
            if getattr(cls, "name", None) != name:
                raise TypeError(f"{ep.value}.name is {getattr(cls, 'name', None)!r}, not {name!r}")
            entry.cls = cls
            entry.aliases = tuple(a.lower() for a in cls.aliases)
        except Exception as err:  # a broken plugin must not take the others down
            entry.error = f"{type(err).__name__}: {err}"
            registry.problems.append(f"plugin {name!r} from {entry.provider}: {entry.error}")
        for alias in entry.aliases:
            if alias in seen_aliases:
                registry.problems.append(
                    f"alias {alias!r} of {name!r} already names {seen_aliases[alias]!r}; ignored"
                )
                entry.aliases = tuple(a for a in entry.aliases if a != alias)
            else:
                seen_aliases[alias] = name
        registry.entries[name] = entry
    return registry


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of the installed environment (cached)."""
    return collect()


def get_analyzer(name: str) -> type[Analyzer]:
    """Return the analyzer class for a plugin name or alias."""
    return default_registry().resolve(name)


def list_plugins() -> list[PluginEntry]:
    """Every registered plugin, loaded or not."""
    return list(default_registry().entries.values())


def make_analyzers(
    plugins: str | Iterable[str | Analyzer], options: dict[str, dict[str, Any]] | None = None
) -> list[Analyzer]:
    """Instantiate analyzers from names (comma-separated string or list) or ready instances."""

    if isinstance(plugins, str):
        plugins = [p for p in plugins.split(",") if p.strip()]
    options = {k.lower(): v for k, v in (options or {}).items()}
    analyzers: list[Analyzer] = []
    used = set()
    for item in plugins:
        if isinstance(item, Analyzer):
            analyzers.append(item)
            continue
        cls = get_analyzer(item)
        opts = {}
        for key in (cls.name, *cls.aliases, item.strip().lower()):
            if key in options:
                opts.update(options[key])
                used.add(key)
        analyzers.append(cls.from_options(opts))
    unused = set(options) - used
    if unused:
        key = sorted(unused)[0]
        raise PluginError(
            f"options given for {key!r}, which is not among the selected analyzers",
            hint=f"selected: {', '.join(a.name for a in analyzers)}",
        )
    if not analyzers:
        raise PluginError("no analyzers selected", hint="pass --plugins lens,contrib")
    names = [a.name for a in analyzers]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PluginError(f"analyzer {sorted(dup)[0]!r} selected twice")
    return analyzers
