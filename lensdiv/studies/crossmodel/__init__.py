"""Studies across models (docs/science.md#study): the same analysis over a family of models,
one ordinary run per model, compared at relative depth ℓ/L.

Modules: ``models`` (what MODELS names, run folder names, the task split of a job array),
``folder`` (the study folder: layout, manifest, each model's status), ``study`` (running,
resuming and gathering a study), ``dataset`` (the tidy long table: Parquet and CSV) and
``summary`` (the depth profiles and the papers' numbers against size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lensdiv.studies.crossmodel.dataset import COLUMNS, tidy_columns
from lensdiv.studies.crossmodel.folder import ModelEntry, read_study
from lensdiv.studies.crossmodel.models import FAMILIES, Task, parse_task, resolve_models, run_names
from lensdiv.studies.crossmodel.summary import NUMBERS, READINGS, Reading, summarize

if TYPE_CHECKING:
    from lensdiv.studies.crossmodel.study import Study as Study
    from lensdiv.studies.crossmodel.study import load_study as load_study
    from lensdiv.studies.crossmodel.study import report_study as report_study
    from lensdiv.studies.crossmodel.study import run_study as run_study

# start-up: `study` imports the runner (torch); the family names and the model lists do not, so
# `lensdiv scaling fit` (which reads FAMILIES) stays free of torch.
_STUDY = ("Study", "load_study", "report_study", "run_study")

__all__ = [
    "COLUMNS",
    "FAMILIES",
    "NUMBERS",
    "READINGS",
    "ModelEntry",
    "Reading",
    "Study",
    "Task",
    "load_study",
    "parse_task",
    "read_study",
    "report_study",
    "resolve_models",
    "run_names",
    "run_study",
    "summarize",
    "tidy_columns",
]


def __getattr__(name: str) -> Any:
    if name in _STUDY:
        import importlib

        value = getattr(importlib.import_module("lensdiv.studies.crossmodel.study"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
