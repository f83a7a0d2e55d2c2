"""Regenerate ``docs/findings.md``: the three papers' headline findings beside what lensdiv measures.

    make findings                       # = python docs/findings.py (trains or loads what it needs)
    python docs/findings.py --tiny --out /tmp/f   # the mechanics at tiny sizes (what the test runs)

Every number in the document is measured by this script through lensdiv's public API (toy models
are trained on first use and cached like any other use) — except the teacher–student test losses,
which it reads from the run of the ``cpu`` preset recorded by ``bench/teacher_student_cpu.py``
(about 15 minutes of training; ``--rerun-teacher-student`` trains it here) and fits α_ℓ to —
every figure is drawn by it, and every verdict follows from a rule stated beside it (``RULES``). The papers' own results, in the column
"paper", are quoted from the papers (or from their authors' code where it names the figure) and
are the only text here that is not measured. ``findings.json`` beside the document holds the
measured values, settings and seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import findings_geometry as G  # noqa: E402  (the geometry rows' rules, shared with the real models)

REPRODUCED, PARTLY, NOT = "reproduced", "partly", "not reproduced"
# A row that compares lensdiv's readings rather than testing a claim of a paper.
COMPARED = "compared"


# -- settings -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """How much every measurement reads; ``FULL`` makes the document, ``TINY`` tests the script.

    Args:
        shallow: The shallow toy of the depth-efficiency rows.
        deep: The deep toy.
        multihop: The toy the depth score is measured on.
        family: The depth family of the loss fit and the update scaling (``zoo:depth`` or a list).
        dynamics_depths: Depths whose middle-block updates are compared.
        tokens: Tokens of the one-pass analyses.
        skip_tokens: Tokens of the layer-skipping sweep.
        linmap_tokens: Tokens of the cross-model maps.
        family_tokens: Tokens each family member is evaluated on.
        per_grade: Multi-hop queries per hop count.
        bootstrap: Bootstrap resamples of the loss fits.
        teacher_student: Overrides of the teacher–student ``preset``.
        preset: Teacher–student preset.
        teacher_student_record: JSON file (from the repository root) of the recorded trials of
            ``bench/teacher_student_cpu.py``: the row reads the run of ``preset`` from it instead
            of training for 15 minutes; ``None`` runs the preset.
        lens_model: The toy the fitted lenses are fitted on.
        lens_tokens: Tokens the affine and Jacobian (a quarter) fits read, and held-out tokens
            of every evaluation.
        lens_preset: The tuned lens' preset.
        lens_tuned: Overrides of the tuned lens' recipe.
        study_depth: The depth family of the cross-model rows (a ``lensdiv study``).
        study_width: The width family they are set against.
        study_plugins: The analyzers of those studies.
        study_tokens: Tokens each model of those studies reads.
        surgery_models: The toys ``prune`` and ``reorder`` run on (the swap and shuffle rows
            on those of at least 4 blocks).
        surgery_tokens: Tokens each of those runs reads.
        outlier_models: The toys ``sinks`` and ``massive`` run on.
        outlier_tokens: Tokens each of those runs reads.
        geometry_models: The toys ``similarity`` and ``spectrum`` run on.
        geometry_tokens: Tokens each of those runs reads.
    """

    shallow: str = "toy:d4"
    deep: str = "toy:d8"
    multihop: str = "toy:kb"
    family: str = "zoo:depth"
    dynamics_depths: tuple[int, ...] = (4, 6, 8)
    tokens: int = 8192
    skip_tokens: int = 4096
    linmap_tokens: int = 16384
    family_tokens: int = 16384
    per_grade: int = 100
    bootstrap: int = 200
    preset: str = "cpu"
    teacher_student: dict[str, Any] = field(default_factory=dict)
    teacher_student_record: str | None = "bench/teacher_student_cpu.json"
    lens_model: str = "toy"
    lens_tokens: int = 16384
    lens_preset: str = "cpu"
    lens_tuned: dict[str, Any] = field(default_factory=dict)
    study_depth: str = "zoo:depth"
    study_width: str = "zoo:width"
    study_plugins: str = "lens,contrib,skip,dynamics"
    study_tokens: int = 8192
    surgery_models: tuple[str, ...] = ("toy:d2", "toy:d4", "toy:d8")
    surgery_tokens: int = 4096
    outlier_models: tuple[str, ...] = ("toy:d2", "toy:d4")
    outlier_tokens: int = 4096
    geometry_models: tuple[str, ...] = ("toy:d4", "toy:d8")
    geometry_tokens: int = 4096


FULL = Sizes()
TINY = Sizes(
    shallow="toy:d2",
    deep="toy:d4",
    family="toy:d1,toy:d2,toy:d3,toy:d4",
    dynamics_depths=(2, 4),
    tokens=512,
    skip_tokens=256,
    linmap_tokens=1024,
    family_tokens=512,
    per_grade=4,
    bootstrap=10,
    preset="fast",
    teacher_student={
        "steps": 20,
        "batch_size": 32,
        "depths": (1, 2, 4),
        "teacher_depth": 8,
        "test_size": 128,
    },
    teacher_student_record=None,
    lens_tokens=1024,
    lens_preset="toy",
    lens_tuned={"steps": 10, "tokens_per_step": 512},
    study_depth="toy:d1,toy:d2,toy:d3,toy:d4",
    study_width="toy:d4-w32,toy:d4",
    study_tokens=256,
    outlier_models=("toy:d2",),
    outlier_tokens=256,
    geometry_models=("toy:d2",),
    geometry_tokens=256,
    surgery_models=("toy:d2", "toy:d4"),
    surgery_tokens=256,
)

#: The rule behind every verdict, as the document states it.
RULES = {
    "contribution": "reproduced if the second-half blocks write less than half as much as the "
    "first-half blocks even with block 0 left out; partly if the second half writes less but "
    "not by half once block 0 is left out; not reproduced otherwise",
    "skip": "the same rule on the effect of skipping a block on later layers (mean over "
    "sequences; the last block, which has no later layers, left out)",
    "depth_score": "over the hop counts the model answers (accuracy significantly above the "
    "prior baseline, one-sided binomial p < 0.05): reproduced if the 95 % interval of the "
    "slope of the per-example depth score against hops contains 0 or lies below it; not "
    "reproduced if it lies above 0; not testable with fewer than two answered hop counts",
    "linmap": "reproduced if the rank correlation of relative depths (diagonality) is at least "
    "0.9 and no best target is more than a quarter of the depth from the same relative depth; "
    "partly if the diagonality is at least 0.5; not reproduced otherwise",
    "bias": "reproduced if the prefix ensembles' cross-entropy falls as members are added and "
    "their diversity is largest where their bias is (rank correlation of bias and diversity "
    "over prefixes > 0.5); partly if one of the two holds",
    "submod": "reproduced if the gains of whole blocks diminish at three quarters of the steps "
    "or more and F(k) ≈ a + b log k fits with R² ≥ 0.9; partly if gains diminish at half of "
    "the steps or more; not reproduced otherwise",
    "dynamics": "three checks: middle-block rotations uniform (coefficient of variation ≤ "
    "0.25), neighbouring updates within 80–100° of each other, the log–log slope of the middle "
    "update against depth within −1 ± 0.25; reproduced if all three hold, partly if one or "
    "two, not reproduced if none",
    "chinchilla": "reproduced if the bootstrap 95 % intervals contain α_m = 1, α_ℓ = 1 and "
    "α_D = 0.3; partly if they contain α_ℓ = 1 only",
    "tuned_lens": "reproduced if the tuned lens' KL to the output is below the logit lens' at "
    "every residual state but the last (held-out tokens) and the reduction in nats is largest "
    "in the first half of the states; partly if it is below at every state but not most in the "
    "first half; not reproduced otherwise",
    "jacobian_lens": "a comparison, not a claim of the paper (verdict: compared): the Jacobian "
    "lens' KL to the output against the logit lens' and the tuned lens' (held-out tokens), and "
    "which reads closer to the output",
    "patchscope_lens": "a comparison (verdict: compared): the token-identity Patchscope's KL "
    "to the output by residual state (held-out tokens) against the logit lens' on the same "
    "tokens and the tuned and Jacobian lenses' (their rows' held-out tokens); the paper's claim "
    "(it estimates the next token better than the logit and tuned lenses from the middle "
    "layers on) is stated as it holds or fails on the toy",
    "lens_bias": "reproduced if the ensemble of the residual states read through the tuned "
    "lens has a lower cross-entropy than read through the logit lens, with lower bias; partly "
    "if only one of the two holds",
    "teacher_student": "reproduced if α_ℓ of the independent teacher has a 95 % interval "
    "containing 1 or lies in 0.8–1.2, and the tied teacher's α_ℓ is larger with a "
    "non-overlapping interval; partly if one of the two holds",
    "study_alignment": "for each depth profile, the mean absolute difference between the "
    "curves of every two models of the depth family, in units of the profile's spread (its "
    "standard deviation over the family), compared three ways: at the same relative depth, at "
    "the same layer counted from the input, and counted from the output; reproduced if the "
    "curves lie closest at the same relative depth for at least three quarters of the profiles, "
    "partly if for at least half, not reproduced otherwise",
    "study_updates": "the log–log slope of the mean middle-block update ‖Δ_ℓ‖/‖h_ℓ‖ against "
    "depth over the family's models of at least 3 blocks (with fewer, the middle blocks include "
    "the first or the last): reproduced if within −1 ± 0.25, partly if negative, not "
    "reproduced otherwise",
    "prune_depth": "the halves rule of `contribution` on the KL to the full output of removing "
    "each single block, per model: reproduced if it holds on every model, not reproduced if "
    "on none, partly otherwise",
    "prune_ends": "two checks per model — removing block 0 costs the most KL of any block; "
    "removing the last block costs more than removing any block between them: reproduced if "
    "all hold, partly if some do, not reproduced if none",
    "reorder_swap": "over every adjacent pair ℓ, ℓ+1 inside the middle half [L/4, L − L/4) of "
    "every model of at least 4 blocks: swapping them costs less KL than removing block ℓ — "
    "reproduced if for all, partly if for some, not reproduced if for none",
    "sinks_form": "per model, over its layers after the first: reproduced if at least half "
    "of their heads are sink heads (mean attention on position 0 above 0.3, Gu et al.'s ε) and "
    "layer 0 has a smaller share; partly if some head of the later layers is a sink head but "
    "fewer than half are; not reproduced if none is; "
    "over the models: reproduced on all, not reproduced on none, partly otherwise",
    "massive_bias": "per model: reproduced if massive activations exist (|x| > 100 and > 1000× "
    "the median |x| of their residual state) and, set to zero where they appear, they raise "
    "the cross-entropy at least ten times as much as set to their mean; partly if they exist "
    "but the ratio is smaller; not reproduced if there are none; over the models as for "
    "`sinks_form`",
    "reorder_shuffle": "per model of at least 4 blocks, the mean KL of 3 random shuffles of "
    "the middle half against 3 of as many blocks from block 0: reproduced if the middle costs "
    "less on every model, partly on some, not reproduced on none",
}
RULES.update(G.RULES)  # the geometry rows (docs/findings_geometry.py)


@dataclass
class Finding:
    """One row of the document."""

    key: str
    title: str
    paper: str
    toy: str
    scaling: str
    command: str
    verdict: str
    why: str
    figure: str
    values: dict[str, Any] = field(default_factory=dict)


# -- verdict rules (pure: the test checks them on made-up numbers) ------------------------------
def halves_verdict(
    values: Sequence[float], skip_last: bool = False
) -> tuple[str, dict[str, float]]:
    """Second half against first half of a per-block quantity, with and without block 0."""
    v = np.asarray(values, float)
    if skip_last:
        v = v[:-1]
    half = len(v) // 2 if not skip_last else (len(v) + 1) // 2
    first, second = v[:half], v[half:]
    ratio = float(second.mean() / first.mean())
    ratio_ex0 = float(second.mean() / first[1:].mean()) if len(first) > 1 else ratio
    if ratio_ex0 < 0.5:
        verdict = REPRODUCED
    elif ratio < 1 or ratio_ex0 < 1:
        verdict = PARTLY
    else:
        verdict = NOT
    return verdict, {"ratio": ratio, "ratio_without_block0": ratio_ex0}


def slope_with_interval(
    x: Sequence[float], y: Sequence[float], se: Sequence[float]
) -> tuple[float, float, float]:
    """Weighted least-squares slope of ``y`` on ``x`` (weights 1/se²) and its 95 % interval."""
    x, y, w = np.asarray(x, float), np.asarray(y, float), 1 / np.asarray(se, float) ** 2
    xm = (w * x).sum() / w.sum()
    sxx = (w * (x - xm) ** 2).sum()
    slope = float((w * (x - xm) * (y - (w * y).sum() / w.sum())).sum() / sxx)
    half = 1.96 * math.sqrt(1 / sxx)
    return slope, slope - half, slope + half


def depth_score_verdict(answered: int, low: float, high: float) -> str:
    """The depth-score rule (see ``RULES``)."""
    if answered < 2:
        return f"{NOT} (not testable)"
    return NOT if low > 0 else REPRODUCED


def linmap_verdict(diagonality: float, max_offset: float) -> str:
    """The linear-map rule (see ``RULES``)."""
    if diagonality >= 0.9 and max_offset <= 0.25:
        return REPRODUCED
    return PARTLY if diagonality >= 0.5 else NOT


def submod_verdict(diminishing: float, r2: float) -> str:
    """The submodularity rule (see ``RULES``)."""
    if diminishing >= 0.75 and r2 >= 0.9:
        return REPRODUCED
    return PARTLY if diminishing >= 0.5 else NOT


def count_verdict(held: int, total: int) -> str:
    """All checks hold, some do, or none."""
    return REPRODUCED if held == total else PARTLY if held else NOT


def teacher_student_verdict(
    independent: tuple[float, float, float], tied: tuple[float, float, float]
) -> str:
    """The teacher–student rule; each fit is ``(alpha, ci_low, ci_high)``."""
    alpha, low, high = independent
    near_one = low <= 1 <= high or 0.8 <= alpha <= 1.2
    steeper = tied[0] > alpha and tied[1] > high
    return count_verdict(int(near_one) + int(steeper), 2)


# -- figures ------------------------------------------------------------------------------------
def _figure(ncols: int = 1, width: float = 5.0) -> tuple[Any, list[Any]]:
    """A figure on a private Agg canvas (no pyplot) with ``ncols`` axes side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    (out / "findings").mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "findings" / name)
    return f"findings/{name}"


# -- measurements -------------------------------------------------------------------------------
def _analyze(model: str, plugins: str, tokens: int, **options: Any) -> Any:
    import lensdiv

    return lensdiv.analyze(
        model, plugins=plugins, max_tokens=tokens, options=options or None, progress=False
    )


def contribution(sizes: Sizes, out: Path) -> Finding:
    """A1 (and A2): how much each block writes, and the logit lens, along relative depth."""
    runs = {m: _analyze(m, "contrib,lens", sizes.tokens) for m in (sizes.shallow, sizes.deep)}
    fig, (ax1, ax2) = _figure(2)
    for name, run in runs.items():
        contrib, lens = run["contrib"].table(), run["lens"].table()
        n = len(contrib)
        ax1.plot((np.asarray(contrib["layer"]) + 0.5) / n, contrib["r_block"], "o-", label=name)
        ax2.plot(np.asarray(lens["layer"]) / n, lens["kl"], "o-", label=name)
    ax1.set(yscale="log", xlabel="relative depth of the block", ylabel="‖a+m‖ / ‖h‖")
    ax1.set_title("contribution of each block")
    ax2.set(xlabel="relative depth of h_l", ylabel="KL(p_l ‖ p_out), nats", title="logit lens")
    for ax in (ax1, ax2):
        ax.axvline(0.5, color="grey", lw=0.8, ls=":")
        ax.legend()
    figure = _save(fig, out, "a1_contribution.png")
    r_block = list(runs[sizes.deep]["contrib"].table()["r_block"])
    verdict, ratios = halves_verdict(r_block)
    kl = list(runs[sizes.deep]["lens"].table()["kl"])
    return Finding(
        key="contribution",
        title="Second-half layers contribute much less than first-half ones",
        paper="Llama 3.1 / Qwen 3 / OLMo 2: the sublayers of the second half write much less into "
        "the residual (relative to it) than those of the first half, with a clear phase "
        "transition between the halves; later layers mostly refine the output distribution "
        "(Csordás et al., finding 1)",
        toy=f"{sizes.deep}: ‖a+m‖/‖h‖ = "
        + ", ".join(f"{v:.2f}" for v in r_block)
        + f" for blocks 0–{len(r_block) - 1}; second half / first half = {ratios['ratio']:.2f}, "
        f"{ratios['ratio_without_block0']:.2f} without block 0. Logit-lens KL "
        f"{kl[0]:.2f} → {kl[len(kl) // 2]:.2f} → 0 nats (embedding → middle → output)",
        scaling="—",
        command=f"lensdiv analyze {sizes.deep} --plugins contrib,lens --max-tokens {sizes.tokens}",
        verdict=verdict,
        why="block 0 turns byte embeddings into features and writes several times the residual; "
        "after it the toys' blocks write similar fractions, falling gradually, with no "
        "transition at half depth"
        if verdict != REPRODUCED
        else "the second half writes less than half as much as the first",
        figure=figure,
        values={"r_block": r_block, "lens_kl": kl, **ratios},
    )


def skip(sizes: Sizes, out: Path) -> Finding:
    """A3: future effect of skipping each block on the updates of later layers."""
    result = _analyze(sizes.deep, "skip", sizes.skip_tokens)["skip"]
    table = result.table()
    later = list(table["later_mean"])
    output = list(table["output_mean"])
    fig, (ax1, ax2) = _figure(2)
    ax1.bar(table["skipped"], table["later_max"], label="max over sequences")
    ax1.bar(table["skipped"], later, width=0.5, label="mean over sequences")
    ax1.set(xlabel="skipped block s", ylabel="mean over l > s of E[s, l]")
    ax1.set_title(f"{sizes.deep}: effect on later layers")
    ax1.legend()
    ax2.bar(table["skipped"], output)
    ax2.set(xlabel="skipped block s", ylabel="‖p − p̃‖₂ (mean)", title="effect on the output")
    figure = _save(fig, out, "a3_skip.png")
    verdict, ratios = halves_verdict(later, skip_last=True)
    return Finding(
        key="skip",
        title="Skipping a second-half layer barely changes later computation",
        paper="Skipping a layer of the second half has a much smaller effect on the "
        "computations of later layers and on the output than skipping one of the first half "
        "(Csordás et al., finding 2)",
        toy=f"{sizes.deep}: effect on later layers (mean over sequences) "
        + ", ".join(f"{v:.2f}" for v in later[:-1])
        + f" for skipping blocks 0–{len(later) - 2}; second half / first half = "
        f"{ratios['ratio']:.2f}, {ratios['ratio_without_block0']:.2f} without block 0",
        scaling="—",
        command=f"lensdiv analyze {sizes.deep} --plugins skip --max-tokens {sizes.skip_tokens}",
        verdict=verdict,
        why="the later a block, the less the layers after it depend on it, but the fall is "
        "gradual after block 0, not a drop at half depth"
        if verdict != REPRODUCED
        else "second-half blocks matter less than half as much to later layers",
        figure=figure,
        values={"later_mean": later, "output_mean": output, **ratios},
    )


def depth_score(sizes: Sizes, out: Path) -> Finding:
    """A5: the multi-hop depth score by hop count, on the toy that answers the queries."""
    result = _analyze(
        sizes.multihop,
        "depth-score",
        sizes.tokens,
        **{"depth-score": {"per_grade": sizes.per_grade}},
    )["depth-score"]
    t = result.table()
    hops = [int(str(g).split("-")[0]) for g in t["grade"]]
    answered = [i for i, p in enumerate(t["p_above_baseline"]) if p < 0.05]
    fig, (ax1, ax2) = _figure(2)
    ax1.errorbar(hops, t["mean_layer"], yerr=t["se_layer"], fmt="o-", capsize=3, label="all")
    ax1.plot(hops, t["score_layer_correct"], "s--", label="correctly answered")
    ax1.set(xlabel="hops", ylabel="depth score (block)", xticks=hops)
    ax1.set_title(f"{result.meta['scored_model']}: depth score")
    ax1.legend()
    ax2.plot(hops, t["accuracy"], "o-", label="accuracy")
    ax2.plot(hops, t["baseline"], "k:", label="prior baseline")
    ax2.set(xlabel="hops", ylabel="accuracy", ylim=(0, 1.05), xticks=hops, title="accuracy")
    ax2.legend()
    figure = _save(fig, out, "a5_depth_score.png")
    values: dict[str, Any] = {
        "model": result.meta["scored_model"],
        "n_layers": result.meta["n_layers"],
        "hops": hops,
        "accuracy": list(t["accuracy"]),
        "baseline": list(t["baseline"]),
        "p_above_baseline": list(t["p_above_baseline"]),
        "examples": list(t["examples"]),
        "score_layer": list(t["score_layer"]),
        "mean_layer": list(t["mean_layer"]),
        "se_layer": list(t["se_layer"]),
        "score_layer_correct": list(t["score_layer_correct"]),
        "score_output": list(t["score_output"]),
        "answered_hops": [hops[i] for i in answered],
    }
    if len(answered) >= 2:
        slope, low, high = slope_with_interval(
            [hops[i] for i in answered],
            [t["mean_layer"][i] for i in answered],
            [t["se_layer"][i] for i in answered],
        )
        values.update(slope=slope, slope_low=low, slope_high=high)
        trend = f"slope {slope:+.2f} blocks per hop (95 % interval {low:+.2f} to {high:+.2f})"
    else:
        low = high = math.nan
        trend = "fewer than two hop counts are answered above their prior baseline: no slope"
    verdict = depth_score_verdict(len(answered), low, high)
    scores = ", ".join(
        f"{h}-hop {m:.2f} ± {s:.2f} (accuracy {a:.0%}, baseline {b:.0%})"
        for h, m, s, a, b in zip(
            hops, t["mean_layer"], t["se_layer"], t["accuracy"], t["baseline"], strict=True
        )
    )
    if verdict == REPRODUCED:
        why = (
            "on the hop counts the toy answers, the layers that matter do not move deeper; but "
            "the toy recalls chains it was trained on (held-out chains stay at their prior "
            "baseline, bench/README.md), so this agrees with the paper without testing "
            "composition of new chains"
        )
    elif verdict == NOT:
        why = (
            "the toy composes facts in sequence across its blocks, so more hops use deeper "
            "blocks: the opposite of the paper's finding"
        )
    else:
        why = "the toy does not answer enough hop counts above the prior baseline"
    return Finding(
        key="depth_score",
        title="Harder (more-hop) problems do not use deeper computation",
        paper="On multi-hop tasks, no evidence that models use more depth to compose "
        "sub-results for examples with more hops (Csordás et al., finding 3)",
        toy=f"{values['model']} ({values['n_layers']} blocks), in-distribution queries (chains "
        f"of the training split, {sizes.per_grade} per hop count); layer-effect depth score "
        f"(mean ± s.e. over examples): {scores}; "
        + (f"{trend} over the answered hop counts {values['answered_hops']}" if answered else trend)
        + "; output-effect depth score "
        + " → ".join(f"{v:.2f}" for v in t["score_output"]),
        scaling="—",
        command=f"lensdiv analyze {sizes.multihop} --plugins depth-score "
        f"-O depth-score.per_grade={sizes.per_grade}",
        verdict=verdict,
        why=why,
        figure=figure,
        values=values,
    )


def linmap(sizes: Sizes, out: Path) -> Finding:
    """A6: affine maps from every layer of the shallow toy onto every layer of the deep one."""
    result = _analyze(sizes.shallow, "linmap", sizes.linmap_tokens, linmap={"target": sizes.deep})[
        "linmap"
    ]
    best = result.table()
    r2 = np.asarray(result.arrays["r2"])
    diagonality = float(result.meta["diagonality"])
    offsets = np.abs(np.asarray(best["best_rel_depth"]) - np.asarray(best["rel_depth"]))
    fig, (ax1, ax2) = _figure(2)
    image = ax1.imshow(r2, origin="lower", aspect="auto", vmin=max(0.0, float(np.nanmin(r2))))
    fig.colorbar(image, ax=ax1, label="R²")
    ax1.plot(best["best_target"], best["source_layer"], "rx", ms=9, label="best target")
    ax1.set(xlabel=f"{sizes.deep} state j", ylabel=f"{sizes.shallow} state s", title="R²")
    ax1.legend(loc="lower right")
    ax2.plot(best["rel_depth"], best["best_rel_depth"], "o-", label="best target")
    ax2.plot([0, 1], [0, 1], "k:", label="same relative depth")
    ax2.set(xlabel=f"relative depth in {sizes.shallow}", ylabel=f"in {sizes.deep}")
    ax2.legend()
    figure = _save(fig, out, "a6_linmap.png")
    verdict = linmap_verdict(diagonality, float(offsets.max()))
    return Finding(
        key="linmap",
        title="A deeper model stretches the same computation over more layers",
        paper="Linear maps from a shallow model's residual stream to a deeper one's: layers at "
        "the same relative depth map best onto each other (Csordás et al., finding 4)",
        toy=f"{sizes.shallow} → {sizes.deep}: best target states "
        f"{[int(j) for j in best['best_target']]}, diagonality (Spearman) {diagonality:.2f}, largest "
        f"distance from the same relative depth {offsets.max():.2f}",
        scaling="—",
        command=f"lensdiv compare {sizes.shallow} {sizes.deep} --max-tokens {sizes.linmap_tokens}",
        verdict=verdict,
        why="the order of the layers is kept"
        + (
            ", but the spacing is not proportional and R² varies little along a row"
            if verdict != REPRODUCED
            else " and each layer lands near its relative depth"
        ),
        figure=figure,
        values={
            "best_target": [int(j) for j in best["best_target"]],
            "diagonality": diagonality,
            "max_offset": float(offsets.max()),
        },
    )


def bias(sizes: Sizes, out: Path) -> Finding:
    """B2–B3: bias and diversity of the prefix ensembles (cross-entropy form) along depth."""
    result = _analyze(sizes.deep, "bias", sizes.tokens, bias={"ce_depth": True})["bias"]
    depth = result.table("depth")
    main = result.table()
    ce_rows = [i for i, form in enumerate(main["form"]) if form == "ce"]
    gap = float(main["identity_gap"][ce_rows[0]]) if ce_rows else math.nan
    keep = [i for i, m in enumerate(depth["members"]) if m > 0]
    b = np.asarray(depth["ce_bias"])[keep]
    d = np.asarray(depth["ce_diversity"])[keep]
    loss = np.asarray(depth["ce_loss"])[keep]
    from scipy.stats import spearmanr

    rho = float(spearmanr(b, d).statistic) if len(keep) > 2 else math.nan
    falls = bool(loss[-1] < loss[0])
    fig, (ax,) = _figure(1, 6)
    states = np.asarray(depth["layer"])[keep]
    ax.plot(states, b, "o-", label="bias (mean member CE)")
    ax.plot(states, d, "s-", label="diversity (mean KL to the ensemble)")
    ax.plot(states, loss, "^-", label="ensemble CE = bias − diversity")
    ax.set(xlabel="prefix ensemble up to h_l", ylabel="nats", yscale="log")
    ax.set_title(f"{sizes.deep}: members written before h_l")
    ax.legend()
    figure = _save(fig, out, "b2_bias_diversity.png")
    verdict = count_verdict(int(falls) + int(rho > 0.5), 2)
    return Finding(
        key="bias",
        title="Layers help when accurate and diverse; diversity matters most far from the truth",
        paper="Bias–diversity decomposition of the layers' ensemble: performance improves when "
        "layers are individually close to the answer and mutually diverse; diversity matters "
        "most when the layers' outputs are far from the truth (Kamigaito et al., abstract)",
        toy=f"{sizes.deep}, cross-entropy form, prefix ensembles h_1 … h_L: ensemble CE "
        f"{loss[0]:.2f} → {loss[-1]:.2f} nats, bias {b[0]:.2f} → {b[-1]:.2f}, diversity "
        f"{d[0]:.2f} → {d[-1]:.2f}; rank correlation of bias and diversity {rho:.2f}; "
        f"identity gap {gap:.1e}",
        scaling="—",
        command=f"lensdiv analyze {sizes.deep} --plugins bias -O bias.ce_depth=true "
        f"--max-tokens {sizes.tokens}",
        verdict=verdict,
        why="adding members raises their mean error (bias) and their spread (diversity) "
        "together, and the ensemble improves because diversity grows more"
        if verdict == REPRODUCED
        else "see the figure: "
        + (
            "the ensemble loss does not fall"
            if not falls
            else "bias and diversity do not rise together"
        ),
        figure=figure,
        values={
            "ce_bias": b.tolist(),
            "ce_diversity": d.tolist(),
            "ce_loss": loss.tolist(),
            "bias_diversity_spearman": rho,
            "identity_gap": gap,
        },
    )


def submod(sizes: Sizes, out: Path) -> Finding:
    """B4: diminishing gains of whole blocks (and members), log fit, violations."""
    result = _analyze(sizes.deep, "submod", sizes.tokens)["submod"]
    blocks = result.table("blocks")
    fit = dict(zip(result.table("fit")["statistic"], result.table("fit")["value"], strict=True))
    diminishing = np.asarray(blocks["diminishing"], float)
    steps = diminishing[~np.isnan(diminishing)] if diminishing.dtype.kind == "f" else diminishing
    share = float(np.mean(steps)) if len(steps) else math.nan
    k = np.asarray(blocks["k"], float)
    F = np.asarray(blocks["F"], float)
    ok = k >= 1
    slope, intercept = np.polyfit(np.log(k[ok]), F[ok], 1)
    pred = intercept + slope * np.log(k[ok])
    r2 = float(1 - ((F[ok] - pred) ** 2).sum() / ((F[ok] - F[ok].mean()) ** 2).sum())
    fig, (ax,) = _figure(1, 6)
    ax.plot(k, F, "o-", label="F(k): first k blocks")
    ax.plot(k[ok], pred, "k:", label=f"{intercept:.2f} + {slope:.2f} log k (R² {r2:.3f})")
    ax.set(xlabel="k (embedding, then blocks 0 … k−2)", ylabel="−CE, nats")
    ax.set_title(f"{sizes.deep}: performance of the first k blocks")
    ax.legend()
    figure = _save(fig, out, "b4_submod.png")
    violation = next((v for s, v in fit.items() if "violation" in s), math.nan)
    verdict = submod_verdict(share, r2)
    return Finding(
        key="submod",
        title="The gain from adding layers is submodular (diminishing)",
        paper="Performance gains from adding layers diminish (submodularity), echoing the "
        "logarithmic shape of parameter scaling laws (Kamigaito et al., abstract)",
        toy=f"{sizes.deep}, whole blocks: gains diminish at {share:.0%} of the steps; "
        f"F(k) ≈ {intercept:.2f} + {slope:.2f} log k, R² {r2:.3f}; submodularity violated in "
        f"{violation:.0%} of sampled nested member pairs",
        scaling="—",
        command=f"lensdiv analyze {sizes.deep} --plugins submod --max-tokens {sizes.tokens}",
        verdict=verdict,
        why="block by block the gains shrink and follow a log curve"
        if verdict == REPRODUCED
        else "the gains do not shrink steadily",
        figure=figure,
        values={
            "F_blocks": F.tolist(),
            "diminishing_share": share,
            "log_fit": [float(intercept), float(slope), r2],
            "violation_rate": float(violation),
        },
    )


def dynamics(sizes: Sizes, out: Path) -> Finding:
    """C1: rotations, angles between neighbouring updates, and update size against depth."""
    from lensdiv.analyzers.dynamics import update_scaling

    results = {
        d: _analyze(f"toy:d{d}", "dynamics", sizes.tokens)["dynamics"]
        for d in sizes.dynamics_depths
    }
    deep = results[max(results)]
    updates = deep.table("updates")
    middle = list(deep.meta["middle_blocks"])
    theta = np.degrees(np.asarray(updates["theta"], float))
    angle = np.degrees(np.asarray(updates["theta_update"], float))
    mid_theta = theta[middle]
    cv = float(mid_theta.std() / mid_theta.mean())
    mid_angle = float(np.nanmean(angle[middle]))
    fit = update_scaling(list(results.values()))
    checks = {
        "uniform rotations": cv <= 0.25,
        "uncorrelated updates": 80 <= mid_angle <= 100,
        "1/depth updates": abs(fit["slope"] + 1) <= 0.25,
    }
    fig, (ax1, ax2) = _figure(2)
    ax1.plot(updates["block"], theta, "o-", label="θ_l rotation")
    ax1.plot(updates["block"], angle, "s-", label="θΔ_l between neighbouring updates")
    ax1.axhline(90, color="grey", ls=":", lw=1)
    ax1.set(xlabel="block l", ylabel="degrees", title=f"toy:d{max(results)}")
    ax1.legend()
    depths = np.asarray(fit["depths"], float)
    ax2.loglog(depths, fit["values"], "o", label="middle ‖Δ‖/‖h‖")
    ax2.loglog(depths, np.exp(fit["intercept"]) * depths ** fit["slope"], "-",
               label=f"slope {fit['slope']:.2f}")  # fmt: skip
    ax2.set(xlabel="depth L", ylabel="middle relative update", title="update against depth")
    ax2.legend()
    figure = _save(fig, out, "c1_dynamics.png")
    verdict = count_verdict(sum(checks.values()), len(checks))
    failed = [name for name, ok in checks.items() if not ok]
    return Finding(
        key="dynamics",
        title="Most layers make small, similar, uncorrelated updates (ensemble averaging)",
        paper="Pythia-410m and other LLMs (Liu et al., Fig. 2a–e): tokens are turned by small, "
        "similar angles through the middle layers, neighbouring updates are nearly uncorrelated "
        "(≈ 90° apart), and the mean update shrinks as 1/depth",
        toy=f"toy:d{max(results)}: middle rotations "
        + ", ".join(f"{v:.0f}°" for v in mid_theta)
        + f" (coefficient of variation {cv:.2f}); neighbouring updates {mid_angle:.0f}° apart; "
        f"middle relative update against depth {list(map(int, depths))}: log–log slope "
        f"{fit['slope']:.2f}",
        scaling="—",
        command="lensdiv analyze toy:dL --plugins dynamics for L in "
        + ", ".join(map(str, sizes.dynamics_depths))
        + "; lensdiv.analyzers.dynamics.update_scaling",
        verdict=verdict,
        why="holds: "
        + ", ".join(n for n, ok in checks.items() if ok)
        + ("; fails: " + ", ".join(failed) if failed else ""),
        figure=figure,
        values={
            "middle_theta_deg": mid_theta.tolist(),
            "rotation_cv": cv,
            "middle_update_angle_deg": mid_angle,
            "update_scaling": fit,
            "checks": checks,
        },
    )


def chinchilla(sizes: Sizes, out: Path) -> Finding:
    """C2: the loss fit on the Chinchilla runs, and the depth term on the toy zoo."""
    from lensdiv import DataSpec
    from lensdiv.studies.scaling import fit_csv, fit_family

    family = fit_family(
        sizes.family,
        DataSpec(max_tokens=sizes.family_tokens),
        terms="depth",
        n_bootstrap=sizes.bootstrap,
        folds=0,
        progress=False,
    )
    fam = {r["name"]: r for r in family.table().rows}
    toy_alpha = fam["alpha_depth"]
    values: dict[str, Any] = {
        "toy_alpha_depth": [toy_alpha["value"], toy_alpha["ci_low"], toy_alpha["ci_high"]],
        "toy_runs": family.table("runs").to_dict()
        if hasattr(family.table("runs"), "to_dict")
        else None,
    }
    fig, (ax1, ax2) = _figure(2)
    _term_plot(ax1, family.table("depth_term"), "depth")
    ax1.set_title(f"toy zoo: α_ℓ = {toy_alpha['value']:.2f}")
    fit = fit_csv("chinchilla", drop_highest=40, depth_offset=-2, n_bootstrap=sizes.bootstrap)
    params = {r["name"]: r for r in fit.table().rows}
    alphas = {t: params[f"alpha_{t}"] for t in ("width", "depth", "tokens")}
    values["chinchilla"] = {
        t: [a["value"], a["stderr"], a["ci_low"], a["ci_high"]] for t, a in alphas.items()
    }
    values["chinchilla_runs"] = fit.meta["n_runs"]
    _term_plot(ax2, fit.table("depth_term"), "depth")
    ax2.set_title(f"Chinchilla runs: α_ℓ = {alphas['depth']['value']:.2f}")
    inside = {
        t: a["ci_low"] <= target <= a["ci_high"]
        for (t, a), target in zip(alphas.items(), (1.0, 1.0, 0.3), strict=True)
    }
    verdict = REPRODUCED if all(inside.values()) else PARTLY if inside["depth"] else NOT
    scaling = (
        f"{fit.meta['n_runs']} Chinchilla runs (40 highest-loss dropped, ties too; depth = "
        "n_layers − 2): "
        + "; ".join(
            f"α_{s} = {a['value']:.2f} ± {a['stderr']:.2f} (bootstrap 95 % "
            f"{a['ci_low']:.2f}–{a['ci_high']:.2f})"
            for s, a in zip(("m", "ℓ", "D"), alphas.values(), strict=True)
        )
    )
    why = (
        "every exponent's interval holds the paper's value"
        if verdict == REPRODUCED
        else ("outside the interval: " + ", ".join(t for t, ok in inside.items() if not ok))
    )
    figure = _save(fig, out, "c2_scaling.png")
    return Finding(
        key="chinchilla",
        title="Loss falls as 1/depth: the scaling-law fit",
        paper="L(m, ℓ, D) = c_m/m^α_m + c_ℓ/ℓ^α_ℓ + c_D/D^α_D + L0 fitted to the Chinchilla runs "
        "(Liu et al., Fig. 2f): α_m ≈ 1, α_ℓ ≈ 1, α_D ≈ 0.3",
        toy=f"toy depth family ({sizes.family}, {sizes.family_tokens} tokens each), "
        f"L = c_ℓ/ℓ^α_ℓ + L0: α_ℓ = {toy_alpha['value']:.2f} (bootstrap 95 % "
        f"{toy_alpha['ci_low']:.2f}–{toy_alpha['ci_high']:.2f})",
        scaling=scaling,
        command="lensdiv scaling fit chinchilla --drop-highest 40 --depth-offset -2; "
        f"lensdiv scaling family {sizes.family} --terms depth",
        verdict=verdict,
        why=why,
        figure=figure,
        values=values,
    )


def _lens_fits(sizes: Sizes, out: Path) -> dict[str, Any]:
    """The toy's tuned and Jacobian lenses (fitted once, shared by the lens rows)."""
    if "fits" not in _LENS_CACHE:
        from lensdiv.lenses.fit import fit_lens

        folder = Path(tempfile.mkdtemp(prefix="findings-lenses-"))
        common = {"eval_tokens": sizes.lens_tokens, "progress": False, "overwrite": True}
        _LENS_CACHE["fits"] = {
            "tuned": fit_lens(sizes.lens_model, "tuned", out=folder / "tuned",
                              preset=sizes.lens_preset, options=dict(sizes.lens_tuned), **common),
            "jacobian": fit_lens(sizes.lens_model, "jacobian", out=folder / "jacobian",
                                 max_tokens=max(sizes.lens_tokens // 4, 512), **common),
        }
    return _LENS_CACHE["fits"]


_LENS_CACHE: dict[str, Any] = {}


def _kl_plot(ax: Any, evaluation: Any, kinds: Sequence[str]) -> None:
    ax.plot(evaluation["layer"], evaluation["kl_logit"], "o-", color="black", label="logit lens")
    for kind in kinds:
        ax.plot(evaluation["layer"], evaluation[f"kl_{kind}"], "o-", label=f"{kind} lens")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_yticks([0, 0.01, 0.1, 1, 10], ["0", "0.01", "0.1", "1", "10"])
    ax.set(xlabel="residual state h_l", ylabel="KL(p_l ‖ p_out), nats")
    ax.set_xticks(list(evaluation["layer"]))
    ax.legend()


def tuned_lens(sizes: Sizes, out: Path) -> Finding:
    """D1: the tuned lens reads every layer closer to the output than the logit lens."""
    fit = _lens_fits(sizes, out)["tuned"]
    table = fit.evaluation
    logit, tuned = np.asarray(table["kl_logit"]), np.asarray(table["kl_tuned"])
    below = bool(np.all(tuned[:-1] < logit[:-1]))
    gain = logit[:-1] - tuned[:-1]
    half = max(1, len(gain) // 2)
    early = bool(gain[:half].max() >= gain[half:].max()) if len(gain) > 1 else True
    verdict = REPRODUCED if below and early else PARTLY if below else NOT
    fig, (ax,) = _figure(1, 6)
    _kl_plot(ax, table, ["tuned"])
    ax.set_title(f"{sizes.lens_model}: held-out tokens")
    figure = _save(fig, out, "d1_tuned_lens.png")
    pairs = ", ".join(f"h{i} {a:.2f} → {b:.2f}" for i, (a, b) in enumerate(zip(logit, tuned, strict=True)))
    return Finding(
        key="tuned_lens",
        title="A tuned lens reads early layers much closer to the output than the logit lens",
        paper="Tuned lens (Belrose et al. 2023, §3–4): an affine translator per layer trained on "
        "KL to the final distribution has far lower KL than the logit lens, most in early and "
        "middle layers, across model families",
        toy=f"{sizes.lens_model}, preset {sizes.lens_preset}, KL(p_l ‖ p_out) on "
        f"{sizes.lens_tokens} held-out tokens, logit → tuned: {pairs} nats",
        scaling="—",
        command=f"lensdiv lenses fit {sizes.lens_model} --kind tuned --preset "
        f"{sizes.lens_preset} --eval-tokens {sizes.lens_tokens}",
        verdict=verdict,
        why="lower KL at every state but the output, the largest gain in nats in the first "
        "half" if verdict == REPRODUCED else "see the figure",
        figure=figure,
        values={"kl_logit": logit.tolist(), "kl_tuned": tuned.tolist(),
                "steps": fit.manifest.get("steps"), "tokens": fit.manifest.get("tokens")},
    )


def jacobian_lens(sizes: Sizes, out: Path) -> Finding:
    """D2: the Jacobian lens' readout against the logit and tuned lenses'."""
    fits = _lens_fits(sizes, out)
    jac, tuned = fits["jacobian"].evaluation, fits["tuned"].evaluation
    logit, j = np.asarray(jac["kl_logit"]), np.asarray(jac["kl_jacobian"])
    t = np.asarray(tuned["kl_tuned"])
    inner = slice(1, len(j) - 1)  # h_0 (not translated) and h_L (the output) aside
    closer = bool(np.all(j[inner] < logit[inner]))
    fig, (ax,) = _figure(1, 6)
    _kl_plot(ax, jac, ["jacobian"])
    ax.plot(tuned["layer"], t, "o--", label="tuned lens (its own held-out run)")
    ax.legend()
    ax.set_title(f"{sizes.lens_model}: held-out tokens")
    figure = _save(fig, out, "d2_jacobian_lens.png")
    pairs = ", ".join(f"h{i} {a:.2f} / {b:.2f}" for i, (a, b) in enumerate(zip(logit, j, strict=True)))
    return Finding(
        key="jacobian_lens",
        title="The Jacobian lens reads what a state does downstream, not the output",
        paper="Jacobian lens (Gurnee et al. 2026): J_l = the mean Jacobian of the last layer "
        "with respect to layer l maps a state into the final layer's space; its readouts verbalise "
        "what a state will contribute",
        toy=f"{sizes.lens_model}, exact estimator, KL(p_l ‖ p_out) on {sizes.lens_tokens} "
        f"held-out tokens, logit / Jacobian: {pairs} nats (tuned: "
        + ", ".join(f"{x:.2f}" for x in t) + ")",
        scaling="—",
        command=f"lensdiv lenses fit {sizes.lens_model} --kind jacobian --max-tokens "
        f"{max(sizes.lens_tokens // 4, 512)} --eval-tokens {sizes.lens_tokens}",
        verdict=COMPARED,
        why="the Jacobian lens reads closer to the output than the logit lens"
        if closer
        else "the Jacobian lens reads further from the output than the logit lens (and the "
        "tuned lens): J_l h sums a state's effect over every later position, a different "
        "question from predicting the output; a comparison, not a claim of the paper",
        figure=figure,
        values={"kl_logit": logit.tolist(), "kl_jacobian": j.tolist(), "kl_tuned": t.tolist()},
    )


def _recorded(out: Path, key: str) -> dict[str, Any] | None:
    """The values of a row recorded in ``out/findings.json`` (``None``: none recorded)."""
    path = out / "findings.json"
    if not path.is_file():
        return None
    rows = {f["key"]: f for f in json.loads(path.read_text())["findings"]}
    return rows[key]["values"] if key in rows else None


def patchscope_lens(sizes: Sizes, out: Path) -> Finding:
    """P1: the token-identity Patchscope's KL to the output beside the logit, tuned and
    Jacobian lenses' (theirs from their rows as recorded, or fitted now)."""
    from lensdiv.lenses.fit import evaluate_lens

    tuned, jac = _recorded(out, "tuned_lens"), _recorded(out, "jacobian_lens")
    if tuned is None or jac is None:
        fits = _lens_fits(sizes, out)
        tuned = {"kl_tuned": list(fits["tuned"].evaluation["kl_tuned"]),
                 "tokens": fits["tuned"].manifest.get("tokens")}
        jac = {"kl_jacobian": list(fits["jacobian"].evaluation["kl_jacobian"])}
    tokens = max(sizes.lens_tokens // 4, 512)
    table = evaluate_lens(sizes.lens_model, "patchscope", max_tokens=tokens,
                          skip_tokens=int(tuned.get("tokens") or 0), progress=False)
    logit, patch = np.asarray(table["kl_logit"]), np.asarray(table["kl_patchscope"])
    t, j = np.asarray(tuned["kl_tuned"]), np.asarray(jac["kl_jacobian"])
    L = len(logit) - 1
    middle = slice(L // 2, L)  # from the middle layers on, the output aside
    beats_logit = bool(np.all(patch[middle] < logit[middle]))
    beats_tuned = bool(np.all(patch[middle] < t[middle]))
    fig, (ax,) = _figure(1, 6)
    _kl_plot(ax, table, ["patchscope"])
    ax.plot(range(len(t)), t, "o--", label="tuned lens (its row's held-out run)")
    ax.plot(range(len(j)), j, "s--", label="Jacobian lens (its row's held-out run)")
    ax.legend()
    ax.set_title(f"{sizes.lens_model}: held-out tokens")
    figure = _save(fig, out, "p1_patchscope_lens.png")
    pairs = ", ".join(
        f"h{i} {a:.2f} / {b:.2f} / {c:.2f} / {d:.2f}"
        for i, (a, b, c, d) in enumerate(zip(logit, patch, t, j, strict=True))
    )
    claim = (
        "holds" if beats_logit and beats_tuned
        else "holds against the logit lens only" if beats_logit
        else "fails"
    )
    against_tuned = ", ".join(
        f"h{i} {'lower' if patch[i] < t[i] else 'higher'} ({patch[i]:.2f} vs {t[i]:.2f})"
        for i in range(1, L)
    )
    return Finding(
        key="patchscope_lens",
        title="The model as its own lens: the token-identity Patchscope",
        paper="Patchscopes (Ghandeharioun et al., ICML 2024, §4.1): h_l patched into the "
        "inspection prompt 'cat -> cat; 1135 -> 1135; hello -> hello; ?' at its last token "
        "estimates the next token better than the logit and tuned lenses from the middle "
        "layers on",
        toy=f"{sizes.lens_model}, KL(p_l ‖ p_out) in nats, logit / patchscope (ℓ* = ℓ, "
        f"{tokens} held-out tokens) / tuned / Jacobian (their rows' held-out tokens): {pairs}",
        scaling="—",
        command=f"lensdiv lenses evaluate {sizes.lens_model} --lens patchscope --max-tokens "
        f"{tokens}",
        verdict=COMPARED,
        why=f"the paper's claim {claim} on the toy from h{L // 2} on. The patchscope reads "
        f"{'every' if np.all(patch[:-1] < logit[:-1]) else 'not every'} state closer to the "
        f"output than the logit lens; against the tuned lens: {against_tuned}. Caveats of a "
        "byte-level toy: its 'next token' is one byte and the inspection prompt 44 bytes it "
        "never saw as a list of repetitions; the tuned and Jacobian figures are on their rows' "
        "held-out tokens, the logit and patchscope ones on the tokens after the tuned fit's",
        figure=figure,
        values={"kl_logit": logit.tolist(), "kl_patchscope": patch.tolist(),
                "kl_tuned": t.tolist(), "kl_jacobian": j.tolist(), "tokens": tokens},
    )


def lens_bias(sizes: Sizes, out: Path) -> Finding:
    """B2–B3 through D1: bias and diversity of the residual states read through each lens."""
    import lensdiv

    fits = _lens_fits(sizes, out)
    rows = {}
    for kind, lens in (("logit", "logit"), ("tuned", fits["tuned"].spec)):
        run = lensdiv.analyze(sizes.lens_model, plugins="bias", lens=lens,
                              max_tokens=sizes.lens_tokens, progress=False,
                              options={"bias": {"members": "states"}})
        forms = run["bias"].table("bias")
        ce = list(forms["form"]).index("ce")
        rows[kind] = {k: float(forms[k][ce]) for k in ("bias", "diversity", "ensemble_loss")}
        rows[kind]["depth"] = {k: list(run["bias"].table("depth")[k])
                               for k in ("ce_bias", "ce_diversity", "ce_loss")}
    better = rows["tuned"]["ensemble_loss"] < rows["logit"]["ensemble_loss"]
    lower_bias = rows["tuned"]["bias"] < rows["logit"]["bias"]
    verdict = count_verdict(int(better) + int(lower_bias), 2)
    fig, (ax,) = _figure(1, 6)
    for kind, style in (("logit", "-"), ("tuned", "--")):
        depth = rows[kind]["depth"]
        ax.plot(depth["ce_bias"], "o" + style, label=f"{kind}: bias")
        ax.plot(depth["ce_diversity"], "s" + style, label=f"{kind}: diversity")
        ax.plot(depth["ce_loss"], "^" + style, label=f"{kind}: ensemble CE")
    ax.set(xlabel="prefix ensemble h_0 … h_l", ylabel="nats")
    ax.set_xticks(range(len(rows["logit"]["depth"]["ce_loss"])))
    ax.set_title(f"{sizes.lens_model}: states as members, through a lens")
    ax.legend(fontsize=7)
    figure = _save(fig, out, "b2_lens_members.png")
    text = "; ".join(
        f"{kind}: ensemble CE {r['ensemble_loss']:.2f} = bias {r['bias']:.2f} − diversity "
        f"{r['diversity']:.2f}" for kind, r in rows.items())
    return Finding(
        key="lens_bias",
        title="Read through a tuned lens, the layers are better and more alike ensemble members",
        paper="Bias–diversity of the layers' ensemble (Kamigaito et al.) with the layers' "
        "predictions read by the logit lens or by the tuned lens (Belrose et al.)",
        toy=f"{sizes.lens_model}, members h_0 … h_L read through the lens, cross-entropy form, "
        f"{sizes.lens_tokens} tokens: {text}",
        scaling="—",
        command=f"lensdiv analyze {sizes.lens_model} --plugins bias -O bias.members=states "
        "--lens tuned:DIR",
        verdict=verdict,
        why="the tuned lens' members are more accurate (lower bias) and their ensemble is "
        "better; much of the logit lens' diversity is its early layers being wrong in different "
        "ways" if verdict == REPRODUCED else "see the figure",
        figure=figure,
        values=rows,
    )


def _term_plot(ax: Any, table: Any, term: str) -> None:
    rows = table.rows
    for series in dict.fromkeys(r["series"] for r in rows):
        xs = [r[term] for r in rows if r["series"] == series]
        ys = [r["value"] for r in rows if r["series"] == series]
        ax.loglog(xs, ys, "o" if series == "data" else "-", ms=3, label=series)
    ax.set(xlabel="depth ℓ", ylabel="L − (other terms)")
    ax.legend()


def teacher_student_record(path: Path, preset: str) -> dict[str, Any]:
    """The recorded trial of ``bench/teacher_student_cpu.py`` whose settings are ``preset``'s."""
    from lensdiv.studies.teacher_student import TeacherStudentConfig

    wanted = json.loads(json.dumps(dataclasses.asdict(TeacherStudentConfig.preset(preset))))
    records = json.loads(path.read_text()) if path.exists() else {}
    for record in records.values():
        if record["config"] == wanted:
            return dict(record)
    raise SystemExit(
        f"{path} records no trial with the settings of preset {preset!r}: run "
        "bench/teacher_student_cpu.py on them, or docs/findings.py --rerun-teacher-student"
    )


def teacher_student(sizes: Sizes, out: Path) -> Finding:
    """C3: α_ℓ per teacher on the toy teacher–student networks: the preset run here, or (the
    full document, unless ``--rerun-teacher-student``) the run of it recorded in ``bench/``."""
    from lensdiv.studies.teacher_student import (
        TeacherStudentConfig,
        fit_depth_exponent,
        run_teacher_student,
    )
    from lensdiv.studies.teacher_student.experiment import teacher_label

    config = TeacherStudentConfig.preset(sizes.preset, **sizes.teacher_student)
    losses: dict[str, dict[int, float]] = {}
    trials: dict[str, Any] = {}
    if sizes.teacher_student_record:
        path = ROOT / sizes.teacher_student_record
        record = teacher_student_record(path, sizes.preset)
        trials = json.loads(path.read_text())
        losses = {t: {int(d): v for d, v in row.items()} for t, row in record["test_loss"].items()}
        cpu, wall = float(record["cpu_seconds"]), float(record["wall_seconds"])
        source = (
            f"recorded by bench/teacher_student_cpu.py (trial {record['trial']}, "
            f"{record['date']}; see bench/README.md)"
        )
    else:
        started = time.process_time()
        result = run_teacher_student(config, progress=False)
        cpu, wall = time.process_time() - started, float(result.meta["wall_seconds"])
        for row in result.table("losses").rows:
            losses.setdefault(row["teacher"], {})[int(row["depth"])] = float(row["test_loss"])
        source = "measured by this script"
    # α_ℓ is fitted here from the test losses, whether recorded or measured.
    fits = []
    for rho, temperature in config.teachers:
        label = teacher_label(rho, temperature)
        depths = sorted(losses[label])
        fit = fit_depth_exponent(depths, [losses[label][d] for d in depths])
        fits.append({"teacher": label, "rho": rho, **dataclasses.asdict(fit)})
    fig, (ax,) = _figure(1, 6)
    for f in fits:
        d = np.asarray(sorted(losses[f["teacher"]]), float)
        ax.loglog(
            d,
            [losses[f["teacher"]][int(x)] for x in d],
            "o",
            label=f"{f['teacher']}: α_ℓ {f['alpha']:.2f}",
        )
        ax.loglog(d, np.exp(f["intercept"]) * d ** -f["alpha"], "k:", lw=0.8)
    ax.set(
        xlabel="student depth ℓ", ylabel="test KL", title=f"teacher–student, preset {sizes.preset}"
    )
    ax.legend()
    figure = _save(fig, out, "c3_teacher_student.png")
    ind = next(f for f in fits if f["rho"] == 0.0)
    tied = next(f for f in fits if f["rho"] == 1.0)
    verdict = teacher_student_verdict(
        (ind["alpha"], ind["ci_low"], ind["ci_high"]),
        (tied["alpha"], tied["ci_low"], tied["ci_high"]),
    )
    text = "; ".join(
        f"{f['teacher']}: α_ℓ = {f['alpha']:.2f} (95 % {f['ci_low']:.2f}–{f['ci_high']:.2f})"
        for f in fits
    )
    return Finding(
        key="teacher_student",
        title="Independent teacher: α_ℓ ≈ 1; tied teacher: steeper",
        paper="Toy residual networks (Liu et al., Fig. 3b and 4c; source exp-9-1: 40k steps of "
        "1024 inputs): a teacher of 128 independent blocks gives α_ℓ ≈ 1 (ensemble averaging), a "
        "teacher whose blocks are tied gives a steeper fall (students discretise a smooth flow)",
        toy=f"preset {sizes.preset} ({config.steps} steps of {config.batch_size}, peak learning "
        f"rate {config.lr:g}{' × 2/√ℓ' if config.depth_scaled_lr else ''}, students "
        f"{list(config.depths)}, seed {config.seed}): {text}; {cpu:.0f} CPU seconds, {source}",
        scaling="—",
        command=f"lensdiv teacher-student --preset {sizes.preset}",
        verdict=verdict,
        why=_teacher_student_why(verdict, ind, tied, trials),
        figure=figure,
        values={
            "alpha": fits,
            "test_loss": losses,
            "config": dataclasses.asdict(config),
            "cpu_seconds": cpu,
            "wall_seconds": wall,
            "source": source,
        },
    )


def _teacher_student_why(
    verdict: str, ind: dict[str, Any], tied: dict[str, Any], trials: dict[str, Any]
) -> str:
    """Why the verdict, from this run's fits and (where recorded) the other trials' fits."""
    if verdict == REPRODUCED:
        return "both parts of the pattern hold at CPU scale (see bench/README.md for the search)"
    parts = []
    if not (ind["ci_low"] <= 1 <= ind["ci_high"] or 0.8 <= ind["alpha"] <= 1.2):
        parts.append(f"the independent teacher's α_ℓ is {ind['alpha']:.2f}")
    if not (tied["alpha"] > ind["alpha"] and tied["ci_low"] > ind["ci_high"]):
        parts.append(
            f"the tied teacher is steeper ({tied['alpha']:.2f}) but the 95 % intervals overlap "
            f"({tied['ci_low']:.2f} < {ind['ci_high']:.2f})"
            if tied["alpha"] > ind["alpha"]
            else "the tied teacher is not steeper"
        )
    text = "; ".join(parts) + " (training losses still falling: students not converged)"
    # The other recorded trials: does any meet both criteria, and what do the source's student
    # depths (6-48) give?
    fits = {n: list(r.get("alpha", {}).values()) for n, r in trials.items()}
    fits = {n: f for n, f in fits.items() if len(f) == 2}
    both = [
        n
        for n, (a, b) in fits.items()
        if teacher_student_verdict(
            (a["alpha"], a["ci_low"], a["ci_high"]), (b["alpha"], b["ci_low"], b["ci_high"])
        )
        == REPRODUCED
    ]
    source = [n for n in fits if min(trials[n]["config"]["depths"]) >= 6]
    late = [float(r["late_drop_max"]) for r in trials.values() if "late_drop_max" in r]
    if fits:
        cost = [float(r["cpu_seconds"]) for r in trials.values() if "cpu_seconds" in r]
        text += (
            f". Of the {len(fits)} recorded trials ({min(cost):.0f}–{max(cost):.0f} CPU "
            "seconds each), "
        ) + (f"{', '.join(both)} meet both criteria" if both else "none meets both criteria")
    if source:
        best = max(source, key=lambda n: fits[n][0]["alpha"])
        text += (
            f": with the source's student depths 6–48 the best independent α_ℓ is "
            f"{fits[best][0]['alpha']:.2f} (trial {best}), but there the tied teacher's α_ℓ is "
            f"only {fits[best][1]['alpha']:.2f} (its deep students stall on a plateau)"
        )
    if late:
        text += (
            f"; in every trial some student's training loss still fell by {min(late):.0%}–"
            f"{max(late):.0%} over the last quarter (bench/README.md)"
        )
    return text


_STUDIES: dict[tuple[str, str, int], Any] = {}


def _study(models: str, plugins: str, tokens: int) -> Any:
    """A study of ``models`` in memory (both cross-model rows read the same two)."""
    import lensdiv

    key = (models, plugins, tokens)
    if key not in _STUDIES:
        _STUDIES[key] = lensdiv.run_study(
            models, plugins=plugins, max_tokens=tokens, progress=False
        )
    return _STUDIES[key]


def _curves(study: Any) -> dict[str, dict[str, Any]]:
    """Every depth profile of a study: ``{name: {model: (layers, rel_depth, values, L)}}``."""
    curves: dict[str, dict[str, Any]] = {}
    summary = study.summary
    for analyzer, table, column in summary.meta["profiles"]:
        name = f"{analyzer}.{column}"
        rows = summary.table(_profile_table(analyzer, table, column)).rows
        for model in dict.fromkeys(r["model"] for r in rows):
            mine = [r for r in rows if r["model"] == model]
            curves.setdefault(name, {})[model] = (
                np.array([r["layer"] for r in mine]),
                np.array([r["rel_depth"] for r in mine]),
                np.array([r["value"] for r in mine], float),
                int(mine[0]["n_layers"]),
            )
    return curves


def _profile_table(analyzer: str, table: str, column: str) -> str:
    from lensdiv.studies.crossmodel.summary import profile_name

    return profile_name(analyzer, table, column)


def alignment(curves: dict[str, Any], *, inner: bool = False) -> dict[str, float]:
    """Mean over pairs of models of different depth of the mean absolute difference of their
    curves, in units of the profile's standard deviation over every model: at the same relative
    depth (the deeper curve interpolated at the shallower one's points), at the same layer from
    the input, and at the same layer from the output. ``inner`` leaves out layer 0 (block 0 and
    the embedding h_0) and the models of fewer than 3 blocks."""
    if inner:
        curves = {
            m: (layers[layers > 0], rel[layers > 0], values[layers > 0], depth)
            for m, (layers, rel, values, depth) in curves.items()
            if depth >= 3
        }
    pooled = np.concatenate([v for _, _, v, _ in curves.values()])
    spread = float(np.nanstd(pooled)) or 1.0
    out: dict[str, list[float]] = {"relative": [], "input": [], "output": []}
    items = sorted(curves.values(), key=lambda c: c[3])
    for i, (layers_s, rel_s, values_s, depth_s) in enumerate(items):
        for layers_d, rel_d, values_d, depth_d in items[i + 1 :]:
            ok = np.isfinite(values_d)
            if depth_d == depth_s or ok.sum() < 1:
                continue
            at_rel = np.interp(rel_s, rel_d[ok], values_d[ok])
            out["relative"].append(_mean(np.abs(at_rel - values_s)))
            by_layer = dict(zip(layers_d.tolist(), values_d, strict=True))
            for kind, shift in (("input", 0), ("output", depth_d - depth_s)):
                pairs = [
                    (v, by_layer.get(int(layer) + shift))
                    for layer, v in zip(layers_s, values_s, strict=True)
                ]
                out[kind].append(_mean([abs(a - b) for a, b in pairs if b is not None]))
    return {k: _mean(v) / spread for k, v in out.items()}


def _mean(values: Any) -> float:
    """Mean of the finite values (NaN when there are none), without a warning."""
    finite = [float(v) for v in values if np.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def width_spread(curves: dict[str, Any]) -> float:
    """For models of one depth: the mean absolute difference of every two curves, layer by
    layer, in units of the profile's standard deviation over them."""
    values = [v for _, _, v, _ in curves.values()]
    spread = float(np.nanstd(np.concatenate(values))) or 1.0
    diffs = [
        float(np.nanmean(np.abs(a - b)))
        for i, a in enumerate(values)
        for b in values[i + 1 :]
        if len(a) == len(b)
    ]
    return float(np.mean(diffs)) / spread if diffs else math.nan


def alignment_verdict(closest: int, total: int) -> str:
    """The alignment rule (see ``RULES``)."""
    if total and closest >= 0.75 * total:
        return REPRODUCED
    return PARTLY if total and closest >= 0.5 * total else NOT


def update_slope_verdict(slope: float) -> str:
    """The update-scaling rule (see ``RULES``)."""
    if abs(slope + 1) <= 0.25:
        return REPRODUCED
    return PARTLY if slope < 0 else NOT


def study_alignment(sizes: Sizes, out: Path) -> Finding:
    """Across the depth family: do the depth profiles line up at relative depth?"""
    depth = _study(sizes.study_depth, sizes.study_plugins, sizes.study_tokens)
    width = _study(sizes.study_width, sizes.study_plugins, sizes.study_tokens)
    curves, control = _curves(depth), _curves(width)
    scores = {name: alignment(c) for name, c in curves.items()}
    closest = [n for n, s in scores.items() if s["relative"] < min(s["input"], s["output"])]
    inner = {name: alignment(c, inner=True) for name, c in curves.items()}
    inner_closest = [n for n, s in inner.items() if s["relative"] < min(s["input"], s["output"])]
    widths = {name: width_spread(c) for name, c in control.items()}
    verdict = alignment_verdict(len(closest), len(scores))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shown = [n for n in scores if n in ("contrib.r_block", "lens.kl", "skip.later_mean",
                                        "dynamics.rel_update")]  # fmt: skip
    fig = Figure(figsize=(10, 7), dpi=100)
    FigureCanvasAgg(fig)
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    depths = sorted({c[3] for c in next(iter(curves.values())).values()}) if curves else [1]
    for i, name in enumerate(shown):
        ax = fig.add_subplot(2, 2, i + 1)
        for _, rel, values, L in curves[name].values():
            colour = cmap(0.85 * depths.index(L) / max(len(depths) - 1, 1))
            ax.plot(rel, values, "o-", ms=3, color=colour, label=f"L = {L}")
        if name in ("contrib.r_block", "dynamics.rel_update"):
            ax.set_yscale("log")
        s = scores[name]
        ax.set_title(f"{name}: relative {s['relative']:.2f}, input {s['input']:.2f}, "
                     f"output {s['output']:.2f}", fontsize=9)  # fmt: skip
        ax.set(xlabel="relative depth ℓ/L", ylabel=_YLABELS[name])
        if i == 0:
            ax.legend(fontsize=7)
    figure = _save(fig, out, "x1_study_alignment.png")
    text = "; ".join(
        f"{n}: {s['relative']:.2f} / {s['input']:.2f} / {s['output']:.2f}"
        for n, s in scores.items()
    )
    mean_rel = float(np.mean([s["relative"] for s in scores.values()])) if scores else math.nan
    mean_width = float(np.nanmean(list(widths.values()))) if widths else math.nan
    return Finding(
        key="study_alignment",
        title="Depth profiles line up at relative depth across a depth family",
        paper="Models of one family compared at relative depth (Llama 3.1 8B and 70B, the Qwen 3 "
        "sizes): a deeper model spreads the same computation over more layers, so what its "
        "layers do lines up with a shallower model's at the same relative depth (Csordás et "
        "al., finding 4)",
        toy=f"a study of {sizes.study_depth} ({sizes.study_plugins}, {sizes.study_tokens} tokens "
        "each); per depth profile, the mean distance between the curves of every two depths in "
        "units of the profile's spread, at the same relative depth / the same layer from the "
        f"input / from the output: {text}. Closest at relative depth: {len(closest)} of "
        f"{len(scores)} profiles. Leaving out block 0 and h_0 and the models of fewer than 3 "
        f"blocks: {len(inner_closest)} of {len(inner)} ("
        + ", ".join(
            f"{n} {s['relative']:.2f} / {s['input']:.2f} / {s['output']:.2f}"
            for n, s in inner.items()
        )
        + f"). For scale, the models of {sizes.study_width} (one depth, different widths) "
        f"differ by {mean_width:.2f} on average, the depth family at relative depth by "
        f"{mean_rel:.2f}",
        scaling="—",
        command=_study_commands(sizes),
        verdict=verdict,
        why=_alignment_why(scores, inner),
        figure=figure,
        values={
            "alignment": scores,
            "closest_at_relative_depth": closest,
            "alignment_inner": inner,
            "inner_closest_at_relative_depth": inner_closest,
            "width_spread": widths,
            "models": [m.model for m in depth.models],
            "width_models": [m.model for m in width.models],
        },
    )


_YLABELS = {
    "lens.kl": "KL(p_ℓ ‖ p_out), nats",
    "contrib.r_block": "‖a+m‖ / ‖h‖",
    "skip.later_mean": "effect on later layers",
    "dynamics.rel_update": "‖Δ_ℓ‖ / ‖h_ℓ‖",
}


def _plain_ticks(ax: Any, xs: Sequence[float]) -> None:
    """Log axes labelled with the plain numbers plotted (no 2×10⁰ labels)."""
    from matplotlib.ticker import FixedLocator, LogFormatter, NullFormatter, ScalarFormatter

    ax.xaxis.set_major_locator(FixedLocator(list(xs)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _alignment_why(scores: dict[str, Any], inner: dict[str, Any]) -> str:
    """Which profiles line up best which way, with and without layer 0 and the shallowest."""
    ways = {"relative": "at the same relative depth", "input": "by layer from the input",
            "output": "by layer from the output"}  # fmt: skip
    best: dict[str, list[str]] = {}
    for name, s in scores.items():
        best.setdefault(min(s, key=s.get), []).append(name)
    text = "; ".join(f"{ways[w]}: {', '.join(names)}" for w, names in best.items())
    closest = len(best.get("relative", []))
    inner_closest = sum(s["relative"] < min(s["input"], s["output"]) for s in inner.values())
    text = f"the curves line up best {text}"
    text += (
        f"; without block 0, h_0 and the models of fewer than 3 blocks, {inner_closest} of "
        f"{len(inner)} line up best at relative depth"
    )
    if inner_closest >= 0.75 * len(inner) > closest:
        text += ", so the first block and the shallowest models decide the verdict"
    return text


def _study_commands(sizes: Sizes) -> str:
    return "; ".join(
        f"lensdiv study run {family} --plugins {sizes.study_plugins} "
        f"--max-tokens {sizes.study_tokens} --out study-{family.split(':')[-1]}"
        for family in (sizes.study_depth, sizes.study_width)
    )


def study_updates(sizes: Sizes, out: Path) -> Finding:
    """Across the depth family: the mean middle update against depth, and against width."""
    depth = _study(sizes.study_depth, sizes.study_plugins, sizes.study_tokens)
    width = _study(sizes.study_width, sizes.study_plugins, sizes.study_tokens)
    rows = depth.summary.table("numbers").rows
    from lensdiv.studies.crossmodel.summary import loglog_slope

    L = [int(r["n_layers"]) for r in rows]
    u = [float(r["update_norm"]) for r in rows]
    deep = [(a, b) for a, b in zip(L, u, strict=True) if a >= 3]
    slope, intercept = loglog_slope([a for a, _ in deep], [b for _, b in deep])
    slope_all, _ = loglog_slope(L, u)
    wrows = width.summary.table("numbers").rows
    W = [int(r["d_model"]) for r in wrows]
    wu = [float(r["update_norm"]) for r in wrows]
    wslope, _ = loglog_slope(W, wu)
    verdict = update_slope_verdict(slope)
    fig, (ax1, ax2) = _figure(2)
    ax1.loglog(L, u, "o", label="middle ‖Δ‖/‖h‖")
    xs = np.array([a for a, _ in deep], float)
    if len(xs):
        ax1.loglog(xs, np.exp(intercept) * xs**slope, "-", label=f"L ≥ 3: slope {slope:.2f}")
    ax1.loglog(xs, xs[0] ** 1 * (deep[0][1] if deep else 1) / xs, "k:", lw=0.8, label="1/L")
    ax1.set(xlabel="blocks L", ylabel="mean middle ‖Δ_ℓ‖/‖h_ℓ‖", title=sizes.study_depth)
    ax1.legend(fontsize=8)
    ax2.loglog(W, wu, "s-", label=f"slope {wslope:.2f}")
    ax2.set(xlabel="d_model", ylabel="mean middle ‖Δ_ℓ‖/‖h_ℓ‖", title=sizes.study_width)
    ax2.legend(fontsize=8)
    _plain_ticks(ax1, L)
    _plain_ticks(ax2, W)
    figure = _save(fig, out, "x2_study_updates.png")
    return Finding(
        key="study_updates",
        title="The mean update shrinks as 1/depth across a model family",
        paper="Across a family of models, the mean update of the middle layers shrinks about as "
        "1/depth, the signature of many small updates averaging like an ensemble (Liu et al., "
        "Fig. 2a–e)",
        toy=f"a study of {sizes.study_depth}: mean middle ‖Δ_ℓ‖/‖h_ℓ‖ "
        + ", ".join(f"{v:.3f} (L = {d})" for d, v in zip(L, u, strict=True))
        + f"; log–log slope {slope:.2f} over L ≥ 3 ({slope_all:.2f} with every depth). "
        f"Across {sizes.study_width} (depth 4): "
        + ", ".join(f"{v:.3f} (d_model {w})" for w, v in zip(W, wu, strict=True))
        + f", slope {wslope:.2f} against width",
        scaling="—",
        command=_study_commands(sizes),
        verdict=verdict,
        why=f"the slope is {slope:.2f}"
        + (
            ", within −1 ± 0.25"
            if verdict == REPRODUCED
            else ", negative but outside −1 ± 0.25"
            if verdict == PARTLY
            else ": the update does not shrink with depth"
        ),
        figure=figure,
        values={
            "n_layers": L,
            "update_norm": u,
            "slope": slope,
            "slope_all_depths": slope_all,
            "width": W,
            "width_update_norm": wu,
            "width_slope": wslope,
        },
    )


# -- depth surgery (E1, E2): prune and reorder on the toy depth family --------------------------
_SURGERY: dict[tuple[Any, ...], Any] = {}


def _surgery_run(model: str, tokens: int, plugins: str = "prune,reorder", **options: Any) -> Any:
    """``prune`` and ``reorder`` on ``model`` (each set of options measured once per script run)."""
    key = (model, tokens, plugins, json.dumps(options, sort_keys=True))
    if key not in _SURGERY:
        _SURGERY[key] = _analyze(model, plugins, tokens, **options)
    return _SURGERY[key]


def combined_verdict(verdicts: Sequence[str]) -> str:
    """Reproduced on every model, on none (not reproduced), or on some."""
    if all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    return NOT if all(v == NOT for v in verdicts) else PARTLY


def ends_checks(kl_remove: Sequence[float]) -> tuple[bool, bool]:
    """Whether removing the first block costs the most of any block, and whether removing the
    last costs more than removing any block between them."""
    v = np.asarray(kl_remove, float)
    return bool(v.argmax() == 0), bool(len(v) < 3 or v[-1] > v[1:-1].max())


def middle_pairs(n_layers: int) -> list[int]:
    """Swaps ``ℓ, ℓ+1`` with both blocks in the middle half ``[L/4, L − L/4)``."""
    a, b = n_layers // 4, n_layers - n_layers // 4
    return [s for s in range(a, b - 1)]


def prune_depth(sizes: Sizes, out: Path) -> Finding:
    """E1: are deeper blocks more removable than early ones (removing one block at a time)?"""
    fig, (ax,) = _figure(1, 6.0)
    verdicts, values = [], {}
    for model in sizes.surgery_models:
        kl = list(_surgery_run(model, sizes.surgery_tokens)["prune"].table("blocks")["kl_remove"])
        verdict, ratios = halves_verdict(kl)
        verdicts.append(verdict)
        values[model] = {"kl_remove": kl, **ratios}
        L = len(kl)
        ax.plot([(b + 0.5) / L for b in range(L)], kl, marker="o", label=model)
    ax.set(xlabel="relative depth of the removed block (ℓ + ½)/L", ylabel="KL(p ‖ p_out) (nats)",
           yscale="log", title="removing one block")
    ax.legend()
    figure = _save(fig, out, "e1_prune_depth.png")
    verdict = combined_verdict(verdicts)
    toy = "; ".join(
        f"{m}: second half / first half = {v['ratio']:.3f}, {v['ratio_without_block0']:.2f} "
        "without block 0" for m, v in values.items()
    )
    return Finding(
        key="prune_depth",
        title="Deeper blocks are more removable than early ones",
        paper="Removing deeper blocks costs far less than removing early ones: a large share of "
        "the deepest blocks can go with little loss (Gromov et al. 2024; Men et al. 2024)",
        toy=toy,
        scaling="—",
        command=f"lensdiv analyze {sizes.surgery_models[-1]} --plugins prune "
        f"--max-tokens {sizes.surgery_tokens}",
        verdict=verdict,
        why="block 0 turns bytes into features and costs several nats; after it the cost of "
        "removing one block falls with depth"
        + ("" if verdict == REPRODUCED else ", but not to half in the second half on every "
           "model: the toys' later blocks are few and each still does a share of the work"),
        figure=figure,
        values={"models": values, "verdicts": verdicts},
    )


def prune_ends(sizes: Sizes, out: Path) -> Finding:
    """E1: are the first and the last block the most critical?"""
    checks, values = [], {}
    for model in sizes.surgery_models:
        kl = list(_surgery_run(model, sizes.surgery_tokens)["prune"].table("blocks")["kl_remove"])
        first, last = ends_checks(kl)
        checks += [first, last]
        values[model] = {"first_most": first, "last_above_middle": last,
                         "rank_of_last": int((np.asarray(kl) > kl[-1]).sum()) + 1}
    verdict = count_verdict(sum(checks), len(checks))
    firsts = sum(v["first_most"] for v in values.values())
    lasts = sum(v["last_above_middle"] for v in values.values())
    n = len(values)
    return Finding(
        key="prune_ends",
        title="The first and the last block are the most critical",
        paper="Removing the first or the last block hurts most; the blocks between them can be "
        "removed or reordered at far less cost (Lad et al. 2024; Men et al. 2024)",
        toy=f"removing block 0 costs the most on {firsts}/{n} models; removing the last costs "
        f"more than any middle block on {lasts}/{n} (rank of the last block among all: "
        + ", ".join(f"{m} {v['rank_of_last']}" for m, v in values.items()) + ")",
        scaling="—",
        command=f"lensdiv analyze {sizes.surgery_models[-1]} --plugins prune "
        f"--max-tokens {sizes.surgery_tokens}",
        verdict=verdict,
        why="the first block is by far the most critical (it builds the features every later "
        "block reads)"
        + ("; the last block is too" if lasts == n else
           "; the last block is not more critical than the early middle blocks on every toy: "
           "a byte-level toy's output needs no separate final stage"),
        figure="findings/e1_prune_depth.png",
        values={"models": values},
    )


def reorder_swap(sizes: Sizes, out: Path) -> Finding:
    """E2: swapping adjacent middle blocks against removing one."""
    models = [m for m in sizes.surgery_models if _depth(m) >= 4]
    fig, axes = _figure(len(models))
    held, total, values = 0, 0, {}
    for ax, model in zip(axes, models, strict=True):
        swaps = _surgery_run(model, sizes.surgery_tokens)["reorder"].table("swaps")
        pairs = middle_pairs(len(swaps))
        cheaper = [bool(swaps["kl_swap"][s] < swaps["kl_remove"][s]) for s in pairs]
        held, total = held + sum(cheaper), total + len(cheaper)
        values[model] = {"pairs": pairs, "kl_swap": list(swaps["kl_swap"]),
                         "kl_remove": list(swaps["kl_remove"]), "swap_cheaper": cheaper}
        ax.plot(swaps["block"], swaps["kl_swap"], marker="o", label="swap ℓ, ℓ+1")
        ax.plot(swaps["block"], swaps["kl_remove"], marker="s", label="remove ℓ")
        ax.axvspan(pairs[0] - 0.2, pairs[-1] + 0.2, alpha=0.1, color="grey")
        ax.set(xlabel="block ℓ", ylabel="KL(p ‖ p_out) (nats)", yscale="log", title=model)
        ax.legend()
    figure = _save(fig, out, "e2_reorder_swap.png")
    verdict = count_verdict(held, total)
    return Finding(
        key="reorder_swap",
        title="Swapping adjacent middle blocks hurts less than removing one",
        paper="Swapping two adjacent middle blocks keeps most of the model's accuracy, more than "
        "deleting a block (Lad et al. 2024)",
        toy=f"swap ℓ, ℓ+1 costs less KL than removing ℓ for {held} of {total} middle pairs "
        "(shaded) of " + ", ".join(models),
        scaling="—",
        command=f"lensdiv analyze {models[-1]} --plugins reorder "
        f"--max-tokens {sizes.surgery_tokens}",
        verdict=verdict,
        why="a swapped block still writes its update, only in another order; a removed one "
        "writes nothing" + ("" if verdict == REPRODUCED else " — but not for every pair"),
        figure=figure,
        values={"models": values},
    )


def reorder_shuffle(sizes: Sizes, out: Path) -> Finding:
    """E2: shuffling the middle half against shuffling a range of the same length at the start."""
    models = [m for m in sizes.surgery_models if _depth(m) >= 4]
    fig, (ax,) = _figure(1, 6.0)
    held, values = 0, {}
    for i, model in enumerate(models):
        L = _depth(model)
        middle = _surgery_run(model, sizes.surgery_tokens)["reorder"]
        start = _surgery_run(model, sizes.surgery_tokens, "reorder",
                             reorder={"start": "0", "stop": str(L - 2 * (L // 4))})["reorder"]
        kl = {}
        for where, result in (("middle", middle), ("start", start)):
            table = result.table("variants")
            kl[where] = [float(k) for v, k in zip(table["variant"], table["kl"], strict=True)
                         if str(v).startswith("shuffle")]
        held += int(np.mean(kl["middle"]) < np.mean(kl["start"]))
        values[model] = {"middle": middle.meta["middle"], "start": start.meta["middle"],
                         "kl_middle": kl["middle"], "kl_start": kl["start"]}
        ax.scatter([i - 0.1] * len(kl["middle"]), kl["middle"], marker="o", color="C0",
                   label="shuffle the middle half" if i == 0 else None)
        ax.scatter([i + 0.1] * len(kl["start"]), kl["start"], marker="s", color="C3",
                   label="shuffle as many blocks from block 0" if i == 0 else None)
    ax.set_xticks(range(len(models)), models)
    ax.set(ylabel="KL(p ‖ p_out) (nats)", yscale="log", title="shuffles (one point per seed)")
    ax.legend()
    figure = _save(fig, out, "e2_reorder_shuffle.png")
    verdict = count_verdict(held, len(models))
    every = [k for v in values.values() for k in (*v["kl_middle"], *v["kl_start"])]
    zeros, total = sum(k == 0 for k in every), len(every) // 2
    moved = [k for v in values.values() for k in v["kl_start"] if k > 0]
    least = min(moved) if moved else math.nan
    return Finding(
        key="reorder_shuffle",
        title="Shuffling the middle hurts less than shuffling the start",
        paper="Randomly reordering the middle layers degrades the model gracefully; the first "
        "and last layers must stay in place (Sun et al. 2024, Transformer Layers as Painters)",
        toy="mean KL of the shuffles, middle half vs as many blocks from block 0: "
        + "; ".join(f"{m} {np.mean(v['kl_middle']):.3g} vs {np.mean(v['kl_start']):.3g}"
                    for m, v in values.items()),
        scaling="—",
        command=f"lensdiv analyze {models[-1]} --plugins reorder -O reorder.start=0 "
        f"-O reorder.stop={_depth(models[-1]) - 2 * (_depth(models[-1]) // 4)} "
        f"--max-tokens {sizes.surgery_tokens}",
        verdict=verdict,
        why="a shuffle of the start moves block 0, which must read the embeddings; the middle "
        "blocks read and write features the others share. Caveat: with 3 seeds of a short "
        f"range, {zeros} of {2 * total} shuffles drew the identity order (KL 0, off the log "
        f"axis), and a start shuffle that leaves block 0 in place costs little "
        f"(least of the start shuffles that moved: {least:.3g} nats)",
        figure=figure,
        values={"models": values},
    )


def sinks_verdict(share_first: float, share_later: float) -> str:
    """The sinks rule for one model (see ``RULES``): the share of sink heads of layer 0 and of
    the later layers (over all their heads)."""
    if share_later >= 0.5 and share_first < share_later:
        return REPRODUCED
    return PARTLY if share_later > 0 else NOT


def massive_verdict(appear: int | None, dce_zero: float, dce_mean: float) -> str:
    """The massive-activation rule for one model (see ``RULES``)."""
    if appear is None:
        return NOT
    return REPRODUCED if dce_zero >= 10 * max(dce_mean, 1e-12) else PARTLY


def sinks_form(sizes: Sizes, out: Path) -> Finding:
    """Attention sinks: do heads after the first layers put their attention on position 0?"""
    fig, (ax1, ax2) = _figure(2)
    verdicts, values = [], {}
    for model in sizes.outlier_models:
        result = _analyze(model, "sinks", sizes.outlier_tokens)["sinks"]
        table = result.table()
        mass, share = list(table["mass0"]), list(table["sink_share"])
        L = len(mass)
        rest = slice(1, None) if L > 1 else slice(0, 1)
        verdicts.append(sinks_verdict(share[0], float(np.mean(share[rest]))))
        tokens = result.tables["sink_tokens"]
        values[model] = {"mass0": mass, "sink_share": share, "kl_removed": list(table["kl"]),
                         "top_token": str(tokens["text"][0]),
                         "top_share": float(tokens["share"][0]),
                         "top_ratio": float(tokens["ratio"][0])}
        ax1.plot([(i + 0.5) / L for i in range(L)], mass, "o-", label=model)
        ax2.plot([(i + 0.5) / L for i in range(L)], table["kl"], "o-", label=model)
    ax1.set(xlabel="relative depth of the layer", ylabel="mean attention on position 0",
            ylim=(0, 1), title="attention on the first token")
    ax1.axhline(0.3, color="grey", lw=0.8, ls=":")
    ax2.set(xlabel="relative depth of the layer", ylabel="KL(p_removed ‖ p_out) (nats)",
            yscale="log", title="the sink of one layer removed")
    for ax in (ax1, ax2):
        ax.legend()
    figure = _save(fig, out, "f1_sinks.png")
    verdict = combined_verdict(verdicts)
    toy = "; ".join(
        f"{m}: attention on position 0 per layer " + ", ".join(f"{x:.2f}" for x in v["mass0"])
        + f", sink heads {', '.join(f'{x:.0%}' for x in v['sink_share'])}; removing the "
        "sink costs KL " + ", ".join(f"{x:.3f}" for x in v["kl_removed"]) + " nats; most "
        "attended token "
        f"{v['top_token']} ({v['top_share']:.0%} of all attention, {v['top_ratio']:.1f}× an even "
        "spread)" for m, v in values.items()
    )
    return Finding(
        key="sinks_form",
        title="Attention sinks form after the first layers",
        paper="In most heads of most layers after the first one or two, much of the attention "
        "goes to the first token, whatever it is (Xiao et al. 2023; Gu et al. 2024: sink heads "
        "with mean attention > 0.3 on it; Barbero et al. 2025 tie them to depth: they keep deep "
        "models from over-mixing)",
        toy=toy,
        scaling="—",
        command=f"lensdiv analyze {sizes.outlier_models[-1]} --plugins sinks "
        f"--max-tokens {sizes.outlier_tokens}",
        verdict=verdict,
        why="the toys spread their attention over the bytes: no head of any layer puts a sink's "
        "share on position 0 (a few per cent, like any other byte; the most attended token, the "
        "space, draws about an even spread's share), and removing it costs little beyond layer "
        "0. Byte-level rows and shallow models may give a sink nothing to do"
        if verdict == NOT
        else "the later layers put more attention on the first token than layer 0"
        + ("" if verdict == REPRODUCED else ", but few of their heads are sinks"),
        figure=figure,
        values={"models": values, "verdicts": verdicts},
    )


def massive_bias(sizes: Sizes, out: Path) -> Finding:
    """Massive activations: do a few huge residual entries exist, and do they act as biases?"""
    fig, (ax,) = _figure(1, 6.0)
    verdicts, values = [], {}
    for model in sizes.outlier_models:
        result = _analyze(model, "massive", sizes.outlier_tokens)["massive"]
        table = result.table()
        ratio = [float(10**x) for x in table["log10_ratio"]]
        truth = result.tables.get("massive_truth")
        dce = {} if truth is None else dict(zip(truth["edit"], truth["dce"], strict=True))
        appear = result.meta["appear"]
        verdicts.append(massive_verdict(appear, dce.get("zero", 0.0), dce.get("mean", 0.0)))
        values[model] = {"max_abs": list(table["max_abs"]), "median": list(table["median"]),
                         "ratio": ratio, "appear": appear, "dce": dce}
        L = len(ratio) - 1
        ax.plot([i / L for i in range(L + 1)], ratio, "o-", label=model)
    ax.axhline(1000, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="relative depth of h_l", ylabel="max |x| / median |x|", yscale="log",
           title="largest activation over the median")
    ax.legend()
    figure = _save(fig, out, "f2_massive.png")
    verdict = combined_verdict(verdicts)
    toy = "; ".join(
        f"{m}: max |x| / median |x| of h_0 … h_L " + ", ".join(f"{x:.0f}" for x in v["ratio"])
        + f" (largest |x| {max(v['max_abs']):.1f})"
        + ("" if v["appear"] is None else f"; massive from h_{v['appear']}, Δ cross-entropy "
           f"zeroed {v['dce'].get('zero', 0):+.3f} vs mean {v['dce'].get('mean', 0):+.3f} nats")
        for m, v in values.items()
    )
    return Finding(
        key="massive_bias",
        title="Massive activations act as biases",
        paper="A few residual dimensions at a few tokens (the first, delimiters) reach ~1000× "
        "the median |activation|, appear abruptly at an early layer, stay nearly constant and "
        "vanish at the end; zeroing them destroys the model while setting them to their mean "
        "does not (Sun, Chen, Kolter, Liu 2024)",
        toy=toy,
        scaling="—",
        command=f"lensdiv analyze {sizes.outlier_models[-1]} --plugins massive "
        f"--max-tokens {sizes.outlier_tokens}",
        verdict=verdict,
        why="the toys have no massive activation: their largest entry is about ten times the "
        "median (at most "
        + f"{max(max(v['ratio']) for v in values.values()):.0f}×, |x| at most "
        + f"{max(max(v['max_abs']) for v in values.values()):.0f}), nowhere near 1000× or 100, "
        "so there is nothing to set to zero or to the mean "
        "(the removal itself is tested on a model with a planted one, tests/test_massive.py)"
        if verdict == NOT
        else "zeroing the massive entries costs much more than setting them to their mean"
        if verdict == REPRODUCED
        else "massive entries exist, but zeroing them costs less than ten times the mean's",
        figure=figure,
        values={"models": values, "verdicts": verdicts},
    )


@functools.cache
def _geometry(models: tuple[str, ...], tokens: int) -> dict[str, dict[str, Any]]:
    """``similarity`` and ``spectrum`` of each toy, one run each, read by the three rows."""
    found = {}
    for model in models:
        run = _analyze(model, "similarity,spectrum", tokens)
        found[model] = G.numbers(run["similarity"], run["spectrum"])
    return found


def _geometry_finding(key: str, sizes: Sizes, out: Path) -> Finding:
    found = _geometry(sizes.geometry_models, sizes.geometry_tokens)
    judged = {m: G.verdicts(v)[key] for m, v in found.items()}
    verdict = G.combined([v for v, _ in judged.values()])
    name = "g1_geometry.png"
    if key == "block_structure":  # one figure for the three rows
        _save(G.figure(found), out, name)
    toy = "; ".join(f"{m}: " + G.cell(key, found[m], v, info) for m, (v, info) in judged.items())
    per_model = ", ".join(f"{v} on {m}" for m, (v, _) in judged.items())
    why = (
        "the toys have no massive dimension to remove"
        if verdict == G.NOT_TESTABLE
        else f"{per_model} (the numbers are in the toy column)"
    )
    return Finding(
        key=key,
        title=G.TITLES[key],
        paper=G.PAPERS[key],
        toy=toy,
        scaling="—",
        command=f"lensdiv analyze {sizes.geometry_models[-1]} --plugins similarity,spectrum "
        f"--max-tokens {sizes.geometry_tokens}",
        verdict=verdict,
        why=why,
        figure=f"findings/{name}",
        values={"models": {m: info for m, (_, info) in judged.items()}},
    )


def block_structure(sizes: Sizes, out: Path) -> Finding:
    """The block structure of the layer × layer linear CKA."""
    return _geometry_finding("block_structure", sizes, out)


def entropy_dip(sizes: Sizes, out: Path) -> Finding:
    """Skean et al.'s mid-depth dip of the prompt-level matrix entropy."""
    return _geometry_finding("entropy_dip", sizes, out)


def cka_outliers(sizes: Sizes, out: Path) -> Finding:
    """How much the massive dimensions drive linear CKA."""
    return _geometry_finding("cka_outliers", sizes, out)


def _depth(model: str) -> int:
    """Blocks of a toy zoo spec (``toy:d8`` → 8; ``toy`` → the default depth)."""
    from lensdiv.models.toy import DEFAULT_DEPTH

    digits = model.split(":d")[-1].split("-")[0] if ":d" in model else ""
    return int(digits) if digits.isdigit() else DEFAULT_DEPTH


MEASUREMENTS: dict[str, Callable[[Sizes, Path], Finding]] = {
    "contribution": contribution,
    "skip": skip,
    "depth_score": depth_score,
    "linmap": linmap,
    "bias": bias,
    "submod": submod,
    "dynamics": dynamics,
    "chinchilla": chinchilla,
    "teacher_student": teacher_student,
    "tuned_lens": tuned_lens,
    "jacobian_lens": jacobian_lens,
    "patchscope_lens": patchscope_lens,
    "lens_bias": lens_bias,
    "study_alignment": study_alignment,
    "study_updates": study_updates,
    "prune_depth": prune_depth,
    "prune_ends": prune_ends,
    "reorder_swap": reorder_swap,
    "reorder_shuffle": reorder_shuffle,
    "sinks_form": sinks_form,
    "massive_bias": massive_bias,
    "block_structure": block_structure,
    "entropy_dip": entropy_dip,
    "cka_outliers": cka_outliers,
}
# Each finding's analysis in docs/science.md (its anchor there).
DEFINITIONS = {
    "tuned_lens": "tuned-lens",
    "jacobian_lens": "fit-jacobian",
    "patchscope_lens": "patchscope",
    "lens_bias": "lenses",
    "contribution": "contrib",
    "skip": "skip",
    "depth_score": "depth-score",
    "linmap": "linmap",
    "bias": "bias",
    "submod": "submod",
    "dynamics": "dynamics",
    "chinchilla": "scaling-fit",
    "teacher_student": "teacher-student",
    "study_alignment": "study",
    "study_updates": "study",
    "prune_depth": "prune",
    "prune_ends": "prune",
    "reorder_swap": "reorder",
    "reorder_shuffle": "reorder",
    "sinks_form": "sinks",
    "massive_bias": "massive",
    "block_structure": "similarity",
    "entropy_dip": "spectrum",
    "cka_outliers": "similarity",
}


# -- the document -------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def duration(seconds: float) -> str:
    """``72 s`` or ``12 min``."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def render(findings: list[Finding], run: dict[str, Any]) -> str:
    """The markdown of ``docs/findings.md``."""
    lines = [
        "# What lensdiv reproduces",
        "",
        "<!-- Generated by docs/findings.py (`make findings`); edit the script, not this file. -->",
        "",
        "One row per headline finding of the three papers lensdiv implements "
        "(defined in [science.md](science.md)): what the paper reports, what lensdiv measures "
        "on its toy zoo and on the scaling data, the command that measures it, and whether the "
        "finding is reproduced. Every number and figure below was measured by "
        "[`docs/findings.py`](findings.py) through lensdiv's public API (the teacher–student "
        "row's test losses as said below); every verdict follows from the rule given in its "
        "section. The papers: A — Csordás, Manning, Potts, *Do "
        "Language Models Use Their Depth Efficiently?* (NeurIPS 2025); B — Kamigaito et al., "
        "*Diversity of Transformer Layers: One Aspect of Parameter Scaling Laws* (2025); C — "
        "Liu, Kangaslahti, Liu, Gore, *Inverse Depth Scaling From Most Layers Being Similar* "
        "(ICML 2026); and the fitted lenses the depth analyses read layers through (D): "
        "Belrose et al., *Eliciting Latent Predictions from Transformers with the Tuned Lens* "
        "(2023), Gurnee et al., *Verbalizable Representations Form a Global Workspace in "
        "Language Models* (2026).",
        "",
        "The same findings on two real models, SmolLM2-135M and Gemma-3-270M (4-bit GGUF "
        "weights, dequantized), and what a second quantization changes: "
        "[findings_real.md](findings_real.md) (`make findings-real`).",
        "",
        f"**This run:** {run['date']}, `make findings` took {duration(run['wall_seconds'])} "
        f"of wall time and {duration(run['cpu_seconds'])} of CPU time on "
        f"{run['machine']} (load average {run['load_before']:.1f} at the start, "
        f"{run['load_after']:.1f} at the end; the machine is shared, so CPU time is the "
        f"comparable figure), {run['trained_note']}. lensdiv {run['versions'].get('lensdiv')}, "
        f"torch {run['versions'].get('torch')}; seeds are every analysis' default (0). Sizes: "
        f"`{run['sizes']}`. {run['teacher_student_note']} No GPU was lent to this work: the "
        "teacher–student `paper` preset (the source's 40k steps of 1024 inputs, a GPU job) has "
        "not been run.",
        "",
        "| finding | paper | lensdiv: toy zoo | lensdiv: scaling data | command | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for f in findings:
        lines.append(
            f"| [{_cell(f.title)}](#{f.key.replace('_', '-')}) | {_cell(f.paper)} | "
            f"{_cell(f.toy)} | {_cell(f.scaling)} | `{_cell(f.command)}` | "
            f"**{f.verdict}**: {_cell(f.why)} |"
        )
    for f in findings:
        anchor = DEFINITIONS[f.key]
        lines += [
            "",
            f'<a id="{f.key.replace("_", "-")}"></a>',
            f"## {f.title}",
            "",
            f"- **Paper:** {f.paper}.",
            f"- **Definitions:** [science.md#{anchor}](science.md#{anchor}).",
            f"- **Toy zoo:** {f.toy}.",
        ]
        if f.scaling != "—":
            lines.append(f"- **Scaling data:** {f.scaling}.")
        lines += [
            f"- **Command:** `{f.command}`",
            f"- **Verdict: {f.verdict}** — {f.why}. Rule: {RULES[f.key]}.",
            f"- Measured in {run['seconds'][f.key]:.0f} s."
            if not str(f.values.get("source", "")).startswith("recorded")
            else f"- Refitted in {run['seconds'][f.key]:.0f} s from the recorded trial "
            f"(training took {f.values['cpu_seconds']:.0f} CPU seconds).",
            "",
            f"![{f.title}]({f.figure})",
        ]
    lines.append("")
    return "\n".join(lines)


def _versions() -> dict[str, str]:
    from lensdiv.core.provenance import versions

    return dict(versions())


def main(argv: Sequence[str] | None = None) -> list[Finding]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the test's)")
    parser.add_argument("--out", type=Path, default=HERE, help="folder of findings.md")
    parser.add_argument("--only", help="comma-separated finding keys (default: all)")
    parser.add_argument(
        "--rerun-teacher-student",
        action="store_true",
        help="train the teacher-student preset (about 15 minutes on 2 cores) instead of reading "
        "its recorded run from bench/teacher_student_cpu.json",
    )
    args = parser.parse_args(argv)
    sizes = TINY if args.tiny else FULL
    if args.rerun_teacher_student:
        sizes = dataclasses.replace(sizes, teacher_student_record=None)
    keys = args.only.split(",") if args.only else list(MEASUREMENTS)
    import torch

    torch.set_num_threads(1)  # the models are small; see the teacher-student --threads help
    load_before = os.getloadavg()[0]
    cached_before = _cached_toys()
    started, cpu0 = time.time(), _cpu_seconds()
    findings, seconds = [], {}
    for key in keys:
        t0 = time.time()
        print(f"measuring {key} ...", file=sys.stderr, flush=True)
        findings.append(MEASUREMENTS[key](sizes, args.out))
        seconds[key] = time.time() - t0
    run = {
        "date": time.strftime("%Y-%m-%d"),
        "wall_seconds": time.time() - started,
        "cpu_seconds": _cpu_seconds() - cpu0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "machine": f"{os.cpu_count()} CPU cores, one torch thread",
        "trained_note": _trained_note(sorted(_cached_toys() - cached_before)),
        "teacher_student_note": (
            "The teacher–student row reads its preset's run recorded in "
            f"`{sizes.teacher_student_record}` (by `bench/teacher_student_cpu.py`, about 15 "
            "minutes of training) and refits α_ℓ from its test losses; "
            "`python docs/findings.py --rerun-teacher-student` trains it again."
            if sizes.teacher_student_record
            else "The teacher–student row was trained by this run."
        ),
        "versions": _versions(),
        "sizes": _sizes_text(sizes),
        "seconds": seconds,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if args.only:  # measure these again; the other rows stay as the last full run left them
        findings, run = _with_recorded(findings, run, args.out / "findings.json")
    (args.out / "findings.md").write_text(render(findings, run))
    record = {"run": run, "sizes": dataclasses.asdict(sizes), "rules": RULES,
              "findings": [dataclasses.asdict(f) for f in findings]}  # fmt: skip
    (args.out / "findings.json").write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    return findings


def _with_recorded(
    findings: list[Finding], run: dict[str, Any], path: Path
) -> tuple[list[Finding], dict[str, Any]]:
    """``findings`` merged into the rows recorded in ``path`` (by key, in the order of
    :data:`MEASUREMENTS`); the run's figures are the recorded ones, with these rows' seconds."""
    if not path.is_file():
        return findings, run
    recorded = json.loads(path.read_text())
    rows = {f["key"]: Finding(**f) for f in recorded["findings"]}
    rows.update({f.key: f for f in findings})
    merged = {**recorded["run"], "seconds": {**recorded["run"]["seconds"], **run["seconds"]}}
    return [rows[k] for k in MEASUREMENTS if k in rows], merged


def _cached_toys() -> set[str]:
    """The toy models of the zoo (with its default recipes) cached now."""
    from lensdiv.models.toy import cached_log, zoo

    return {spec.name for spec in zoo() if cached_log(spec) is not None}


def _trained_note(trained: list[str]) -> str:
    if trained:
        return "including training the toy models that were not cached: " + ", ".join(trained)
    from lensdiv.models.toy import cached_log, zoo

    logs = [log for log in map(cached_log, zoo()) if log is not None]
    minutes = sum(log["train_seconds"] for log in logs) / 60
    return (
        "with the toy models already cached by earlier uses (`lensdiv toy train --all`; their "
        f"training logs record {minutes:.0f} minutes of wall time for the {len(logs)} cached)"
    )


def _sizes_text(sizes: Sizes) -> str:
    fields = dataclasses.asdict(sizes)
    return ", ".join(f"{k}={v}" for k, v in fields.items() if v not in ({}, ()))


def _cpu_seconds() -> float:
    """CPU seconds of this process and of every child it waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


if __name__ == "__main__":
    main()
