"""Nothing outside the repository: no tracked file refers to a path a user's clone does not have
(a folder beside the repository, an absolute path of one machine, a markdown link that climbs out
of the repository or leads nowhere), and the definitions every analyzer links to exist."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from lensdiv import Analyzer
from lensdiv.core.registry import SCIENCE_DOC, default_registry, definitions
from tests.test_cli import invoke

ROOT = Path(__file__).resolve().parents[1]
UP = ".." + "/"  # the parent folder, in a path
# The folder that sits beside the repository where it is developed. This file is tracked too, so
# it spells the name in parts: a search of the tracked files for references to it finds none.
SIBLING = "sha" + "red"
# What a reference outside the repository looks like in any text: the sibling folder, read from
# the parent folder or joined onto a parent folder in Python, and absolute paths of a
# developer's machine.
OUTSIDE = re.compile(
    rf"\.\./{SIBLING}\b"  # from any folder
    rf"|(?:^|[\s\"'`(\[]){SIBLING}/"  # SIBLING/data/... as a path of its own
    rf"|/\s*[\"']{SIBLING}[\"']"  # Path(...).parent / "SIBLING"
    r"|(?<![\w.])/(?:work|home|Users)/"  # /work/..., /home/NAME/..., /Users/NAME/...
)
# A markdown link or image: [text](target) or [text](target "title").
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def tracked_files() -> list[Path]:
    """The repository's tracked files (skips when this is not a git checkout, e.g. an sdist)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (or no git): the tracked files are unknown")
    files = [ROOT / name for name in out.decode().split("\0") if name]
    if not files:
        pytest.skip("git lists no tracked files here")
    return [f for f in files if f.is_file()]


def read_text(path: Path) -> str | None:
    """The file's text, or ``None`` for a binary file (a PNG, say)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def strings_of(value: object) -> list[str]:
    """Every string of a parsed JSON value (keys too), in order."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings_of(v))]
    if isinstance(value, list):
        return [s for item in value for s in strings_of(item)]
    return []


def lines_of(path: Path, text: str) -> list[str]:
    """The lines a reader sees: a JSON file's (or notebook's) strings unescaped, else the text."""
    if path.suffix in (".json", ".ipynb"):
        return [line for s in strings_of(json.loads(text)) for line in s.splitlines()]
    return text.splitlines()


def markdown_of(path: Path, text: str) -> list[str]:
    """The markdown in a file: a ``.md`` file without its fenced code, a notebook's markdown
    cells; nothing for other files."""
    if path.suffix == ".md":
        return [FENCE.sub("", text)]
    if path.suffix == ".ipynb":
        cells = json.loads(text)["cells"]
        return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return []


def outside_references(path: Path, text: str, root: Path = ROOT) -> list[str]:
    """Every reference of ``text`` (the content of ``path``) to something outside ``root``:
    ``line N: ...`` for each match of :data:`OUTSIDE`, and each relative markdown link that
    leaves ``root`` or names no file in it."""
    problems = []
    for number, line in enumerate(lines_of(path, text), 1):
        for match in OUTSIDE.finditer(line):
            problems.append(f"line {number}: {match.group(0).strip()!r} in {line.strip()[:120]!r}")
    for markdown in markdown_of(path, text):
        for match in LINK.finditer(markdown):
            target = match.group(1).split("#", 1)[0]
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue  # an anchor of the same page, or a URL
            resolved = (path.parent / target).resolve()
            if not resolved.is_relative_to(root.resolve()):
                problems.append(f"link {match.group(1)!r} leads outside the repository")
            elif not resolved.exists():
                problems.append(f"link {match.group(1)!r} names no file of the repository")
    return problems


def test_no_tracked_file_refers_outside_the_repository() -> None:
    found = {}
    for path in tracked_files():
        if path == Path(__file__).resolve():
            continue  # the patterns themselves
        text = read_text(path)
        if text is not None and (problems := outside_references(path, text)):
            found[str(path.relative_to(ROOT))] = problems
    assert not found, "references outside the repository:\n" + json.dumps(found, indent=1)


@pytest.mark.parametrize(
    "name,text",
    [
        ("README.md", f"see [the science]({UP}{SIBLING}/SCIENCE.md)"),
        ("README.md", "see [the science](../../elsewhere/SCIENCE.md)"),
        ("README.md", "see [the science](docs/no_such_file.md#lens)"),
        ("docs/notes.md", "![figure](../../figure.png)"),
        ("lensdiv/x.py", f"CSV = ROOT.parent / '{SIBLING}' / 'data' / 'runs.csv'"),
        ("lensdiv/x.py", f'CSV = Path("{SIBLING}/data/runs.csv")'),
        ("lensdiv/x.py", f"Example: lensdiv scaling fit {UP}{SIBLING}/data/runs.csv"),
        ("tests/x.py", f'DATA = "/work/{SIBLING}/data/runs.csv"'),
        ("docs/x.json", '{"path": "/home/someone/lensdiv/data.csv"}'),
        ("docs/x.json", json.dumps({"code": f'csv = ROOT.parent / "{SIBLING}" / "runs.csv"'})),
        (
            "tutorials/t.ipynb",
            json.dumps(
                {
                    "cells": [
                        {
                            "cell_type": "code",
                            "source": [f'csv = Path(x).parents[2] / "{SIBLING}" / "data"\n'],
                        }
                    ]
                }
            ),
        ),
        (
            "tutorials/t.ipynb",
            json.dumps({"cells": [{"cell_type": "markdown", "source": ["[x](../../up.md)"]}]}),
        ),
    ],
)
def test_an_outside_reference_is_found(name: str, text: str) -> None:
    assert outside_references(ROOT / name, text), text


@pytest.mark.parametrize(
    "name,text",
    [
        ("README.md", "see [the science](docs/science.md#lens) and [the web](https://x.org/a)"),
        (
            "docs/findings.md",
            "[science](science.md#bias), [top](#top), ![f](findings/a1_contribution.png)",
        ),
        ("tutorials/t.md", "[findings](../docs/findings.md#teacher-student)"),
        ("README.md", "```\n[not a link](../../outside)\n```\n"),
        ("lensdiv/x.py", 'constant: Literal["shared", "separate"] = "shared"  # shared equally'),
        ("docs/x.py", "python docs/findings.py --tiny --out /tmp/f"),
    ],
)
def test_references_inside_the_repository_are_fine(name: str, text: str) -> None:
    assert outside_references(ROOT / name, text) == [], text


# -- the definitions of the analyses ----------------------------------------------------------------
def anchors(path: Path) -> set[str]:
    return set(re.findall(r'<a id="([^"]+)"></a>', path.read_text(encoding="utf-8")))


def test_every_builtin_analyzer_links_to_its_definitions() -> None:
    science = ROOT / SCIENCE_DOC
    ids = anchors(science)
    builtin = [
        e
        for e in default_registry().entries.values()
        if e.target.startswith(("lensdiv.analyzers.", "lensdiv.lenses."))
    ]
    assert {e.name for e in builtin} >= {
        "lens", "contrib", "skip", "patch", "linmap", "bias", "submod", "depth-score", "dynamics",
        "fit-affine", "fit-jacobian",
    }  # fmt: skip
    for entry in builtin:
        assert entry.cls is not None, entry.error
        assert definitions(entry.cls) == f"{SCIENCE_DOC}#{entry.name}"
        assert entry.name in ids, f"{SCIENCE_DOC} has no anchor for {entry.name}"
    assert {"conventions", "scaling-fit", "scaling-family", "teacher-student", "lenses",
            "tuned-lens"} <= ids


@dataclass(frozen=True)
class _ThirdParty(Analyzer):
    name = "third-party"
    description = "not lensdiv's"

    def hooks(self, info):
        return []

    def update(self, state, step):
        pass

    def finalize(self, state, info):
        raise NotImplementedError


def test_a_third_party_analyzer_has_no_lensdiv_definitions() -> None:
    assert definitions(_ThirdParty) is None


def test_plugins_show_prints_the_definitions_link() -> None:
    for name, anchor in (("lens", "lens"), ("multihop", "depth-score")):
        result = invoke("plugins", "show", name)
        assert result.exit_code == 0, result.output
        assert f"definitions: docs/science.md#{anchor}" in result.output


def test_the_readme_and_findings_link_to_the_definitions() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/science.md)" in readme
    for name in ("lens", "contrib", "skip", "depth-score", "dynamics"):
        assert f"](docs/science.md#{name})" in readme, name
    findings = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
    assert "](science.md)" in findings
