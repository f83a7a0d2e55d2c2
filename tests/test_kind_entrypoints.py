"""Kinds of lens and data sources come from entry points, as analyzers do: lensdiv's own are
declared in pyproject.toml, a package adds one the same way; a broken or clashing entry is left
out with one warning line and the others keep working."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from lensdiv.core import entrypoints
from lensdiv.core.entrypoints import DATA_SOURCES_GROUP, LENS_KINDS_GROUP
from lensdiv.core.errors import PluginWarning
from lensdiv.data import spec as data_spec
from lensdiv.data.sources import DataSpec, check_source, registered_sources
from lensdiv.ops import translators
from lensdiv.ops.translators import LENS_KINDS

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

PYPROJECT = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
GROUPS = PYPROJECT["project"]["entry-points"]

THIRD_PARTY = '''
from lensdiv.data.spec import Source
from lensdiv.ops.translators import LOGIT, LensKind

MINE = LensKind("mine", "My lens", "my lens", make=lambda options: LOGIT)
NAMED_WRONG = LensKind("other", "Other lens", "other lens", make=lambda options: LOGIT)
CLASH = LensKind("logit", "Not the logit lens", "not the logit lens", make=lambda options: LOGIT)
NOT_A_KIND = 42


class Lines(Source):
    """``lines:A|B``: each part a document."""

    kind = "lines"
    syntax = "lines:A|B"
    summary = "lines"

    @classmethod
    def claims(cls, spec):
        return isinstance(spec.source, str) and spec.source.startswith("lines:")

    def documents(self):
        return iter(self.spec.source[len("lines:"):].split("|"))


class Text(Lines):
    kind = "text"  # a kind lensdiv has
'''


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A package ``kinds_pkg`` on ``sys.path`` and ``entries(group, {name: target})``, which makes
    the installed entry points of ``group`` those of lensdiv plus the given ones."""
    (tmp_path / "kinds_pkg.py").write_text(textwrap.dedent(THIRD_PARTY))
    monkeypatch.syspath_prepend(str(tmp_path))
    real = metadata.entry_points

    def entries(wanted: str, extra: dict[str, str]) -> None:
        own = list(real(group=wanted))
        added = [metadata.EntryPoint(name, target, wanted) for name, target in extra.items()]

        def installed(**selection: Any) -> Any:
            return own + added if selection.get("group") == wanted else real(**selection)

        monkeypatch.setattr(entrypoints.metadata, "entry_points", installed)

    yield entries


def test_lensdivs_own_kinds_are_its_declared_entry_points() -> None:
    assert list(LENS_KINDS) == ["logit", "last-block", "patchscope", "tuned", "jacobian", "affine"]
    assert set(GROUPS[LENS_KINDS_GROUP]) == set(LENS_KINDS)
    for name, target in GROUPS[LENS_KINDS_GROUP].items():
        assert metadata.EntryPoint(name, target, LENS_KINDS_GROUP).load() is LENS_KINDS[name]
    kinds = [source.kind for source in registered_sources()]
    assert set(GROUPS[DATA_SOURCES_GROUP]) == set(kinds)
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=DATA_SOURCES_GROUP)}
    assert installed == GROUPS[DATA_SOURCES_GROUP], "reinstall lensdiv (pip install -e .)"


def test_a_packages_lens_kind_joins_and_bad_ones_are_refused(third_party: Any) -> None:
    third_party(
        LENS_KINDS_GROUP,
        {
            "mine": "kinds_pkg:MINE",
            "named-wrong": "kinds_pkg:NAMED_WRONG",
            "logit": "kinds_pkg:CLASH",
            "number": "kinds_pkg:NOT_A_KIND",
            "broken": "kinds_pkg_missing:KIND",
        },
    )
    fresh = translators._LensKinds()
    with pytest.warns(PluginWarning) as said:
        names = list(fresh)
    assert names == [*LENS_KINDS, "mine"]  # lensdiv's first, in their order; the package's after
    assert fresh["logit"] is LENS_KINDS["logit"]  # the built-in keeps its name
    assert fresh["mine"].build().kind == "logit"
    lines = sorted(str(w.message) for w in said)
    assert len(lines) == 4, lines
    assert any("'logit'" in line and "already" in line for line in lines)
    assert any("'named-wrong'" in line and "'other'" in line for line in lines)
    assert any("'number'" in line and "not a LensKind" in line for line in lines)
    assert any("'broken'" in line and "ModuleNotFoundError" in line for line in lines)
    assert all("\n" not in line for line in lines)


def test_a_packages_data_source_joins_and_a_clash_is_refused(
    third_party: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    third_party(
        DATA_SOURCES_GROUP,
        {"lines": "kinds_pkg:Lines", "text2": "kinds_pkg:Text", "gone": "nowhere_pkg:Source"},
    )
    monkeypatch.setattr(data_spec, "_SOURCES", [])
    monkeypatch.setattr(data_spec, "_LOADED", [])
    with pytest.warns(PluginWarning) as said:
        kinds = [source.kind for source in registered_sources()]
    assert kinds == [
        *("text", "jsonl", "folder", "hub", "literal", "builtin", "memory", "tokens", "pydoc"),
        "lines",  # a package's source after lensdiv's, so asked first
    ]
    assert check_source(DataSpec(source="lines:a|b")) == "lines"  # asked before the path sources
    lines = [str(w.message) for w in said]
    assert len(lines) == 2 and any("'text'" in line and "already" in line for line in lines)
    assert any("'gone'" in line and "ModuleNotFoundError" in line for line in lines)
