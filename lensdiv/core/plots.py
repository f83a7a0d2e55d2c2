"""Declarative plots: a :class:`Plot` is data (JSON round trip) that draws itself from the
tables and arrays of a result, on a private Agg canvas.

The rules every figure follows (integer axes of layers, labelled units, a diverging colour map
centred on zero for signed values, hatched blank cells) live here, in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from lensdiv.core.errors import ResultError


@runtime_checkable
class Plotted(Protocol):
    """What a plot draws from: a result's named tables and arrays."""

    @property
    def tables(self) -> Mapping[str, Any]: ...

    @property
    def arrays(self) -> Mapping[str, Any]: ...


def _holds(names: Mapping[str, Any]) -> str:
    """``it has: a, b`` (or ``it has none``), for lines about what a result lacks."""
    return f"it has: {', '.join(names)}" if names else "it has none"


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
        color: Column whose value colours each ``group``'s line on the sequential colour map,
            with a colour bar labelled ``clabel`` (e.g. one line per model coloured by its
            parameter count; lines are then labelled by their group value alone). The scale is
            logarithmic when every value is positive and they span a factor of 10 or more.
        limits: A heatmap's fixed colour scale ``(low, high)`` (e.g. ``(0, 1)`` for a
            similarity), the same in every figure of that quantity; default: the data's range
            (symmetric about 0 when ``signed``).
        depth: A heatmap whose rows and columns are the residual states ``h_0 … h_L`` of a
            model of ``depth = L`` blocks, drawn on relative-depth axes ``ℓ/L`` (0 the
            embedding, 1 the last block's output); 0: index axes.
        labels: The legend's name of each ``y`` column, in order (default: the column names).
        ylim: A line plot's fixed y range ``(low, high)`` (``(0, 1)`` for a share or a
            probability, so that a small range is not stretched to fill the axes); ``None``
            (either end): the data's.
        thresholds: ``(value, label)`` pairs drawn as dashed lines across a line plot, or as
            marks on a heatmap's colour bar, each labelled (a cut-off the figure is read by).
        logc: A heatmap's colour scale logarithmic, over its positive values (one large cell,
            such as removing block 0, then does not flatten the rest; values ≤ 0 take the
            lowest colour).
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
    color: str | None = None
    limits: tuple[float, float] | None = None
    depth: int = 0
    labels: tuple[str, ...] = ()
    ylim: tuple[float | None, float | None] | None = None
    thresholds: tuple[tuple[float, str], ...] = ()
    logc: bool = False

    def __post_init__(self) -> None:
        if self.mask and self.mask not in _MASKS:
            raise ValueError(f"plot {self.name!r}: mask must be one of {sorted(_MASKS)}")
        for key in ("y", "points", "xticklabels", "yticklabels", "labels"):
            object.__setattr__(self, key, tuple(getattr(self, key)))
        if self.labels and len(self.labels) != len(self.y):
            raise ValueError(f"plot {self.name!r}: one label per y column ({len(self.y)})")
        if self.ylim is not None:
            object.__setattr__(self, "ylim", tuple(self.ylim))
        object.__setattr__(
            self, "thresholds", tuple((float(v), str(t)) for v, t in self.thresholds)
        )
        if self.extent is not None:
            object.__setattr__(self, "extent", tuple(float(v) for v in self.extent))
        if self.limits is not None:
            object.__setattr__(self, "limits", tuple(float(v) for v in self.limits))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (tuples as lists); :meth:`from_dict` inverts it. ``color``,
        ``limits``, ``depth``, ``labels``, ``ylim`` and ``thresholds`` are absent when unset, so
        plots without them read as in earlier versions."""
        data = {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}
        data["thresholds"] = [list(pair) for pair in self.thresholds]
        unset_values: tuple[tuple[str, Any], ...] = (
            ("color", None),
            ("limits", None),
            ("depth", 0),
            ("labels", []),
            ("ylim", None),
            ("thresholds", []),
            ("logc", False),
        )
        for key, unset in unset_values:
            if data[key] == unset:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plot:
        """A spec from :meth:`to_dict` output (or from a result of an earlier version)."""
        fields: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
        }
        if "thresholds" in fields:
            fields["thresholds"] = tuple(tuple(pair) for pair in fields["thresholds"])
        return cls(**fields)

    def data(self, result: Plotted) -> np.ndarray:
        """The heatmap's array as drawn: float, with masked cells set to NaN."""
        values = np.array(result.arrays[self.source], dtype=float, ndmin=2)
        if self.mask:
            rows, cols = np.indices(values.shape)
            values[_MASKS[self.mask](rows, cols)] = np.nan
        return values

    def missing(self, result: Plotted) -> str | None:
        """What this plot reads that ``result`` lacks (a damaged ``result.json``, a plugin's
        spec naming a table it never made), in one line; ``None`` when nothing is."""
        if self.kind == "heatmap":
            if self.source not in result.arrays:
                return f"the result has no array {self.source!r} ({_holds(result.arrays)})"
            return None
        if self.source not in result.tables:
            return f"the result has no table {self.source!r} ({_holds(result.tables)})"
        columns = result.tables[self.source].columns
        for column in (self.x, *self.y, self.group):
            if column is not None and column not in columns:
                return f"table {self.source!r} has no column {column!r} ({_holds(columns)})"
        return None

    def figure(self, result: Plotted, *, caption: bool = True) -> tuple[Any, Any]:
        """A ``(Figure, Axes)`` on a private Agg canvas with this plot drawn.

        Args:
            result: The result whose table or array the plot draws.
            caption: Write the caption under the axes (a PNG file carries its own; a page
                shows it as text instead).

        Raises:
            ResultError: The result lacks the table, array or column the plot reads
                (:meth:`missing`).
        """
        problem = self.missing(result)
        if problem is not None:
            raise ResultError(problem)
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

    def full_caption(self, result: Plotted) -> str:
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

    def draw(self, result: Plotted, ax: Any) -> None:
        """Draw onto a matplotlib ``Axes``."""
        from matplotlib.ticker import MaxNLocator

        if self.kind == "line":
            table = result.tables[self.source]
            xs = table[self.x] if self.x else np.arange(len(table))
            group = self.group
            groups = [None] if group is None else list(dict.fromkeys(table[group]))
            colours = self._colours(table, groups, ax)
            for value in groups:
                rows = (
                    np.ones(len(table), dtype=bool)
                    if value is None or group is None
                    else np.asarray(table[group] == value)
                )
                for col, name in zip(self.y, self.labels or self.y, strict=True):
                    label = name if value is None else f"{self.group}={value}"
                    if colours:
                        label = str(value)
                    if value is not None and len(self.y) > 1:
                        label = f"{name}, {label}"
                    dots = col in self.points or str(value) in self.points
                    style: dict[str, Any] = {"marker": "o", "markersize": 5 if dots else 3}
                    if dots:
                        style["linestyle"] = "none"
                    if colours:
                        style["color"] = colours[value]
                    ax.plot(
                        np.asarray(xs)[rows], np.asarray(table[col])[rows], label=label, **style
                    )
            for level, text in self.thresholds:
                ax.axhline(level, color="0.35", linestyle="--", linewidth=0.9, label=text)
            if self.ylim is not None:
                ax.set_ylim(*self.ylim)
            if len(self.y) * len(groups) + len(self.thresholds) > 1:
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

    def _colours(self, table: Any, groups: list[Any], ax: Any) -> dict[Any, Any]:
        """Each group's colour from its ``color`` value (grey where it has none), and the colour
        bar; empty without ``color`` and ``group``."""
        if self.color is None or self.group is None:
            return {}
        import matplotlib
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import ListedColormap, LogNorm, Normalize

        keys, values = np.asarray(table[self.group]), np.asarray(table[self.color], dtype=float)
        first = {g: values[np.flatnonzero(keys == g)[0]] for g in groups}
        finite = np.array([v for v in first.values() if np.isfinite(v)])
        low = float(finite.min()) if finite.size else 0.0
        high = float(finite.max()) if finite.size else 1.0
        logarithmic = finite.size > 0 and low > 0 and high >= 10 * low
        norm = (
            LogNorm(low, high) if logarithmic else Normalize(low, high if high > low else low + 1)
        )
        # The map's last (palest) sixth is cut: a yellow line on white is hard to see.
        cmap = ListedColormap(matplotlib.colormaps[SEQUENTIAL_CMAP](np.linspace(0, 0.85, 256)))
        bar = ax.figure.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax)
        bar.set_label(self.clabel or self.color)
        return {g: cmap(norm(v)) if np.isfinite(v) else "0.6" for g, v in first.items()}

    def _heatmap(self, result: Plotted, ax: Any) -> None:
        import matplotlib
        from matplotlib.colors import LogNorm, Normalize
        from matplotlib.ticker import MaxNLocator

        values = self.data(result)
        if values.size == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            return
        # NaN cells transparent: the hatching of the background shows through.
        cmap = matplotlib.colormaps[DIVERGING_CMAP if self.signed else SEQUENTIAL_CMAP]
        cmap = cmap.with_extremes(bad=(0.0, 0.0, 0.0, 0.0))
        finite = values[np.isfinite(values)]
        extent = self.extent
        if self.depth:
            half = 0.5 / self.depth
            extent = (-half, 1 + half, -half, 1 + half)
        positive = finite[finite > 0]
        norm: Normalize
        if self.logc and positive.size:
            high = float(positive.max())
            norm = LogNorm(float(positive.min()), high if high > positive.min() else high * 10)
            norm.clip = True  # a value ≤ 0 takes the lowest colour
        elif self.limits is not None:
            norm = Normalize(*self.limits)
        elif self.signed:
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
            extent=extent,
            interpolation="nearest",
        )
        if np.isnan(values).any():
            ax.patch.set_facecolor("white")
            ax.patch.set_hatch("///")
            ax.patch.set_edgecolor("0.75")
        bar = ax.figure.colorbar(image, ax=ax)
        bar.set_label(self.clabel)
        formatter = bar.ax.yaxis.get_major_formatter()
        if isinstance(norm, LogNorm):
            _plain_log_labels(bar.ax.yaxis)  # 0.2, 1, 6: not 2×10⁻¹
        elif hasattr(formatter, "set_useOffset"):  # "+1.2e4" over the bar reads as a title
            formatter.set_useOffset(False)
        for level, _ in self.thresholds:  # a cut-off marked on the scale (the caption names
            bar.ax.axhline(level, color="red", linewidth=2)  # it: no room beside the bar)
        n_rows, n_cols = values.shape
        for axis, labels, count, edges in (
            (ax.xaxis, self.xticklabels, n_cols, extent[:2] if extent else None),
            (ax.yaxis, self.yticklabels, n_rows, extent[2:] if extent else None),
        ):
            if self.depth:
                axis.set_ticks([0.0, 0.25, 0.5, 0.75, 1.0])
            elif labels:
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


def _plain_log_labels(axis: Any) -> None:
    """Label a log axis with plain numbers (``2``, ``30``, ``0.5``) rather than matplotlib's
    ``2×10⁰`` style; minor ticks are labelled only where the axis spans few decades."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        """matplotlib's choice of which log ticks to label, each in one plain style."""

        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return _plain_number(x)

    axis.set_major_formatter(Plain(labelOnlyBase=False))  # 0.1, 1, 10, 1,000: one style
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _plain_number(value: float, _position: Any = None) -> str:
    """A tick value as people write it: ``0.01``, ``0.5``, ``20``, ``1000``; ``1e+06`` beyond."""
    if value == 0 or not np.isfinite(value):
        return "0" if value == 0 else ""
    if 1e-4 <= abs(value) < 1e6:
        return f"{value:.6f}".rstrip("0").rstrip(".") if abs(value) < 1 else f"{value:,.0f}"
    return f"{value:.0e}"


def agg_figure() -> tuple[Any, Any]:
    """A ``(Figure, Axes)`` pair on a private Agg canvas (no pyplot, no global backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()
