"""The whole fit of runs (or of a CSV or built-in table of runs) as a ``scaling`` Result.

The :class:`~lensdiv.core.results.Result` holds the parameters with their errors, each run's
residual, the held-out error and one log-log plot per term.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lensdiv.core.errors import DataError, OptionError
from lensdiv.core.provenance import versions
from lensdiv.core.results import Plot, Result, Table
from lensdiv.studies.scaling.datasets import builtin_dataset
from lensdiv.studies.scaling.fit import (
    ScalingFit,
    Uncertainty,
    bootstrap,
    cross_validate,
    fit_law,
    intervals,
)
from lensdiv.studies.scaling.law import SYMBOLS, TERMS, formula, parse_terms
from lensdiv.studies.scaling.runs import Runs, read_runs, varying_terms


def fit_runs(
    runs: Runs,
    terms: str | Sequence[str] | None = None,
    *,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
    notes: Sequence[str] = (),
    meta: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Result:
    """Fit the law to runs, with Jacobian errors, a bootstrap and held-out error.

    Args:
        runs: The runs (constant size columns are dropped from the fit, with a note).
        terms: Terms to fit (see :func:`~lensdiv.studies.scaling.law.parse_terms`); default:
            every size the runs have.
        n_bootstrap, folds, seed, confidence: How the uncertainty is measured (see
            :class:`~lensdiv.studies.scaling.fit.Uncertainty`).
        notes: Sentences to add to the summary (e.g. why a term was dropped earlier).
        meta: Extra settings to record (source, columns, offsets ...).
        extra: Extra per-run columns for the data table (e.g. parameter counts).

    Returns:
        A ``scaling`` :class:`~lensdiv.core.results.Result`: tables ``parameters``, ``runs`` and
        ``heldout``, one log-log plot per term, and the settings in ``meta``.

    Raises:
        DataError: Too few runs for the parameters (or for the folds), or nothing varies.
        OptionError: Bad counts or confidence.
    """
    uncertainty = Uncertainty(n_bootstrap, folds, seed, confidence)
    return scaling_result(runs, terms, uncertainty, notes=notes, meta=meta, extra=extra)


def scaling_result(
    runs: Runs,
    terms: str | Sequence[str] | None,
    uncertainty: Uncertainty,
    *,
    notes: Sequence[str] = (),
    meta: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Result:
    """:func:`fit_runs` with its uncertainty settings already checked."""
    folds = uncertainty.folds
    fitted, dropped = varying_terms(runs, _available(runs, terms))
    notes = [*notes, *dropped]
    p = 2 * len(fitted) + 1
    if len(runs) <= p:
        raise DataError(
            f"{len(runs)} runs cannot fit {p} parameters ({formula(fitted)}): need more runs "
            "than parameters",
            hint="add runs, or fit fewer terms with --terms",
        )
    if folds and len(runs) - math.ceil(len(runs) / folds) <= p:
        raise DataError(
            f"{folds}-fold held-out fits of {len(runs)} runs leave too few runs for {p} parameters",
            hint="use fewer --folds, or --folds 0 to skip the held-out check",
        )
    fit = fit_law(runs, fitted)
    boot = bootstrap(runs, fit, uncertainty.n_bootstrap, seed=uncertainty.seed)
    bounds = intervals(boot, uncertainty.confidence, len(fit.names))
    heldout = cross_validate(runs, fit, folds, seed=uncertainty.seed) if folds else None
    if np.isnan(fit.cov).any():
        notes.append("JᵀJ is singular, so the parameters are not all identifiable (stderr NaN)")
    settings = {
        **(meta or {}),
        "terms": list(fit.terms),
        "formula": formula(fit.terms),
        "scales": dict(fit.scales),
        "n_runs": len(runs),
        "mse_log_loss": fit.mse,
        "seed": uncertainty.seed,
        "n_bootstrap": uncertainty.n_bootstrap,
        "confidence": uncertainty.confidence,
        "folds": folds,
        "notes": notes,
        "versions": versions("scipy"),
    }
    return Result(
        analyzer="scaling",
        summary=_summary(fit, bounds, heldout, uncertainty.confidence, notes),
        tables={
            "parameters": _parameter_table(fit, bounds, uncertainty.confidence),
            "runs": _runs_table(runs, fit, extra),
            "heldout": _heldout_table(heldout, fit),
            **{f"{t}_term": _term_table(runs, fit, t) for t in fit.terms},
        },
        plots=tuple(_term_plot(t) for t in fit.terms),
        meta=settings,
    )


def fit_csv(
    source: str | Path,
    terms: str | Sequence[str] = "full",
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    drop_highest: int = 0,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
) -> Result:
    """Read runs from a CSV or a built-in table (see
    :func:`~lensdiv.studies.scaling.runs.read_runs`) and fit them (see :func:`fit_runs`).

    Example: the source's Chinchilla fit, on the built-in table, is
    ``fit_csv("chinchilla", drop_highest=40, depth_offset=-2)``.
    """
    terms = parse_terms(terms)
    uncertainty = Uncertainty(n_bootstrap, folds, seed, confidence)
    read = read_runs(source, terms, columns=columns, depth_offset=depth_offset)
    runs = read.drop_highest(drop_highest)
    kept = set(runs.labels)
    dropped = [label for label in read.labels if label not in kept]
    notes = []
    if dropped:
        ties = (
            f", {len(dropped) - drop_highest} more tied with the last"
            if len(dropped) > drop_highest
            else ""
        )
        notes.append(f"dropped the {drop_highest} highest-loss runs of {len(read)}{ties}")
    dataset = builtin_dataset(source)
    meta = {
        "source": read.source,
        **({"citation": dataset.citation} if dataset else {}),
        "columns": dict(runs.columns),
        "depth_offset": depth_offset,
        "drop_highest": drop_highest,
        "dropped": dropped,
    }
    return scaling_result(runs, terms, uncertainty, notes=notes, meta=meta)


def _available(runs: Runs, terms: str | Sequence[str] | None) -> tuple[str, ...]:
    """The requested terms (default: all the runs have), each of which the runs must have."""
    if terms is None:
        return tuple(t for t in TERMS if t in runs.sizes)
    wanted = parse_terms(terms)
    missing = [t for t in wanted if t not in runs.sizes]
    if missing:
        raise OptionError(
            f"the runs have no {', '.join(missing)} sizes (they have: {', '.join(runs.sizes)})",
            hint="read them with these terms, or fit fewer terms",
        )
    return wanted


def _parameter_table(
    fit: ScalingFit, bounds: tuple[np.ndarray, np.ndarray], confidence: float
) -> Table:
    values, errors = fit.values(), fit.stderr()
    scales = [fit.scales[name.split("_", 1)[1]] if "_" in name else math.nan for name in fit.names]
    return Table(
        "parameters",
        {
            "name": fit.names,
            "value": [values[n] for n in fit.names],
            "stderr": [errors[n] for n in fit.names],
            "ci_low": bounds[0],
            "ci_high": bounds[1],
            "scale": scales,
        },
        f"{formula(fit.terms)}: value, Jacobian stderr, bootstrap {confidence:.0%} interval; "
        "scale = the size's reference scale inside the fit",
    )


def _runs_table(runs: Runs, fit: ScalingFit, extra: Mapping[str, Any] | None) -> Table:
    predicted = fit.predict(runs.sizes)
    columns: dict[str, Any] = {"run": list(runs.labels), "loss": runs.loss}
    columns |= {t: runs.sizes[t] for t in fit.terms}
    columns |= dict(extra or {})
    columns |= {"predicted": predicted, "log_residual": np.log(runs.loss / predicted)}
    return Table("runs", columns, "each run: loss, sizes, the fit's prediction and log residual")


def _heldout_table(heldout: dict[str, list[Any]] | None, fit: ScalingFit) -> Table:
    """The folds, their mean, and the in-sample error of the fit to every run."""
    keys = ("fold", "n_train", "n_test", "train_rmse", "test_rmse")
    rows = {k: list((heldout or {}).get(k, [])) for k in keys}
    extra: list[tuple[Any, ...]] = [("in-sample", fit.n_runs, 0, math.sqrt(fit.mse), math.nan)]
    if heldout:
        extra.insert(0, ("mean", *(float(np.mean(rows[k])) for k in keys[1:])))
    for row in extra:
        for key, value in zip(keys, row, strict=True):
            rows[key].append(value)
    return Table("heldout", rows, "RMSE of log-loss on the training and held-out runs per fold")


def _term_table(runs: Runs, fit: ScalingFit, term: str) -> Table:
    """One term's fitted curve and its share of the data (``L`` minus the other terms and
    ``L0``), stacked long so one plot shows both."""
    parts = fit.parts(runs.sizes)
    others = sum((v for t, v in parts.items() if t != term), np.zeros(len(runs)))
    observed = runs.loss - others - fit.values()["L0"]
    x = runs.sizes[term]
    grid = np.geomspace(x.min(), x.max(), 50)
    curve = fit.values()[f"c_{term}"] / grid ** fit.values()[f"alpha_{term}"]
    return Table(
        f"{term}_term",
        {
            term: [*grid, *x],  # the curve first, so the data is drawn on top of it
            "value": [*curve, *np.where(observed > 0, observed, np.nan)],
            "series": ["fit"] * len(grid) + ["data"] * len(x),
        },
        f"the {term} term: data minus the other fitted terms and L0 (NaN if not positive), "
        "and the fitted power law",
    )


def _term_plot(term: str) -> Plot:
    symbol = SYMBOLS[term]
    return Plot(
        "line",
        f"{term}_term",
        f"{term} term: c_{symbol}/{symbol}^α_{symbol}",
        source=f"{term}_term",
        x=term,
        y=("value",),
        xlabel=f"{term} {symbol}",
        ylabel="L − other terms − L0",
        logx=True,
        logy=True,
        group="series",
        points=("data",),
    )


def _summary(
    fit: ScalingFit,
    bounds: tuple[np.ndarray, np.ndarray],
    heldout: dict[str, list[Any]] | None,
    confidence: float,
    notes: Sequence[str],
) -> str:
    values, errors = fit.values(), fit.stderr()
    exponents = []
    for t in sorted(fit.terms, key=lambda t: t != "depth"):  # depth first: it is the question
        name = f"alpha_{t}"
        text = f"α_{SYMBOLS[t]} = {values[name]:.3f} ± {errors[name]:.3f}"
        low, high = (float(bound[fit.names.index(name)]) for bound in bounds)
        if not math.isnan(low):
            text += f" (bootstrap {confidence:.0%} interval {low:.3f} to {high:.3f})"
        exponents.append(text)
    lead = "Depth exponent " if "depth" in fit.terms else "Exponent "
    out = lead + "; ".join(exponents)
    out += f", fitting {formula(fit.terms)} to {fit.n_runs} runs (± is the Jacobian stderr)."
    out += f" RMSE of log-loss {math.sqrt(fit.mse):.4f} in sample"
    if heldout:
        test = float(np.mean(heldout["test_rmse"]))
        out += f", {test:.4f} held out ({len(heldout['fold'])}-fold)"
    return " ".join([out + ".", *(f"{n[0].upper()}{n[1:]}." for n in notes)])
