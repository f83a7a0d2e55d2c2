"""Fitting an affine (least-squares) lens (docs/science.md D3) from streamed moments.

``T_l(h) = W_l h + c_l`` minimises ``E‖W_l h_l + c_l − h_L‖²`` (optionally ridge) over the
positions of the data, for every residual state ``h_l`` (``l = 0..L-1``; ``h_L`` reads itself).
Closed form from the moments ``Σ [h_l, 1][h_l, 1]ᵀ`` and ``Σ [h_l, 1] h_Lᵀ``
(:mod:`lensdiv.ops.ridge`, the solver ``linmap`` uses): sums in float64, so shards and ranks
merge exactly and the fit is the same however the data was split.

The result carries the lens in tuned-lens's layout (``affine_lens/config.json`` +
``params.pt``, each translator stored as ``A_l = W_l − I``, ``b_l = c_l`` in tuned-lens's
residual form ``h + A_l h + b_l``): ``--lens affine:PATH`` reads it, tuned-lens loads it as a
tuned lens, and ``lensdiv lenses fit --kind tuned --init PATH`` starts training from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.devices import masked_stack
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.lens_files import TunedLensFolder
from lensdiv.ops.ridge import augment, fit_affine

AFFINE_FOLDER = "affine_lens"


@dataclass(frozen=True)
class AffineFit(Analyzer):
    """Fit an affine lens: the least-squares map from each residual state to the final one.

    Args:
        ridge: Ridge penalty relative to the mean eigenvalue of each state's covariance (0 for
            plain least squares).
        exclude_bos: Leave the BOS position out of the fit (its states are outliers in most
            models).
    """

    name = "fit-affine"
    description = "Fit an affine lens (least squares from h_l to h_L) in tuned-lens's layout"
    depth_profiles = ()  # a fit, not a depth analysis: nothing for a study to compare

    ridge: float = 1e-4
    exclude_bos: bool = True

    def __post_init__(self) -> None:
        if self.ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge}")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def min_tokens(self, info: ModelInfo) -> int:
        """More positions than the ``d_model + 1`` parameters of each map."""
        return info.d_model + 2

    def update(self, state: Stats, step: Step) -> None:
        y = add_moments(state, step, self.exclude_bos)
        if y is not None:
            state.add("yy", y.square().sum())

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(AffineLens.from_state(state, info, self.ridge), self, info)


# -- the numbers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AffineLens:
    """The fitted affine lens: no tables, no prose.

    Args:
        weights: Per residual state ``h_l`` (``l = 0..L-1``) tuned-lens's ``A_l = W_l − I``
            (float32, CPU).
        biases: Per state ``b_l = c_l`` (float32, CPU).
        r2: Per state: the share of ``h_L``'s variance its map explains (training positions).
        ridge_lambda: Per state: the ridge penalty used (absolute).
        exact_solve: Per state: whether the normal equations were solved exactly.
        positions: Positions fitted on.
    """

    weights: dict[int, Tensor]
    biases: dict[int, Tensor]
    r2: list[float]
    ridge_lambda: list[float]
    exact_solve: list[bool]
    positions: int

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, ridge: float) -> AffineLens:
        """Solve every state's least squares from the streamed moments."""
        xtx, xty = state["xtx"], state["xty"]
        d = info.d_model
        n = float(xtx[0, d, d])
        mean_y = xty[0, d] / n
        total = float(state["yy"]) - n * float(mean_y @ mean_y)  # Σ‖y − ȳ‖²
        eye = torch.eye(d, dtype=torch.float64, device=xtx.device)
        lens = cls({}, {}, [], [], [], int(n))
        for layer in range(info.n_layers):
            maps, lam, solved = fit_affine(xtx[layer], xty[layer], ridge)
            lens.weights[layer] = (maps[:d].T - eye).float().cpu()  # tuned-lens's A = W − I
            lens.biases[layer] = maps[d].float().cpu()
            residual = _residual(xtx[layer], xty[layer], maps, float(state["yy"]))
            lens.r2.append(1.0 - residual / total)
            lens.ridge_lambda.append(lam)
            lens.exact_solve.append(solved)
        return lens


def _residual(xtx: Tensor, xty: Tensor, maps: Tensor, yy: float) -> float:
    """``Σ‖y − [x, 1] maps‖²`` from the moments: ``Σ‖y‖² − 2 tr(mapsᵀ X̃ᵀY) + tr(mapsᵀ X̃ᵀX̃ maps)``."""
    return yy - 2.0 * float((maps * xty).sum()) + float((maps * (xtx @ maps)).sum())


# -- the presentation ------------------------------------------------------------------------------


def present(lens: AffineLens, options: AffineFit, info: ModelInfo) -> Result:
    """The fit's table, plot and summary, and the lens as an artifact in tuned-lens's layout."""
    layers = list(range(info.n_layers))
    table = Table(
        "affine",
        {
            "layer": layers,
            "state": [f"h{layer}" for layer in layers],
            "r2": lens.r2,
            "ridge_lambda": lens.ridge_lambda,
            "exact_solve": lens.exact_solve,
        },
        "Affine lens: how much of h_L each state's least-squares map explains (training positions)",
    )
    artifact = TunedLensFolder(
        AFFINE_FOLDER,
        lens.weights,
        lens.biases,
        d_model=info.d_model,
        n_layers=info.n_layers,
        model_name=info.name,
        extra={
            "fitted_by": "lensdiv",
            "lensdiv_lens": "affine",
            "ridge": options.ridge,
            "positions": lens.positions,
        },
    )
    summary = (
        f"Affine lens from {lens.positions} positions: h_L is explained with R² {lens.r2[0]:.3g} "
        f"from the embedding and {lens.r2[-1]:.3g} from h{info.n_layers - 1}; saved in "
        f"tuned-lens's layout ({AFFINE_FOLDER}/)."
    )
    return Result(
        options.name,
        summary,
        tables={"affine": table},
        plots=(
            Plot(
                "line",
                "affine_r2",
                "Affine lens: R² of h_L from h_l",
                "affine",
                x="layer",
                y=("r2",),
                xlabel="residual state h_l (0 = embedding)",
                ylabel="R² (training positions)",
                caption="1 = h_L is an affine function of h_l on these positions.",
            ),
        ),
        meta={"positions": lens.positions},
        artifacts=(artifact,),
    )


def add_moments(
    state: Stats, step: Step, exclude_bos: bool, xtx: str = "xtx", xty: str = "xty"
) -> Tensor | None:
    """Add this batch's least-squares moments of ``h_l → h_L`` to ``state``, in float64:
    ``Σ [h_l, 1][h_l, 1]ᵀ`` to ``xtx`` and ``Σ [h_l, 1] h_Lᵀ`` to ``xty`` (``[L, d+1, ·]``), over
    its real positions (BOS left out with ``exclude_bos``). Returns those positions' ``h_L``
    (float64), or ``None`` where the batch has none."""
    info = step.info
    keep = step.batch.positions(exclude_bos=exclude_bos)
    if not keep.any():
        return None
    x = masked_stack([step.resid(layer) for layer in range(info.n_layers)], keep)
    y = masked_stack([step.resid(info.n_layers)], keep)[0].double()
    xa = augment(x)  # [L, n, d + 1]
    d = xa.shape[2]
    state.zeros(xtx, (info.n_layers, d, d), xa.device).baddbmm_(xa.transpose(1, 2), xa)
    sums = state.zeros(xty, (info.n_layers, d, y.shape[1]), xa.device)
    for layer in range(info.n_layers):
        sums[layer].addmm_(xa[layer].T, y)
    return y
