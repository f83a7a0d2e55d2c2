"""The depth exponent ``α_ℓ``: the least-squares slope of log test loss against log depth."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class DepthFit:
    """Least-squares fit ``log loss = c − α log depth``.

    Args:
        alpha: The depth exponent ``α_ℓ`` (minus the slope).
        stderr: Standard error of ``α_ℓ``.
        ci_low: Lower end of the two-sided t-interval.
        ci_high: Upper end of the two-sided t-interval.
        r2: Coefficient of determination of the log–log line.
        intercept: ``c``, the fitted log loss at depth 1.
    """

    alpha: float
    stderr: float
    ci_low: float
    ci_high: float
    r2: float
    intercept: float


def fit_depth_exponent(
    depths: Sequence[int] | np.ndarray, losses: Sequence[float] | np.ndarray, level: float = 0.95
) -> DepthFit:
    """Fit ``α_ℓ`` by ordinary least squares of log loss on log depth, with a t-interval.

    Args:
        depths: Student depths (at least three distinct).
        losses: Positive test losses, one per depth.
        level: Coverage of the confidence interval.
    """
    x, y = np.log(np.asarray(depths, float)), np.log(np.asarray(losses, float))
    n = len(x)
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    sxx = float(((x - x.mean()) ** 2).sum())
    stderr = math.sqrt(float(residuals @ residuals) / (n - 2) / sxx)
    half = float(stats.t.ppf(0.5 + level / 2, n - 2)) * stderr
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(residuals @ residuals) / total if total > 0 else math.nan
    alpha = -float(slope)
    return DepthFit(alpha, stderr, alpha - half, alpha + half, r2, float(intercept))
