"""Writes the course's notebooks: each lesson's exercise notebook (``tutorials/course/``) and
its solution notebook (``tutorials/course/solutions/``) from the one source below, so the two
never drift apart. Run ``python tutorials/course/solutions/course_build.py`` after editing; the tests
check the committed notebooks equal what this writes.

An exercise cell is a function's header (signature and docstring) followed by either
``# your code here`` and ``raise NotImplementedError`` (the exercise) or the solution's body.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
COURSE = HERE.parent
sys.path.insert(0, str(HERE))

from course_cells import Cell, blank_body  # noqa: E402  (beside this file)
from course_lessons import LESSONS  # noqa: E402


def notebook(cells: list[Cell], solved: bool) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    out = []
    for cell in cells:
        if cell.kind == "md":  # a solution sits one folder deeper: its relative links too
            text = re.sub(r"\]\((\.\./)", r"](../\1", cell.text) if solved else cell.text
            out.append(nbformat.v4.new_markdown_cell(text))
        elif cell.kind == "code":
            out.append(nbformat.v4.new_code_cell(cell.text))
        else:
            body = cell.solution if solved else blank_body(cell)
            out.append(nbformat.v4.new_code_cell((cell.text + body).rstrip("\n")))
    for i, c in enumerate(out):
        c["id"] = f"c{i:02d}"
    nb.cells = out
    return nb


def build() -> dict[Path, str]:
    """Every notebook's path and its text."""
    files = {}
    for name, cells in LESSONS:
        for solved, folder in ((False, COURSE), (True, HERE)):
            text = nbformat.writes(notebook(cells, solved))
            files[folder / f"{name}.ipynb"] = text
    return files


if __name__ == "__main__":
    for path, text in build().items():
        path.write_text(text, encoding="utf-8")
        print(path.relative_to(COURSE.parent.parent))
    sys.exit(0)
