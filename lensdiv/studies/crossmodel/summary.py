"""What a study shows: each depth profile at relative depth, one line per model coloured by size,
and the numbers the papers report per model, against model size (docs/science.md#study).

The summary is an ordinary :class:`~lensdiv.core.results.Result` (tables, declarative plots), so
it saves, renders and redraws like any analyzer's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lensdiv.core.depth import depth_index
from lensdiv.core.results import Plot, Result, Table

_SIZES = "Lines are coloured by the model's parameter count (the colour bar)."
_AT = "States h_ℓ sit at ℓ/L, blocks at (ℓ + ½)/L."


@dataclass(frozen=True)
class Reading:
    """How a built-in depth profile is drawn and what the paper reads in it.

    Args:
        ylabel: The quantity and its unit.
        caption: The paper's reading of the profile, and what to look for across models.
        logy: Draw on a logarithmic y axis.
    """

    ylabel: str
    caption: str
    logy: bool = False


#: The papers' readings of the built-in analyzers' depth profiles, by (analyzer, table.column).
READINGS: dict[tuple[str, str], Reading] = {
    ("contrib", "contrib.r_block"): Reading(
        "‖a_ℓ + m_ℓ‖ / ‖h_ℓ‖ (ratio)",
        "Csordás et al. (A1): in Llama 3.1 and Qwen 3 the blocks of the second half write much "
        "less into the residual, relative to it, than those of the first half, with a transition "
        "near half depth. If a deeper model stretches the same computation over more layers, "
        "the curves of different depths coincide on ℓ/L.",
        logy=True,
    ),
    ("contrib", "contrib.cos_update"): Reading(
        "cos(Δ_ℓ, h_ℓ)",
        "Csordás et al. (A1): the cosine of each block's update with the residual it is added "
        "to; below 0 the block erases part of what is there. Compare where along ℓ/L the "
        "models' updates turn from building features to refining them.",
    ),
    ("lens", "lens.kl"): Reading(
        "KL(p_ℓ ‖ p_out) (nats)",
        "Csordás et al. (A2): read through the logit lens, the residual's prediction stays far "
        "from the output through the first half and closes in during the second, where layers "
        "refine the output distribution. Models that stretch the same computation fall at the "
        "same ℓ/L.",
    ),
    ("lens", "lens.ce"): Reading(
        "next-token cross-entropy (nats)",
        "Csordás et al. (A2): the logit lens' next-token loss of each residual state; where "
        "along ℓ/L it falls says which part of the depth does the predicting.",
    ),
    ("skip", "skip.later_mean"): Reading(
        "mean over l > s of E[s, l]",
        "Csordás et al. (A3): skipping a block of the second half barely changes the "
        "computation of the later layers, skipping one of the first half changes it much; the "
        "effect falls near half depth (the table's skip_fall_depth).",
    ),
    ("skip", "skip.output_mean"): Reading(
        "‖p − p̃‖₂ (mean)",
        "Csordás et al. (A3): the effect of skipping one block on the output distribution, "
        "much smaller for a block of the second half than for one of the first half.",
    ),
    ("dynamics", "updates.rel_update"): Reading(
        "‖Δ_ℓ‖ / ‖h_ℓ‖",
        "Liu et al. (C1): the middle blocks make small, similar updates, and the deeper the "
        "model the smaller each one, about as 1/L (the update-scaling plot's log–log slope): "
        "many small updates that add up like an ensemble.",
        logy=True,
    ),
    ("dynamics", "updates.theta"): Reading(
        "rotation θ_ℓ = ∠(h_ℓ, h_ℓ₊₁) (rad)",
        "Liu et al. (C1): tokens are turned by small, similar angles through the middle "
        "layers; a deeper model turns them by less per block.",
    ),
    ("dynamics", "updates.theta_update"): Reading(
        "∠(Δ_ℓ, Δ_ℓ₊₁) (rad)",
        "Liu et al. (C1): neighbouring updates are nearly orthogonal (π/2 ≈ 1.57 rad), so they "
        "average out like the members of an ensemble rather than follow one smooth path.",
    ),
    ("bias", "depth.bias"): Reading(
        "bias (squared error)",
        "Kamigaito et al. (B2): the mean error of the members written before h_ℓ; with "
        "diversity, it decides the prefix ensemble's loss (loss = bias − diversity).",
    ),
    ("bias", "depth.diversity"): Reading(
        "diversity (squared error)",
        "Kamigaito et al. (B3): how much the members written before h_ℓ disagree; diversity "
        "matters most where the members are far from the truth.",
    ),
    ("prune", "blocks.kl_remove"): Reading(
        "KL(p_removed ‖ p_out) (nats)",
        "Men et al. (ShortGPT), Gromov et al. (E1): removing one block of the second half moves "
        "the output much less than removing one of the first half, and the first and the last "
        "block are the most critical. On a logarithmic axis, so that block 0 does not flatten "
        "the rest.",
        logy=True,
    ),
    ("prune", "blocks.block_influence"): Reading(
        "block influence 1 − cos(h_ℓ, h_ℓ₊₁)",
        "Men et al. (ShortGPT, E1): the cheap signal that should predict removability: low where "
        "a block barely turns the residual. Compare its shape with kl_remove's.",
        logy=True,
    ),
    ("reorder", "swaps.kl_swap"): Reading(
        "KL(p_swapped ‖ p_out) (nats)",
        "Lad et al. (E2): swapping two adjacent middle blocks costs little, less than removing "
        "one (kl_remove); the first and the last blocks do not tolerate it.",
        logy=True,
    ),
    ("sinks", "sinks.mass_first"): Reading(
        "mean attention on the first position(s)",
        "Xiao et al., Gu et al. (F1): in most heads of most layers after the first one or two, "
        "much of the attention goes to the first token; the curve rises after the first layers. "
        "Compare where along ℓ/L it rises in models of different depth.",
    ),
    ("sinks", "sinks.sink_share"): Reading(
        "share of sink heads (mean mass > ε)",
        "Gu et al. (F1): the share of a layer's heads whose mean attention on the first token "
        "exceeds ε = 0.3; Barbero et al. tie sinks to depth (they keep deep models from "
        "over-mixing), so deeper models should have more of them.",
    ),
    ("sinks", "sinks.kl"): Reading(
        "KL(p_removed ‖ p_out) (nats)",
        "The truth beside the sink mass (F1): what removing a layer's sink does to the output. "
        "A sink that only parks attention costs little to remove where the values it carries "
        "are small.",
        logy=True,
    ),
    ("massive", "massive.log10_ratio"): Reading(
        "log10(max |x| / median |x|)",
        "Sun et al. (F2): massive activations reach ~1000× the median (3 on this axis) abruptly "
        "at an early layer, stay nearly constant through the middle and vanish at the end.",
    ),
    ("massive", "massive.massive_share"): Reading(
        "massive entries per position",
        "Sun et al. (F2): massive entries sit at very few positions (the first token, "
        "delimiters) and dimensions; where they are present, this is their count per position.",
    ),
    ("similarity", "similarity_blocks.cka_next"): Reading(
        "linear CKA(h_ℓ, h_ℓ+1)",
        "Kornblith et al. (G1): consecutive residual states are nearly identical in the middle "
        "of a deep model (CKA near 1) and change most in the first blocks and the last.",
    ),
    ("similarity", "similarity_blocks.block_influence"): Reading(
        "1 − cos(h_ℓ, h_ℓ+1)",
        "Men et al. (ShortGPT, E1/G1): the blocks that rotate the state least are the ones "
        "removed first; they sit in the second half.",
    ),
    ("spectrum", "spectrum.dataset_entropy"): Reading(
        "dataset matrix entropy (nats)",
        "Skean et al. (G2): the entropy of the last tokens' Gram dips in the middle layers of "
        "autoregressive models, where the representations compress most.",
    ),
    ("spectrum", "spectrum.prompt_entropy"): Reading(
        "prompt matrix entropy (nats)",
        "Skean et al. (G2): within a prompt, the tokens' Gram entropy also dips mid-depth.",
    ),
    ("spectrum", "spectrum.twonn"): Reading(
        "TwoNN intrinsic dimension",
        "Valeriani et al. (G2): the intrinsic dimension rises to a peak in the first layers, "
        "then falls and stays low through the middle.",
    ),
    ("reorder", "swaps.kl_remove"): Reading(
        "KL(p_removed ‖ p_out) (nats)",
        "Lad et al. (E2): removing block ℓ, the reference for swapping it with block ℓ + 1.",
        logy=True,
    ),
}


def profile_reading(analyzer: str, table: str, column: str) -> Reading:
    """The reading of a profile; a plain description for one the papers do not discuss."""
    known = READINGS.get((analyzer, f"{table}.{column}"))
    if known is not None:
        return known
    return Reading(column, f"{analyzer}'s {column} (table {table}) of each model on ℓ/L.")


def profile_name(analyzer: str, table: str, column: str) -> str:
    """A file stem for a profile: ``lens-kl``, ``dynamics-updates-theta``."""
    parts = [analyzer, column] if table == analyzer else [analyzer, table, column]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", "-".join(parts))


# -- the study's numbers ------------------------------------------------------------------------
#: The numbers of the papers computed per model, and what each is (docs/science.md#study).
NUMBERS = {
    "contrib_half_ratio": "contrib: mean r_block of the second half of blocks 1..L−1 over the "
    "first half's (A1; block 0 left out, as contrib's summary)",
    "skip_fall_depth": "skip: relative depth (ℓ + ½)/L of the first block after the peak whose "
    "effect on later layers is below half the peak (A3; blocks 1..L−2)",
    "lens_kl_mid": "lens: KL(p_ℓ ‖ p_out) at relative depth ½, interpolated between states (A2)",
    "update_norm": "dynamics: mean ‖Δ_ℓ‖/‖h_ℓ‖ of the middle blocks (C1; its log–log slope "
    "against L over the models of at least 3 blocks in the update-scaling table)",
    "prunable_fraction": "prune: the prunable fraction n/L at KL ≤ 0.1 nats — the most blocks "
    "of one contiguous range whose removal keeps KL(p_removed ‖ p_out) ≤ 0.1 nats, over L "
    "(E1; ranges up to prune's max_n blocks)",
    "prunable_start": "prune: relative depth ℓ/L of the first block of that range (the range "
    "of least KL among those of its length)",
}
#: The KL (nats) of the numbers' prunable fraction, and the thresholds of its figure.
PRUNE_KL = 0.1
PRUNE_THRESHOLDS = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


def model_numbers(results: Mapping[str, Result], n_layers: int) -> dict[str, float]:
    """The numbers of :data:`NUMBERS` whose analyzer ran (NaN where the model is too shallow)."""
    numbers: dict[str, float] = {}
    if "contrib" in results and "contrib" in results["contrib"].tables:
        numbers["contrib_half_ratio"] = half_ratio(results["contrib"].table("contrib")["r_block"])
    if "skip" in results and "skip" in results["skip"].tables:
        later = results["skip"].table("skip")["later_mean"]
        numbers["skip_fall_depth"] = fall_depth(later, n_layers)
    if "lens" in results and "lens" in results["lens"].tables:
        table = results["lens"].table("lens")
        index = depth_index(table, n_layers)
        if index is not None:
            depths = [index.relative(int(v)) for v in table[index.column]]
            numbers["lens_kl_mid"] = float(np.interp(0.5, depths, table["kl"]))
    if "dynamics" in results:
        numbers["update_norm"] = float(
            results["dynamics"].meta.get("mean_middle_rel_update", math.nan)
        )
    if "prune" in results and "grid" in results["prune"].tables and n_layers:
        fraction, start, _ = prunable(results["prune"].table("grid"), n_layers, PRUNE_KL)
        numbers["prunable_fraction"], numbers["prunable_start"] = fraction, start
    return numbers


def prunable(grid: Table, n_layers: int, kl: float) -> tuple[float, float, float]:
    """``(fraction, start, stop)``: the prunable fraction ``n/L`` at ``kl`` nats — the longest
    contiguous range of blocks in ``prune``'s grid table whose removal keeps ``KL(p_removed ‖
    p_out) ≤ kl`` — and the relative depths ``ℓ/L``, ``(ℓ + n)/L`` where the cheapest such range
    starts and ends; ``(0, NaN, NaN)`` when removing any single block costs more."""
    best = (0, math.nan, math.nan)
    cells = zip(grid["start"], grid["n"], grid["kl"], strict=True)
    for start, n, value in sorted(cells, key=lambda c: (-int(c[1]), float(c[2]), int(c[0]))):
        if math.isfinite(float(value)) and float(value) <= kl:
            best = (int(n), int(start) / n_layers, (int(start) + int(n)) / n_layers)
            break
    return best[0] / n_layers, best[1], best[2]


def half_ratio(r_block: Sequence[Any] | np.ndarray) -> float:
    """Second half over first half of blocks ``1..L−1`` (NaN below 3 blocks)."""
    rest = np.asarray(r_block, float)[1:]
    if len(rest) < 2:
        return math.nan
    half = len(rest) // 2
    first, second = rest[:half].mean(), rest[half:].mean()
    return float(second / first) if first else math.nan


def fall_depth(later: Sequence[Any] | np.ndarray, n_layers: int) -> float:
    """Relative depth of the first block after the peak (over blocks ``1..L−2``) whose effect
    is below half the peak; NaN when the effect never halves or there are too few blocks."""
    values = np.asarray(later, float)[1 : n_layers - 1]
    if len(values) < 2 or not np.isfinite(values).any():
        return math.nan
    peak = int(np.nanargmax(values))
    for i in range(peak + 1, len(values)):
        if values[i] < values[peak] / 2:
            return (i + 1 + 0.5) / n_layers
    return math.nan


def loglog_slope(x: Sequence[Any], y: Sequence[Any]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``log y`` on ``log x`` (NaN without two
    distinct positive ``x`` with positive ``y``)."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a > 0 and b > 0 and math.isfinite(b)]
    if len({a for a, _ in pairs}) < 2:
        return math.nan, math.nan
    slope, intercept = np.polyfit(np.log([a for a, _ in pairs]), np.log([b for _, b in pairs]), 1)
    return float(slope), float(intercept)


# -- the summary result -------------------------------------------------------------------------
def summarize(
    models: Sequence[Mapping[str, Any]],
    runs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Result]]],
    profiles: Callable[[str, Result, int], list[tuple[str, str]]],
) -> Result:
    """The study's summary.

    Args:
        models: One row per model of the study (``model``, ``run``, ``status``, ``reason``,
            ``seconds``, size facts), in the study's order.
        runs: ``(model, size facts, results)`` of each finished run, in the study's order.
        profiles: ``(analyzer, result, n_layers) -> [(table, column)]``, its depth profiles.
    """
    tables: dict[str, Table] = {"models": _models_table(models)}
    colours = _Colours.of(runs)
    plots: list[Plot] = []
    labels = {m.get("model"): _label(str(m.get("model")), str(m.get("run"))) for m in models}
    numbers = _numbers(runs)
    curves = _curves(runs, profiles, labels)
    ran = [k for k in NUMBERS if any(math.isfinite(v) for v in numbers[k])]
    tables["numbers"] = Table(
        "numbers",
        {k: v for k, v in numbers.items() if k in ("model", "params", "n_layers", "d_model", *ran)},
        "The papers' numbers for each model, against its size",
    )
    # Below 3 blocks the "middle" blocks include the first or the last (dynamics' middle_blocks),
    # whose updates are unlike the rest: the slope is fitted over the models of 3 blocks or more.
    deep = [i for i, n in enumerate(numbers["n_layers"]) if n >= 3]
    slope, intercept = loglog_slope(
        [numbers["n_layers"][i] for i in deep], [numbers["update_norm"][i] for i in deep]
    )
    if math.isfinite(slope):
        tables["update_scaling"] = _update_scaling(numbers, slope, intercept)
        plots.append(_update_scaling_plot(slope))
    for (analyzer, table_name, column), curve in curves.items():
        name = profile_name(analyzer, table_name, column)
        tables[name] = Table(name, curve, f"{analyzer} {table_name}.{column} of every model")
        plots.append(_profile_plot(name, analyzer, table_name, column, colours))
    fractions = _prunable_fractions(runs, labels)
    if fractions is not None:
        tables["prune_fraction"] = fractions
        plots.append(_prune_plot(colours))
    summary = _summary_line(models, numbers, ran, slope)
    meta = {"update_slope": slope, "profiles": [list(k) for k in curves], "numbers": NUMBERS}
    return Result("study", summary + ".", tables=tables, plots=tuple(plots), meta=meta)


@dataclass(frozen=True)
class _Colours:
    """How the summary's lines are coloured: by parameter count when every run knows it (a
    colour bar), else by depth L (``column``, its ``label``, the captions' last sentence)."""

    column: str
    label: str
    note: str

    @classmethod
    def of(cls, runs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Result]]]) -> _Colours:
        """The colouring of these runs."""
        sizes = [(facts.get("params"), facts.get("n_layers")) for _, facts, _ in runs]
        if bool(runs) and all(p is not None for p, _ in sizes):
            return cls("params", "parameters", f" {_SIZES}")
        return cls("n_layers", "blocks L", " Lines are coloured by depth L.")


def _models_table(models: Sequence[Mapping[str, Any]]) -> Table:
    """Each model of the study: its status, size facts and time."""
    return Table(
        "models",
        {
            key: [m.get(key) if m.get(key) is not None else _missing(key) for m in models]
            for key in (
                "model",
                "run",
                "status",
                "params",
                "n_layers",
                "d_model",
                "d_vocab",
                "seconds",
                "reason",
            )
        },
        "Each model of the study: its status, size facts and time",
    )


def _numbers(
    runs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Result]]],
) -> dict[str, list[Any]]:
    """The papers' numbers (:data:`NUMBERS`) of every finished run and its size facts, a column
    each (NaN where a run has none)."""
    numbers: dict[str, list[Any]] = {
        k: [] for k in ("model", "params", "n_layers", "d_model", *NUMBERS)
    }
    for model, facts, results in runs:
        n_layers = int(facts.get("n_layers") or 0)
        values = model_numbers(results, n_layers) if n_layers else {}
        numbers["model"].append(model)
        for key in ("params", "n_layers", "d_model"):
            numbers[key].append(facts.get(key) if facts.get(key) is not None else math.nan)
        for key in NUMBERS:
            numbers[key].append(values.get(key, math.nan))
    return numbers


def _curves(
    runs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Result]]],
    profiles: Callable[[str, Result, int], list[tuple[str, str]]],
    labels: Mapping[Any, str],
) -> dict[tuple[str, str, str], dict[str, list[Any]]]:
    """Every depth profile ``(analyzer, table, column)`` of every run, at relative depth: one
    row per model and layer (a table without a depth index left out)."""
    curves: dict[tuple[str, str, str], dict[str, list[Any]]] = {}
    for model, facts, results in runs:
        n_layers = int(facts.get("n_layers") or 0)
        for analyzer, result in results.items():
            for table_name, column in profiles(analyzer, result, n_layers) if n_layers else []:
                table = result.table(table_name)
                index = depth_index(table, n_layers)
                if index is None:
                    continue
                curve = curves.setdefault(
                    (analyzer, table_name, column),
                    {k: [] for k in ("model", "label", "params", "n_layers", "layer", "rel_depth")}
                    | {"value": []},
                )
                for layer, value in zip(table[index.column], table[column], strict=True):
                    curve["model"].append(model)
                    curve["label"].append(labels.get(model, model))
                    curve["params"].append(_number(facts.get("params")))
                    curve["n_layers"].append(n_layers)
                    curve["layer"].append(int(layer))
                    curve["rel_depth"].append(index.relative(int(layer)))
                    curve["value"].append(float(value))
    return curves


def _update_scaling_plot(slope: float) -> Plot:
    """The mean middle update against depth, log–log, with its fitted slope."""
    return Plot(
        "line",
        "update_scaling",
        f"Mean middle update against depth: slope {slope:.2f}",
        "update_scaling",
        x="n_layers",
        y=("update_norm",),
        group="series",
        points=("measured",),
        logx=True,
        logy=True,
        xlabel="blocks L",
        ylabel="mean middle ‖Δ_ℓ‖ / ‖h_ℓ‖",
        caption="Liu et al. (C1): the mean update of the middle blocks shrinks about as "
        f"1/L (slope −1) across a family; here the log–log slope is {slope:.2f}, fitted "
        "over the models of at least 3 blocks (with fewer, the middle blocks include the "
        "first or the last).",
    )


def _profile_plot(
    name: str, analyzer: str, table_name: str, column: str, colours: _Colours
) -> Plot:
    """One depth profile of every model at relative depth, read as :data:`READINGS` says."""
    reading = profile_reading(analyzer, table_name, column)
    return Plot(
        "line",
        name,
        f"{analyzer}: {column}",
        name,
        x="rel_depth",
        y=("value",),
        group="label",
        color=colours.column,
        clabel=colours.label,
        logy=reading.logy,
        xlabel="relative depth ℓ/L",
        ylabel=reading.ylabel,
        caption=f"{reading.caption} {_AT}" + colours.note,
    )


def _prune_plot(colours: _Colours) -> Plot:
    """The prunable fraction of the depth against the KL threshold, a line per model."""
    return Plot(
        "line",
        "prune_fraction",
        "Prunable fraction of the depth",
        "prune_fraction",
        x="kl",
        y=("fraction",),
        group="label",
        color=colours.column,
        clabel=colours.label,
        logx=True,
        xlabel="KL threshold (nats)",
        ylabel="prunable fraction n/L",
        caption="The most blocks of one contiguous range whose removal keeps "
        "KL(p_removed ‖ p_out) at or below the threshold, as a fraction of the depth "
        "(ranges up to prune's max_n blocks; summary/prune_fraction.csv gives where each "
        "range lies, start_depth..stop_depth in ℓ/L). Gromov et al. and Men et al. (E1) remove "
        "a large fraction of the deeper blocks of LLMs before the output collapses; "
        "models that use their depth alike have the same curve." + colours.note,
    )


def _summary_line(
    models: Sequence[Mapping[str, Any]],
    numbers: Mapping[str, list[Any]],
    ran: Sequence[str],
    slope: float,
) -> str:
    """The summary's line (without its full stop): the models, then each number's span over
    the models where it was measured."""
    done = sum(1 for m in models if m.get("status") == "complete")
    summary = f"{len(models)} models, {done} complete."
    if "contrib_half_ratio" in ran:
        summary += " contrib second/first-half ratio " + _span(numbers["contrib_half_ratio"])
    if "lens_kl_mid" in ran:
        summary += "; lens KL at half depth " + _span(numbers["lens_kl_mid"]) + " nats"
    if "skip_fall_depth" in ran:
        summary += "; skip effect halves at ℓ/L " + _span(numbers["skip_fall_depth"])
    if math.isfinite(slope):
        summary += f"; mean middle update ∝ L^{slope:.2f}"
    if "prunable_fraction" in ran:
        summary += f"; prunable fraction at KL ≤ {PRUNE_KL:g} nats " + _span(
            numbers["prunable_fraction"]
        )
    return summary


def _prunable_fractions(
    runs: Sequence[tuple[str, Mapping[str, Any], Mapping[str, Result]]], labels: Mapping[Any, str]
) -> Table | None:
    """The prunable fraction of every model that ran ``prune``, at each of
    :data:`PRUNE_THRESHOLDS` (``None`` when none did)."""
    keys = ("model", "label", "params", "n_layers", "kl", "fraction", "start_depth", "stop_depth")
    columns: dict[str, list[Any]] = {k: [] for k in keys}
    for model, facts, results in runs:
        n_layers = int(facts.get("n_layers") or 0)
        if "prune" not in results or "grid" not in results["prune"].tables or not n_layers:
            continue
        grid = results["prune"].table("grid")
        for kl in PRUNE_THRESHOLDS:
            fraction, start, stop = prunable(grid, n_layers, kl)
            row = (model, labels.get(model, model), _number(facts.get("params")), n_layers, kl)
            for key, value in zip(keys, (*row, fraction, start, stop), strict=True):
                columns[key].append(value)
    if not columns["model"]:
        return None
    return Table("prune_fraction", columns, "Prunable fraction of each model per KL threshold")


def _update_scaling(numbers: Mapping[str, list[Any]], slope: float, intercept: float) -> Table:
    rows = [
        (m, L, u)
        for m, L, u in zip(
            numbers["model"], numbers["n_layers"], numbers["update_norm"], strict=True
        )
        if math.isfinite(u) and L > 0
    ]
    depths = sorted({L for _, L, _ in rows if L >= 3})
    fit = [(f"L^{slope:.2f} fit", L, math.exp(intercept) * L**slope) for L in depths]
    columns = {
        "series": ["measured"] * len(rows) + [s for s, _, _ in fit],
        "model": [m for m, _, _ in rows] + [""] * len(fit),
        "n_layers": [L for _, L, _ in rows] + [L for _, L, _ in fit],
        "update_norm": [u for _, _, u in rows] + [v for _, _, v in fit],
    }
    return Table("update_scaling", columns, "Mean middle update against depth, and its fit")


def _span(values: Sequence[Any]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "–"
    low, high = min(finite), max(finite)
    return f"{low:.2f}" if math.isclose(low, high, rel_tol=5e-3) else f"{low:.2f}–{high:.2f}"


def _label(model: str, run: str) -> str:
    """How a model is named in a legend: its spec, or its folder's name for a local path."""
    local = model.startswith(("/", ".", "~")) or os.path.exists(model)
    return run if local and run else model


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else math.nan


def _missing(key: str) -> Any:
    return "" if key in ("model", "run", "status", "reason") else math.nan
