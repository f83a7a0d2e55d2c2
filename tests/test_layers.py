"""The architecture of ARCHITECTURE.md, enforced: layers import one way, no module imports
another in a circle, and function-local imports of lensdiv exist only for start-up time."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lensdiv"
# The package's root imports its public names lazily by design (`lensdiv --help`, notebooks).
LAZY_BY_DESIGN = ("lensdiv/__init__.py",)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[ast.AST, str, bool]]:
    """``(node, imported module, at module level)`` for every import of a lensdiv module."""
    tree = ast.parse(path.read_text())
    local = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for sub in ast.walk(node)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out += [(node, n, id(node) not in local) for n in names if n.split(".")[0] == "lensdiv"]
    return out


def test_layers_import_one_way() -> None:
    """import-linter's layers contract (pyproject.toml, [tool.importlinter])."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    proc = subprocess.run([exe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_no_import_cycles() -> None:
    """Imports between lensdiv modules form no cycle: a function-local import counts too (it
    only postpones the circle to the first call)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        if path.relative_to(ROOT).as_posix() in LAZY_BY_DESIGN:
            continue  # the package's public names, imported on first use by design
        for _, target, _top in _imports(path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    _acyclic(graph)


def test_the_course_scripts_import_no_cycle() -> None:
    """The course's build scripts (beside its solutions) import each other one way."""
    folder = ROOT / "tutorials" / "course" / "solutions"
    scripts = {p.stem: p for p in folder.glob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in scripts}
    for name, path in scripts.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in scripts:
                graph[name].add(node.module)
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name in scripts}
    _acyclic(graph)


def _acyclic(graph: dict[str, set[str]]) -> None:
    """Fail with the first cycle of ``graph`` (node -> the nodes it imports)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def _reason(lines: list[str], lineno: int) -> str:
    """The comments that stand for an import at line ``lineno`` (1-based): on its line, and
    on the lines above it up to the first that is neither an import, a comment nor blank (one
    comment says why for a group of imports)."""
    said = [lines[lineno - 1]]
    for line in reversed(lines[: lineno - 1]):
        text = line.strip()
        if text.startswith("#") or not text:
            said.append(text)
        elif text.startswith(("from ", "import ")) or text.endswith(("(", ",", ")")):
            said.append(line.split("#", 1)[1] if "#" in line else "")
        else:
            break
    return " ".join(said)


def test_function_local_imports_say_why() -> None:
    """A lensdiv import inside a function (the commands' included) is there for start-up time,
    and says so: on its line or in a comment above its group of imports."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(LAZY_BY_DESIGN):
            continue
        lines = path.read_text().splitlines()
        for node, target, top in _imports(path):
            if top:
                continue
            if "start-up" not in _reason(lines, node.lineno).lower():
                offenders.append(f"{rel}:{node.lineno} imports {target}")
    assert not offenders, "function-local imports without a start-up reason:\n" + "\n".join(
        offenders
    )


# The longest a function in lensdiv/ may be: a finalize computes the numbers and hands them to a
# presentation function, a command calls the Python API, and neither grows into a page of mixed
# concerns (issues 25 and 45).
MAX_FUNCTION_LINES = 100


def test_functions_are_short() -> None:
    """No function (or method) in lensdiv/ is longer than 100 lines."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    rel = path.relative_to(ROOT).as_posix()
                    long.append(f"{rel}:{node.lineno} {node.name} has {lines} lines")
    assert not long, (
        f"functions over {MAX_FUNCTION_LINES} lines (split the computation from the "
        "presentation):\n" + "\n".join(long)
    )
