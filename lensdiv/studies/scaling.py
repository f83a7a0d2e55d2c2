"""Depth scaling laws (SCIENCE.md C2): fit ``L = c_m/m^α_m + c_ℓ/ℓ^α_ℓ + c_D/D^α_D + L0`` to runs.

The runs come from a CSV of training runs (the Chinchilla table, say) or are collected by
evaluating a family of models on the same tokens. The fit minimises the mean squared error of
log-loss with scipy's trust-region least squares from a grid of starts. Inside the fit each size
is divided by a fixed reference scale (the power of ten nearest its geometric mean) and positive
quantities are optimised as logs, so the problem is well conditioned; the reported coefficients
are in the data's own units. Uncertainty comes three ways: standard errors from the Jacobian
(``Cov = σ² (JᵀJ)⁻¹``), a bootstrap over runs (percentile intervals) and k-fold held-out error.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float

from lensdiv.core.errors import DataError, OptionError, did_you_mean
from lensdiv.core.results import Plot, Result, Table

# The size variables, in the order they appear in the law, with their symbols.
TERMS = ("width", "depth", "tokens")
SYMBOLS = {"width": "m", "depth": "ℓ", "tokens": "D"}
ROLES = ("loss", *TERMS)
DEFAULT_COLUMNS = {"loss": "loss", "width": "d_model", "depth": "n_layers", "tokens": "num_tokens"}
# Model-family shortcuts for `lensdiv scaling family`: the toy zoo's depth and width families.
FAMILIES = {
    "zoo:depth": ("toy:d1", "toy:d2", "toy:d3", "toy:d4", "toy:d6", "toy:d8"),
    "zoo:width": ("toy:d4-w32", "toy:d4-w64", "toy:d4-w128"),
}
# Grid of starts: the floor L0 as a fraction of the lowest loss, and each exponent.
_FLOOR_FRACTIONS = (0.1, 0.5, 0.9)
_START_EXPONENTS = (0.3, 1.0, 2.0)
_TIGHT = {"ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}


def parse_terms(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"full"`` or names joined by commas or hyphens (``"depth,tokens"``, ``"width-depth"``).

    Returns:
        The terms in the law's order (width, depth, tokens).
    """
    if isinstance(text, str):
        names = [n.strip().lower() for n in text.replace("-", ",").split(",") if n.strip()]
    else:
        names = [str(n).strip().lower() for n in text]
    if names in (["full"], ["all"]):
        return TERMS
    for name in names:
        if name not in TERMS:
            raise OptionError(
                f"unknown scaling term {name!r}{did_you_mean(name, TERMS)}",
                hint="use 'full' or some of width, depth, tokens, e.g. --terms depth,tokens",
            )
    if not names:
        raise OptionError("no scaling terms given", hint="use 'full' or e.g. --terms depth")
    return tuple(t for t in TERMS if t in names)


def formula(terms: Sequence[str]) -> str:
    """The law in symbols, e.g. ``L = c_ℓ/ℓ^α_ℓ + L0``."""
    parts = [f"c_{SYMBOLS[t]}/{SYMBOLS[t]}^α_{SYMBOLS[t]}" for t in terms]
    return "L = " + " + ".join([*parts, "L0"])


@dataclass(frozen=True)
class Runs:
    """Training runs: each run's loss and sizes.

    Args:
        loss: Final loss of each run (positive).
        sizes: Term name to the value per run (width m, depth ℓ after any offset, tokens D).
        labels: A name per run (``line 7`` of a CSV, or a model spec).
        columns: Role (``loss``, a term) to the column the values came from.
        source: Where the runs came from (a file or a model list).
    """

    loss: Float[np.ndarray, " n"]
    sizes: Mapping[str, np.ndarray]
    labels: tuple[str, ...]
    columns: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_COLUMNS))
    source: str = ""

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, index: np.ndarray) -> Runs:
        """The runs at ``index`` (an integer array; repeats allowed, as in a bootstrap)."""
        return Runs(
            loss=self.loss[index],
            sizes={t: v[index] for t, v in self.sizes.items()},
            labels=tuple(self.labels[i] for i in index),
            columns=self.columns,
            source=self.source,
        )

    def drop_highest(self, n: int) -> Runs:
        """Without the ``n`` highest-loss runs (the least-trained, off the law's asymptote).

        Runs tied with the ``n``-th highest loss go too, as in the source's fit (ties have no
        order); the Chinchilla table has three runs at its 40th-highest loss.
        """
        if n < 0:
            raise OptionError(f"drop-highest must be 0 or more, got {n}")
        if n == 0:
            return self
        keep = np.flatnonzero(self.loss < np.sort(self.loss)[-min(n, len(self))])
        if not len(keep):
            raise DataError(
                f"cannot drop the {n} highest-loss runs of {len(self)}: none would be left",
                hint="use a smaller --drop-highest",
            )
        return self.subset(keep)


# -- reading runs ------------------------------------------------------------------------------
def resolve_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """The role → column mapping: the defaults overridden by ``columns``."""
    merged = dict(DEFAULT_COLUMNS)
    for role, name in (columns or {}).items():
        if role not in ROLES:
            raise OptionError(
                f"unknown column role {role!r}{did_you_mean(role, ROLES)}",
                hint=f"roles are {', '.join(ROLES)}, e.g. --column depth=n_layers",
            )
        merged[role] = name
    return merged


def runs_from_columns(
    table: Mapping[str, Sequence[Any]],
    terms: Sequence[str],
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    labels: Sequence[str],
    source: str,
) -> Runs:
    """Validate named columns of raw values (strings or numbers) and turn them into :class:`Runs`.

    Args:
        table: Column name to one raw value per run.
        terms: The terms to be fitted; only their columns (and the loss) are required.
        columns: Role → column name overrides of :data:`DEFAULT_COLUMNS`.
        depth_offset: Added to the depth column (``-2``: ℓ = n_layers − 2).
        labels: Where each run is, for error messages (``line 7``).
        source: File or model list, for error messages.

    Raises:
        DataError: A needed column is missing, or a value is not a positive finite number.
    """
    mapping = resolve_columns(columns)
    roles = ["loss", *terms]
    missing = [mapping[r] for r in roles if mapping[r] not in table]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise DataError(
            f"{source} has no column {names} (it has: {', '.join(table) or 'none'})",
            hint="name the columns with --column ROLE=NAME, e.g. --column depth=layers",
        )
    values = {
        r: _positive_column(
            table[mapping[r]],
            r,
            mapping[r],
            labels,
            source,
            float(depth_offset if r == "depth" else 0),
        )
        for r in roles
    }
    return Runs(
        loss=values["loss"],
        sizes={t: values[t] for t in terms},
        labels=tuple(labels),
        columns={r: mapping[r] for r in roles},
        source=source,
    )


def _positive_column(
    raw: Sequence[Any], role: str, name: str, labels: Sequence[str], source: str, offset: float
) -> np.ndarray:
    out = np.empty(len(raw))
    shown = f"{name} {offset:+g}" if offset else f"column {name!r}"
    for i, value in enumerate(raw):
        where = f"{source} {labels[i]}"
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise DataError(
                f"{where}: column {name!r} is {str(value)!r}, not a number",
                hint="every run needs a number there (remove or fix the run)",
            ) from None
        if not math.isfinite(number):
            raise DataError(f"{where}: column {name!r} is {value}, not a finite number")
        number += offset
        if number <= 0:
            raise DataError(
                f"{where}: {role} is {number:g} ({shown}), but the fit takes its log",
                hint="drop the run"
                + (" or change --depth-offset" if offset else "")
                + " (every loss and size must be positive)",
            )
        out[i] = number
    return out


def read_runs(
    path: str | Path,
    terms: str | Sequence[str] = "full",
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    drop_highest: int = 0,
) -> Runs:
    """Read training runs from a CSV with a header row.

    Args:
        path: The CSV file (e.g. ``model_size,FLOP,loss,num_tokens,d_model,n_layers``).
        terms: Terms to fit (see :func:`parse_terms`); only their columns are required.
        columns: Role → column overrides, e.g. ``{"depth": "layers"}``.
        depth_offset: Added to the depth column (the source fit Chinchilla with ``-2``).
        drop_highest: Drop this many highest-loss runs.

    Raises:
        DataError: Missing, unreadable or empty file, a missing column, a bad value (naming its
            line), or ``drop_highest`` not below the number of runs.
    """
    path = Path(path)
    terms = parse_terms(terms)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"runs file {str(path)!r} does not exist", hint="check the path") from None
    except UnicodeDecodeError:
        raise DataError(f"runs file {str(path)!r} is not UTF-8 text") from None
    except OSError as err:
        raise DataError(f"cannot read {str(path)!r}: {err.strerror}") from None
    rows = [(n, row) for n, row in enumerate(csv.reader(text.splitlines()), 1) if any(row)]
    if not rows:
        raise DataError(f"runs file {str(path)!r} is empty", hint="it needs a header and runs")
    header = [h.strip() for h in rows[0][1]]
    body = rows[1:]
    if not body:
        raise DataError(f"runs file {str(path)!r} has a header but no runs")
    table = {
        name: [row[j].strip() if j < len(row) else "" for _, row in body]
        for j, name in enumerate(header)
    }
    runs = runs_from_columns(
        table,
        terms,
        columns=columns,
        depth_offset=depth_offset,
        labels=[f"line {n}" for n, _ in body],
        source=path.name,
    )
    runs = dataclasses.replace(runs, source=str(path))
    return runs.drop_highest(drop_highest)


# -- the law and its fit -----------------------------------------------------------------------
def reference_scales(runs: Runs, terms: Sequence[str]) -> dict[str, float]:
    """Each size's reference scale: the power of ten nearest its geometric mean."""
    return {t: float(10.0 ** round(float(np.mean(np.log10(runs.sizes[t]))))) for t in terms}


def design(
    sizes: Mapping[str, np.ndarray], terms: Sequence[str], scales: Mapping[str, float]
) -> Float[np.ndarray, "n k"]:
    """``u[i, k] = log(x_ik / s_k)``: the sizes on the fit's log scale."""
    return np.stack([np.log(np.asarray(sizes[t], float) / scales[t]) for t in terms], axis=1)


def _parts(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"]
) -> tuple[Float[np.ndarray, "n k"], float]:
    """Each term's value ``c_k (x/s)^-α_k`` per run, and the floor L0."""
    k = u.shape[1]
    exponent = np.clip(theta[:k] - u * theta[k : 2 * k], -700.0, 700.0)  # no overflow mid-search
    return np.exp(exponent), float(np.exp(theta[2 * k]))


def log_residuals(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"], log_loss: Float[np.ndarray, " n"]
) -> Float[np.ndarray, " n"]:
    """``log L̂ − log L`` per run.

    Args:
        theta: ``[log c_1..k (at the reference scales), α_1..k, log L0]``.
        u: :func:`design` of the runs.
        log_loss: Log of each run's loss.
    """
    parts, floor = _parts(theta, u)
    return np.log(parts.sum(axis=1) + floor) - log_loss


def log_jacobian(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"], log_loss: Float[np.ndarray, " n"]
) -> Float[np.ndarray, "n p"]:
    """∂(log L̂)/∂theta per run (``log_loss`` is unused; scipy passes it)."""
    parts, floor = _parts(theta, u)
    total = (parts.sum(axis=1) + floor)[:, None]
    return np.concatenate([parts / total, -u * parts / total, floor / total], axis=1)


@dataclass(frozen=True)
class ScalingFit:
    """A fitted law.

    Args:
        terms: The fitted terms, in the law's order.
        scales: Each term's reference scale.
        theta: ``[log c_k at the scales, α_k, log L0]``, the optimiser's parameters.
        cov: Their covariance ``σ² (JᵀJ)⁻¹`` (NaN where JᵀJ is singular).
        rss: Residual sum of squares of log-loss.
        n_runs: Runs fitted.
    """

    terms: tuple[str, ...]
    scales: Mapping[str, float]
    theta: Float[np.ndarray, " p"]
    cov: Float[np.ndarray, "p p"]
    rss: float
    n_runs: int

    @property
    def mse(self) -> float:
        """Mean squared error of log-loss (the objective)."""
        return self.rss / self.n_runs

    @property
    def names(self) -> list[str]:
        """Names of the reported parameters: ``c_<term>``, ``alpha_<term>`` per term, ``L0``."""
        return [f"{p}_{t}" for t in self.terms for p in ("c", "alpha")] + ["L0"]

    def values(self) -> dict[str, float]:
        """The reported parameters, coefficients in the data's units (``c / x^α`` with raw x)."""
        return dict(zip(self.names, reported(self.theta, self.terms, self.scales), strict=True))

    def stderr(self) -> dict[str, float]:
        """Jacobian standard errors of :meth:`values` (delta method for the coefficients)."""
        k, values = len(self.terms), self.values()
        out: dict[str, float] = {}
        for i, t in enumerate(self.terms):
            grad = np.zeros(len(self.theta))
            grad[i], grad[k + i] = 1.0, math.log(self.scales[t])  # log c = log c_s + α log s
            out[f"c_{t}"] = values[f"c_{t}"] * math.sqrt(float(grad @ self.cov @ grad))
            out[f"alpha_{t}"] = math.sqrt(float(self.cov[k + i, k + i]))
        out["L0"] = values["L0"] * math.sqrt(float(self.cov[2 * k, 2 * k]))
        return out

    def parts(self, sizes: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each term's contribution ``c_k / x_k^α_k`` at ``sizes``."""
        parts, _ = _parts(self.theta, design(sizes, self.terms, self.scales))
        return {t: parts[:, i] for i, t in enumerate(self.terms)}

    def predict(self, sizes: Mapping[str, np.ndarray]) -> np.ndarray:
        """The predicted loss at ``sizes``."""
        parts, floor = _parts(self.theta, design(sizes, self.terms, self.scales))
        return parts.sum(axis=1) + floor


def reported(
    theta: Float[np.ndarray, " p"], terms: Sequence[str], scales: Mapping[str, float]
) -> list[float]:
    """``[c_t, α_t for each term] + [L0]`` from the optimiser's parameters (raw units)."""
    k = len(terms)
    out = []
    for i, t in enumerate(terms):
        out += [float(np.exp(theta[i] + theta[k + i] * math.log(scales[t]))), float(theta[k + i])]
    return [*out, float(np.exp(theta[2 * k]))]


def _grid(log_loss: np.ndarray, k: int) -> list[np.ndarray]:
    """Starts: a floor below the lowest loss, the median's excess shared by the terms, and every
    combination of starting exponents."""
    lowest, middle = float(np.exp(log_loss.min())), float(np.exp(np.median(log_loss)))
    starts = []
    for fraction in _FLOOR_FRACTIONS:
        floor = fraction * lowest
        share = math.log(max(middle - floor, 1e-3 * middle) / k)
        for exponents in itertools.product(_START_EXPONENTS, repeat=k):
            starts.append(np.array([share] * k + list(exponents) + [math.log(floor)]))
    return starts


def fit_law(
    runs: Runs,
    terms: Sequence[str],
    *,
    scales: Mapping[str, float] | None = None,
    start: np.ndarray | None = None,
) -> ScalingFit:
    """Least-squares fit of log-loss from a grid of starts (or one warm start); keep the best.

    Args:
        runs: The runs (at least one more than the ``2k + 1`` parameters).
        terms: Terms of the law.
        scales: Reference scales (default :func:`reference_scales`; fixed across refits so a
            bootstrap's parameters are comparable).
        start: Warm start ``theta`` instead of the grid.
    """
    from scipy.optimize import least_squares

    terms = tuple(terms)
    scales = dict(scales or reference_scales(runs, terms))
    u = design(runs.sizes, terms, scales)
    log_loss = np.log(runs.loss)
    best = None
    for x0 in [start] if start is not None else _grid(log_loss, len(terms)):
        solution = least_squares(log_residuals, x0, jac=log_jacobian, args=(u, log_loss))
        if best is None or solution.cost < best.cost:
            best = solution
    best = least_squares(log_residuals, best.x, jac=log_jacobian, args=(u, log_loss), **_TIGHT)
    rss = float(np.sum(best.fun**2))
    cov = _covariance(best.jac, rss, len(runs))
    return ScalingFit(terms, scales, best.x, cov, rss, len(runs))


def _covariance(jac: np.ndarray, rss: float, n: int) -> np.ndarray:
    """``σ² (JᵀJ)⁻¹`` with ``σ² = RSS / (n − p)``; NaN when JᵀJ is numerically singular."""
    p = jac.shape[1]
    jtj = jac.T @ jac
    if np.linalg.cond(jtj) > 1e14:
        return np.full((p, p), np.nan)
    return rss / (n - p) * np.linalg.inv(jtj)


def bootstrap(
    runs: Runs, fit: ScalingFit, n: int, *, seed: int = 0
) -> Float[np.ndarray, "n_boot q"]:
    """Refit ``n`` resamples of the runs (with replacement), warm-started from ``fit``.

    Returns:
        One row of reported parameters (:attr:`ScalingFit.names`) per resample.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        index = rng.integers(0, len(runs), len(runs))
        refit = fit_law(runs.subset(index), fit.terms, scales=fit.scales, start=fit.theta)
        rows.append(reported(refit.theta, fit.terms, fit.scales))
    return np.asarray(rows, dtype=float).reshape(n, len(fit.names))


def cross_validate(
    runs: Runs, fit: ScalingFit, folds: int, *, seed: int = 0
) -> dict[str, list[Any]]:
    """k-fold held-out error: refit without each fold, score it (RMSE of log-loss).

    Returns:
        Columns ``fold``, ``n_train``, ``n_test``, ``train_rmse``, ``test_rmse``.
    """
    order = np.random.default_rng(seed).permutation(len(runs))
    out: dict[str, list[Any]] = {
        "fold": [],
        "n_train": [],
        "n_test": [],
        "train_rmse": [],
        "test_rmse": [],
    }
    for i, test in enumerate(np.array_split(order, folds), 1):
        train = np.setdiff1d(order, test)
        refit = fit_law(runs.subset(train), fit.terms, scales=fit.scales, start=fit.theta)
        held = runs.subset(np.sort(test))
        u = design(held.sizes, fit.terms, fit.scales)
        test_rmse = float(np.sqrt(np.mean(log_residuals(refit.theta, u, np.log(held.loss)) ** 2)))
        out["fold"].append(str(i))
        out["n_train"].append(len(train))
        out["n_test"].append(len(test))
        out["train_rmse"].append(math.sqrt(refit.mse))
        out["test_rmse"].append(test_rmse)
    return out


# -- the whole analysis --------------------------------------------------------------------------
def varying_terms(runs: Runs, terms: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """The terms whose column varies, and a note for each constant one (it cannot be fitted)."""
    kept, notes = [], []
    for t in terms:
        values = runs.sizes[t]
        if np.all(values == values[0]):
            column = runs.columns.get(t, t)
            notes.append(f"{t} term dropped: {column} is {values[0]:g} in every run")
        else:
            kept.append(t)
    if not kept:
        raise DataError(
            f"no size varies across the {len(runs)} runs ({', '.join(notes)})",
            hint="fit runs that differ in width, depth or tokens",
        )
    return tuple(kept), notes


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
        terms: Terms to fit (see :func:`parse_terms`); default: every size the runs have.
        n_bootstrap: Bootstrap resamples (0: none; the intervals are then NaN).
        folds: Folds of the held-out check (0: none).
        seed: Seeds the bootstrap and the fold split.
        confidence: Coverage of the bootstrap percentile intervals.
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
    _check_counts(n_bootstrap, folds, confidence)
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
    intervals = _intervals(bootstrap(runs, fit, n_bootstrap, seed=seed), confidence, len(fit.names))
    heldout = cross_validate(runs, fit, folds, seed=seed) if folds else None
    if np.isnan(fit.cov).any():
        notes.append("JᵀJ is singular, so the parameters are not all identifiable (stderr NaN)")
    from lensdiv.core.provenance import versions  # provenance; imports torch, so only here

    settings = {
        **(meta or {}),
        "terms": list(fit.terms),
        "formula": formula(fit.terms),
        "scales": dict(fit.scales),
        "n_runs": len(runs),
        "mse_log_loss": fit.mse,
        "seed": seed,
        "n_bootstrap": n_bootstrap,
        "confidence": confidence,
        "folds": folds,
        "notes": notes,
        "versions": versions("scipy"),
    }
    return Result(
        analyzer="scaling",
        summary=_summary(fit, intervals, heldout, confidence, notes),
        tables={
            "parameters": _parameter_table(fit, intervals, confidence),
            "runs": _runs_table(runs, fit, extra),
            "heldout": _heldout_table(heldout, fit),
            **{f"{t}_term": _term_table(runs, fit, t) for t in fit.terms},
        },
        plots=tuple(_term_plot(t) for t in fit.terms),
        meta=settings,
    )


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


def _check_counts(n_bootstrap: int, folds: int, confidence: float) -> None:
    if n_bootstrap < 0:
        raise OptionError(f"bootstrap must be 0 or more, got {n_bootstrap}")
    if folds < 0 or folds == 1:
        raise OptionError(f"folds must be 0 (none) or at least 2, got {folds}")
    if not 0 < confidence < 1:
        raise OptionError(f"confidence must be between 0 and 1, got {confidence}")


def _intervals(boot: np.ndarray, confidence: float, q: int) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap percentile intervals per reported parameter (NaN without a bootstrap)."""
    if not len(boot):
        return np.full(q, np.nan), np.full(q, np.nan)
    tail = 50 * (1 - confidence)
    low, high = np.nanpercentile(boot, [tail, 100 - tail], axis=0)
    return low, high


def _parameter_table(
    fit: ScalingFit, intervals: tuple[np.ndarray, np.ndarray], confidence: float
) -> Table:
    values, errors = fit.values(), fit.stderr()
    scales = [fit.scales[name.split("_", 1)[1]] if "_" in name else math.nan for name in fit.names]
    return Table(
        "parameters",
        {
            "name": fit.names,
            "value": [values[n] for n in fit.names],
            "stderr": [errors[n] for n in fit.names],
            "ci_low": intervals[0],
            "ci_high": intervals[1],
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
    extra = [("in-sample", fit.n_runs, 0, math.sqrt(fit.mse), math.nan)]
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
    intervals: tuple[np.ndarray, np.ndarray],
    heldout: dict[str, list[Any]] | None,
    confidence: float,
    notes: Sequence[str],
) -> str:
    values, errors = fit.values(), fit.stderr()
    exponents = []
    for t in sorted(fit.terms, key=lambda t: t != "depth"):  # depth first: it is the question
        name = f"alpha_{t}"
        text = f"α_{SYMBOLS[t]} = {values[name]:.3f} ± {errors[name]:.3f}"
        low, high = (float(bound[fit.names.index(name)]) for bound in intervals)
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


def fit_csv(
    path: str | Path,
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
    """Read runs from a CSV (see :func:`read_runs`) and fit them (see :func:`fit_runs`).

    Example: the source's Chinchilla fit is
    ``fit_csv("chinchilla_runs.csv", drop_highest=40, depth_offset=-2)``.
    """
    terms = parse_terms(terms)
    _check_counts(n_bootstrap, folds, confidence)
    read = read_runs(path, terms, columns=columns, depth_offset=depth_offset)
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
    meta = {
        "source": str(path),
        "columns": dict(runs.columns),
        "depth_offset": depth_offset,
        "drop_highest": drop_highest,
        "dropped": dropped,
    }
    return fit_runs(
        runs,
        terms,
        n_bootstrap=n_bootstrap,
        folds=folds,
        seed=seed,
        confidence=confidence,
        notes=notes,
        meta=meta,
    )


# -- collecting runs from a model family -------------------------------------------------------
def expand_models(models: str | Sequence[str]) -> list[str]:
    """Model specs from a comma-separated list; ``zoo:depth`` / ``zoo:width`` expand to the toy
    zoo's depth family (width 64) and width family (depth 4)."""
    names = models.split(",") if isinstance(models, str) else list(models)
    out: list[str] = []
    for name in (n.strip() for n in names):
        if name.startswith("zoo:") and name not in FAMILIES:
            raise OptionError(
                f"unknown model family {name!r}{did_you_mean(name, list(FAMILIES))}",
                hint=f"use {' or '.join(FAMILIES)}, or list the models",
            )
        out += FAMILIES.get(name, (name,) if name else ())
    if len(out) < 2:
        raise OptionError(
            f"a family needs at least two models, got {len(out)}",
            hint="e.g. lensdiv scaling family toy:d2,toy:d4,toy:d6,toy:d8 (or zoo:depth)",
        )
    return out


def collect_family(
    models: str | Sequence[str],
    data: Any = None,
    *,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Table:
    """Evaluate each model on the same tokens: mean next-token cross-entropy and its sizes.

    Args:
        models: Model specs (see :func:`expand_models`), loaded one at a time.
        data: A :class:`~lensdiv.data.sources.DataSpec` (default: the built-in corpus, 16384 tokens).
        device, dtype: Where and in which precision the models run.
        trust_remote_code: Allow hub models with custom code.
        progress: Show a progress bar over the models.

    Returns:
        Table ``family``: ``model``, ``loss``, ``d_model``, ``n_layers``, ``tokens`` (trained on,
        from a toy model's training log; NaN when unknown), ``params`` and ``eval_tokens``.

    Raises:
        DataError: The models tokenize the data differently (a family shares one tokenizer).
        ModelLoadError: A spec names nothing loadable.
    """
    from lensdiv.data.sources import DataSpec, check_source, token_batches
    from lensdiv.models.load import load_model

    specs = expand_models(models)
    data = data if data is not None else DataSpec()
    check_source(data)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("model", "loss", "d_model", "n_layers", "tokens", "params", "eval_tokens")
    }
    reference: tuple[str, list[Any]] | None = None
    with _family_progress(progress) as bar:
        task = bar.add_task("models", total=len(specs), model="")
        for spec in specs:
            bar.update(task, model=spec + _training_note(spec))
            # Nested live displays are not allowed: a toy model that must train does so quietly.
            model = load_model(
                spec,
                device=device,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                progress=False,
            )
            batches = list(token_batches(data, model.tokenizer))
            if reference is None:
                reference = (spec, batches)
            _check_same_tokens(reference, spec, batches)
            loss, count = _mean_cross_entropy(model, batches)
            rows["model"].append(spec)
            rows["loss"].append(loss)
            rows["d_model"].append(int(model.cfg.d_model))
            rows["n_layers"].append(int(model.cfg.n_layers))
            rows["tokens"].append(_tokens_trained(spec))
            rows["params"].append(sum(p.numel() for p in model.parameters()))
            rows["eval_tokens"].append(count)
            del model  # one model in memory at a time
            bar.advance(task)
    return Table("family", rows, "each model's mean next-token cross-entropy on the same tokens")


def _family_progress(enabled: bool) -> Any:
    from lensdiv.core.progress import progress_bar

    return progress_bar("[bold]evaluating[/bold] {task.fields[model]}", "models", enabled=enabled)


def _check_same_tokens(reference: tuple[str, list[Any]], spec: str, batches: list[Any]) -> None:
    first, expected = reference
    same = len(batches) == len(expected) and all(
        a.tokens.shape == b.tokens.shape and bool((a.tokens == b.tokens).all())
        for a, b in zip(batches, expected, strict=True)
    )
    if not same:
        raise DataError(
            f"{spec} and {first} tokenize the data differently, so their losses are not comparable",
            hint="a family must share one tokenizer",
        )


def _mean_cross_entropy(model: Any, batches: list[Any]) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over the real positions, and their number."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            tokens, mask = batch.tokens.to(device), batch.mask.to(device)
            logits = model(tokens)
            valid = mask[:, 1:] & mask[:, :-1]
            targets = tokens[:, 1:][valid]
            total += float(F.cross_entropy(logits[:, :-1][valid].float(), targets, reduction="sum"))
            count += int(valid.sum())
    return total / count, count


def _training_note(spec: str) -> str:
    """What the progress bar adds for a toy model that is not cached (it trains first)."""
    from lensdiv.models.load import resolve_spec

    parsed = resolve_spec(spec)
    if parsed.kind != "toy":
        return ""
    from lensdiv.models.toy import cached_log, parse_toy

    return "" if cached_log(parse_toy(parsed.resolved)) else " (not cached: training it first)"


def _tokens_trained(spec: str) -> float:
    """Tokens a toy model was trained on (from its cached training log); NaN otherwise."""
    from lensdiv.models.load import resolve_spec

    parsed = resolve_spec(spec)
    if parsed.kind != "toy":
        return math.nan
    from lensdiv.models.toy import cached_log, parse_toy

    log = cached_log(parse_toy(parsed.resolved))
    if log is None:
        return math.nan
    recipe = log["recipe"]
    return float(recipe["steps"] * recipe["batch_size"] * recipe["seq_len"])


def fit_family(
    models: str | Sequence[str],
    data: Any = None,
    terms: str | Sequence[str] = "full",
    *,
    depth_offset: int = 0,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Result:
    """Collect a model family's losses on the same data (:func:`collect_family`) and fit them
    (:func:`fit_family_table`).

    Example: ``fit_family("zoo:depth", terms="depth", folds=0)``.
    """
    from lensdiv.data.sources import DataSpec

    terms = parse_terms(terms)
    _check_counts(n_bootstrap, folds, confidence)
    data = data if data is not None else DataSpec()
    family = collect_family(
        models,
        data,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        progress=progress,
    )
    return fit_family_table(
        family,
        terms,
        depth_offset=depth_offset,
        n_bootstrap=n_bootstrap,
        folds=folds,
        seed=seed,
        confidence=confidence,
        meta={"data": dataclasses.asdict(data)},
    )


def fit_family_table(
    family: Table,
    terms: str | Sequence[str] = "full",
    *,
    depth_offset: int = 0,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
    meta: Mapping[str, Any] | None = None,
) -> Result:
    """Fit the law to a table from :func:`collect_family`.

    Terms whose size is unknown for some model (tokens of a non-toy model) or the same for every
    model (the width of a depth family) are dropped, with a note in the summary.

    Args:
        family: The collected table.
        terms, n_bootstrap, folds, seed, confidence: As for :func:`fit_runs`.
        depth_offset: Added to the layer count (ℓ = n_layers + offset).
        meta: Extra settings to record (the data the losses were measured on).
    """
    terms = parse_terms(terms)
    notes = []
    unknown = [m for m, t in zip(family["model"], family["tokens"], strict=True) if math.isnan(t)]
    if "tokens" in terms and unknown:
        notes.append(f"tokens term dropped: tokens trained unknown for {', '.join(unknown)}")
        terms = tuple(t for t in terms if t != "tokens")
        if not terms:
            raise DataError(
                f"cannot fit tokens: tokens trained unknown for {', '.join(unknown)}",
                hint="fit width or depth, e.g. --terms depth",
            )
    columns = {"loss": "loss", "width": "d_model", "depth": "n_layers", "tokens": "tokens"}
    runs = runs_from_columns(
        dict(family.columns),
        terms,
        columns=columns,
        depth_offset=depth_offset,
        labels=list(family["model"]),
        source="model",
    )
    runs = dataclasses.replace(runs, source=",".join(family["model"]))
    settings = {
        "models": list(family["model"]),
        **(meta or {}),
        "columns": columns,
        "depth_offset": depth_offset,
    }
    extra = {k: family[k] for k in ("d_model", "n_layers", "params", "eval_tokens")}
    return fit_runs(
        runs,
        terms,
        n_bootstrap=n_bootstrap,
        folds=folds,
        seed=seed,
        confidence=confidence,
        notes=notes,
        meta=settings,
        extra=extra,
    )
