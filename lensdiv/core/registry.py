"""The plugin registry: every analyzer, built-in or third-party, comes from the ``lensdiv.plugins``
entry-point group (like pytest's ``pytest11``). Each entry remembers the distribution that supplied
it; a plugin that claims a built-in's name is refused naming both packages (the built-in stays),
two third-party plugins with one name are both refused; a plugin that fails to import is reported
and the others keep working.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import metadata
from typing import TYPE_CHECKING, Any

from lensdiv.core.analyzer import Analyzer, checked_options
from lensdiv.core.entrypoints import is_builtin, provider
from lensdiv.core.errors import OptionError, PluginError, PluginWarning, did_you_mean

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Analyzer

GROUP = "lensdiv.plugins"
# The definitions of the built-in analyses, in the repository; each analyzer's section has an
# anchor named after it (docs/science.md#lens).
SCIENCE_DOC = "docs/science.md"


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
    """All plugins found, plus problems met while collecting them.

    Args:
        entries: The plugins by name.
        problems: One line per problem.
        refused: The problems of plugins refused for a name that a built-in analyzer (or its
            alias) keeps, by that name: selecting it runs the built-in, with these warnings.
    """

    entries: dict[str, PluginEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    refused: dict[str, list[str]] = field(default_factory=dict)

    def refuse(self, name: str, line: str) -> None:
        """Record a plugin refused for ``name``, which another analyzer keeps."""
        self.problems.append(line)
        self.refused.setdefault(name, []).append(line)

    def names(self) -> list[str]:
        """Plugin names and aliases that resolve."""
        out = []
        for entry in self.entries.values():
            out += [entry.name, *entry.aliases]
        return out

    def resolve(self, name: str) -> type[Analyzer]:
        """Return the analyzer class registered under ``name`` or one of its aliases."""
        if not isinstance(name, str):
            raise PluginError(
                f"an analyzer name must be text, not {name!r} ({type(name).__name__})",
                hint="`lensdiv plugins list` shows the names",
            )
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


def collect(entry_points: Iterable[metadata.EntryPoint] | None = None) -> Registry:
    """Load every analyzer of the ``lensdiv.plugins`` group (or of ``entry_points``).

    Built-in analyzers come first and keep their names and aliases: a third-party plugin that
    claims one is refused (naming both packages) and the built-in stays usable. Two third-party
    plugins that claim the same name are both refused, since neither is more right than the other.
    """

    if entry_points is None:
        entry_points = metadata.entry_points(group=GROUP)
    registry = Registry()
    seen_aliases: dict[str, str] = {}
    builtin_names: set[str] = set()
    for ep in sorted(entry_points, key=lambda e: (not is_builtin(e), e.name)):
        name = ep.name.strip().lower()
        entry = PluginEntry(name=name, target=ep.value, provider=provider(ep))
        if name in registry.entries:
            other = registry.entries[name]
            if other.target == entry.target:  # the same distribution seen twice on sys.path
                continue
            if name in builtin_names:
                registry.refuse(
                    name,
                    f"analyzer name {name!r} of {entry.provider} ({entry.target}) is a built-in "
                    f"analyzer of {other.provider} ({other.target}); {entry.provider}'s plugin is "
                    "refused and the built-in kept (rename the plugin)",
                )
                continue
            registry.problems.append(
                f"duplicate analyzer name {name!r}: registered by {other.provider} "
                f"({other.target}) and by {entry.provider} ({entry.target}); both refused"
            )
            other.cls, other.error = None, f"name also registered by {entry.provider}"
            continue
        if name in seen_aliases:
            owner = registry.entries[seen_aliases[name]]
            registry.refuse(
                name,
                f"analyzer name {name!r} of {entry.provider} ({entry.target}) is an alias of "
                f"{owner.name!r} from {owner.provider}; {entry.provider}'s plugin is refused "
                "(rename the plugin)",
            )
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
            taken = seen_aliases.get(alias) or (alias if alias in registry.entries else None)
            if taken is not None:
                registry.problems.append(
                    f"alias {alias!r} of {name!r} already names {taken!r}; ignored"
                )
                entry.aliases = tuple(a for a in entry.aliases if a != alias)
            else:
                seen_aliases[alias] = name
        registry.entries[name] = entry
        if is_builtin(ep):
            builtin_names.add(name)
    return registry


@lru_cache(maxsize=1)
def default_registry() -> Registry:
    """The registry of the installed environment (cached)."""
    return collect()


def get_analyzer(name: str) -> type[Analyzer]:
    """Return the analyzer class for a plugin name or alias."""
    return default_registry().resolve(name)


def definitions(cls: type[Analyzer]) -> str | None:
    """Where the analysis of ``cls`` is defined: ``docs/science.md#NAME`` for a built-in analyzer
    (a class of ``lensdiv.analyzers`` or a lens fit of ``lensdiv.lenses``), ``None`` for a
    third-party one, which its own package documents."""
    if cls.__module__.startswith(("lensdiv.analyzers.", "lensdiv.lenses.")):
        return f"{SCIENCE_DOC}#{cls.name}"
    return None


def list_plugins() -> list[PluginEntry]:
    """Every registered plugin, loaded or not."""
    return list(default_registry().entries.values())


def make_analyzers(
    plugins: str | Analyzer | type[Analyzer] | Iterable[str | Analyzer | type[Analyzer]],
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[Analyzer]:
    """Instantiate analyzers from names (comma-separated string or list), analyzer classes or
    ready instances; every option value is checked against its annotation. A name that an
    installed plugin claimed in vain (a built-in keeps it) selects the built-in, with a
    :class:`~lensdiv.core.errors.PluginWarning` saying so.

    Raises:
        PluginError: Something other than names, classes or instances; an unknown name; an
            analyzer selected twice; none selected.
        OptionError: ``options`` not ``{analyzer: {option: value}}``; a bad option or value.
    """

    if isinstance(plugins, str):
        plugins = [p for p in plugins.split(",") if p.strip()]
    elif isinstance(plugins, (Analyzer, type)):
        plugins = [plugins]
    elif not isinstance(plugins, Iterable):
        raise PluginError(
            f"plugins must be analyzer names, Analyzer instances or a list of them, not "
            f"{plugins!r} ({type(plugins).__name__})",
            hint="e.g. plugins='lens,contrib' or plugins=['lens', MyAnalyzer()]",
        )
    options = _option_table(options)
    analyzers: list[Analyzer] = []
    used = set()
    for item in plugins:
        if isinstance(item, type) and issubclass(item, Analyzer) and not inspect.isabstract(item):
            cls: type[Analyzer] = item
        elif isinstance(item, Analyzer):
            cls = type(item)
        elif isinstance(item, str):
            cls = get_analyzer(item)
            for line in default_registry().refused.get(item.strip().lower(), ()):
                warnings.warn(line, PluginWarning, stacklevel=3)  # at the caller of analyze()
        else:
            raise PluginError(
                f"plugins holds {item!r} ({type(item).__name__}), which is neither an analyzer "
                "name nor a concrete Analyzer class or instance",
                hint="e.g. plugins=['lens', MyAnalyzer()]; `lensdiv plugins list` shows the names",
            )
        opts: dict[str, Any] = {}
        keys = (cls.name, *cls.aliases) + ((item.strip().lower(),) if isinstance(item, str) else ())
        for key in keys:
            if key in options:
                opts.update(options[key])
                used.add(key)
        if isinstance(item, Analyzer):
            # An instance with options given beside it: those options win over its own.
            analyzer = cls.from_options({**item.options(), **opts}) if opts else item
            analyzers.append(checked_options(analyzer))
        else:
            analyzers.append(cls.from_options(opts))
    unused = set(options) - used
    if unused:
        key = sorted(unused)[0]
        raise PluginError(
            f"options given for {key!r}, which is not among the selected analyzers",
            hint=f"selected: {', '.join(a.name for a in analyzers) or 'none'}",
        )
    if not analyzers:
        raise PluginError("no analyzers selected", hint="pass --plugins lens,contrib")
    names = [a.name for a in analyzers]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PluginError(f"analyzer {sorted(dup)[0]!r} selected twice")
    return analyzers


def _option_table(options: Any) -> dict[str, dict[str, Any]]:
    """``{analyzer: {option: value}}`` with lower-case analyzer names, after checking its shape."""
    if options is None:
        return {}
    example = "e.g. options={'lens': {'top_k': 10}}"
    if not isinstance(options, Mapping):
        raise OptionError(
            f"options must map analyzer names to their options, not {type(options).__name__}",
            hint=example,
        )
    table: dict[str, dict[str, Any]] = {}
    for key, value in options.items():
        if not isinstance(key, str):
            raise OptionError(f"options has the key {key!r}, not an analyzer name", hint=example)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise OptionError(
                f"options[{key!r}] must map option names to values, not {value!r}", hint=example
            )
        table.setdefault(key.strip().lower(), {}).update(value)
    return table
