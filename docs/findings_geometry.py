"""The findings of the representation's geometry (issue 44), shared by ``docs/findings.py`` (the
toys) and ``docs/findings_real.py`` (the real models): their rules, the pure functions that turn a
``similarity`` and a ``spectrum`` result into verdicts (the tests check them on made-up numbers),
and their figure.

- **Block structure** (Kornblith et al. 2019; Nguyen, Raghu, Kornblith 2021; the pruning papers'
  reading of it, Gromov et al. 2024, Men et al. 2024): the layer × layer linear CKA matrix has a
  block of consecutive states that all represent alike, in the second half of the model.
- **The mid-depth entropy dip** (Skean et al. 2025, "Layer by Layer", arXiv 2502.02013): the
  prompt-level matrix entropy is lowest at intermediate depth, not at the ends.
- **Outliers drive CKA** (Davari et al. 2022, arXiv 2210.16156): a few dimensions decide linear
  CKA; in language models the candidates are the massive activations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

REPRODUCED, PARTLY, NOT = "reproduced", "partly", "not reproduced"
NOT_TESTABLE = f"{NOT} (not testable)"

#: Linear CKA at or above this is "represents alike" for the block structure.
BLOCK_CKA = 0.9
#: |Δ linear CKA| from removing the massive dimensions that counts as driving it / as visible.
DRIVES, VISIBLE = 0.1, 0.02

RULES = {
    "block_structure": f"the longest run of consecutive residual states whose linear CKA with "
    f"each other is at least {BLOCK_CKA} (every pair of the run): reproduced if it spans at "
    "least a quarter of the states (and at least 3) and its centre lies in the second half; "
    "partly if it spans a quarter elsewhere; not reproduced otherwise; over the models: "
    "reproduced on all, not reproduced on none, partly otherwise",
    "entropy_dip": "the prompt-level matrix entropy (Skean et al.'s: α = 1, of each prompt's "
    "token Gram normalised to unit trace, in nats, averaged over prompts) over h_0 … h_L: reproduced if its minimum lies at relative depth "
    "0.2–0.8 and is below both ends by more than twice the combined standard error; partly if "
    "the minimum lies there but is not that far below both ends; not reproduced if it lies "
    "in the first or last fifth; over the models as for `block_structure`",
    "cka_outliers": f"with the massive dimensions (as `massive` defines them: |x| > 100 and "
    f"> 1000× the state's median) removed, the largest change of any linear CKA entry: "
    f"reproduced if it is at least {DRIVES}, partly if at least {VISIBLE}, not reproduced if "
    "smaller; not testable on a model without massive dimensions; over the models as for "
    "`block_structure` (untestable models left out)",
}

PAPERS = {
    "block_structure": "The layer × layer similarity of a deep network's representations has "
    "a block structure: many consecutive layers represent alike (Kornblith et al. 2019; "
    "Nguyen, Raghu, Kornblith 2021), which the pruning papers read as redundancy of the deeper "
    "layers of LLMs (Gromov et al. 2024; Men et al. 2024, ShortGPT)",
    "entropy_dip": "The prompt-level matrix entropy of autoregressive LLMs dips at "
    "intermediate depth, where the representations are most compressed, and those layers "
    "serve downstream tasks better than the last (Skean et al. 2025, Layer by Layer, Fig. 2)",
    "cka_outliers": "CKA is dominated by a few outlier dimensions: removing them can change "
    "the similarity a lot (Davari et al. 2022); in language models those are the massive "
    "activations (Sun et al. 2024)",
}

TITLES = {
    "block_structure": "Consecutive layers form a block of alike representations",
    "entropy_dip": "Matrix entropy dips at mid-depth",
    "cka_outliers": "A few massive dimensions drive CKA",
}


def longest_block(cka: np.ndarray, threshold: float = BLOCK_CKA) -> tuple[int, int]:
    """``(first, last)`` state of the longest run of consecutive states whose CKA with each
    other is at least ``threshold`` (every pair; the earliest of equally long runs)."""
    n = len(cka)
    best = (0, 0)
    for a in range(n):
        b = a
        while b + 1 < n and np.nanmin(cka[a : b + 2, a : b + 2]) >= threshold:
            b += 1
        if b - a > best[1] - best[0]:
            best = (a, b)
    return best


def block_verdict(cka: np.ndarray) -> tuple[str, dict[str, Any]]:
    """:data:`RULES` ``block_structure`` on one model's linear CKA matrix over h_0 … h_L."""
    a, b = longest_block(cka)
    states = len(cka)
    L = states - 1
    span = b - a + 1
    wide = span >= max(3, math.ceil(states / 4))
    late = (a + b) / 2 >= L / 2
    verdict = REPRODUCED if wide and late else PARTLY if wide else NOT
    off = cka[~np.eye(states, dtype=bool)]
    return verdict, {"first": a, "last": b, "span": span, "states": states,
                     "next_mean": float(np.mean(np.diag(cka, 1))), "mean_off": float(off.mean())}


def dip_verdict(entropy: Sequence[float], se: Sequence[float]) -> tuple[str, dict[str, Any]]:
    """:data:`RULES` ``entropy_dip`` on one model's entropy (and its standard errors) over
    h_0 … h_L."""
    e, s = np.asarray(entropy, float), np.nan_to_num(np.asarray(se, float))
    L = len(e) - 1
    low = int(np.nanargmin(e))
    depth = low / L
    below = [bool(e[end] - e[low] > 2 * math.hypot(s[end], s[low])) for end in (0, L)]
    middle = 0.2 <= depth <= 0.8
    verdict = REPRODUCED if middle and all(below) else PARTLY if middle else NOT
    return verdict, {"lowest": low, "relative_depth": depth, "entropy": e.tolist(),
                     "below_first": below[0], "below_last": below[1]}


def outlier_verdict(change: np.ndarray, massive_dims: Sequence[int]) -> tuple[str, dict[str, Any]]:
    """:data:`RULES` ``cka_outliers`` on the matrix of (no massive − all) linear CKA."""
    largest = float(np.nanmax(np.abs(change))) if np.isfinite(change).any() else 0.0
    info = {"max_abs_change": largest, "massive_dims": list(massive_dims)}
    if not massive_dims:
        return NOT_TESTABLE, info
    verdict = REPRODUCED if largest >= DRIVES else PARTLY if largest >= VISIBLE else NOT
    return verdict, info


def combined(verdicts: Sequence[str]) -> str:
    """Over the models (untestable ones left out): reproduced on all, on none, or on some."""
    tested = [v for v in verdicts if v != NOT_TESTABLE]
    if not tested:
        return NOT_TESTABLE
    if all(v == REPRODUCED for v in tested):
        return REPRODUCED
    if all(v == NOT for v in tested):
        return NOT
    return PARTLY


def numbers(similarity: Any, spectrum: Any) -> dict[str, Any]:
    """What the three rows read from a ``similarity`` and a ``spectrum`` result (a
    :class:`lensdiv.Result`), as plain lists."""
    table = spectrum.table("spectrum")
    clean = spectrum.tables.get("spectrum_no_massive")
    return {
        "prompt_entropy_no_massive": None
        if clean is None
        else [float(x) for x in clean["prompt_entropy"]],
        "cka": np.asarray(similarity.arrays["linear_all"], float).tolist(),
        "cka_no_sink": np.asarray(similarity.arrays["linear_no_sink"], float).tolist(),
        "change": np.asarray(similarity.arrays["linear_outlier_change"], float).tolist(),
        "massive_dims": [int(d) for d in similarity.meta.get("massive_dims") or []],
        "prompt_entropy": [float(x) for x in table["prompt_entropy"]],
        "prompt_entropy_se": [float(x) for x in table["prompt_entropy_se"]],
        "dataset_entropy": [float(x) for x in table["dataset_entropy"]],
        "token_erank": [float(x) for x in table["token_erank"]],
    }


def verdicts(found: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """The three verdicts (and what they read) of one model's :func:`numbers`."""
    return {
        "block_structure": block_verdict(np.asarray(found["cka"], float)),
        "entropy_dip": dip_verdict(found["prompt_entropy"], found["prompt_entropy_se"]),
        "cka_outliers": outlier_verdict(np.asarray(found["change"], float),
                                        found["massive_dims"]),
    }


def cell(key: str, found: dict[str, Any], verdict: str, info: dict[str, Any]) -> str:
    """One model's cell of row ``key``."""
    if key == "block_structure":
        return (f"longest block of linear CKA ≥ {BLOCK_CKA}: h_{info['first']}–h_{info['last']} "
                f"({info['span']} of {info['states']} states); consecutive states' CKA mean "
                f"{info['next_mean']:.2f}, all pairs' {info['mean_off']:.2f} → **{verdict}**")
    if key == "entropy_dip":
        e, L = info["entropy"], len(info["entropy"]) - 1
        text = (f"prompt entropy lowest at h_{info['lowest']} (ℓ/L "
                f"{info['relative_depth']:.2f}): {e[info['lowest']]:.3f} against h_0 {e[0]:.3f} "
                f"and h_{L} {e[L]:.3f} nats")
        clean = found.get("prompt_entropy_no_massive")
        if clean and found.get("massive_dims"):
            low = int(np.nanargmin(clean))
            text += (f"; with the massive dimensions removed, lowest at h_{low} ({clean[low]:.3f}"
                     f" nats, h_0 {clean[0]:.3f}, h_{L} {clean[L]:.3f})")
        return f"{text} → **{verdict}**"
    dims = ", ".join(map(str, info["massive_dims"][:4])) or "none"
    sink = np.asarray(found["cka_no_sink"], float) - np.asarray(found["cka"], float)
    return (f"massive dimensions {dims}; removing them moves linear CKA by up to "
            f"{info['max_abs_change']:.3f}, leaving out position 0 by up to "
            f"{float(np.nanmax(np.abs(sink))):.3f} → **{verdict}**")


def figure(found_by_model: dict[str, dict[str, Any]], styles: dict[str, str] | None = None) -> Any:
    """Linear CKA of each model (a fixed 0–1 scale, the block outlined), its prompt entropy by
    relative depth, and the CKA change from removing the massive dimensions."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    models = list(found_by_model)
    fig = Figure(figsize=(3.2 * len(models) + 8.5, 3.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(models) + 2)
    image = None
    for ax, m in zip(axes, models, strict=False):
        cka = np.asarray(found_by_model[m]["cka"], float)
        image = ax.imshow(cka, origin="lower", cmap="viridis", vmin=0.0, vmax=1.0)
        a, b = longest_block(cka)
        ax.add_patch(Rectangle((a - 0.5, a - 0.5), b - a + 1, b - a + 1, fill=False, ec="red",
                               lw=1.2))
        ax.set(title=f"{m}: linear CKA", xlabel="h_l", ylabel="h_l")
    if image is not None:
        fig.colorbar(image, ax=axes[len(models) - 1], label="linear CKA (fixed scale 0–1)")
    entropy_ax, change_ax = axes[-2], axes[-1]
    for m, found in found_by_model.items():
        style = (styles or {}).get(m, "o-")
        e = np.asarray(found["prompt_entropy"], float)
        se = np.nan_to_num(np.asarray(found["prompt_entropy_se"], float))
        depth = np.arange(len(e)) / (len(e) - 1)
        entropy_ax.errorbar(depth, e, yerr=se, fmt=style, ms=3, label=m)
        change = np.abs(np.asarray(found["change"], float))
        change_ax.plot(depth, np.nanmax(change, axis=1), style, ms=3, label=m)
    entropy_ax.axvspan(0.2, 0.8, color="grey", alpha=0.1, lw=0)
    entropy_ax.set_ylim(bottom=0)
    entropy_ax.set(xlabel="relative depth ℓ/L", ylabel="prompt matrix entropy (nats)",
                   title="entropy by depth (± SE; 0.2–0.8 shaded)")
    change_ax.axhline(DRIVES, color="grey", lw=0.8, ls=":", label=f"{DRIVES}: drives CKA")
    change_ax.axhline(VISIBLE, color="grey", lw=0.8, ls="--", label=f"{VISIBLE}: visible")
    change_ax.set(xlabel="relative depth ℓ/L of h_l", ylabel="max |Δ linear CKA| of row l",
                  ylim=(0, 1), title="massive dimensions removed")
    for ax in (entropy_ax, change_ax):
        ax.legend(fontsize=6)
    return fig
