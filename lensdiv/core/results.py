"""Result objects: frozen, self-rendering (terminal and notebook), JSON round-trip, CSV, PNG plots.

A :class:`Result` is plain data: named :class:`Table` s (columns of numbers or strings), named
arrays (matrices such as a layer × layer effect map), declarative :class:`Plot` specs and the
metadata that produced it. Because plots are data too, ``lensdiv report`` redraws a saved run
without the analyzer that made it. A result may also carry :class:`Artifact` s, files in formats
of their own that other tools read (a fitted lens in TransformerLens' or tuned-lens' format):
``result.json`` lists their names, and :meth:`Result.save` writes them beside it.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from rich.jupyter import JupyterMixin

from lensdiv.core.errors import LensdivError, ResultError, SaveError

# Re-exported: a result's plots are drawn by lensdiv.core.plots, where Plot now lives.
from lensdiv.core.plots import BLANK_NOTE as BLANK_NOTE
from lensdiv.core.plots import DIVERGING_CMAP as DIVERGING_CMAP
from lensdiv.core.plots import SEQUENTIAL_CMAP as SEQUENTIAL_CMAP
from lensdiv.core.plots import Plot as Plot
from lensdiv.core.plots import agg_figure as agg_figure

SCHEMA = 1
# Width of plain text when there is no terminal to ask (a log file, a pipe, a notebook's print).
TEXT_WIDTH = 100


def render_text(renderable: Any, width: int | None = None) -> str:
    """What ``renderable`` prints in a terminal, as plain text (no colours, no escape codes).

    Args:
        renderable: Anything rich can print (a :class:`Result`, a :class:`Table`, a ``Run``).
        width: Columns; default: the terminal's width, else ``COLUMNS``, else 100.
    """
    import io
    import shutil

    from rich.console import Console

    if width is None:
        width = shutil.get_terminal_size((TEXT_WIDTH, 24)).columns
    console = Console(
        file=io.StringIO(),
        width=width,
        color_system=None,
        force_terminal=False,
        force_jupyter=False,
        highlight=False,
        emoji=False,
    )
    console.print(renderable)
    text: str = console.file.getvalue()  # type: ignore[attr-defined]  # a StringIO, set above
    return text.rstrip("\n")


class Rendered(JupyterMixin):
    """Renders the same everywhere: rich in a terminal, HTML in a notebook, and, through
    ``str()`` / ``print()`` in a plain script or a log, the terminal's text without colours."""

    def __str__(self) -> str:
        return render_text(self)


@dataclass(frozen=True)
class Table(Rendered):
    """Named columns of equal length.

    Args:
        name: File stem and key of the table.
        columns: Column name to list of values (numbers or strings).
        description: One line saying what a row is.
        keys: How many leading columns name a row (``start`` and ``n`` of a grid): a table
            wider than the terminal repeats them in each part it is cut into.
    """

    name: str
    columns: Mapping[str, Any]  # sequences, numpy arrays or tensors; stored as lists
    description: str = ""
    keys: int = 1

    def __post_init__(self) -> None:
        lengths = {len(v) for v in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"table {self.name!r} has columns of different lengths {lengths}")
        object.__setattr__(self, "columns", {k: _plain(v) for k, v in self.columns.items()})

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))

    def __getitem__(self, column: str) -> np.ndarray:
        return np.asarray(self.columns[column])

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The table as a list of row dicts."""
        keys = list(self.columns)
        return [
            dict(zip(keys, vals, strict=False))
            for vals in zip(*self.columns.values(), strict=False)
        ]

    def to_pandas(self) -> Any:
        """Return a ``pandas.DataFrame`` (needs the ``pandas`` extra)."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError("to_pandas needs pandas: pip install 'lensdiv[pandas]'") from None
        return pd.DataFrame(dict(self.columns))

    def to_csv(self, path: str | os.PathLike[str]) -> None:
        """Write the table as CSV (header row, then one line per row)."""
        import csv

        with _atomic(Path(path)) as tmp, open(tmp, "w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(self.columns)
            writer.writerows(zip(*self.columns.values(), strict=False))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        # A table wider than the terminal is cut into several, each repeating the key columns
        # (``keys``), rather than shrinking every number to an ellipsis.
        from rich.table import Table as RichTable

        names = list(self.columns)
        cells = {c: [_fmt(v) for v in self.columns[c]] for c in names}
        widths = {c: max([len(c), *map(len, cells[c])]) + 3 for c in names}
        key, rest = names[: max(self.keys, 1)], names[max(self.keys, 1) :]
        groups: list[list[str]] = []
        for col in rest:
            if groups and sum(widths[c] for c in [*key, *groups[-1], col]) < options.max_width:
                groups[-1].append(col)
            else:
                groups.append([col])
        for i, group in enumerate(groups or [[]]):
            title = (self.description or self.name) if i == 0 else None
            table = RichTable(title=title, title_justify="left")
            for col in [*key, *group]:
                table.add_column(col, justify="right", no_wrap=True)
            for row in zip(*(cells[c] for c in [*key, *group]), strict=False):
                table.add_row(*row)
            yield table


class Artifact(abc.ABC):
    """A file (or folder) a result carries in a format of its own, e.g. a fitted lens.

    Attributes:
        name: Its name inside the analyzer's output folder.
    """

    name: str

    @abc.abstractmethod
    def write(self, path: Path) -> list[Path]:
        """Write the artifact at ``path`` (a file, or a folder of files); return the files.

        Raises:
            OSError: The disk or folder refused it (the result's other files are kept).
        """


@dataclass(frozen=True)
class SavedArtifact(Artifact):
    """An artifact of a result read back from disk: its name only (the files are there)."""

    name: str

    def write(self, path: Path) -> list[Path]:
        raise ResultError(f"{self.name} was read back from disk; it cannot be written again")


@dataclass(frozen=True)
class Result(Rendered):
    """What an analyzer returns: tables, arrays, plots and the settings that produced them.

    Args:
        analyzer: Name of the analyzer (and of its output folder).
        summary: A few plain sentences on what the numbers show.
        tables: Named tables; the first is the main one.
        arrays: Named numeric arrays (matrices, curves).
        plots: Plot specs drawn by :meth:`save_plots`.
        meta: Options, model, data, token counts and versions.
        warnings: Caveats a reader must see beside the numbers (e.g. a task the model cannot
            do); shown in the terminal, the report and the manifest.
        artifacts: Files in formats of their own (see :class:`Artifact`), written beside
            ``result.json``, which lists their names.
    """

    analyzer: str
    summary: str = ""
    tables: Mapping[str, Table] = field(default_factory=dict)
    arrays: Mapping[str, Any] = field(default_factory=dict)
    plots: tuple[Plot, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    artifacts: tuple[Artifact, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "warnings", tuple(str(w) for w in self.warnings))
        arrays = {k: np.asarray(v, dtype=float) for k, v in self.arrays.items()}
        object.__setattr__(self, "arrays", arrays)
        object.__setattr__(self, "tables", dict(self.tables))
        object.__setattr__(self, "plots", tuple(self.plots))
        object.__setattr__(self, "meta", _plain(dict(self.meta)))

    def table(self, name: str | None = None) -> Table:
        """The named table, or the main (first) one."""
        if name is None:
            return next(iter(self.tables.values()))
        return self.tables[name]

    def to_pandas(self, table: str | None = None) -> Any:
        """The named (or main) table as a ``pandas.DataFrame``."""
        return self.table(table).to_pandas()

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` inverts it exactly."""
        data = {
            "schema": SCHEMA,
            "analyzer": self.analyzer,
            "summary": self.summary,
            "tables": {
                k: {"columns": dict(t.columns), "description": t.description}
                | ({"keys": t.keys} if t.keys != 1 else {})
                for k, t in self.tables.items()
            },
            "arrays": {k: v.tolist() for k, v in self.arrays.items()},
            "plots": [p.to_dict() for p in self.plots],
            "meta": dict(self.meta),
        }
        if self.warnings:  # absent when there are none (results of earlier versions read alike)
            data["warnings"] = list(self.warnings)
        if self.artifacts:  # likewise
            data["artifacts"] = [a.name for a in self.artifacts]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """Rebuild a result from :meth:`to_dict` output."""
        try:
            return cls(
                analyzer=data["analyzer"],
                summary=data.get("summary", ""),
                tables={
                    k: Table(k, t["columns"], t.get("description", ""), t.get("keys", 1))
                    for k, t in data.get("tables", {}).items()
                },
                arrays=data.get("arrays", {}),
                plots=tuple(Plot.from_dict(p) for p in data.get("plots", [])),
                meta=data.get("meta", {}),
                warnings=tuple(data.get("warnings", ())),
                artifacts=tuple(SavedArtifact(str(n)) for n in data.get("artifacts", ())),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ResultError(f"not a lensdiv result ({type(err).__name__}: {err})") from None

    def to_json(self, indent: int | None = 1) -> str:
        """JSON text (NaN and infinities are written as JSON's ``NaN``/``Infinity``)."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Result:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def save(self, directory: str | os.PathLike[str], *, plots: bool = True) -> list[Path]:
        """Write ``result.json`` and one CSV per table, then the artifacts, then one PNG per
        plot; return the paths.

        Every file is written atomically (a temporary file renamed into place), so no reader
        ever sees half a file. The numbers come first, and each file stands alone: a file that
        cannot be written (disk full, no permission) or a plot that cannot be drawn does not
        stop the others.

        Raises:
            SaveError: Naming every file that was not written and why; ``err.written`` lists
                the files that were.
        """
        files = _Files(self.analyzer, Path(directory))
        for name, table in self.tables.items():
            path = files.directory / f"{name}.csv"
            files.attempt(path, partial(table.to_csv, path))
        path = files.directory / "result.json"
        files.attempt(path, partial(self._write_json, path))
        for artifact in self.artifacts:
            files.attempt_many(files.directory / artifact.name, artifact.write)
        if plots:
            self._draw_each(files)
        return files.done()

    def missing(self) -> list[str]:
        """What the plots read that this result lacks (a damaged ``result.json``), one line per
        table, array or column; empty for a sound result."""
        lines = (spec.missing(self) for spec in self.plots)
        return list(dict.fromkeys(line for line in lines if line is not None))

    def redraw(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Draw every plot into ``directory`` again (``lensdiv report --plots``), each on its own.

        Raises:
            SaveError: Naming the plots that could not be drawn or written.
        """
        files = _Files(self.analyzer, Path(directory))
        self._draw_each(files)
        return files.done()

    def _draw_each(self, files: _Files) -> None:
        for spec in self.plots:
            # One plot at a time through save_plots, so a plot that cannot be drawn (a bad
            # spec, a missing table) costs only its own PNG.
            single = dataclasses.replace(self, plots=(spec,))
            path = files.directory / f"{spec.name}.png"
            files.attempt(path, partial(single.save_plots, files.directory), drawing=True)

    def _write_json(self, path: Path) -> None:
        text = self.to_json()
        with _atomic(path) as tmp:
            tmp.write_text(text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Result:
        """Read a result from its folder or its ``result.json``."""
        path = Path(path)
        if path.is_dir():
            path = path / "result.json"
        try:
            return cls.from_json(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ResultError(f"cannot read result {path}: {err}") from None
        except ResultError as err:
            raise ResultError(f"{path}: {err.message}", hint="rerun the analysis") from None

    def save_plots(self, directory: str | os.PathLike[str]) -> list[Path]:
        """Draw every plot to ``directory/<plot.name>.png``.

        Figures are drawn on their own Agg canvas, never through ``pyplot``, so saving plots
        neither needs a display nor changes the backend of a notebook or GUI session.
        """
        paths = []
        for spec in self.plots:
            fig, _ = spec.figure(self)
            path = Path(directory) / f"{spec.name}.png"
            with _atomic(path) as tmp:
                fig.savefig(tmp, format="png")
            paths.append(path)
        return paths

    # -- rendering -----------------------------------------------------------------------------
    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.panel import Panel

        yield Panel(
            self.summary or "(no summary)", title=f"[bold]{self.analyzer}[/bold]", expand=False
        )
        if self.warnings:
            # Caveats sit right under the summary, boxed, so nobody reads the numbers without them.
            yield Panel(
                "\n".join(f"! {w}" for w in self.warnings),
                title=f"[bold yellow]warning ({self.analyzer})[/bold yellow]",
                border_style="yellow",
                expand=False,
            )
        if self.tables:
            yield self.table()


def _plain(value: Any) -> Any:
    """Convert numpy / torch scalars and arrays to JSON-able Python values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)


class _atomic:
    """Context manager yielding a temporary path that replaces ``path`` on success."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return self.tmp

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        try:
            if exc_type is None:
                os.replace(self.tmp, self.path)
        finally:  # written or not, no temporary file stays behind
            self.tmp.unlink(missing_ok=True)


class _Files:
    """Files of one result being written: each attempted on its own, failures collected."""

    def __init__(self, analyzer: str, directory: Path) -> None:
        self.analyzer = analyzer
        self.directory = directory
        self.written: list[Path] = []
        self.failed: dict[Path, str] = {}
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self.failed[directory] = _reason(err)
            raise _save_error(analyzer, directory, self.written, self.failed) from None

    def attempt(self, path: Path, write: Callable[[], Any], drawing: bool = False) -> None:
        try:
            write()
            self.written.append(path)
        except Exception as err:  # one file that cannot be written must not cost the others
            drawn = drawing and not isinstance(err, OSError)
            self.failed[path] = f"cannot draw: {_reason(err)}" if drawn else _reason(err)

    def attempt_many(self, path: Path, write: Callable[[Path], list[Path]]) -> None:
        """Like :meth:`attempt`, for a writer that says which files it wrote."""
        try:
            self.written.extend(write(path))
        except Exception as err:  # one artifact that cannot be written must not cost the others
            self.failed[path] = _reason(err)

    def done(self) -> list[Path]:
        if self.failed:
            raise _save_error(self.analyzer, self.directory, self.written, self.failed)
        return self.written


def _reason(err: BaseException) -> str:
    """Why a file was not written, in a few words (``No space left on device``)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    if isinstance(err, LensdivError):  # a line of its own (a table the result lacks)
        return str(err).splitlines()[0][:200]
    return f"{type(err).__name__}: {err}".splitlines()[0][:200]


# What to do about a file that could not be written, by errno.
_SAVE_HINTS = {
    errno.ENOSPC: "free some disk space, or write to another folder",
    errno.EDQUOT: "free some space within your disk quota, or write to another folder",
    errno.EACCES: "make the folder writable, or write to another folder",
    errno.EPERM: "make the folder writable, or write to another folder",
    errno.EROFS: "the file system is read-only: write to another folder",
    errno.EFBIG: "a file-size limit (ulimit -f) stopped the write: raise it, or write elsewhere",
}


def _save_error(
    analyzer: str, directory: Path, written: list[Path], failed: dict[Path, str]
) -> SaveError:
    """One line naming every file not written, grouped by reason."""
    by_reason: dict[str, list[str]] = {}
    for path, reason in failed.items():
        by_reason.setdefault(reason, []).append(path.name if path != directory else str(path))
    parts = "; ".join(f"{', '.join(names)} ({reason})" for reason, names in by_reason.items())
    hint = next(
        (
            hint
            for code, hint in _SAVE_HINTS.items()
            if any(os.strerror(code) == reason for reason in by_reason)
        ),
        "the files that were written are complete",
    )
    return SaveError(
        f"{analyzer}: could not write {len(failed)} file(s) in {directory}: {parts}",
        hint=hint,
        written=written,
        failed=failed,
    )


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so a reader never sees a half-written file."""
    with _atomic(path) as tmp:
        tmp.write_text(json.dumps(_plain(data), indent=1))
