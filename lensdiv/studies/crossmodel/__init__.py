"""Studies across models (docs/science.md#study): the same analysis over a family of models,
one ordinary run per model, compared at relative depth ℓ/L.

Modules: ``models`` (what MODELS names, run folder names, the task split of a job array),
``study`` (running, resuming and gathering a study folder), ``dataset`` (the tidy long table:
Parquet and CSV) and ``summary`` (the depth profiles and the papers' numbers against size).
"""

from __future__ import annotations

from lensdiv.studies.crossmodel.dataset import COLUMNS, tidy_columns
from lensdiv.studies.crossmodel.models import FAMILIES, Task, parse_task, resolve_models, run_names
from lensdiv.studies.crossmodel.study import (
    ModelEntry,
    Study,
    load_study,
    read_study,
    report_study,
    run_study,
)
from lensdiv.studies.crossmodel.summary import NUMBERS, READINGS, Reading, summarize

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
