"""The result of ``submod``: tables, arrays, plots, summary and metadata of
:class:`~lensdiv.analyzers.submod.curves.SubmodCurves`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from lensdiv.analyzers.submod.curves import SubmodCurves
from lensdiv.analyzers.submod.setfunction import Curve
from lensdiv.core.results import Plot, Result, Table

if TYPE_CHECKING:  # the analyzer imports this module; its type is only an annotation here
    from lensdiv.analyzers.submod import Submodularity


def present(curves: SubmodCurves, options: Submodularity) -> Result:
    """The prefix, block, greedy, fit, unit and triple tables, the curves, summary and meta."""
    stats, names, K = curves.stats, curves.units, curves.plan.n_units
    masks = sorted(curves.subsets)
    return Result(
        analyzer=options.name,
        summary=_summary(curves, options),
        tables=_tables(curves, _unit_word(options)),
        arrays={
            "prefix_F": np.asarray(stats.prefix.values),
            "greedy_F": np.asarray(stats.greedy_values),
            "subsets": np.asarray(
                [[m >> u & 1 for u in range(K)] for m in masks], dtype=float
            ).reshape(len(masks), K),
            "subset_F": np.asarray([curves.subsets[m] for m in masks]),
        },
        plots=_plots(options),
        meta={
            "units": names,
            "n_units": K,
            "positions": curves.positions,
            "subsets_evaluated": len(curves.subsets),
            "constant_handling": _constant_note(options),
            "sampling": (
                "with replacement, uniform over (j, S, T) with S ⊊ T ⊆ U∖{j}: j uniform, "
                "other units in S / T∖S / outside T w.p. 1/3 each, redrawn if S = T"
            ),
            "triples": len(curves.plan.triples),
            "greedy_steps": len(stats.greedy),
            "greedy_order": [names[u] for u in stats.greedy],
            "resume": curves.resume,
        },
    )


def _tables(curves: SubmodCurves, word: str) -> dict[str, Table]:
    """``prefix`` (and ``blocks``), ``greedy``, ``fit``, ``units`` and ``triples``."""
    stats, names, nan = curves.stats, curves.units, math.nan
    tables = {
        "prefix": _curve_table(
            "prefix",
            stats.prefix,
            ["(none)", *names],
            f"F of the first k {word} in depth order; gain = F(k) − F(k−1); "
            "diminishing: the next gain is no larger",
        )
    }
    if curves.blocks is not None:
        n_blocks = len(curves.blocks.values) - 1
        tables["blocks"] = _curve_table(
            "blocks",
            curves.blocks,
            ["embed", *[f"block{layer}" for layer in range(n_blocks)]],
            "Direct path of the embedding and the first k blocks (k = 0..L); log fit over k = 1..L",
        )
    tables["greedy"] = Table(
        "greedy",
        {
            "step": list(range(len(stats.greedy_values))),
            "added": ["(none)", *[names[u] for u in stats.greedy]],
            "F": stats.greedy_values,
            "gain": [nan, *curves.greedy_gains],
        },
        "Greedy curve: each step adds the unit with the largest F",
    )
    headline = curves.headline
    tables["fit"] = Table(
        "fit",
        {"statistic": list(headline), "value": list(headline.values())},
        "Headline statistics",
    )
    tables["units"] = Table(
        "units",
        {
            "unit": names,
            "alone": stats.alone,
            "last": stats.last,
            "alone_minus_last": [x - y for x, y in zip(stats.alone, stats.last, strict=True)],
        },
        "Each unit's gain added first (alone = F({i}) − F(∅)) and last (F(U) − F(U∖{i}))",
    )
    triples = curves.plan.triples
    gain_s, gain_t = curves.triple_gains()
    tables["triples"] = Table(
        "triples",
        {
            "j": [names[j] for _, _, j in triples],
            "size_S": [bin(s).count("1") for s, _, _ in triples],
            "size_T": [bin(t).count("1") for _, t, _ in triples],
            "gain_S": gain_s,
            "gain_T": gain_t,
            "margin": stats.margins,
        },
        "Sampled S ⊊ T, j ∉ T: margin = gain at S − gain at T (< −tol: violation)",
    )
    return tables


def _curve_table(name: str, c: Curve, added: list[str], description: str) -> Table:
    """A curve ``F(k)`` with its gains, log fit and diminishing steps, one row per ``k``."""
    nan = math.nan
    a, b, _ = c.fit
    K = len(c.gains)
    return Table(
        name,
        {
            "k": list(range(K + 1)),
            "added": added,
            "F": c.values,
            "gain": [nan, *c.gains],
            "fit": [nan]
            + [a + b * math.log(k) if not math.isnan(b) else nan for k in range(1, K + 1)],
            "diminishing": [nan, *[float(d) for d in c.diminishing], nan] if K else [nan],
        },
        description,
    )


def _plots(options: Submodularity) -> tuple[Plot, ...]:
    """The prefix curve with its log fit, its gains, and the greedy curve."""
    word = _unit_word(options)
    label = _metric_label(options)
    if "(" not in label:  # an axis says its unit
        label += " (fraction)"
    return (
        Plot(
            "line",
            "submod_prefix",
            f"F(k) over the first k {word} and a + b log k",
            "prefix",
            x="k",
            y=("F", "fit"),
            labels=("F(k)", "a + b log k (least squares)"),
            xlabel=f"k ({word} in depth order)",
            ylabel=label,
        ),
        Plot(
            "line",
            "submod_gains",
            "Marginal gains Δ_k = F(k) − F(k−1)",
            "prefix",
            x="k",
            y=("gain",),
            xlabel=f"k ({word} in depth order)",
            ylabel=f"gain Δ_k of {label}",
            signed=True,
            caption="Diminishing returns (submodularity): each gain at most the one before it.",
        ),
        Plot(
            "line",
            "submod_greedy",
            "Greedy curve",
            "greedy",
            x="step",
            y=("F",),
            xlabel=f"greedy step (number of {word} chosen)",
            ylabel=label,
        ),
    )


def _unit_word(options: Submodularity) -> str:
    return "members" if options.mode == "direct" else "blocks"


def _metric_label(options: Submodularity) -> str:
    return "−CE (nats)" if options.metric == "neg_ce" else "top-1 accuracy"


def _constant_note(options: Submodularity) -> str:
    if options.mode == "removal":
        return "none: true removal; the final norm and unembedding read the reduced residual"
    if options.constant == "full":
        return "z_S = Σ_{i∈S} z_i + (β·W_U + b_U): every subset gets the whole constant"
    return "z_S = Σ_{i∈S} z_i + |S|/M·(β·W_U + b_U): the constant shared equally by members"


def _summary(curves: SubmodCurves, options: Submodularity) -> str:
    """From ``F(∅)`` to ``F(U)``, the shape of the curves, the violations and the greedy start."""
    stats, names = curves.stats, curves.units
    K = len(names)
    what = "members (direct-path logit sums)" if options.mode == "direct" else "blocks (removal)"
    parts = [
        f"{_metric_label(options)} of the first k of {K} {what}: F goes from "
        f"{stats.prefix.values[0]:.4g} (none) to {stats.prefix.values[-1]:.4g} (all)."
    ]
    parts.append("By " + _unit_word(options) + ": " + _describe(stats.prefix))
    if curves.blocks is not None:
        parts.append("By whole blocks (embedding first): " + _describe(curves.blocks))
    if stats.margins:
        parts.append(
            f"Submodularity fails in {stats.violations}/{len(stats.margins)} sampled nested "
            f"pairs ({stats.violation_rate:.0%}, tol {options.tol:g}); a unit helps at least as "
            f"much added first as added last for {curves.alone_ge_last}/{K}."
        )
    if stats.greedy:
        first = ", ".join(names[u] for u in stats.greedy[:4])
        parts.append(f"Greedy adds {first}{', …' if len(stats.greedy) > 4 else ''} first.")
    return " ".join(parts)


def _describe(c: Curve) -> str:
    """One sentence on a curve's shape."""
    frac = c.diminishing_fraction
    if not c.diminishing:
        return "too few points to judge the gains."
    verdict = (
        "diminishing"
        if frac >= 0.75
        else "partly diminishing"
        if frac >= 0.5
        else "not diminishing"
    )
    text = (
        f"gains are {verdict} (Δ_(k+1) ≤ Δ_k at {sum(c.diminishing)}/{len(c.diminishing)} "
        f"steps, {frac:.0%})"
    )
    a, b, r2 = c.fit
    if len(c.gains) >= 3:
        text += f"; F(k) ≈ {a:.4g} + {b:.4g}·log k, R² = {r2:.3f}"
    return text + "."
