"""The cells of the course's notebooks: markdown, code, and exercises (a function's header with
either a blank body or its solution), from which ``course_build.py`` writes the notebooks and
``course_lessons.py`` is written."""

from __future__ import annotations

from dataclasses import dataclass

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
    stub: str = ""  # an exercise's blank body when it is more than blank(text): a method to come


def blank_body(cell: Cell) -> str:
    """What an exercise notebook shows under the cell's header."""
    return cell.stub or blank(cell.text)


def md(text: str) -> Cell:
    return Cell("md", text.strip("\n"))


def code(text: str) -> Cell:
    return Cell("code", text.strip("\n"))


def exercise(header: str, solution: str, stub: str = "") -> Cell:
    """A function's header and its solution; ``stub``: the blank body when it holds more than
    ``# your code here`` (the methods still to write, each raising ``NotImplementedError``)."""
    body = blank(header) + "\n" + stub.strip("\n") + "\n" if stub else ""
    return Cell("exercise", header.strip("\n") + "\n", solution.strip("\n") + "\n", body)


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
