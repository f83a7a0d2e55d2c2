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
from dataclasses import dataclass
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
COURSE = HERE.parent
BLANK = "    # your code here\n    raise NotImplementedError\n"


def blank(header: str) -> str:
    """The blank body under a header: indented one level below its last ``def``."""
    last = [line for line in header.splitlines() if line.lstrip().startswith("def ")][-1]
    indent = " " * (len(last) - len(last.lstrip()))
    return "".join(indent + line + "\n" if line else "\n" for line in BLANK.splitlines())


@dataclass(frozen=True)
class Cell:
    kind: str  # "md", "code" or "exercise"
    text: str
    solution: str = ""


def md(text: str) -> Cell:
    return Cell("md", text.strip("\n"))


def code(text: str) -> Cell:
    return Cell("code", text.strip("\n"))


def exercise(header: str, solution: str) -> Cell:
    return Cell("exercise", header.strip("\n") + "\n", solution.strip("\n") + "\n")


def hints(*texts: str) -> str:
    return "\n".join(
        f"<details><summary>Hint {i}</summary>\n\n{t.strip()}\n\n</details>"
        for i, t in enumerate(texts, 1)
    )


def head(number: int, title: str, goal: str, reading: str, minutes: str, level: str) -> Cell:
    return md(
        f"# Course {number} · {title}\n\n**Goal.** {goal[0].upper() + goal[1:]}\n\n**Read first.** {reading}\n\n"
        f"**Time:** {minutes} · **Difficulty:** {level}\n\n"
        "Each exercise is a function to complete where it says `# your code here`; the cell after "
        "it checks it against lensdiv's own computation on several inputs (random ones, real "
        "states of the toy model, edge cases) and tells you what is most likely wrong. Until "
        "your function passes, the cells below use lensdiv's own, so you can read on. The "
        "solutions are in `solutions/` (try first: the hints unfold one at a time)."
    )


SETUP = """
import warnings

import matplotlib.pyplot as plt
import torch

from lensdiv.course import toy

%matplotlib inline
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, without ipywidgets

FAST = toy.fast()  # set by the tests (LENSDIV_TUTORIAL_FAST=1): tiny sizes, numbers mean nothing
model = toy.toy()  # the 4-block toy model (trained and cached on first use)
L = model.cfg.n_layers
print(f"toy model: {L} blocks, d_model {model.cfg.d_model}, vocabulary {model.cfg.d_vocab} (bytes)")
"""


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
            body = cell.solution if solved else blank(cell.text)
            out.append(nbformat.v4.new_code_cell((cell.text + body).rstrip("\n")))
    for i, c in enumerate(out):
        c["id"] = f"c{i:02d}"
    nb.cells = out
    return nb


def build() -> dict[Path, str]:
    """Every notebook's path and its text."""
    sys.path.insert(0, str(HERE))
    from course_lessons import LESSONS  # the lessons' text, beside this file

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
