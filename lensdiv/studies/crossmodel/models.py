"""Which models a study runs, under which folder names, and which of them this task runs.

MODELS is read the way a shell user writes it: a comma list, brace groups
(``EleutherAI/pythia-{70m,160m}``), a family of the toy zoo (``zoo:depth``, ``zoo:width``), a text
file of specs one per line, a local model folder, or a folder of model folders. ``--task I/N``
(or a SLURM job array's environment) picks every N-th model from the I-th, so the tasks of an
array split a study with no coordination.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lensdiv.core.errors import OptionError, did_you_mean

# The toy zoo's families: depths at width 64, widths at depth 4 (lensdiv/models/toy.py).
FAMILIES = {
    "zoo:depth": ("toy:d1", "toy:d2", "toy:d3", "toy:d4", "toy:d6", "toy:d8"),
    "zoo:width": ("toy:d4-w32", "toy:d4-w64", "toy:d4-w128"),
}
_BRACES = re.compile(r"\{([^{}]*,[^{}]*)\}")


def resolve_models(models: str | Sequence[str]) -> list[str]:
    """The model specs MODELS names, in order, each once.

    Args:
        models: A string or a list of strings, each a comma list of: a family of the toy zoo, a
            text file of specs (one per line; blank lines and ``#`` comments skipped), a model
            folder (with ``config.json``), a folder of model folders (sorted by name), or any
            spec ``lensdiv analyze`` takes. Brace groups expand as in a shell.

    Raises:
        OptionError: An unknown ``zoo:`` family, a folder holding no model, or no model at all.
    """
    items = [models] if isinstance(models, str) else list(models)
    specs: list[str] = []
    for item in items:
        for word in _split(str(item)):
            for name in _expand_braces(word):
                specs += _specs_of(name.strip(), nested=False)
    specs = list(dict.fromkeys(specs))
    if not specs:
        raise OptionError(
            "no model given",
            hint="name models, e.g. zoo:depth, toy:d2,toy:d4 or a file of model specs",
        )
    return specs


def _split(text: str) -> list[str]:
    """Split at the commas outside brace groups."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_braces(word: str) -> list[str]:
    """``a-{1,2}-b`` -> ``a-1-b``, ``a-2-b`` (every group, left to right)."""
    match = _BRACES.search(word)
    if match is None:
        return [word]
    head, tail = word[: match.start()], word[match.end() :]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in _expand_braces(head + choice.strip() + tail)
    ]


def _specs_of(name: str, *, nested: bool) -> list[str]:
    if not name:
        return []
    if name.startswith("zoo:"):
        if name not in FAMILIES:
            raise OptionError(
                f"unknown model family {name!r}{did_you_mean(name, list(FAMILIES))}",
                hint=f"use {' or '.join(FAMILIES)}, or list the models",
            )
        return list(FAMILIES[name])
    path = Path(name).expanduser()
    if path.is_file() and not nested:
        return _read_list(path)
    if path.is_dir() and not (path / "config.json").is_file():
        inner = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
        if not inner:
            raise OptionError(
                f"{name} holds no model (no config.json in it or in a folder inside it)",
                hint="name a model folder written by save_pretrained, or a folder of them",
            )
        return [str(p) for p in inner]
    return [name]


def _read_list(path: Path) -> list[str]:
    """The specs of a text file, one per line (``#`` starts a comment)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise OptionError(
            f"cannot read the model list {path}: {err}", hint="a text file, one model per line"
        ) from None
    specs = []
    for line in lines:
        text = line.split("#", 1)[0].strip()
        for word in _split(text):
            for name in _expand_braces(word):
                specs += _specs_of(name.strip(), nested=True)
    return specs


def run_names(specs: Sequence[str]) -> list[str]:
    """One folder name per spec, readable and distinct: ``toy:d4`` -> ``toy-d4``,
    ``EleutherAI/pythia-70m`` -> ``EleutherAI-pythia-70m``, a local folder -> its name (a
    second ``model`` -> ``model-2``)."""
    names: list[str] = []
    for spec in specs:
        path = Path(spec).expanduser()
        base = path.resolve().name if path.exists() else spec
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.") or "model"
        name, n = slug, 1
        while name in names:
            n += 1
            name = f"{slug}-{n}"
        names.append(name)
    return names


@dataclass(frozen=True)
class Task:
    """Which models of a study this process runs: model ``i`` when ``i mod count == index``.

    Args:
        index: This task's number, from 0.
        count: How many tasks split the study.
        source: Where the split came from: ``"--task"``, ``"SLURM_ARRAY_TASK_ID"`` or ``"all"``.
    """

    index: int = 0
    count: int = 1
    source: str = "all"

    def runs(self, position: int) -> bool:
        """Whether the model at ``position`` of the study is this task's."""
        return position % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_task(task: str | tuple[int, int] | None, environ: Mapping[str, str] = os.environ) -> Task:
    """``"I/N"``, ``(I, N)``, or ``None``: a SLURM job array's task (``SLURM_ARRAY_TASK_ID``
    counted from ``SLURM_ARRAY_TASK_MIN`` in steps of ``SLURM_ARRAY_TASK_STEP``, of
    ``SLURM_ARRAY_TASK_COUNT``) when those are set, else every model.

    Raises:
        OptionError: Not two whole numbers with ``0 ≤ I < N``, or an array environment that
            does not add up.
    """
    if task is None:
        return _slurm_task(environ)
    if isinstance(task, str):
        first, slash, second = task.partition("/")
        try:
            pair = (int(first), int(second)) if slash else None
        except ValueError:
            pair = None
        if pair is None:
            raise OptionError(
                f"--task {task!r} is not I/N", hint="e.g. --task 0/4 (the first of four tasks)"
            )
    else:
        pair = task
    index, count = pair
    if not 0 <= index < count:
        raise OptionError(
            f"--task {index}/{count}: the task number must be 0 to {count - 1}"
            if count > 0
            else f"--task {index}/{count}: the number of tasks must be at least 1",
            hint="tasks are numbered from 0, e.g. --task 0/4 ... --task 3/4",
        )
    return Task(index, count, "--task")


def _slurm_task(environ: Mapping[str, str]) -> Task:
    if "SLURM_ARRAY_TASK_ID" not in environ:
        return Task()
    numbers: dict[str, int] = {}
    try:
        for key in ("ID", "MIN", "STEP", "COUNT", "MAX"):
            if f"SLURM_ARRAY_TASK_{key}" in environ:
                numbers[key] = int(environ[f"SLURM_ARRAY_TASK_{key}"])
        first, step = numbers.get("MIN", 0), numbers.get("STEP", 1)
        count = numbers.get("COUNT") or (numbers["MAX"] - first) // step + 1
        index, off = divmod(numbers["ID"] - first, step)
    except (KeyError, ValueError, ZeroDivisionError):
        index, off, count = -1, 0, 0
    if off or not 0 <= index < count:
        shown = ", ".join(f"{k}={v}" for k, v in environ.items() if k.startswith("SLURM_ARRAY"))
        raise OptionError(
            f"cannot tell this job array task's share of the study from {shown}",
            hint="pass --task I/N",
        )
    return Task(index, count, "SLURM_ARRAY_TASK_ID")
