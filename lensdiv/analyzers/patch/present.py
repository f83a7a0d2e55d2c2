"""The result of ``patch``: tables, heatmaps, summary and metadata of :class:`PatchingMaps`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.analyzers.patch.maps import Aligned, PatchingMaps
from lensdiv.core.results import Plot, Result, Table
from lensdiv.data.pairs import ANSWER_RULE

if TYPE_CHECKING:  # the analyzer imports this module; its type is only an annotation here
    from lensdiv.analyzers.patch import Patching

ALIGNMENT = (
    "end: column j of a [.., T] map is the position j-(T-1) tokens before the answer position "
    "(the prompt's last token); a column averages the pairs long enough to have it"
)
COLUMNS = (
    "Columns count back from the answer position (0); a token under an offset is the "
    "clean prompt's token there, shown where every pair has the same one."
)


def present(maps: PatchingMaps, options: Patching) -> Result:
    """The depth, patching, erasure, IG and pairs tables, the heatmaps, summary and meta."""
    arrays: dict[str, Any] = {"positions": maps.offsets}
    for site, grid in maps.patch.items():
        arrays[f"patch_{site}"] = grid.mean
        arrays[f"patch_{site}_stderr"] = grid.stderr
    for kind, aligned in (("erasure", maps.erasure), ("ig", maps.ig)):
        if aligned is not None:
            arrays[kind] = aligned.mean
            arrays[f"{kind}_stderr"] = aligned.stderr
    meta: dict[str, Any] = {}
    if maps.ig_abs_error is not None and maps.ig_rel_error is not None:
        arrays["ig_completeness_abs_error"] = maps.ig_abs_error
        arrays["ig_completeness_rel_error"] = maps.ig_rel_error
        meta["ig_completeness_rel_error"] = float(maps.ig_rel_error.max())
        meta["ig_completeness_abs_error"] = float(maps.ig_abs_error.max())
    bos = " (BOS excluded)" if options.exclude_bos else ""
    meta.update(
        metric=options.metric,
        sites=list(options.sites),
        ig_steps=options.ig_steps,
        ig_rule="midpoint",
        ig_baseline="mean over the prompt's positions of h_l" + bos,
        erasure_mean="dataset mean of h_l over clean prompts' positions" + bos,
        pairs=options.pairs,
        n_pairs=len(maps.pairs),
        degenerate_pairs=maps.degenerate,
        positions=maps.n_pos,
        alignment=ALIGNMENT,
        answer_token=ANSWER_RULE,
        answer_position="last prompt token",
        intervention=maps.intervention,
    )
    return Result(
        analyzer=options.name,
        summary=_summary(maps, options),
        tables=_tables(maps, options.metric),
        arrays=arrays,
        plots=_heatmaps(maps, options.metric),
        meta=meta,
    )


# -- tables -------------------------------------------------------------------------------------
def _tables(maps: PatchingMaps, metric: str) -> dict[str, Table]:
    """``depth`` (per layer), the long tables of every map, then ``pairs``."""
    tables = {
        "depth": Table(
            "depth",
            _depth_columns(maps),
            "Per layer: best patching score (pos = offset from the answer), erasure and IG",
        ),
        "patching": Table(
            "patching",
            _patching_columns(maps),
            "Normalised patching score per site, layer, position",
        ),
    }
    if maps.erasure is not None:
        tables["erasure"] = Table(
            "erasure",
            _long(maps.erasure, maps.offsets, "distance"),
            "||p - p~||_2 at the answer after erasing h_l(t)",
        )
    if maps.ig is not None:
        tables["ig"] = Table(
            "ig",
            _long(maps.ig, maps.offsets, "attribution"),
            "Integrated-gradients attribution of h_l(t)",
        )
    pairs = maps.pairs
    tables["pairs"] = Table(
        "pairs",
        {
            "line": [p.line for p in pairs],
            "tokens": [p.tokens for p in pairs],
            "target_id": [p.target for p in pairs],
            "foil_id": [p.foil for p in pairs],
            f"clean_{metric}": [p.clean for p in pairs],
            f"corrupt_{metric}": [p.corrupt for p in pairs],
            "normalised": [int(p.normalised) for p in pairs],
        },
        "Clean and corrupt metric of every pair",
    )
    return tables


def _depth_columns(maps: PatchingMaps) -> dict[str, list]:
    """Per residual state: each site's best score and where, erasure's, IG's sums."""
    offsets = maps.offsets
    depth: dict[str, Any] = {"layer": list(range(maps.n_layers + 1))}
    for site, grid in maps.patch.items():
        best, where = grid.best()
        depth[f"{site}_max"] = [*best, math.nan]
        depth[f"{site}_pos"] = [*(offsets[w] if w >= 0 else math.nan for w in where), math.nan]
    if maps.erasure is not None:
        best, where = maps.erasure.best()
        depth["erasure_max"] = best
        depth["erasure_pos"] = [offsets[w] if w >= 0 else math.nan for w in where]
    if maps.ig is not None:
        depth["ig_sum"] = torch.nansum(maps.ig.mean, 1).tolist()
        depth["ig_answer"] = maps.ig.mean[:, -1].tolist()
        depth["ig_completeness_rel_error"] = maps.ig_rel_error
    return depth


def _patching_columns(maps: PatchingMaps) -> dict[str, list]:
    """One row per site, layer and position."""
    columns: dict[str, list] = {k: [] for k in ("site", "layer", "pos", "score")}
    columns.update(stderr=[], pairs=[], metric_mean=[])
    for site, grid in maps.patch.items():
        raw_mean = maps.metric_mean[site]
        for layer in range(maps.n_layers):
            for j, offset in enumerate(maps.offsets):
                columns["site"].append(site)
                columns["layer"].append(layer)
                columns["pos"].append(offset)
                columns["score"].append(float(grid.mean[layer, j]))
                columns["stderr"].append(float(grid.stderr[layer, j]))
                columns["pairs"].append(int(grid.pairs[j]))
                columns["metric_mean"].append(float(raw_mean[layer, j]))
    return columns


def _long(grid: Aligned, offsets: list[int], value: str) -> dict[str, list]:
    """One row per residual state and position of an ``[L + 1, T]`` map."""
    rows: dict[str, list] = {"layer": [], "pos": [], value: [], "stderr": [], "pairs": []}
    for layer in range(grid.mean.shape[0]):
        for j, offset in enumerate(offsets):
            rows["layer"].append(layer)
            rows["pos"].append(offset)
            rows[value].append(float(grid.mean[layer, j]))
            rows["stderr"].append(float(grid.stderr[layer, j]))
            rows["pairs"].append(int(grid.pairs[j]))
    return rows


# -- plots ----------------------------------------------------------------------------------------
def _heatmaps(maps: PatchingMaps, metric: str) -> tuple[Plot, ...]:
    """One heatmap per patched site, then erasure and IG, on the end-aligned position axis."""
    n_pos, L = maps.n_pos, maps.n_layers
    ticks, shared = position_labels([p.text for p in maps.pairs], maps.offsets)
    xlabel = "position: offset from the answer position (0)" + (
        " and the clean token there" if shared else ""
    )

    def heatmap(name: str, title: str, rows: int, **spec: Any) -> Plot:
        return Plot(
            "heatmap",
            name,
            title,
            name,
            xticklabels=ticks,
            extent=(-(n_pos - 1) - 0.5, 0.5, -0.5, rows - 0.5),
            xlabel=xlabel,
            **spec,
        )

    plots = [
        heatmap(
            f"patch_{site}",
            f"Activation patching of {site}",
            L,
            ylabel="layer l (block)" if site != "resid_pre" else "layer l (h_l = resid_pre)",
            clabel="score (0 = corrupt, 1 = clean)",
            signed=True,
            caption=f"A clean activation patched into the corrupt run: score = (m − m_corrupt)"
            f" / (m_clean − m_corrupt), m = {metric}; mean over pairs. {COLUMNS}",
        )
        for site in maps.patch
    ]
    if maps.erasure is not None:
        plots.append(
            heatmap(
                "erasure",
                "Residual erasure: h_l(t) replaced by its mean",
                L + 1,
                ylabel="residual state h_l",
                clabel="‖p − p̃‖₂ (fixed scale 0 to √2)",
                limits=(0.0, 2**0.5),
                caption="Change of the output distribution at the answer position; mean over "
                f"pairs. {COLUMNS}",
            )
        )
    if maps.ig is not None:
        unit = "logits" if metric == "logit_diff" else "probability"
        plots.append(
            heatmap(
                "ig",
                "Integrated gradients per residual state",
                L + 1,
                ylabel="residual state h_l",
                clabel=f"attribution ({unit})",
                signed=True,
                caption=f"Attribution of {metric} to h_l(t), baseline: the prompt's mean "
                f"of h_l; mean over pairs. {COLUMNS}",
            )
        )
    return tuple(plots)


def position_labels(
    texts: Sequence[Sequence[str]], offsets: Sequence[int]
) -> tuple[tuple[str, ...], bool]:
    """Labels of the end-aligned position axis: ``"offset"``, plus ``"\\ntoken"`` where every pair
    long enough has the same clean token at that offset (``texts``: each pair's clean tokens,
    empty where unknown); and whether any token is shown."""
    labels, shared = [], False
    for offset in offsets:
        seen = {
            text[len(text) - 1 + offset] for text in texts if text and len(text) - 1 + offset >= 0
        }
        if len(seen) == 1:
            labels.append(f"{offset}\n{_visible(seen.pop())}")
            shared = True
        else:
            labels.append(str(offset))
    return tuple(labels), shared


def _visible(token: str) -> str:
    """A token as a tick label: spaces and line breaks made visible, long ones cut."""
    text = token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return text if len(text) <= 8 else text[:7] + "…"


# -- summary --------------------------------------------------------------------------------------
def _summary(maps: PatchingMaps, options: Patching) -> str:
    """Where the answer sits along depth, the strongest sublayer outputs, erasure and IG."""
    offsets, degenerate = maps.offsets, maps.degenerate
    parts = [
        f"{len(maps.pairs)} pairs, metric {options.metric}"
        + (f" ({degenerate} with equal clean and corrupt metric left out)" if degenerate else "")
        + "."
    ]
    if "resid_pre" in maps.patch:
        _, where = maps.patch["resid_pre"].best()
        runs = _runs([offsets[w] if w >= 0 else None for w in where])
        spans = [
            ("the answer position" if pos == 0 else f"offset {pos}")
            + (f" in layers {a}-{b}" if a != b else f" in layer {a}")
            for a, b, pos in runs
        ]
        text = ", then ".join(spans)
        parts.append(f"Patching the residual stream, the answer sits at {text}.")
    for site, label in (("attn_out", "attention"), ("mlp_out", "MLP")):
        if site in maps.patch and torch.isfinite(maps.patch[site].mean).any():
            grid = maps.patch[site].mean
            layer, j = _argmax(grid)
            parts.append(
                f"Strongest {label} output: layer {layer} at offset {offsets[j]} "
                f"(score {float(grid[layer, j]):.2f})."
            )
    if maps.erasure is not None and torch.isfinite(maps.erasure.mean).any():
        layer, j = _argmax(maps.erasure.mean)
        parts.append(
            f"Erasing h_{layer} at offset {offsets[j]} moves the output most "
            f"(||p - p~|| = {float(maps.erasure.mean[layer, j]):.3f})."
        )
    if maps.ig is not None and torch.isfinite(maps.ig.mean).any():
        layer, j = _argmax(maps.ig.mean.abs())
        error = float(maps.ig_rel_error.max()) if maps.ig_rel_error is not None else math.nan
        parts.append(
            f"Integrated gradients put the most weight on h_{layer} at offset {offsets[j]}; "
            f"completeness error at most {error:.2g} (relative) with {options.ig_steps} steps."
        )
    parts.append("Offsets count back from the answer position (0).")
    return " ".join(parts)


def _argmax(grid: Float[Tensor, "row pos"]) -> tuple[int, int]:
    """Row and column of the largest finite entry."""
    filled = torch.where(torch.isfinite(grid), grid, torch.full_like(grid, -math.inf))
    flat = int(filled.argmax())
    return flat // grid.shape[1], flat % grid.shape[1]


def _runs(values: Sequence[int | None]) -> list[tuple[int, int, int]]:
    """``[(first, last, value)]`` for runs of equal values (``None`` entries are skipped)."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if value is None:
            continue
        if runs and runs[-1][2] == value and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, value)
        else:
            runs.append((i, i, value))
    return runs
