"""What a run leaves on disk: each result saved on its own, and a manifest that always ends in a
final state and lists the files that are there.

Final states of a run: ``complete`` (every analyzer finished or was skipped with its reason),
``partial`` (some results, but an analyzer failed or the data stopped early), ``failed`` (no
result at all) and ``interrupted`` (Ctrl-C or SIGTERM; what was finished is kept). Each analyzer
ends ``complete``, ``partial`` (finished on part of the data), ``saved`` (a shard's state, for
``lensdiv merge``), ``failed``, ``skipped`` or ``interrupted`` (stopped before it had a result).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.errors import ResultError, SaveError
from lensdiv.core.results import Result, write_json_atomic
from lensdiv.run.interrupts import shielded, signal_name, signum_of
from lensdiv.run.report import REPORT, VIEWS

MANIFEST = "manifest.json"
FINAL = ("complete", "partial", "failed", "interrupted")
DONE = ("complete", "partial", "saved", "failed", "skipped", "interrupted")
KEPT = ("complete", "partial", "saved")  # an analyzer whose work is on disk


def save_result(result: Result, out: Path, entry: dict[str, Any]) -> str | None:
    """Write ``result`` to ``out/<analyzer>/`` and record in ``entry`` what is on disk.

    Returns:
        ``None``, or one line saying which files could not be written (the analyzer then counts
        as failed; every file that could be written is on disk and listed).
    """
    folder = out / result.analyzer
    with shielded():  # a file in hand is finished even if Ctrl-C arrives meanwhile
        try:
            written = result.save(folder)
            problem = None
        except SaveError as err:
            written, problem = err.written, str(err)
            entry["not_written"] = sorted(_relative(p, out) for p in err.failed)
        except Exception as err:  # e.g. a result whose meta is not JSON
            written, problem = [], f"{type(err).__name__}: {err}".splitlines()[0][:300]
    entry["files"] = sorted(_relative(p, out) for p in written)
    if written:
        entry["path"] = result.analyzer
    return problem


@dataclass(frozen=True)
class Written:
    """What a run left in its folder: the files written and those that could not be.

    Args:
        folder: The run's output folder.
        files: What is there, relative to ``folder``: ``manifest.json``, ``report.html``, ...,
            and ``NAME/`` for an analyzer folder with every file the result has.
        missing: Files that could not be written (disk full, a file-size limit), relative to
            ``folder``; an analyzer folder some of whose files are missing is listed here file
            by file and, for the files that are there, as ``NAME/ (n of m files)`` in ``files``.
    """

    folder: Path
    files: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def complete(self) -> bool:
        """Every file the run meant to write is on disk."""
        return not self.missing

    def line(self, complete: str | None = None) -> str:
        """One line for the end of a command: where the results are, and when some are missing,
        what was and was not written. ``complete`` describes the folder when nothing is
        missing (default: the list of files)."""
        if not self.missing:
            return f"results in {self.folder} ({complete or ', '.join(self.files)})"
        there = ", ".join(self.files) if self.files else "nothing"
        return (
            f"results in {self.folder} are incomplete: not written: {', '.join(self.missing)}; "
            f"written: {there}"
        )


def written(
    out: Path, manifest: Mapping[str, Any], unwritten: Mapping[str, str] | None = None
) -> Written:
    """What the run of ``manifest`` left in ``out``.

    Args:
        out: The run folder.
        manifest: The run's manifest (its analyzers' ``files`` and ``not_written``).
        unwritten: ``{name: why}`` for the run's own files (``manifest.json``, ``report.html``)
            whose last write failed: they are missing even if an older copy is on disk.
    """
    unwritten = unwritten or {}
    files = [n for n in (MANIFEST, REPORT, VIEWS) if n not in unwritten and (out / n).is_file()]
    missing = [n for n in (MANIFEST, REPORT, VIEWS) if n in unwritten]
    for name, entry in manifest.get("analyzers", {}).items():
        kept, lost = entry.get("files", []), entry.get("not_written", [])
        if kept and lost:
            files.append(f"{name}/ ({len(kept)} of {len(kept) + len(lost)} files)")
        elif kept:
            files.append(f"{name}/")
        missing += lost
    return Written(out, tuple(files), tuple(missing))


def _relative(path: Path, out: Path) -> str:
    try:
        return path.relative_to(out).as_posix()
    except ValueError:
        return str(path)


def write_manifest(out: Path | None, manifest: Mapping[str, Any]) -> str | None:
    """Write the manifest atomically (never interrupted half-way); ``None`` or why it failed."""
    if out is None:
        return None
    with shielded():
        try:
            write_json_atomic(out / MANIFEST, manifest)
        except OSError as err:
            return f"{out / MANIFEST} could not be written: {err.strerror or err}"
        except Exception as err:  # unserialisable content: a bug, but the run's files stay
            return f"{out / MANIFEST} could not be written: {type(err).__name__}: {err}"
    return None


def finish(manifest: dict[str, Any], stopped: BaseException | None) -> str:
    """Put every analyzer and the run into a final state; return the run's status.

    Analyzers still pending or running become ``interrupted`` (a signal) or ``failed`` (an
    error stopped the run); the run is ``interrupted``, ``complete``, ``partial`` or ``failed``.
    """
    entries: dict[str, dict[str, Any]] = manifest.get("analyzers", {})
    signalled = isinstance(stopped, KeyboardInterrupt)
    for entry in entries.values():
        if entry.get("status") not in DONE:
            if signalled:
                entry["status"] = "interrupted"
            else:
                entry["status"] = "failed"
                entry.setdefault("error", manifest.get("error", "the run stopped before it ran"))
    statuses = [e["status"] for e in entries.values()]
    if signalled:
        status = "interrupted"
        manifest["signal"] = signal_name(signum_of(stopped))  # type: ignore[arg-type]  # signalled: stopped is set
    elif not any(s in KEPT for s in statuses):
        status = "failed"
    elif stopped is None and all(s in ("complete", "saved", "skipped") for s in statuses):
        status = "complete"
    else:
        status = "partial"
    manifest["status"] = status
    return status


def read_manifest(folder: Path, hint: str) -> dict[str, Any]:
    """The manifest of the run folder ``folder``, checked by :func:`check_manifest`.

    Raises:
        ResultError: No manifest there (with ``hint``: which folders to pass), or one that cannot
            be read, is not JSON or has the wrong shape.
    """
    path = folder / MANIFEST
    if not path.is_file():
        raise ResultError(f"{str(folder)!r} is not a lensdiv run folder (no {MANIFEST})", hint=hint)
    try:
        return check_manifest(json.loads(path.read_text()), path)
    except json.JSONDecodeError as err:
        raise ResultError(f"{path} is not valid JSON: {err.msg}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ResultError(f"cannot read {path}: {err}") from None


def check_manifest(data: Any, path: Path) -> dict[str, Any]:
    """``data`` read from ``path`` is a manifest lensdiv can report on (right shape).

    Raises:
        ResultError: Naming what is wrong, so a damaged run is one line, not a traceback.
    """
    hint = "the folder's manifest.json is damaged; rerun the analysis"
    if not isinstance(data, dict):
        raise ResultError(f"{path} is not a lensdiv manifest (a JSON {_kind(data)})", hint=hint)
    for key, kind in (("analyzers", dict), ("model", dict), ("timings", dict)):
        if key in data and not isinstance(data[key], kind):
            raise ResultError(f"{path}: {key!r} is a JSON {_kind(data[key])}", hint=hint)
    for name, entry in data.get("analyzers", {}).items():
        if not isinstance(entry, dict):
            raise ResultError(f"{path}: the entry of {name!r} is a JSON {_kind(entry)}", hint=hint)
    return data


def _kind(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
