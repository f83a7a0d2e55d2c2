"""The plugin registry: duplicates, broken plugins, aliases and suggestions, on fake entry points.

The entry points target classes of this module (``tests.test_registry:Name``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.metadata import EntryPoint

import pytest

from lensdiv.analyzers.lens import LogitLens
from lensdiv.core.errors import PluginError
from lensdiv.core.registry import GROUP, collect
from tests.helpers import Alpha

# -- tiny analyzers: targets of the fake entry points below (``tests.test_registry:Name``) ------
# ``Alpha`` (shared with the option tests) is one too: importing it makes it an attribute here.


@dataclass(frozen=True)
class AlphaTwin(Alpha):
    """Claims the same name as :class:`Alpha` (a duplicate from another package)."""

    aliases = ()


@dataclass(frozen=True)
class Beta(Alpha):
    """A second, independent analyzer."""

    name = "beta"
    aliases = ("b",)


@dataclass(frozen=True)
class Clash(Alpha):
    """Claims an alias :class:`Alpha` already has."""

    name = "clash"
    aliases = ("al",)


class NotAnAnalyzer:
    """Registered by mistake: not an ``Analyzer`` subclass."""

    name = "stray"


def _ep(name: str, target: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"tests.test_registry:{target}", group=GROUP)


# -- Registry ------------------------------------------------------------------------------------


def test_registry_duplicate_names_are_refused_naming_both() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("alpha", "AlphaTwin"), _ep("beta", "Beta")])
    duplicates = [p for p in registry.problems if "duplicate" in p]
    assert len(duplicates) == 1
    assert re.search(r"tests\.test_registry:Alpha\b", duplicates[0])
    assert "tests.test_registry:AlphaTwin" in duplicates[0]
    with pytest.raises(PluginError, match="alpha"):
        registry.resolve("alpha")
    assert registry.resolve("beta") is Beta


def test_registry_same_target_twice_is_not_a_duplicate() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("alpha", "Alpha")])
    assert registry.problems == []
    assert registry.resolve("alpha") is Alpha


def test_registry_broken_plugins_are_reported_and_others_work() -> None:
    registry = collect([
        EntryPoint(name="broken", value="tests.no_such_module_here:Thing", group=GROUP),
        _ep("stray", "NotAnAnalyzer"),
        _ep("gamma", "Beta"),  # entry-point name differs from the class's name
        _ep("alpha", "Alpha"),
        _ep("beta", "Beta"),
    ])
    problems = "\n".join(registry.problems)
    assert len(registry.problems) == 3
    assert "broken" in problems and "ModuleNotFoundError" in problems
    assert "stray" in problems and "not a lensdiv.Analyzer" in problems
    assert "gamma" in problems
    for name in ("broken", "stray", "gamma"):
        entry = registry.entries[name]
        assert entry.cls is None and entry.error and "failed to load" in entry.description
        with pytest.raises(PluginError, match="failed to load"):
            registry.resolve(name)
    assert registry.resolve("alpha") is Alpha and registry.resolve("beta") is Beta
    assert registry.entries["alpha"].description == Alpha.description


def test_registry_unknown_name_suggests() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("beta", "Beta")])
    with pytest.raises(PluginError, match="(?i)did you mean 'alpha'"):
        registry.resolve("alpah")
    with pytest.raises(PluginError, match="unknown analyzer"):
        registry.resolve("zzzzzz")


def test_registry_aliases() -> None:
    registry = collect([_ep("beta", "Beta"), _ep("alpha", "Alpha")])
    for name in ("alpha", "al", "AL", " alfa ", "Alpha"):
        assert registry.resolve(name) is Alpha, name
    assert registry.resolve("b") is Beta
    assert set(registry.names()) == {"alpha", "al", "alfa", "beta", "b"}


def test_registry_alias_clash_is_reported() -> None:
    registry = collect([_ep("alpha", "Alpha"), _ep("clash", "Clash")])
    assert any("'al'" in p for p in registry.problems)
    assert registry.resolve("al") is Alpha and registry.resolve("clash") is Clash


def test_installed_registry_holds_the_builtins() -> None:
    from lensdiv.core.registry import get_analyzer, list_plugins

    entries = {e.name: e for e in list_plugins()}
    assert entries["lens"].cls is LogitLens and entries["lens"].provider.startswith("lensdiv ")
    assert get_analyzer("logit-lens") is LogitLens


@dataclass(frozen=True)
class FakeLens(Alpha):
    """A third-party analyzer that claims the built-in name ``lens`` and the alias ``al``."""

    name = "lens"
    aliases = ("al",)


@dataclass(frozen=True)
class LogitLensTwin(Alpha):
    """A third-party analyzer named like an alias of the built-in ``lens``."""

    name = "logit-lens"
    aliases = ("lens",)


def test_a_plugin_claiming_a_builtin_name_is_refused_and_the_builtin_kept() -> None:
    builtin = EntryPoint(name="lens", value="lensdiv.analyzers.lens:LogitLens", group=GROUP)
    # Listed first and alphabetically earlier than the built-in: built-ins are still read first.
    registry = collect([_ep("lens", "FakeLens"), _ep("logit-lens", "LogitLensTwin"), builtin])
    assert registry.resolve("lens") is LogitLens and registry.resolve("logit-lens") is LogitLens
    problems = "\n".join(registry.problems)
    assert "tests.test_registry:FakeLens" in problems and "lensdiv.analyzers.lens:LogitLens" in problems
    assert "is a built-in analyzer" in problems and "refused" in problems
    assert "'logit-lens'" in problems and "is an alias of 'lens'" in problems
    assert registry.entries["lens"].cls is LogitLens and "logit-lens" not in registry.entries

