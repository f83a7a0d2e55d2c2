"""The study folder on disk: its layout, the study manifest, and each model's entry and status.

A model's status comes from disk: the record of its last attempt (``status/NAME.json``, written
after it, removed when an attempt starts), else its run's manifest (one still ``running`` was
killed: ``interrupted``), else ``pending``. So the tasks of a job array share nothing but the
folder, each writing only its own models' records.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.errors import OptionError, StudyError
from lensdiv.core.files import folder_problem
from lensdiv.core.provenance import versions
from lensdiv.core.results import write_json_atomic
from lensdiv.run.outcome import FINAL, MANIFEST
from lensdiv.studies.crossmodel.dataset import size_facts
from lensdiv.studies.crossmodel.models import run_names

STUDY = "study.json"
RUNS = "runs"
STATUS = "status"
SUMMARY = "summary"
PARQUET = "study.parquet"
CSV = "study.csv"
HTML = "study.html"
FINISHED = ("complete", "partial")  # a run whose results are on disk
# Settings that change a study's numbers: a folder holding a study with others is refused.
IDENTITY = ("models", "plugins", "data", "lens", "dtype")


@dataclass
class ModelEntry:
    """One model of a study.

    Args:
        model: The spec, as the study names it.
        run: Its run folder's name under ``runs/``.
        task: The task (of the split the study runs under) that runs it.
        status: ``pending``, or the run's final state (``complete``, ``partial``, ``failed``,
            ``interrupted``).
        reason: Why it is not complete, on one line.
        seconds: Wall time of its last attempt.
        action: What this call did with it: ``ran``, ``kept`` (finished before), or ``""``
            (another task's).
        size: ``params``, ``n_layers``, ``d_model``, ``d_vocab`` (``None`` where unknown).
    """

    model: str
    run: str
    task: int = 0
    status: str = "pending"
    reason: str | None = None
    seconds: float | None = None
    action: str = ""
    size: dict[str, int | None] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The entry as the study manifest and the summary's models table record it."""
        return {
            "model": self.model,
            "run": self.run,
            "task": self.task,
            "status": self.status,
            "reason": self.reason,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            **{k: self.size.get(k) for k in ("params", "n_layers", "d_model", "d_vocab")},
        }


def read_study(out: Path) -> dict[str, Any]:
    """The manifest of the study folder ``out``.

    Raises:
        StudyError: No ``study.json`` there, or one that cannot be read.
    """
    path = out / STUDY
    if not path.is_file():
        raise StudyError(
            f"{str(out)!r} is not a lensdiv study folder (no {STUDY})",
            hint="pass the --out folder of `lensdiv study run`",
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise StudyError(f"cannot read {path}: {err}", hint="rerun the study") from None
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise StudyError(f"{path} is not a lensdiv study manifest", hint="rerun the study")
    return data


def entries_of(manifest: Mapping[str, Any]) -> list[ModelEntry]:
    """The models of a study manifest, under the folder names it gave them (a local model
    folder that has moved since keeps its run's name)."""
    specs = list(manifest["settings"].get("models", []))
    recorded = {row.get("model"): row.get("run") for row in manifest.get("models", [])}
    return [
        ModelEntry(m, str(recorded.get(m) or r))
        for m, r in zip(specs, run_names(specs), strict=True)
    ]


def status_on_disk(folder: Path | None) -> str | None:
    """The final status of the run in ``folder`` when its manifest has one."""
    if folder is None or not (folder / MANIFEST).is_file():
        return None
    try:
        status = json.loads((folder / MANIFEST).read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None
    return status if status in FINAL else None


def open_folder(out: Path, settings: dict[str, Any]) -> None:
    """Start ``out`` as a study folder, or check that it holds this study."""
    problem = folder_problem(out)
    if problem is not None:
        raise OptionError(
            f"cannot write the study to --out {out}: {problem}",
            hint="choose a folder you can write to",
        )
    if (out / STUDY).is_file():
        old = read_study(out)["settings"]
        for key in IDENTITY:
            if old.get(key) != settings.get(key):
                raise StudyError(
                    f"--out {out} holds a study with other {key} ({_short(old.get(key))}, not "
                    f"{_short(settings.get(key))})",
                    hint="resume it with the same settings, or choose another --out",
                )
        return
    if out.is_dir() and any(out.iterdir()) and not (out / RUNS).is_dir():
        raise OptionError(
            f"--out {out} is a folder with other files in it, not a study",
            hint="choose an empty or new folder for the study",
        )
    write_json_atomic(out / STUDY, study_manifest(settings, []))


def refresh(out: Path, entries: Sequence[ModelEntry]) -> None:
    """Every model's status from disk: its last attempt's record, else its run's manifest."""
    for entry in entries:
        folder = out / RUNS / entry.run
        record = read_json(out / STATUS / f"{entry.run}.json")
        manifest = read_json(folder / MANIFEST)
        entry.size = size_facts(manifest) if manifest else {}
        if record is not None and not (record.get("status") in FINISHED and manifest is None):
            entry.status = str(record.get("status", "failed"))
            entry.reason = record.get("reason")
            entry.seconds = record.get("seconds")
        elif manifest is not None:  # no record: the attempt never ended (killed)
            status = manifest.get("status")
            entry.status = status if status in FINAL else "interrupted"
            entry.reason = None if entry.status == "complete" else "the run did not finish"
            entry.seconds = manifest.get("timings", {}).get("total_s")
        else:
            entry.status, entry.reason, entry.seconds = "pending", None, None


def study_manifest(settings: Mapping[str, Any], models: Sequence[ModelEntry]) -> dict[str, Any]:
    """What ``study.json`` holds: the settings, every model's row, the counts by status."""
    counts: dict[str, int] = {}
    for m in models:
        counts[m.status] = counts.get(m.status, 0) + 1
    complete = bool(models) and all(m.status == "complete" for m in models)
    return {
        "lensdiv_study": 1,
        "status": "complete" if complete else "partial",
        "counts": counts,
        "settings": dict(settings),
        "models": [m.row() for m in models],
        "versions": versions(),
        "updated": now(),
    }


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or ``None`` (missing, unreadable, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def now() -> str:
    """The local time, as manifests write it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def host() -> str:
    """This machine's name (a record says where its model ran)."""
    return os.uname().nodename if hasattr(os, "uname") else ""
