"""``spectrum`` — the spectrum of each layer's representation (docs/science.md G2).

Per residual state ``h_ℓ``: the matrix entropy of the token Gram normalised to unit trace
(Rényi-α, Skean et al. 2025), Roy & Vetterli's effective rank and the participation ratio, at
three levels — *token* (every real position: streamed d × d moments), *dataset* (the last token
of each row: streamed moments, in ``groups`` row groups for a jackknife interval) and *prompt*
(each row's own tokens, averaged over rows, with the spread across rows) —, the curvature of each
row's token trajectory, and the TwoNN intrinsic dimension on a capped sample of token rows. The
nonzero eigenvalues of ``X_c X_cᵀ`` are those of ``X_cᵀ X_c``, so the streamed moments give the
Gram's spectrum. Everything also with the sink (position 0) left out and the massive dimensions
removed (``massive``'s definition).

Memory: ``(2 + groups)(L+1) d²`` float64 for the moments, ``sample (L+1) d`` for the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lensdiv.analyzers.similarity import VARIANTS, Z, row_keys, write_sample
from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.geometry import (
    RANK_TOL,
    batched_gram_eigenvalues,
    covariance_eigenvalues,
    curvature_angles,
    curvature_sums,
    effective_rank,
    first_positions,
    jackknife,
    matrix_entropy,
    participation_ratio,
    refuse_large_state,
    spectral_measures,
    twonn,
)
from lensdiv.ops.outliers import massive_counts
from lensdiv.ops.surgery import last_positions

MEASURES = ("entropy", "erank", "pr")


@dataclass(frozen=True)
class Spectrum(Analyzer):
    """Matrix entropy, effective rank, participation ratio (token, dataset and prompt level),
    curvature and TwoNN intrinsic dimension per residual state, with and without the outliers.

    Args:
        alpha: Order of the Rényi entropy (1: Shannon).
        center: Centre the states before the Gram (the covariance's spectrum).
        sample: Token rows kept for TwoNN, drawn as ``similarity`` draws its sample; its cost
            grows as ``sample²``.
        per_batch: Sampled positions a batch gives at most.
        per_row: Sampled positions a row gives at most.
        groups: Row groups (a hash of the row's tokens, mod ``groups``) of the last-token
            moments: the jackknife.
        max_state_gb: Refuse (before the run) moments larger than this.
        absolute, ratio, bins_per_decade: The massive dimensions, as ``massive`` defines them.
        seed: Draws the sample's rows.
    """

    name = "spectrum"
    aliases = ("matrix-entropy",)
    description = "Matrix entropy, effective rank, curvature, TwoNN dimension by depth"
    depth_profiles = (
        "spectrum.dataset_entropy",
        "spectrum.prompt_entropy",
        "spectrum.token_erank",
        "spectrum.twonn",
        "spectrum.curvature",
    )

    alpha: float = 1.0
    center: bool = True
    sample: int = 1024
    per_batch: int = 64
    per_row: int = 8
    groups: int = 4
    max_state_gb: float = 4.0
    absolute: float = 100.0
    ratio: float = 1000.0
    bins_per_decade: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"alpha must be positive, got {self.alpha}")
        if not 1 <= self.per_row <= self.per_batch <= self.sample:
            raise ValueError("need 1 <= per_row <= per_batch <= sample")
        if self.groups < 2:
            raise ValueError(f"groups must be at least 2, got {self.groups}")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def state_bytes(self, info: ModelInfo) -> int:
        """Bytes of the moments and the sample."""
        L1, d = info.n_layers + 1, info.d_model
        return 8 * ((2 + self.groups) * L1 * d * d + self.sample * L1 * d)

    def setup(self, model: object, info: ModelInfo) -> None:
        refuse_large_state(
            "spectrum",
            self.state_bytes(info),
            self.max_state_gb,
            "",
            "lower -O spectrum.groups or raise max_state_gb",
        )

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.mask
        if not keep.any():
            return
        info, device = step.info, keep.device
        L1, d = info.n_layers + 1, info.d_model
        h = torch.stack([step.resid(layer).to(device).double() for layer in range(L1)])
        first = first_positions(keep)
        last = last_positions(keep) & keep
        counts, dims = massive_counts(h, keep, self.absolute, self.ratio, self.bins_per_decade)
        state.add("massive", counts)
        for part, where in (("rest", keep & ~first), ("first", first)):
            x = h[:, where]  # [L+1, n, d]
            state.add(f"n_{part}", float(where.sum()))
            state.add(f"s_{part}", x.sum(1))
            state.zeros(f"m_{part}", (L1, d, d), device).baddbmm_(x.transpose(1, 2), x)
        group = torch.tensor(
            [k % self.groups for k in row_keys(step.batch.tokens, keep)], device=device
        )
        n_last = state.zeros("last_n", (self.groups,), device)
        s_last = state.zeros("last_s", (self.groups, L1, d), device)
        m_last = state.zeros("last_m", (self.groups, L1, d, d), device)
        for g in group.unique().tolist():
            where = last & (group == g)[:, None]
            x = h[:, where]
            n_last[g] += float(where.sum())
            s_last[g] += x.sum(1)
            m_last[g].baddbmm_(x.transpose(1, 2), x)
        self._rows(state, h, keep, ~dims)
        write_sample(state, step, h, self.sample, self.per_batch, self.per_row, self.seed)

    def _rows(self, state: Stats, h: Tensor, keep: Tensor, clean: Tensor) -> None:
        """Prompt-level spectra (each row's tokens) and curvature, per variant: sums, sums of
        squares and counts (rows of one length at once). The massive dimensions of this batch
        are removed for ``no_massive``."""
        L1, device = h.shape[0], keep.device
        sums = torch.zeros(len(VARIANTS), len(MEASURES), 2, L1, dtype=torch.float64, device=device)
        rows = torch.zeros(len(VARIANTS), dtype=torch.float64, device=device)
        curve = torch.zeros(len(VARIANTS), 3, L1, dtype=torch.float64, device=device)
        angles = curvature_angles(h)  # every variant but no_massive: the same states
        for v, variant in enumerate(VARIANTS):
            mask = keep.clone()
            if variant == "no_sink":
                mask[:, 0] = False
            feats = h[..., clean] if variant == "no_massive" else h
            lengths = mask.sum(1)
            for n in lengths.unique().tolist():
                same = (lengths == n).nonzero()[:, 0]
                if n < 2:
                    continue
                z = _real_positions(feats, mask, same, n)
                eig = batched_gram_eigenvalues(z, self.center)
                for m, value in enumerate(spectral_measures(eig, self.alpha)):
                    sums[v, m, 0] += value.sum(1)
                    sums[v, m, 1] += (value**2).sum(1)
                rows[v] += len(same)
            total, squares, count = curvature_sums(
                feats, mask, None if variant == "no_massive" else angles
            )
            curve[v, 0], curve[v, 1], curve[v, 2] = total, squares, float(count)
        state.add("prompt_sums", sums)
        state.add("prompt_rows", rows)
        state.add("curvature", curve)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if float(state.get("n_rest", 0.0)) + float(state.get("n_first", 0.0)) == 0:
            raise ValueError("no real position was seen")
        return present(SpectrumNumbers.from_state(state, self, info), self, info)


def _real_positions(feats: Tensor, mask: Tensor, same: Tensor, n: int) -> Tensor:
    """The real positions of rows ``same`` (each has ``n``), in order: ``[L+1, rows, n, d]``; a
    view, not a copy, when the rows are all rows and their positions all or all but the first."""
    rows = feats if len(same) == feats.shape[1] else feats[:, same]
    real = mask[same]
    if n == real.shape[1]:
        return rows
    if n == real.shape[1] - 1 and not bool(real[:, 0].any()):
        return rows[:, :, 1:]
    return rows[:, real].reshape(feats.shape[0], len(same), n, -1)


def _measures(eig: Tensor, alpha: float) -> tuple[float, float, float]:
    return matrix_entropy(eig, alpha), effective_rank(eig), participation_ratio(eig)


# -- the numbers ---------------------------------------------------------------------------------
def _spectra(n: float, s: Tensor, m: Tensor, dims: Tensor | None, center: bool) -> list[Tensor]:
    """Each layer's eigenvalues of the (centred) second moment, ``dims`` kept."""
    out = []
    for layer in range(s.shape[0]):
        sl, ml = s[layer], m[layer]
        if dims is not None:
            sl, ml = sl[dims], ml[dims][:, dims]
        if not center:
            sl = torch.zeros_like(sl)
        out.append(covariance_eigenvalues(n, sl, ml))
    return out


@dataclass(frozen=True)
class SpectrumNumbers:
    """Everything ``spectrum`` reports, per variant (:data:`VARIANTS`) and residual state.

    Args:
        columns: ``{variant: {column: [L+1]}}``: ``token_*``, ``dataset_*`` (with ``_se``, the
            jackknife's), ``prompt_*`` (with ``_se``, across rows) for entropy, erank and pr;
            ``curvature`` (radians, ``_se``), ``twonn`` (``_se``).
        eigenvalues: The token covariance spectrum per state (all positions), descending.
        massive_dims: The massive dimensions (any state, any batch).
        tokens, rows, sample: Positions, rows and sample rows read.
    """

    columns: dict[str, dict[str, np.ndarray]]
    eigenvalues: np.ndarray
    massive_dims: list[int]
    tokens: int
    rows: int
    sample: int

    @classmethod
    def from_state(cls, state: Stats, options: Spectrum, info: ModelInfo) -> SpectrumNumbers:
        d = info.d_model
        dims = [int(j) for j in torch.nonzero(state["massive"].sum(0) > 0)[:, 0]]
        kept = torch.tensor([j for j in range(d) if j not in dims], dtype=torch.long)
        parts = {
            p: (float(state[f"n_{p}"]), state[f"s_{p}"].cpu(), state[f"m_{p}"].cpu())
            for p in ("rest", "first")
        }
        (n0, s0, m0), (n1, s1, m1) = parts["rest"], parts["first"]
        everything = (n0 + n1, s0 + s1, m0 + m1)
        token: dict[str, tuple[float, Tensor, Tensor]] = {
            "all": everything,
            "no_sink": parts["rest"],
            "no_massive": everything,
        }
        columns: dict[str, dict[str, np.ndarray]] = {}
        spectra_all: list[Tensor] = []
        for v, variant in enumerate(VARIANTS):
            cols: dict[str, np.ndarray] = {}
            feats = kept if variant == "no_massive" and dims else None
            n, s, m = token[variant]
            spectra = _spectra(n, s, m, feats, options.center)
            if variant == "all":
                spectra_all = spectra
            _put(cols, "token", [_measures(e, options.alpha) for e in spectra])
            if variant == "no_sink":  # the last token of a row is never its position 0
                cols.update({k: v for k, v in columns["all"].items() if k.startswith("dataset")})
            else:
                cols.update(_dataset(state, options, feats, interval=variant == "all"))
            cols.update(_prompt(state, v))
            cols.update(_sampled(state, variant, feats))
            columns[variant] = cols
        width = max(len(e) for e in spectra_all)
        eig = np.full((len(spectra_all), width), math.nan)
        for i, e in enumerate(spectra_all):
            eig[i, : len(e)] = e.numpy()
        return cls(
            columns=columns,
            eigenvalues=eig,
            massive_dims=dims,
            tokens=int(everything[0]),
            rows=int(float(state["prompt_rows"][0])),
            sample=int(float(state["sample_filled"].sum())) if "sample_filled" in state else 0,
        )


def _put(cols: dict[str, np.ndarray], level: str, values: list[tuple[float, float, float]]) -> None:
    for m, measure in enumerate(MEASURES):
        cols[f"{level}_{measure}"] = np.array([v[m] for v in values])


def _dataset(
    state: Stats, options: Spectrum, feats: Tensor | None, interval: bool
) -> dict[str, np.ndarray]:
    """Dataset level (last tokens) and, with ``interval``, its delete-one-group jackknife
    standard error (``groups`` more eigendecompositions per state)."""
    n, s, m = state["last_n"].cpu(), state["last_s"].cpu(), state["last_m"].cpu()
    full = [
        _measures(e, options.alpha)
        for e in _spectra(float(n.sum()), s.sum(0), m.sum(0), feats, options.center)
    ]
    cols: dict[str, np.ndarray] = {}
    _put(cols, "dataset", full)
    leave: list[list[tuple[float, float, float]]] = []
    for g in range(options.groups if interval else 0):
        rest = [i for i in range(options.groups) if i != g]
        if float(n[rest].sum()) < 2 or float(n[g]) == 0:
            leave = []
            break
        spectra = _spectra(
            float(n[rest].sum()), s[rest].sum(0), m[rest].sum(0), feats, options.center
        )
        leave.append([_measures(e, options.alpha) for e in spectra])
    for k, measure in enumerate(MEASURES):
        cols[f"dataset_{measure}_se"] = np.array(
            [
                jackknife(0.0, [row[layer][k] for row in leave]) if leave else math.nan
                for layer in range(len(full))
            ]
        )
    return cols


def _prompt(state: Stats, v: int) -> dict[str, np.ndarray]:
    """Prompt level: the mean over rows and its standard error; curvature likewise over triples."""
    sums, rows = state["prompt_sums"].cpu()[v], float(state["prompt_rows"][v])
    cols: dict[str, np.ndarray] = {}
    for m, measure in enumerate(MEASURES):
        mean, se = _mean_se(sums[m, 0], sums[m, 1], rows)
        cols[f"prompt_{measure}"], cols[f"prompt_{measure}_se"] = mean, se
    total, squares, count = state["curvature"].cpu()[v]
    cols["curvature"], cols["curvature_se"] = _mean_se(total, squares, count)
    return cols


def _mean_se(
    total: Tensor, squares: Tensor, count: Tensor | float
) -> tuple[np.ndarray, np.ndarray]:
    n = torch.as_tensor(count, dtype=torch.float64)
    mean = total / n.clamp_min(1)
    var = (squares - n * mean**2).clamp_min(0) / (n - 1).clamp_min(1)
    se = (var / n.clamp_min(1)).sqrt()
    empty = n < 2
    return mean.masked_fill(n < 1, math.nan).numpy(), se.masked_fill(empty, math.nan).numpy()


def _sampled(state: Stats, variant: str, feats: Tensor | None) -> dict[str, np.ndarray]:
    """TwoNN on the sample's rows (without position 0 for ``no_sink``)."""
    if "sample_filled" not in state:
        return {"twonn": np.array([math.nan]), "twonn_se": np.array([math.nan])}
    filled = state["sample_filled"].cpu() > 0
    x, pos = state["sample_x"].cpu()[filled], state["sample_pos"].cpu()[filled]
    if variant == "no_sink":
        x = x[pos != 0]
    if feats is not None:
        x = x[..., feats]
    values = [twonn(x[:, layer]) for layer in range(x.shape[1])]
    return {"twonn": np.array([v[0] for v in values]), "twonn_se": np.array([v[1] for v in values])}


# -- the result ----------------------------------------------------------------------------------
def present(numbers: SpectrumNumbers, options: Spectrum, info: ModelInfo) -> Result:
    """Tables, arrays, plots and summary of a spectrum run."""
    L1 = info.n_layers + 1
    tables = {}
    for variant in VARIANTS:
        name = "spectrum" if variant == "all" else f"spectrum_{variant}"
        cols = {k: np.broadcast_to(v, (L1,)) for k, v in numbers.columns[variant].items()}
        for key in [k for k in cols if k.endswith("_se")]:
            base = key[: -len("_se")]
            cols[f"{base}_lo"], cols[f"{base}_hi"] = (
                cols[base] - Z * cols[key],
                cols[base] + Z * cols[key],
            )
        tables[name] = Table(
            name,
            {"layer": list(range(L1)), **cols},
            f"Residual state h_l ({variant.replace('_', ' ')}): matrix entropy (nats), effective "
            "rank, participation ratio at token, dataset and prompt level; curvature (radians); "
            "TwoNN dimension; _lo/_hi: 95 % intervals",
        )
    change: dict[str, list[Any]] = {
        "measure": [],
        "variant": [],
        "mean_abs_change": [],
        "max_abs_change": [],
    }
    for column in (
        "token_entropy",
        "dataset_entropy",
        "prompt_entropy",
        "token_erank",
        "curvature",
        "twonn",
    ):
        reference = np.broadcast_to(numbers.columns["all"][column], (L1,))
        for variant in VARIANTS[1:]:
            delta = np.abs(np.broadcast_to(numbers.columns[variant][column], (L1,)) - reference)
            finite = delta[np.isfinite(delta)]
            change["measure"].append(column)
            change["variant"].append(variant)
            change["mean_abs_change"].append(float(finite.mean()) if finite.size else math.nan)
            change["max_abs_change"].append(float(finite.max()) if finite.size else math.nan)
    tables["spectrum_change"] = Table(
        "spectrum_change",
        change,
        "How much leaving out the sink position or the massive dimensions moves each profile",
    )
    share = numbers.eigenvalues / np.nansum(numbers.eigenvalues, 1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        # The numerical null space (below RANK_TOL of the variance) is left blank.
        logeig = np.where(share > RANK_TOL, np.log10(share), np.nan)
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, info),
        tables=tables,
        arrays={"log10_eigenvalue_share": logeig},
        plots=_plots(),
        meta={
            "alpha": options.alpha,
            "center": options.center,
            "tokens": numbers.tokens,
            "rows": numbers.rows,
            "sample_rows": numbers.sample,
            "massive_dims": numbers.massive_dims,
            "state_bytes": options.state_bytes(info),
            "entropy_unit": "nats",
            "intervals": {
                "dataset": f"95 % normal, jackknife over {options.groups} row groups",
                "prompt": "95 % normal, standard error across rows",
                "curvature": "95 % normal, standard error across triples of positions",
                "twonn": "95 % normal, the MLE's d/sqrt(N)",
                "token": "none (every position, streamed)",
            },
        },
    )


def _summary(numbers: SpectrumNumbers, info: ModelInfo) -> str:
    cols = numbers.columns["all"]
    ent = cols["dataset_entropy"]
    dip = int(np.nanargmin(ent)) if np.isfinite(ent).any() else 0
    twonn_ = np.broadcast_to(cols["twonn"], ent.shape)
    peak = int(np.nanargmax(twonn_)) if np.isfinite(twonn_).any() else 0
    return (
        f"Dataset entropy (last tokens, {numbers.rows} rows) is lowest at h_{dip} "
        f"({ent[dip]:.3g} nats; h_0 {ent[0]:.3g}, h_{info.n_layers} {ent[-1]:.3g}); token-level "
        f"effective rank from {cols['token_erank'][0]:.3g} to {cols['token_erank'][-1]:.3g}; "
        f"TwoNN dimension peaks at h_{peak} ({twonn_[peak]:.3g}, {numbers.sample} sampled rows). "
        + (
            f"Massive dimension(s): {', '.join(map(str, numbers.massive_dims[:4]))}."
            if numbers.massive_dims
            else "No massive dimension."
        )
    )


def _plots() -> tuple[Plot, ...]:
    return (
        Plot(
            "line",
            "spectrum_entropy",
            "Matrix entropy by depth",
            "spectrum",
            x="layer",
            y=("token_entropy", "dataset_entropy", "prompt_entropy"),
            xlabel="residual state h_l",
            ylabel="entropy (nats)",
            labels=(
                "token level (every token)",
                "dataset level (last tokens)",
                "prompt level (mean over prompts)",
            ),
            ylim=(0.0, None),
        ),
        Plot(
            "line",
            "spectrum_rank",
            "Effective rank and participation ratio",
            "spectrum",
            x="layer",
            y=("token_erank", "token_pr", "twonn"),
            xlabel="residual state h_l",
            ylabel="dimensions (log scale)",
            labels=("effective rank", "participation ratio", "TwoNN intrinsic dimension"),
            logy=True,
        ),
        Plot(
            "line",
            "spectrum_entropy_no_massive",
            "Matrix entropy, massive dimensions removed",
            "spectrum_no_massive",
            x="layer",
            y=("token_entropy", "dataset_entropy", "prompt_entropy"),
            xlabel="residual state h_l",
            ylabel="entropy (nats)",
            labels=(
                "token level (every token)",
                "dataset level (last tokens)",
                "prompt level (mean over prompts)",
            ),
            ylim=(0.0, None),
        ),
        Plot(
            "heatmap",
            "spectrum_eigenvalues",
            "Token covariance spectrum by depth",
            "log10_eigenvalue_share",
            xlabel="eigenvalue rank",
            ylabel="residual state h_l",
            clabel="log10 share of the variance",
            caption="Each row: the eigenvalues of the token covariance of h_l over their sum.",
        ),
    )
