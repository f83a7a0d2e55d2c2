"""The runs and studies saved under ``lensdiv explore --runs DIR``, and the one page of each it
serves: a run folder's ``report.html`` (beside its ``manifest.json``, :mod:`lensdiv.run.outcome`)
or a study folder's ``study.html`` (beside its ``study.json``), in the folder and up to three
folders below it; never a path outside it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.run.outcome import MANIFEST
from lensdiv.run.report import REPORT
from lensdiv.studies.crossmodel.folder import HTML, STUDY
from lensdiv.web.asks import RequestError

RUN_PAGE = REPORT  # the saved layouts: a run folder, a study folder
STUDY_PAGE = HTML
_DEPTH = 3  # folders below --runs searched for runs and studies


@dataclass(frozen=True)
class SavedPage:
    """A run or study under ``--runs`` with its page."""

    kind: str  # "run" or "study"
    path: str  # relative to the runs folder, "/"-separated
    model: str
    status: str
    what: str  # analyzers (a run) or models (a study)

    def to_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "path": self.path,
            "model": self.model,
            "status": self.status,
            "what": self.what,
            "page": f"{self.path}/{RUN_PAGE if self.kind == 'run' else STUDY_PAGE}".lstrip("/"),
        }


def saved_pages(root: Path | None) -> list[dict[str, str]]:
    """The runs and studies with a page under ``root`` (none without a folder), by path."""
    if root is None or not root.is_dir():
        return []
    found: list[SavedPage] = []
    _walk(root, root, 0, found)
    return [page.to_dict() for page in sorted(found, key=lambda p: p.path)]


def saved_page(root: Path | None, relative: str) -> Path:
    """The report.html or study.html at ``relative`` under ``root``.

    Raises:
        RequestError: No runs folder, another file name, or a path that leaves the folder.
    """
    if root is None:
        raise RequestError("no runs folder", hint="start lensdiv explore with --runs DIR")
    parts = relative.split("/")
    if parts[-1] not in (RUN_PAGE, STUDY_PAGE) or any(p in ("", ".", "..") for p in parts):
        raise RequestError(f"not a run's or a study's page: {relative!r}")
    path = root.joinpath(*parts).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise RequestError(f"no page {relative!r} under the runs folder")
    return path


def _walk(root: Path, folder: Path, depth: int, found: list[SavedPage]) -> None:
    rel = folder.relative_to(root).as_posix()
    rel = "" if rel == "." else rel
    manifest, study = _json(folder / MANIFEST), _json(folder / STUDY)
    if study is not None and (folder / STUDY_PAGE).is_file():
        models = [m for m in _of(study, "models", list) if isinstance(m, dict)]
        names = [str(m.get("model")) for m in models]
        done = sum(1 for m in models if m.get("status") == "complete")
        plugins = _of(study, "settings", dict).get("plugins", "")
        shown = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
        what = plugins if isinstance(plugins, str) else ", ".join(map(str, plugins))
        found.append(SavedPage("study", rel, shown, f"{done}/{len(models)} complete", what))
    elif manifest is not None and (folder / RUN_PAGE).is_file():
        model = _of(manifest, "model", dict)
        name = str(model.get("spec") or model.get("name") or "?")
        status = str(manifest.get("status", "?"))
        found.append(
            SavedPage("run", rel, name, status, ", ".join(_of(manifest, "analyzers", dict)))
        )
    if depth >= _DEPTH:
        return
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return
    for child in children:
        _walk(root, child, depth + 1, found)


def _of(data: Mapping[str, Any], key: str, kind: type) -> Any:
    """``data[key]`` when it is a ``kind`` (a damaged file lists as empty, never fails)."""
    value = data.get(key)
    return value if isinstance(value, kind) else kind()


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None
