"""The geometry of a layer's representation (docs/science.md G1, G2): representational similarity
of two sets of states (CKA, CCA, Procrustes) and the spectrum of one (matrix entropy, effective
rank, participation ratio, TwoNN intrinsic dimension), as small pure functions of float64 tensors.

Rows are token states, columns features. ``X`` (``n × d``) and ``Y`` (``n × e``) hold the same
tokens' states at two layers. Functions named ``*_from_moments`` read the streamed sufficient
statistics (a count, column sums and cross-products, which merge by addition); the others read
the rows themselves (a capped sample of them). Nothing here knows about models or states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lensdiv.core.errors import OptionError

# Singular values below this fraction of the largest are the numerical null space.
RANK_TOL = 1e-10


def centered(x: Float[Tensor, "n d"]) -> Float[Tensor, "n d"]:
    """``x`` with its column means removed."""
    return x - x.mean(0, keepdim=True)


# -- linear CKA from moments (the streamed form) ----------------------------------------------------
def covariance(n: float, s_x: Tensor, s_y: Tensor, s_xy: Tensor) -> Tensor:
    """The centred cross-product ``Σ (x − x̄)(y − ȳ)ᵀ = Σ xyᵀ − (Σx)(Σy)ᵀ / n`` from moments."""
    return s_xy - torch.outer(s_x, s_y) / n


def cka_from_covariances(c_xy: Tensor, c_xx: Tensor, c_yy: Tensor) -> float:
    """Linear CKA in feature space, ``‖C_xy‖²_F / (‖C_xx‖_F ‖C_yy‖_F)`` (NaN for a constant
    side)."""
    den = float(torch.linalg.matrix_norm(c_xx) * torch.linalg.matrix_norm(c_yy))
    return float((c_xy * c_xy).sum()) / den if den > 0 else math.nan


def linear_cka(x: Float[Tensor, "n d"], y: Float[Tensor, "n e"]) -> float:
    """Linear CKA of two sets of rows (Kornblith et al. 2019), feature-space form."""
    x, y = centered(x.double()), centered(y.double())
    return cka_from_covariances(y.T @ x, x.T @ x, y.T @ y)


# -- Gram-space HSIC and CKA ------------------------------------------------------------------------
def center_gram(k: Float[Tensor, "n n"]) -> Float[Tensor, "n n"]:
    """``H K H`` with ``H = I − 11ᵀ/n``."""
    return k - k.mean(0, keepdim=True) - k.mean(1, keepdim=True) + k.mean()


def hsic_biased(k: Float[Tensor, "n n"], l: Float[Tensor, "n n"]) -> float:  # noqa: E741
    """``tr(K H L H) / (n − 1)²`` (Gretton et al. 2005)."""
    n = k.shape[0]
    return float((center_gram(k) * center_gram(l)).sum()) / (n - 1) ** 2


def hsic_unbiased(k: Float[Tensor, "n n"], l: Float[Tensor, "n n"]) -> float:  # noqa: E741
    """Song et al.'s (2012) unbiased HSIC₁, ``[tr(K̃L̃) + 1ᵀK̃1·1ᵀL̃1/((n−1)(n−2)) −
    2/(n−2)·1ᵀK̃L̃1] / (n(n−3))`` with ``K̃``, ``L̃`` the Grams with zeroed diagonals (n ≥ 4)."""
    n = k.shape[0]
    if n < 4:
        return math.nan
    kt = k - torch.diag(torch.diagonal(k))
    lt = l - torch.diag(torch.diagonal(l))
    trace = float((kt * lt).sum())
    sums = float(kt.sum()) * float(lt.sum()) / ((n - 1) * (n - 2))
    cross = 2.0 / (n - 2) * float(kt.sum(0) @ lt.sum(1))
    return (trace + sums - cross) / (n * (n - 3))


def cka_gram(k: Tensor, l: Tensor, *, unbiased: bool = False) -> float:  # noqa: E741
    """``HSIC(K, L) / √(HSIC(K, K) HSIC(L, L))`` with the biased or unbiased estimator."""
    hsic = hsic_unbiased if unbiased else hsic_biased
    den = hsic(k, k) * hsic(l, l)
    return hsic(k, l) / math.sqrt(den) if den > 0 else math.nan


def rbf_gram(x: Float[Tensor, "n d"], scale: float = 1.0) -> Float[Tensor, "n n"]:
    """Gaussian kernel ``exp(−‖a − b‖² / (2σ²))`` with ``σ = scale ×`` the median distance between
    distinct rows (Kornblith et al.'s median heuristic)."""
    x = x.double()
    sq = (x * x).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2 * x @ x.T).clamp_min(0.0)
    off = ~torch.eye(x.shape[0], dtype=torch.bool, device=x.device)
    sigma = scale * float(d2[off].sqrt().median()) if x.shape[0] > 1 else 1.0
    if sigma <= 0:
        return torch.ones_like(d2)
    return torch.exp(-d2 / (2 * sigma**2))


# -- CCA and Procrustes on one thin SVD per side ------------------------------------------------------
@dataclass(frozen=True)
class Basis:
    """The thin SVD ``X_c = U S Vᵀ`` of centred rows, with the numerical null space dropped.

    Args:
        u: Left singular vectors ``[n, r]`` (an orthonormal basis of the centred rows' span).
        s: Singular values ``[r]``, largest first.
        vt: Right singular vectors ``[r, d]``.
    """

    u: Tensor
    s: Tensor
    vt: Tensor

    @classmethod
    def of(cls, x: Float[Tensor, "n d"]) -> Basis:
        u, s, vt = torch.linalg.svd(centered(x.double()), full_matrices=False)
        r = int((s > RANK_TOL * s[0]).sum()) if s.numel() and s[0] > 0 else 0
        return cls(u[:, :r], s[:r], vt[:r])

    def directions(self, keep: float, cap: int) -> int:
        """How many leading directions hold ``keep`` of the variance (SVCCA's reduction),
        at most ``cap``."""
        if self.s.numel() == 0:
            return 0
        share = (self.s**2).cumsum(0) / (self.s**2).sum()
        k = int((share < keep - 1e-12).sum()) + 1
        return max(1, min(k, cap, self.s.numel()))


def canonical_correlations(
    a: Basis, b: Basis, ka: int | None = None, kb: int | None = None
) -> Tensor:
    """The canonical correlations of two sets of rows (largest first), from orthonormal bases of
    their (reduced) spans: the singular values of ``U_aᵀ U_b``."""
    ua, ub = a.u[:, :ka], b.u[:, :kb]
    return torch.linalg.svdvals(ua.T @ ub).clamp(0.0, 1.0)


def mean_cca(x: Float[Tensor, "n d"], y: Float[Tensor, "n e"]) -> float:
    """Mean canonical correlation over the full-rank spans (invariant to invertible maps)."""
    rho = canonical_correlations(Basis.of(x), Basis.of(y))
    return float(rho.mean()) if rho.numel() else math.nan


def svcca(a: Basis, b: Basis, keep: float = 0.99, cap: int = 1 << 30) -> float:
    """SVCCA (Raghu et al. 2017): each side reduced to the directions that keep ``keep`` of its
    variance (at most ``cap``), then the mean canonical correlation."""
    rho = canonical_correlations(a, b, a.directions(keep, cap), b.directions(keep, cap))
    return float(rho.mean()) if rho.numel() else math.nan


def pwcca(a: Basis, b: Basis, keep: float = 0.99, cap: int = 1 << 30) -> float:
    """PWCCA (Morcos et al. 2018) after SVCCA's reduction: canonical correlations weighted by how
    much of ``a``'s features each canonical variate accounts for, ``α_i ∝ Σ_j |⟨h_i, x_j⟩|``
    (``h_i`` the variates of ``a``, ``x_j`` its centred feature columns). Not symmetric."""
    ka, kb = a.directions(keep, cap), b.directions(keep, cap)
    if ka == 0 or kb == 0:
        return math.nan
    left, rho, _ = torch.linalg.svd(a.u[:, :ka].T @ b.u[:, :kb], full_matrices=False)
    # h = U_a A, and U_aᵀ X_c = S Vᵀ: ⟨h_i, x_j⟩ = (Aᵀ S Vᵀ)_ij.
    alpha = (left.T @ (a.s[:ka, None] * a.vt[:ka])).abs().sum(1)
    m = rho.numel()
    alpha = alpha[:m]
    return float((alpha * rho.clamp(0, 1)).sum() / alpha.sum())


def procrustes(a: Basis, b: Basis) -> float:
    """Orthogonal Procrustes distance (Ding et al. 2021) of the centred rows, each scaled to unit
    Frobenius norm: ``2 − 2‖XᵀY‖_*`` (0 for a rotated copy, at most 2)."""
    na, nb = float(a.s.norm()), float(b.s.norm())
    if na == 0 or nb == 0:
        return math.nan
    inner = (a.s[:, None] * (a.u.T @ b.u)) * b.s[None, :]
    return max(0.0, 2.0 - 2.0 * float(torch.linalg.svdvals(inner).sum()) / (na * nb))


# -- spectra ---------------------------------------------------------------------------------------
def covariance_eigenvalues(n: float, s: Tensor, s_xx: Tensor) -> Tensor:
    """Eigenvalues (descending, ≥ 0) of the centred second moment ``Σ xxᵀ − ssᵀ/n``: the nonzero
    eigenvalues of the centred Gram ``X_c X_cᵀ`` of the same rows."""
    c = covariance(n, s, s, s_xx)
    return torch.linalg.eigvalsh((c + c.T) / 2).flip(0).clamp_min(0.0)


def gram_eigenvalues(x: Float[Tensor, "n d"], center: bool = True) -> Tensor:
    """Eigenvalues (descending, ≥ 0) of ``Z Zᵀ`` for ``Z`` the (centred) rows, through the
    smaller of ``Z Zᵀ`` and ``Zᵀ Z`` (they share their nonzero eigenvalues)."""
    z = centered(x.double()) if center else x.double()
    small = z @ z.T if z.shape[0] <= z.shape[1] else z.T @ z
    return torch.linalg.eigvalsh((small + small.T) / 2).flip(0).clamp_min(0.0)


def _shares(eigenvalues: Tensor) -> Tensor:
    total = eigenvalues.sum()
    p = eigenvalues[eigenvalues > RANK_TOL * eigenvalues.max()] if total > 0 else eigenvalues[:0]
    return p / p.sum() if p.numel() else p


def matrix_entropy(eigenvalues: Tensor, alpha: float = 1.0) -> float:
    """Rényi-α entropy of a Gram normalised to unit trace (Skean et al. 2025), in nats:
    ``log(Σ λᵢ^α) / (1 − α)``, Shannon's ``−Σ λᵢ log λᵢ`` at ``α = 1``. ``log k`` for ``k``
    equal eigenvalues."""
    p = _shares(eigenvalues)
    if p.numel() == 0:
        return math.nan
    if abs(alpha - 1.0) < 1e-12:
        return float(-(p * p.log()).sum())
    return float(torch.log((p**alpha).sum()) / (1.0 - alpha))


def effective_rank(eigenvalues: Tensor) -> float:
    """Roy & Vetterli's (2007) effective rank ``exp(−Σ pᵢ log pᵢ)``, ``pᵢ = σᵢ / Σσⱼ`` over the
    singular values ``σ = √λ``."""
    p = _shares(_shares(eigenvalues).sqrt())  # the null space dropped on λ, then σ = √λ
    return float(torch.exp(-(p * p.log()).sum())) if p.numel() else math.nan


def participation_ratio(eigenvalues: Tensor) -> float:
    """``(Σλ)² / Σλ²`` of the covariance eigenvalues."""
    sq = float((eigenvalues**2).sum())
    return float(eigenvalues.sum()) ** 2 / sq if sq > 0 else math.nan


def twonn(x: Float[Tensor, "n d"]) -> tuple[float, float, int]:
    """TwoNN intrinsic dimension (Facco et al. 2017): from ``μ = r₂/r₁``, the ratio of each
    point's second to first nearest-neighbour distance, the maximum-likelihood ``d̂ = N / Σ log μ``
    and its standard error ``d̂/√N``. Points with a duplicate (``r₁ = 0``) are left out; returns
    ``(d̂, standard error, N used)``."""
    x = x.double()
    sq = (x * x).sum(1)
    d2 = (sq[:, None] + sq[None, :] - 2 * x @ x.T).clamp_min(0.0)
    d2.fill_diagonal_(math.inf)
    if x.shape[0] < 3:
        return math.nan, math.nan, 0
    # The two nearest found from the Gram, their distances recomputed from the differences (a
    # duplicate is then exactly 0, not the Gram's round-off).
    near = d2.topk(2, dim=1, largest=False).indices
    two = (x[:, None, :] - x[near]).norm(dim=-1)
    ok = two[:, 0] > 0
    mu = two[ok, 1] / two[ok, 0]
    n = int(mu.numel())
    total = float(mu.log().sum())
    if n == 0 or total <= 0:
        return math.nan, math.nan, n
    d = n / total
    return d, d / math.sqrt(n), n


def spectral_measures(eigenvalues: Tensor, alpha: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`matrix_entropy`, :func:`effective_rank` and :func:`participation_ratio` of many
    spectra at once (``[..., k]``, each ≥ 0; NaN for an all-zero one)."""
    eig = eigenvalues.clamp_min(0.0)
    top = eig.amax(-1, keepdim=True)
    keep = eig > RANK_TOL * top
    lam = torch.where(keep, eig, torch.zeros_like(eig))
    total = lam.sum(-1, keepdim=True)
    p = lam / total
    logp = torch.where(keep, p, torch.ones_like(p)).log()
    if abs(alpha - 1.0) < 1e-12:
        entropy = -(p * logp).sum(-1)
    else:
        entropy = torch.where(keep, p**alpha, torch.zeros_like(p)).sum(-1).log() / (1.0 - alpha)
    sigma = lam.sqrt()
    q = sigma / sigma.sum(-1, keepdim=True)
    logq = torch.where(keep, q, torch.ones_like(q)).log()
    erank = torch.exp(-(q * logq).sum(-1))
    pr = eig.sum(-1) ** 2 / (eig**2).sum(-1)
    empty = total[..., 0] <= 0
    nan = torch.full_like(entropy, math.nan)
    return (
        torch.where(empty, nan, entropy),
        torch.where(empty, nan, erank),
        torch.where(empty, nan, pr),
    )


def batched_gram_eigenvalues(z: Float[Tensor, "*batch n d"], center: bool = True) -> Tensor:
    """:func:`gram_eigenvalues` of many sets of rows at once (``[..., min(n, d)]``)."""
    z = z.double()
    if center:
        z = z - z.mean(-2, keepdim=True)
    small = z @ z.transpose(-1, -2) if z.shape[-2] <= z.shape[-1] else z.transpose(-1, -2) @ z
    return torch.linalg.eigvalsh((small + small.transpose(-1, -2)) / 2).flip(-1).clamp_min(0.0)


def curvature_angles(h: Float[Tensor, "*lead batch pos d"]) -> Float[Tensor, "*lead batch pos2"]:
    """The angle (radians) between consecutive token-to-token differences ``v_t = h_{t+1} − h_t``
    at every triple of positions ``t, t+1, t+2`` (Skean et al.'s curvature; ``pos − 2`` of them
    per row), as ``2 atan2(‖û_a − û_b‖, ‖û_a + û_b‖)`` of the unit differences: exact at small
    angles, where ``acos`` of a dot product is not. Two ``[..., pos, d]`` temporaries."""
    h = h.double()
    u = h[..., 1:, :] - h[..., :-1, :]
    u.div_(torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(1e-300))
    ua, ub = u[..., :-1, :], u[..., 1:, :]
    diff = ua - ub
    apart = torch.linalg.vector_norm(diff, dim=-1)
    together = torch.linalg.vector_norm(diff.add_(ub, alpha=2.0), dim=-1)  # ua + ub
    return 2 * torch.atan2(apart, together)


def curvature_sums(
    h: Float[Tensor, "*lead batch pos d"],
    mask: Bool[Tensor, "batch pos"],
    angles: Tensor | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Sum and sum of squares (per leading index, e.g. per layer) and count of the
    :func:`curvature_angles` within each row, over triples of real positions (``angles``: those of
    ``h`` computed already, for several masks of the same states)."""
    angle = curvature_angles(h) if angles is None else angles
    valid = mask[:, :-2] & mask[:, 1:-1] & mask[:, 2:]
    angle = torch.where(valid, angle, torch.zeros_like(angle))
    return angle.sum((-2, -1)), (angle**2).sum((-2, -1)), int(valid.sum())


def jackknife(full: float, leave_out: list[float]) -> float:
    """The delete-one-group jackknife standard error ``√((G−1)/G · Σ(θ₋g − θ̄)²)``."""
    g = len(leave_out)
    values = [v for v in leave_out if math.isfinite(v)]
    if g < 2 or len(values) < g:
        return math.nan
    mean = sum(values) / g
    return math.sqrt((g - 1) / g * sum((v - mean) ** 2 for v in values))


def sketch_matrix(d: int, k: int, seed: int, device: torch.device | str = "cpu") -> Tensor:
    """A ``d × k`` Gaussian projection with entries ``N(0, 1/k)`` (made on the CPU from ``seed``,
    so every process makes the same): ``E[P Pᵀ] = I``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d, k, generator=g, dtype=torch.float64) / math.sqrt(k)).to(device)


def first_positions(keep: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos"]:
    """Position 0 of every row that keeps it: the attention sink's place, which the
    outlier-aware variants leave out."""
    first = torch.zeros_like(keep)
    first[:, 0] = keep[:, 0]
    return first


def refuse_large_state(
    name: str, size_bytes: int, max_state_gb: float, what: str, hint: str
) -> None:
    """Refuse (before any work) moments of ``size_bytes`` over ``max_state_gb`` GiB.

    Raises:
        OptionError: Over the cap; says how large (``what``: of what) and what to change.
    """
    size = size_bytes / 2**30
    if size > max_state_gb:
        raise OptionError(
            f"{name}'s moments would hold {size:.1f} GiB{what}, over max_state_gb={max_state_gb}",
            hint=hint,
        )
