"""Closed-form affine maps from streamed moments: ridge regression with an unregularised bias.

Shared by the cross-model linear maps (``linmap``, docs/science.md A6) and the affine lens
(docs/science.md D3). The moments ``Σ x̃ x̃ᵀ`` and ``Σ x̃ yᵀ`` of ``x̃ = [x, 1]`` are sums, so they
stream in float64 and merge exactly across shards and ranks; the fit solves the centred form
``(Σ_xx + λI) W = Σ_xy``, ``b = ȳ − Wᵀx̄`` with ``λ = ridge × trace(Σ_xx)/d`` (the mean eigenvalue
of the source covariance, so ``ridge`` is scale-free). Cholesky first; a singular system
(``ridge=0`` on rank-deficient states) falls back to the minimum-norm solution.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor

# Eigenvalues below this fraction of the largest are treated as zero in the fallback.
PINV_RTOL = 1e-12


def augment(x: Float[Tensor, "*batch n d"]) -> Float[Tensor, "*batch n d_aug"]:
    """``[x, 1]`` in float64: the constant column carries the bias."""
    x = x.double()
    return torch.cat([x, x.new_ones((*x.shape[:-1], 1))], dim=-1)


def fit_affine(
    xtx: Float[Tensor, "d_aug d_aug"], xty: Float[Tensor, "d_aug k"], ridge: float
) -> tuple[Float[Tensor, "d_aug k"], float, bool]:
    """Ridge regression with an unregularised bias, from the moments of ``[x; 1]`` and ``y``.

    Args:
        xtx: ``Σ x̃ x̃ᵀ`` (the last row/column hold ``Σ x`` and the count).
        xty: ``Σ x̃ yᵀ`` (the last row holds ``Σ y``).
        ridge: ``λ`` relative to the mean eigenvalue of the source covariance.

    Returns:
        ``(maps, λ, exact)``: ``maps`` stacks ``W`` over ``bᵀ`` so that ``ŷ = [x, 1] @ maps``;
        ``λ`` is the absolute penalty on the covariance scale; ``exact`` is False when the system
        was singular and the minimum-norm solution was used.
    """
    d = xtx.shape[0] - 1
    n = xtx[d, d]
    if float(n) <= 0:
        raise ValueError("no training positions to fit a map on")
    mean_x = xtx[:d, d] / n
    mean_y = xty[d] / n
    cov_xx = xtx[:d, :d] / n - torch.outer(mean_x, mean_x)
    cov_xx = (cov_xx + cov_xx.T) / 2
    cov_xy = xty[:d] / n - torch.outer(mean_x, mean_y)
    lam = float(ridge * torch.trace(cov_xx) / d)
    system = cov_xx + lam * torch.eye(d, dtype=cov_xx.dtype, device=cov_xx.device)
    factor, info = torch.linalg.cholesky_ex(system)
    # Cholesky can succeed on a matrix that is singular up to rounding; its pivots tell.
    pivots = factor.diagonal().square()
    exact = int(info) == 0 and bool(pivots.min() > PINV_RTOL * pivots.max())
    if exact:
        weight = torch.cholesky_solve(cov_xy, factor)
    else:
        evals, evecs = torch.linalg.eigh(system)
        keep = evals > PINV_RTOL * evals.abs().max().clamp_min(1e-300)
        inv = torch.where(keep, 1.0 / torch.where(keep, evals, 1.0), 0.0)
        weight = evecs @ (inv[:, None] * (evecs.T @ cov_xy))
    bias = mean_y - mean_x @ weight
    return torch.cat([weight, bias[None]], dim=0), lam, exact
