"""Result objects: frozen, self-rendering (terminal and notebook), JSON round-trip, CSV, PNG plots.

A :class:`Result` is plain data: named :class:`Table` s (columns of numbers or strings), named
arrays (matrices such as a layer × layer effect map), declarative :class:`Plot` specs and the
metadata that produced it. Because plots are data too, ``lensdiv report`` redraws a saved run
without the analyzer that made it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np
from rich.jupyter import JupyterMixin

from lensdiv.core.errors import ResultError, SaveError

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
    """

    name: str
    columns: Mapping[str, Any]  # sequences, numpy arrays or tensors; stored as lists
    description: str = ""

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
        # A table wider than the terminal is cut into several, each repeating the first (key)
        # column, rather than shrinking every number to an ellipsis.
        from rich.table import Table as RichTable

        names = list(self.columns)
        cells = {c: [_fmt(v) for v in self.columns[c]] for c in names}
        widths = {c: max([len(c), *map(len, cells[c])]) + 3 for c in names}
        key, rest = names[0], names[1:]
        groups: list[list[str]] = []
        for col in rest:
            if groups and sum(widths[c] for c in [key, *groups[-1], col]) < options.max_width:
                groups[-1].append(col)
            else:
                groups.append([col])
        for i, group in enumerate(groups or [[]]):
            title = (self.description or self.name) if i == 0 else None
            table = RichTable(title=title, title_justify="left")
            for col in [key, *group]:
                table.add_column(col, justify="right", no_wrap=True)
            for row in zip(*(cells[c] for c in [key, *group]), strict=False):
                table.add_row(*row)
            yield table


# How a masked cell rule reads: cells (row, col) of a heatmap drawn blank.
_MASKS: dict[str, Any] = {
    "col<=row": lambda r, c: c <= r,
    "col<row": lambda r, c: c < r,
    "col>=row": lambda r, c: c >= r,
    "col>row": lambda r, c: c > r,
}
# Heatmaps label every column or row with its own tick up to this many; beyond, every k-th.
_MAX_TICKS = 32
# Colour maps: one-directional for magnitudes, diverging (white = 0) for signed quantities.
SEQUENTIAL_CMAP = "viridis"
DIVERGING_CMAP = "RdBu_r"
BLANK_NOTE = "Hatched cells have no value."


@dataclass(frozen=True)
class Plot:
    """A declarative plot of a table (``line``) or an array (``heatmap``).

    The spec is data (it round-trips through JSON with the result), so ``lensdiv report``
    redraws a saved run without the analyzer that made it. Rules every figure follows: integer
    ticks on integer axes (layers, blocks, positions), axes and colour bars labelled with their
    quantity and unit, a diverging colour map centred at 0 for signed quantities, and cells
    without a value (NaN, or blanked by ``mask``) left blank over a hatched background and said
    so in the caption.

    Args:
        kind: ``"line"`` draws ``y`` columns against ``x``; ``"heatmap"`` draws array ``source``
            (rows on the y axis from the bottom, columns on the x axis).
        name: File stem of the PNG.
        title: Figure title (short; details go in ``caption``).
        source: Table name (line) or array name (heatmap).
        x: Column for the x axis (line).
        y: Columns drawn as lines (line).
        xlabel, ylabel: Axis labels: quantity and unit, e.g. ``"KL (nats)"``.
        logy: Logarithmic y axis.
        logx: Logarithmic x axis (with ``logy``: a log-log plot of a power law).
        group: Column whose values split the rows into separate lines (one per value, in
            order of appearance), e.g. one line per teacher type.
        points: Lines (``y`` columns, or ``group`` values) drawn as points without connecting
            lines, e.g. ``("data",)`` for measurements around a fitted curve.
        clabel: Colour-bar label of a heatmap: quantity and unit.
        signed: The quantity has a sign: a diverging colour map centred at 0 with symmetric
            limits (heatmap), a zero line (line).
        xticklabels, yticklabels: One label per heatmap column / row (e.g. the tokens of a
            prompt); empty: integer ticks.
        extent: Heatmap cell edges in data coordinates ``(left, right, bottom, top)``, e.g.
            ``(-11.5, 0.5, -0.5, 3.5)`` for end-aligned positions; default: indices.
        mask: Heatmap cells drawn blank because they are undefined, by row and column index:
            ``"col<=row"`` (e.g. skip's ``E[s, l]`` for ``l ≤ s``), ``"col<row"``,
            ``"col>=row"`` or ``"col>row"``.
        caption: A sentence under the figure: what a cell or line is, why cells are blank.
    """

    kind: Literal["line", "heatmap"]
    name: str
    title: str
    source: str
    x: str | None = None
    y: tuple[str, ...] = ()
    xlabel: str = ""
    ylabel: str = ""
    logy: bool = False
    logx: bool = False
    group: str | None = None
    points: tuple[str, ...] = ()
    clabel: str = ""
    signed: bool = False
    xticklabels: tuple[str, ...] = ()
    yticklabels: tuple[str, ...] = ()
    extent: tuple[float, float, float, float] | None = None
    mask: str = ""
    caption: str = ""

    def __post_init__(self) -> None:
        if self.mask and self.mask not in _MASKS:
            raise ValueError(f"plot {self.name!r}: mask must be one of {sorted(_MASKS)}")
        for key in ("y", "points", "xticklabels", "yticklabels"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.extent is not None:
            object.__setattr__(self, "extent", tuple(float(v) for v in self.extent))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (tuples as lists); :meth:`from_dict` inverts it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plot:
        """A spec from :meth:`to_dict` output (or from a result of an earlier version)."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        return cls(**fields)

    def data(self, result: Result) -> np.ndarray:
        """The heatmap's array as drawn: float, with masked cells set to NaN."""
        values = np.array(result.arrays[self.source], dtype=float, ndmin=2)
        if self.mask:
            rows, cols = np.indices(values.shape)
            values[_MASKS[self.mask](rows, cols)] = np.nan
        return values

    def figure(self, result: Result, *, caption: bool = True) -> tuple[Any, Any]:
        """A ``(Figure, Axes)`` on a private Agg canvas with this plot drawn.

        Args:
            result: The result whose table or array the plot draws.
            caption: Write the caption under the axes (a PNG file carries its own; a page
                shows it as text instead).
        """
        fig, ax = agg_figure()
        self.draw(result, ax)
        text = self.full_caption(result) if caption else ""
        if text:
            import textwrap

            lines = textwrap.wrap(text, 110)
            fig.text(0.01, 0.01, "\n".join(lines), fontsize=7.5, ha="left", va="bottom")
            fig.tight_layout(rect=(0, 0.035 * len(lines) + 0.01, 1, 1))
        else:
            fig.tight_layout()
        return fig, ax

    def full_caption(self, result: Result) -> str:
        """The caption, plus a note on blank cells when the heatmap has some and says nothing."""
        caption = self.caption
        if (
            self.kind == "heatmap"
            and self.source in result.arrays
            and "hatched" not in caption.lower()
            and np.isnan(self.data(result)).any()
        ):
            caption = f"{caption} {BLANK_NOTE}".strip()
        return caption

    def draw(self, result: Result, ax: Any) -> None:
        """Draw onto a matplotlib ``Axes``."""
        from matplotlib.ticker import MaxNLocator

        if self.kind == "line":
            table = result.tables[self.source]
            xs = table[self.x] if self.x else np.arange(len(table))
            group = self.group
            groups = [None] if group is None else list(dict.fromkeys(table[group]))
            for value in groups:
                rows = (
                    np.ones(len(table), dtype=bool)
                    if value is None or group is None
                    else np.asarray(table[group] == value)
                )
                for col in self.y:
                    label = col if value is None else f"{self.group}={value}"
                    if value is not None and len(self.y) > 1:
                        label = f"{col}, {label}"
                    dots = col in self.points or str(value) in self.points
                    style = {"marker": "o", "markersize": 5 if dots else 3}
                    if dots:
                        style["linestyle"] = "none"
                    ax.plot(
                        np.asarray(xs)[rows], np.asarray(table[col])[rows], label=label, **style
                    )
            if len(self.y) * len(groups) > 1:
                ax.legend(fontsize=8)
            if self.logy:
                ax.set_yscale("log")
                _plain_log_labels(ax.yaxis)
            if self.logx:
                ax.set_xscale("log")
                _plain_log_labels(ax.xaxis)
            elif _integers(xs):
                # Layers, blocks, grades and steps: a half layer does not exist.
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if self.signed:
                ax.axhline(0.0, color="0.5", linewidth=0.8, zorder=0)
        else:
            self._heatmap(result, ax)
        ax.set_title(self.title)
        ax.set_xlabel(self.xlabel or (self.x or ""))
        ax.set_ylabel(self.ylabel)

    def _heatmap(self, result: Result, ax: Any) -> None:
        import matplotlib
        from matplotlib.colors import Normalize
        from matplotlib.ticker import MaxNLocator

        values = self.data(result)
        if values.size == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            return
        # NaN cells transparent: the hatching of the background shows through.
        cmap = matplotlib.colormaps[DIVERGING_CMAP if self.signed else SEQUENTIAL_CMAP]
        cmap = cmap.with_extremes(bad=(0.0, 0.0, 0.0, 0.0))
        finite = values[np.isfinite(values)]
        if self.signed:
            bound = float(np.abs(finite).max()) if finite.size else 1.0
            norm = Normalize(-(bound or 1.0), bound or 1.0)  # centred: white is exactly 0
        else:
            low = float(finite.min()) if finite.size else 0.0
            high = float(finite.max()) if finite.size else 1.0
            norm = Normalize(low, high if high > low else low + 1.0)
        image = ax.imshow(
            values,
            aspect="auto",
            origin="lower",
            cmap=cmap,
            norm=norm,
            extent=self.extent,
            interpolation="nearest",
        )
        if np.isnan(values).any():
            ax.patch.set_facecolor("white")
            ax.patch.set_hatch("///")
            ax.patch.set_edgecolor("0.75")
        bar = ax.figure.colorbar(image, ax=ax)
        bar.set_label(self.clabel)
        n_rows, n_cols = values.shape
        for axis, labels, count, edges in (
            (ax.xaxis, self.xticklabels, n_cols, self.extent[:2] if self.extent else None),
            (ax.yaxis, self.yticklabels, n_rows, self.extent[2:] if self.extent else None),
        ):
            if labels:
                start, stop = edges if edges is not None else (-0.5, count - 0.5)
                step = (stop - start) / max(count, 1)
                every = max(1, -(-count // _MAX_TICKS))
                index = list(range(0, count, every))
                axis.set_ticks([start + (i + 0.5) * step for i in index])
                axis.set_ticklabels([labels[i] for i in index])
            else:
                axis.set_major_locator(MaxNLocator(integer=True))
        if self.xticklabels:
            widest = max(len(line) for label in self.xticklabels for line in label.split("\n"))
            lines = max(label.count("\n") + 1 for label in self.xticklabels)
            if lines == 1 and widest > 3:  # long single-line labels (tokens) slant to fit
                ax.tick_params(axis="x", labelrotation=45)
            elif widest * min(n_cols, _MAX_TICKS) > 60:
                ax.tick_params(axis="x", labelsize=7)


def _integers(values: Any) -> bool:
    """Whether every finite value is a whole number (an axis of layers, blocks, steps)."""
    array = np.asarray(values)
    if array.dtype.kind in "iu":
        return True
    if array.dtype.kind != "f":
        return False
    finite = array[np.isfinite(array)]
    return bool(finite.size) and bool(np.all(finite == np.round(finite)))


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
    """

    analyzer: str
    summary: str = ""
    tables: Mapping[str, Table] = field(default_factory=dict)
    arrays: Mapping[str, Any] = field(default_factory=dict)
    plots: tuple[Plot, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

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
                for k, t in self.tables.items()
            },
            "arrays": {k: v.tolist() for k, v in self.arrays.items()},
            "plots": [p.to_dict() for p in self.plots],
            "meta": dict(self.meta),
        }
        if self.warnings:  # absent when there are none (results of earlier versions read alike)
            data["warnings"] = list(self.warnings)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """Rebuild a result from :meth:`to_dict` output."""
        try:
            return cls(
                analyzer=data["analyzer"],
                summary=data.get("summary", ""),
                tables={
                    k: Table(k, t["columns"], t.get("description", ""))
                    for k, t in data.get("tables", {}).items()
                },
                arrays=data.get("arrays", {}),
                plots=tuple(Plot.from_dict(p) for p in data.get("plots", [])),
                meta=data.get("meta", {}),
                warnings=tuple(data.get("warnings", ())),
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
        """Write ``result.json`` and one CSV per table, then one PNG per plot; return the paths.

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
        if plots:
            self._draw_each(files)
        return files.done()

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


def _plain_log_labels(axis: Any) -> None:
    """Label a log axis with plain numbers (``2``, ``30``, ``0.5``) rather than matplotlib's
    ``2×10⁰`` style; minor ticks are labelled only where the axis spans few decades."""
    from matplotlib.ticker import LogFormatter

    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def agg_figure() -> tuple[Any, Any]:
    """A ``(Figure, Axes)`` pair on a private Agg canvas (no pyplot, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


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

    def done(self) -> list[Path]:
        if self.failed:
            raise _save_error(self.analyzer, self.directory, self.written, self.failed)
        return self.written


def _reason(err: BaseException) -> str:
    """Why a file was not written, in a few words (``No space left on device``)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
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
