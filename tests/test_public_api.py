"""The plugin API: what ``lensdiv``, ``lensdiv.testing`` and ``lensdiv.ops.resume`` export, the
deprecated aliases of the old layout, and plugins that import nothing else.

A plugin that imports only public names keeps loading when modules inside the package move (the
layered layout moved ``lensdiv.analyzer`` to ``lensdiv.core.analyzer`` and broke every plugin that
imported it). The scaffold's generated plugin and ``plugins/lensdiv-attention`` — sources and
tests — are parsed with ``ast`` and held to the public names.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import lensdiv
from lensdiv.cli import app
from lensdiv.core.registry import default_registry
from lensdiv.testing.scaffold import new_plugin

ROOT = Path(__file__).resolve().parents[1]
# The modules of the plugin API: their __all__ is what a plugin may import (README, "The plugin
# API").
PUBLIC_MODULES = ("lensdiv", "lensdiv.testing", "lensdiv.ops.resume")
OLD_LAYOUT = {  # module of the layout before the layers: where its names live now
    "lensdiv.analyzer": "lensdiv.core.analyzer",
    "lensdiv.results": "lensdiv.core.results",
    "lensdiv.stats": "lensdiv.core.stats",
    "lensdiv.errors": "lensdiv.core.errors",
}


def _public() -> dict[str, set[str]]:
    return {m: set(importlib.import_module(m).__all__) for m in PUBLIC_MODULES}


def private_uses(path: Path) -> list[str]:
    """``"file:line: what"`` for every use of lensdiv in ``path`` outside the plugin API: an
    import of another module, a name not in a public module's ``__all__``, or an attribute of a
    public module that is not (``lensdiv.core.stats.Stats`` after ``import lensdiv``)."""
    public = _public()
    tree = ast.parse(path.read_text(), filename=str(path))
    bound: dict[str, str] = {}  # local name -> the lensdiv module it stands for
    found: list[str] = []

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{path.name}:{getattr(node, 'lineno', 0)}: {what}")

    def check_module(node: ast.AST, module: str) -> bool:
        if module not in public:
            say(node, f"{module} is not part of the plugin API")
            return False
        return True

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "lensdiv":
                    continue
                if check_module(node, alias.name):
                    bound[alias.asname or "lensdiv"] = alias.name if alias.asname else "lensdiv"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] != "lensdiv" or not check_module(node, node.module):
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in public:
                    bound[alias.asname or alias.name] = sub
                elif alias.name not in public[node.module]:
                    say(node, f"{alias.name} is not in {node.module}.__all__")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        base: ast.expr = node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if not isinstance(base, ast.Name) or base.id not in bound:
            continue
        module = bound[base.id]
        for attr in chain:  # public submodules, then one public name
            if f"{module}.{attr}" in public:
                module = f"{module}.{attr}"
                continue
            if attr not in public[module]:
                say(node, f"{module}.{attr} is not part of the plugin API")
            break
    return sorted(set(found))


def _python_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*.py") if "build" not in p.parts)
    assert files, root
    return files


def test_every_public_name_resolves() -> None:
    for module, names in _public().items():
        loaded = importlib.import_module(module)
        for name in names:
            assert getattr(loaded, name) is not None, f"{module}.{name}"
    assert {"Analyzer", "Result", "Table", "Plot", "Stats", "Step", "ModelInfo", "Batch",
            "LensdivError", "UnsupportedModelError", "analyze"} <= set(lensdiv.__all__)
    assert {"check_analyzer", "boot_native_tiny", "token_batches"} <= set(
        importlib.import_module("lensdiv.testing").__all__)


def test_the_scaffolds_plugin_imports_only_public_names(tmp_path: Path) -> None:
    package = new_plugin("resid-norm", tmp_path)
    files = _python_files(package)
    assert any(p.parent.name == "tests" for p in files)
    assert [use for path in files for use in private_uses(path)] == []


def test_lensdiv_attention_imports_only_public_names() -> None:
    files = _python_files(ROOT / "plugins" / "lensdiv-attention")
    assert any(p.parent.name == "tests" for p in files)
    assert [use for path in files for use in private_uses(path)] == []


def test_the_check_finds_what_is_not_public(tmp_path: Path) -> None:
    path = tmp_path / "plugin.py"
    path.write_text(
        "import lensdiv\n"
        "import lensdiv.testing as lt\n"
        "from lensdiv import Analyzer, testing\n"
        "from lensdiv.data.sources import token_batches\n"
        "from lensdiv.analyzer import Step\n"
        "from lensdiv import core\n"
        "x = lensdiv.core.stats.Stats\n"
        "y = lensdiv.testing.check_analyzer, lt.boot_tiny, testing.nothing_here\n"
    )
    assert private_uses(path) == [
        "plugin.py:4: lensdiv.data.sources is not part of the plugin API",
        "plugin.py:5: lensdiv.analyzer is not part of the plugin API",
        "plugin.py:6: core is not in lensdiv.__all__",
        "plugin.py:7: lensdiv.core is not part of the plugin API",
        "plugin.py:8: lensdiv.testing.nothing_here is not part of the plugin API",
    ]


# -- the old layout: deprecated aliases ------------------------------------------------------------


# The release that removes the aliases (the README's plugin API section says so).
ALIASES_REMOVED_IN = (0, 3)


@pytest.mark.parametrize("old", sorted(OLD_LAYOUT))
def test_the_old_modules_are_deprecated_aliases(old: str) -> None:
    """Each alias warns, naming the release that removes it, the import to use and where the
    module moved; it gives the moved module's names."""
    sys.modules.pop(old, None)
    removed = ".".join(map(str, ALIASES_REMOVED_IN))
    with pytest.warns(DeprecationWarning) as caught:
        alias = importlib.import_module(old)
    (text,) = [str(w.message) for w in caught if str(w.message).startswith(old)]
    assert f"{old} is deprecated and will be removed in lensdiv {removed}:" in text
    assert "from lensdiv (the plugin API" in text and OLD_LAYOUT[old] in text
    assert f"removed in lensdiv {removed}" in (ROOT / "README.md").read_text()
    moved = importlib.import_module(OLD_LAYOUT[old])
    for name in (n for n in vars(moved) if not n.startswith("__")):
        assert getattr(alias, name) is getattr(moved, name)
    with pytest.raises(AttributeError):
        alias.no_such_name  # noqa: B018  # the point: an unknown name is still an error


def test_the_aliases_are_gone_by_the_release_that_removes_them() -> None:
    """A reminder that fails: from lensdiv 0.3 on, the alias modules must be deleted (with this
    test's fixture plugin of the old layout and the README's paragraph)."""
    version = tuple(int(part) for part in lensdiv.__version__.split(".")[:2])
    if version >= ALIASES_REMOVED_IN:
        left = [old for old in OLD_LAYOUT if (ROOT / (old.replace(".", "/") + ".py")).exists()]
        assert not left, f"lensdiv {lensdiv.__version__} still ships the aliases {left}"
    assert not (ROOT / "lensdiv" / "scaffold.py").exists()  # moved to lensdiv.testing


_OLD_STYLE = '''
from dataclasses import dataclass

from lensdiv.analyzer import Analyzer, ModelInfo, Step
from lensdiv.results import Result, Table
from lensdiv.stats import Stats


@dataclass(frozen=True)
class Oldstyle(Analyzer):
    """Counts tokens, written against the layout before the layers."""

    name = "oldstyle"
    description = "a plugin of the old layout"

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "counted", tables={"t": Table("t", {"n": [int(state["n"])]})})
'''


@pytest.fixture
def old_style_plugin(tmp_path: Path) -> Iterator[None]:
    """An installed distribution whose plugin imports ``lensdiv.analyzer`` and friends."""
    (tmp_path / "oldstyle.py").write_text(_OLD_STYLE)
    info = tmp_path / "lensdiv_oldstyle-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lensdiv-oldstyle\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lensdiv.plugins]\noldstyle = oldstyle:Oldstyle\n")
    sys.path.insert(0, str(tmp_path))
    default_registry.cache_clear()
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop("oldstyle", None)
    default_registry.cache_clear()


def test_a_plugin_of_the_old_layout_still_loads(old_style_plugin: None, tmp_path: Path) -> None:
    runner = CliRunner()
    listing = runner.invoke(app, ["plugins", "list"], catch_exceptions=False)
    assert listing.exit_code == 0 and "failed to load" not in listing.output
    assert "oldstyle" in listing.output
    result = runner.invoke(app, ["analyze", "toy", "-p", "oldstyle", "--out", str(tmp_path / "o"),
                                 "--max-tokens", "256", "--seq-len", "32", "--no-progress"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run: Any = lensdiv.load_run(tmp_path / "o")
    assert run["oldstyle"].table()["n"] == [256]
