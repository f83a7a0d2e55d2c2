"""The least-squares fit of the law to runs, and its uncertainty.

The fit minimises the mean squared error of log-loss with scipy's trust-region least squares from
a grid of starts. Each size is divided by a fixed reference scale (the power of ten nearest its
geometric mean) and positive quantities are optimised as logs, so the problem is well conditioned.
Uncertainty comes three ways: Jacobian standard errors (``Cov = σ² (JᵀJ)⁻¹``), a bootstrap over
runs and k-fold held-out error.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from jaxtyping import Float
from scipy.optimize import least_squares

from lensdiv.core.errors import OptionError
from lensdiv.studies.scaling.law import design, log_jacobian, log_residuals, reported, term_values
from lensdiv.studies.scaling.runs import Runs

# Grid of starts: the floor L0 as a fraction of the lowest loss, and each exponent.
_FLOOR_FRACTIONS = (0.1, 0.5, 0.9)
_START_EXPONENTS = (0.3, 1.0, 2.0)
_TIGHT = {"ftol": 1e-12, "xtol": 1e-12, "gtol": 1e-12}


@dataclass(frozen=True)
class Uncertainty:
    """How a fit's uncertainty is measured, beyond the Jacobian standard errors.

    Args:
        n_bootstrap: Bootstrap resamples (0: none; the intervals are then NaN).
        folds: Folds of the held-out check (0: none).
        seed: Seeds the bootstrap and the fold split.
        confidence: Coverage of the bootstrap percentile intervals.

    Raises:
        OptionError: A negative count, one fold, or a confidence outside (0, 1).
    """

    n_bootstrap: int = 200
    folds: int = 5
    seed: int = 0
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.n_bootstrap < 0:
            raise OptionError(f"bootstrap must be 0 or more, got {self.n_bootstrap}")
        if self.folds < 0 or self.folds == 1:
            raise OptionError(f"folds must be 0 (none) or at least 2, got {self.folds}")
        if not 0 < self.confidence < 1:
            raise OptionError(f"confidence must be between 0 and 1, got {self.confidence}")


def reference_scales(runs: Runs, terms: Sequence[str]) -> dict[str, float]:
    """Each size's reference scale: the power of ten nearest its geometric mean."""
    return {t: float(10.0 ** round(float(np.mean(np.log10(runs.sizes[t]))))) for t in terms}


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
        parts, _ = term_values(self.theta, design(sizes, self.terms, self.scales))
        return {t: parts[:, i] for i, t in enumerate(self.terms)}

    def predict(self, sizes: Mapping[str, np.ndarray]) -> np.ndarray:
        """The predicted loss at ``sizes``."""
        parts, floor = term_values(self.theta, design(sizes, self.terms, self.scales))
        return parts.sum(axis=1) + floor


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
    terms = tuple(terms)
    scales = dict(scales or reference_scales(runs, terms))
    u = design(runs.sizes, terms, scales)
    log_loss = np.log(runs.loss)
    best = None
    for x0 in [start] if start is not None else _grid(log_loss, len(terms)):
        solution = least_squares(log_residuals, x0, jac=log_jacobian, args=(u, log_loss))
        if best is None or solution.cost < best.cost:
            best = solution
    assert best is not None  # the grid always holds a start
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


def intervals(boot: np.ndarray, confidence: float, q: int) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap percentile intervals per reported parameter (NaN without a bootstrap)."""
    if not len(boot):
        return np.full(q, np.nan), np.full(q, np.nan)
    tail = 50 * (1 - confidence)
    low, high = np.nanpercentile(boot, [tail, 100 - tail], axis=0)
    return low, high


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
