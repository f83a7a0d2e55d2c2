"""The prompt view: for one prompt, a layer × position grid of what each residual state predicts.

A :class:`PromptView` is plain data (made by :func:`lensdiv.ops.prompt.prompt_view` from a model,
or read back from JSON) that renders itself: a coloured table in a terminal, plain text through
``print``, an interactive grid in a notebook or an HTML page (hovering a cell shows the top-k
tokens with their probabilities, the KL divergence to the model's output and the entropy), and a
heatmap PNG.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.errors import ResultError
from lensdiv.core.results import Rendered, agg_figure, write_json_atomic
from lensdiv.view.html import PROB_CMAP, prob_colour, render, visible

# Positions whose cells carry their token text in the PNG (beyond that the cells get too small).
_ANNOTATE_MAX = 40
# Right-most columns whose hover box opens to the left, so it stays on the page.
_TIP_RIGHT = 3


@dataclass(frozen=True)
class PromptView(Rendered):
    """What every residual state of a model predicts at every position of one prompt.

    Row ``r`` is one residual state read out (``rows[r]``, from the embedding up to the output),
    column ``t`` one position of the prompt (``tokens[t]``); each cell holds the state's top-k
    next-token predictions with their probabilities (read out in float32), the KL divergence
    from the cell's distribution to the model's output distribution at that position, its
    entropy, and the probability and rank of the token that actually comes next.

    Args:
        model: The model's name.
        lens: ``"logit"`` (each ``h_l`` through the final norm and unembedding),
            ``"last-block"`` (each ``h_l`` through the final block first) or ``"skip"``.
        title: Heading, e.g. ``"Logit lens"``.
        note: One sentence on what a row is and what the KL compares with.
        tokens: The prompt's tokens as strings, BOS included when it was prepended.
        rows: Row labels from the first state to the last (``h0`` … ``h4``).
        top_tokens: ``[row][position][k]`` top-k token strings, most likely first.
        top_probs: ``[row][position][k]`` their probabilities.
        kl: ``[row][position]`` ``KL(p_cell ‖ p_output)`` in nats.
        entropy: ``[row][position]`` entropy of the cell's distribution in nats.
        next_prob: ``[row][position]`` probability of the prompt's next token (NaN at the end).
        next_rank: ``[row][position]`` its rank, 0 = top-1 (-1 at the end).
        meta: How it was made: readout precision, model dtype, intervention, top_k.
    """

    model: str
    lens: str
    title: str
    note: str
    tokens: Sequence[str]
    rows: Sequence[str]
    top_tokens: Sequence[Sequence[Sequence[str]]]
    top_probs: Sequence[Sequence[Sequence[float]]]
    kl: Sequence[Sequence[float]]
    entropy: Sequence[Sequence[float]]
    next_prob: Sequence[Sequence[float]]
    next_rank: Sequence[Sequence[int]]
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n_rows, n_pos = len(self.rows), len(self.tokens)
        for name in ("top_tokens", "top_probs", "kl", "entropy", "next_prob", "next_rank"):
            grid = getattr(self, name)
            if len(grid) != n_rows or any(len(row) != n_pos for row in grid):
                raise ValueError(f"prompt view: {name} is not {n_rows} rows × {n_pos} positions")

    @property
    def text(self) -> str:
        """The prompt as the model read it (special tokens included)."""
        return "".join(self.tokens)

    @property
    def top_k(self) -> int:
        """Number of tokens kept per cell."""
        return len(self.top_tokens[0][0]) if self.rows and self.tokens else 0

    # -- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` inverts it."""
        return {
            "model": self.model,
            "lens": self.lens,
            "title": self.title,
            "note": self.note,
            "tokens": list(self.tokens),
            "rows": list(self.rows),
            "top_tokens": [[list(cell) for cell in row] for row in self.top_tokens],
            "top_probs": [[list(cell) for cell in row] for row in self.top_probs],
            "kl": [list(row) for row in self.kl],
            "entropy": [list(row) for row in self.entropy],
            "next_prob": [list(row) for row in self.next_prob],
            "next_rank": [list(row) for row in self.next_rank],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptView:
        """Rebuild a view from :meth:`to_dict` output."""
        try:
            return cls(**{k: data[k] for k in _FIELDS if k in data})
        except (KeyError, TypeError, ValueError) as err:
            raise ResultError(f"not a lensdiv prompt view: {err}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the view as JSON (``.json``), an HTML page (``.html``) or a PNG (``.png``)."""
        path = Path(path)
        if path.suffix == ".html":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.page())
        elif path.suffix == ".png":
            path.parent.mkdir(parents=True, exist_ok=True)
            fig, _ = self.figure()
            fig.savefig(path, format="png")
        else:
            write_json_atomic(path, self.to_dict())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PromptView:
        """Read a view saved as JSON."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ResultError(f"cannot read prompt view {path}: {err}") from None

    # -- terminal ------------------------------------------------------------------------------
    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.table import Table as RichTable
        from rich.text import Text

        yield Text.assemble((f"{self.title}: ", "bold"), (self.model, "bold"), f"  {self.text!r}")
        yield Text(self.note, style="dim")
        order = list(range(len(self.rows)))[::-1]  # the output on top, as in the heatmap
        cells = [
            [f"{visible(self.top_tokens[r][t][0], 10)} {_short(self.top_probs[r][t][0])}"]
            for r in order
            for t in range(len(self.tokens))
        ]
        width = max([len(c[0]) for c in cells] + [4]) + 3
        label = max(len(r) for r in self.rows) + 3
        per_group = max(1, (options.max_width - label) // width)
        positions = list(range(len(self.tokens)))
        for start in range(0, len(positions), per_group):
            group = positions[start : start + per_group]
            table = RichTable(title_justify="left", pad_edge=False, padding=(0, 1))
            table.add_column("state", justify="right", no_wrap=True)
            for t in group:
                table.add_column(f"{t}:{visible(self.tokens[t], 8)}", no_wrap=True)
            for r in order:
                row: list[Any] = [self.rows[r]]
                for t in group:
                    p = self.top_probs[r][t][0]
                    background, ink = prob_colour(p)
                    text = f"{visible(self.top_tokens[r][t][0], 10)} {_short(p)}"
                    row.append(Text(text, style=f"{ink} on {background}"))
                table.add_row(*row)
            yield table
        yield Text(
            "cell: the top-1 next-token prediction and its probability (colour: light = "
            "unlikely, dark = likely); columns: position:input token.",
            style="dim",
        )

    # -- notebook and HTML ---------------------------------------------------------------------
    def _repr_mimebundle_(
        self, include: Sequence[str] = (), exclude: Sequence[str] = (), **kwargs: Any
    ) -> dict[str, str]:
        return {"text/plain": str(self), "text/html": self.html()}

    def _repr_html_(self) -> str:
        return self.html()

    def html(self, *, style: bool = True) -> str:
        """An HTML fragment with hover boxes (top-k, KL, entropy); ``style``: include its CSS."""
        return render("prompt.html.j2", view=self, grid=self._grid(), style=style)

    def page(self) -> str:
        """A complete, self-contained HTML page of the view (no network)."""
        return render("prompt_page.html.j2", view=self, grid=self._grid())

    def _grid(self) -> list[dict[str, Any]]:
        """Rows for the template, the output first: cells with colours and hover contents."""
        n_pos = len(self.tokens)
        rows = []
        for r in reversed(range(len(self.rows))):
            cells = []
            for t in range(n_pos):
                p = self.top_probs[r][t][0]
                background, ink = prob_colour(p)
                cells.append(
                    {
                        "top": list(zip(self.top_tokens[r][t], self.top_probs[r][t], strict=True)),
                        "background": background,
                        "ink": ink,
                        "kl": self.kl[r][t],
                        "entropy": self.entropy[r][t],
                        "next": self.tokens[t + 1] if t + 1 < n_pos else None,
                        "next_prob": self.next_prob[r][t],
                        "next_rank": self.next_rank[r][t],
                        "right": t >= n_pos - _TIP_RIGHT and n_pos > _TIP_RIGHT,
                    }
                )
            rows.append({"label": self.rows[r], "cells": cells})
        return rows

    # -- heatmap -------------------------------------------------------------------------------
    def figure(self) -> tuple[Any, Any]:
        """A heatmap (colour: top-1 probability; text: top-1 token) on a private Agg canvas."""
        import numpy as np

        n_rows, n_pos = len(self.rows), len(self.tokens)
        fig, ax = agg_figure()
        fig.set_size_inches(min(max(6.4, 2.4 + 0.62 * n_pos), 30.0), max(3.6, 2.2 + 0.5 * n_rows))
        probs = np.array([[cell[0] for cell in row] for row in self.top_probs], dtype=float)
        image = ax.imshow(
            probs,
            aspect="auto",
            origin="lower",
            cmap=PROB_CMAP,
            vmin=0.0,
            vmax=1.0,
            interpolation="nearest",
        )
        bar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
        bar.set_label("top-1 probability")
        if n_pos <= _ANNOTATE_MAX:
            for r in range(n_rows):
                for t in range(n_pos):
                    _, ink = prob_colour(float(probs[r, t]))
                    ax.text(
                        t,
                        r,
                        visible(self.top_tokens[r][t][0], 8),
                        ha="center",
                        va="center",
                        fontsize=9,
                        color=ink,
                    )
        ax.set_xticks(range(n_pos))
        labels = [visible(tok, 10) for tok in self.tokens]
        slant = max(map(len, labels), default=0) > 2  # long tokens slant to fit
        ax.set_xticklabels(labels, rotation=45 if slant else 0, ha="right" if slant else "center")
        ax.set_yticks(range(n_rows))
        ax.set_yticklabels(list(self.rows))
        ax.set_xlabel("position: input token")
        ax.set_ylabel("residual state")
        ax.set_title(f"{self.title}: {self.model} · {visible(self.text, 60)}", fontsize=11)
        fig.text(
            0.01,
            0.01,
            "Cell: the state's most likely next token; colour: its probability. " + self.note,
            fontsize=7.5,
            ha="left",
            va="bottom",
            wrap=True,
        )
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        return fig, ax


@dataclass(frozen=True)
class PromptViews(Rendered):
    """Several lenses' views of the same prompt, side by side (``lensdiv lens --lens A,B``).

    Args:
        views: One :class:`PromptView` per lens, in the order given.
    """

    views: tuple[PromptView, ...]

    def __post_init__(self) -> None:
        if not self.views:
            raise ValueError("prompt views: no view")
        if len({tuple(v.tokens) for v in self.views}) > 1:
            raise ValueError("prompt views: the views read different prompts")

    def __getitem__(self, index: int) -> PromptView:
        return self.views[index]

    def __len__(self) -> int:
        return len(self.views)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; :meth:`from_dict` inverts it."""
        return {"views": [v.to_dict() for v in self.views]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptViews:
        """Rebuild the views from :meth:`to_dict` output."""
        try:
            return cls(tuple(PromptView.from_dict(v) for v in data["views"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ResultError(f"not lensdiv prompt views: {err}") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the views as JSON (``.json``), one HTML page (``.html``: the lenses side by
        side) or one PNG (``.png``: one heatmap per lens, side by side)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".html":
            path.write_text(self.page())
        elif path.suffix == ".png":
            fig = self.figure()
            fig.savefig(path, format="png")
        else:
            write_json_atomic(path, self.to_dict())
        return path

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.views

    def _repr_mimebundle_(
        self, include: Sequence[str] = (), exclude: Sequence[str] = (), **kwargs: Any
    ) -> dict[str, str]:
        return {"text/plain": str(self), "text/html": self.html()}

    def html(self) -> str:
        """An HTML fragment: the views side by side (each with its hover boxes)."""
        return render("prompt_views.html.j2", views=self.views, grids=self._grids(), style=True)

    def page(self) -> str:
        """A complete, self-contained HTML page of the views (no network)."""
        return render("prompt_views_page.html.j2", views=self.views, grids=self._grids())

    def _grids(self) -> list[list[dict[str, Any]]]:
        return [view._grid() for view in self.views]

    def figure(self) -> Any:
        """One heatmap per lens side by side, on a private Agg canvas."""
        import numpy as np
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        images = []
        for view in self.views:
            fig, _ = view.figure()
            canvas = FigureCanvasAgg(fig)
            canvas.draw()
            images.append(np.asarray(canvas.buffer_rgba()))
        height = max(image.shape[0] for image in images)
        width = sum(image.shape[1] for image in images)
        dpi = 100
        out = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
        FigureCanvasAgg(out)
        left = 0
        for image in images:
            axes = out.add_axes(
                (
                    left / width,
                    1 - image.shape[0] / height,
                    image.shape[1] / width,
                    image.shape[0] / height,
                )
            )
            axes.imshow(image)
            axes.axis("off")
            left += image.shape[1]
        return out


_FIELDS = (
    "model",
    "lens",
    "title",
    "note",
    "tokens",
    "rows",
    "top_tokens",
    "top_probs",
    "kl",
    "entropy",
    "next_prob",
    "next_rank",
    "meta",
)


def _short(p: float) -> str:
    """A probability in three characters: ``.62``, ``1.0``, ``.05``."""
    if not math.isfinite(p):
        return "–"
    return "1.0" if p >= 0.995 else f"{p:.2f}"[1:]
