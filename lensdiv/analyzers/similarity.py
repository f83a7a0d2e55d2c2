"""``similarity`` — layer × layer representational similarity of one model (docs/science.md G1).

Over the residual states ``h_0 … h_L`` of every real position: linear CKA streamed from float64
moments (the count, the column sums and the cross-products of every pair of states, which merge
by addition across batches, processes and shards), and, on a capped sample of token rows kept in
the state, the kernel forms — the unbiased HSIC estimator's CKA, RBF CKA, SVCCA, PWCCA and the
orthogonal Procrustes distance — with a jackknife over row groups on the sample's linear CKA.
Block influence and the angular distance of consecutive states come from the code path ``prune``
reads (:func:`lensdiv.ops.surgery.signal_sums`).

Every matrix is also computed with the sink position (position 0 of each row) left out and with
the massive dimensions (``massive``'s definition, :func:`lensdiv.ops.outliers.massive_entries`)
removed; a table says how much each changes the result.

Memory: the moments hold ``2 (L+1)² d d'`` float64 (position 0 apart from the rest, so the sink
can be left out exactly; ``d' = d``, or ``sketch`` when set), the sample ``sample · (L+1) · d``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.geometry import (
    Basis,
    center_gram,
    first_positions,
    hsic_unbiased,
    jackknife,
    procrustes,
    pwcca,
    rbf_gram,
    refuse_large_state,
    sketch_matrix,
    svcca,
)
from lensdiv.ops.outliers import massive_counts
from lensdiv.ops.surgery import last_positions, signal_sums

VARIANTS = ("all", "no_sink", "no_massive")
MEASURES = ("linear", "unbiased", "rbf", "svcca", "pwcca", "procrustes")
# Measures read from the sample (the streamed moments give ``linear``).
SAMPLED = MEASURES[1:]
Z = 1.959963984540054  # the two-sided 95 % normal quantile


@dataclass(frozen=True)
class Similarity(Analyzer):
    """Layer × layer similarity of the residual states: CKA (linear streamed, unbiased, RBF),
    SVCCA, PWCCA, Procrustes; block influence; each with and without the outliers.

    Args:
        sample: Token rows kept for the kernel forms: ``per_row`` positions of each row (drawn
            from the row's tokens and ``seed``) of the first ``sample / per_batch`` batches, at
            most ``per_batch`` a batch. Their cost grows as ``sample²``.
        per_batch: Sampled positions a batch gives at most.
        per_row: Sampled positions a row gives at most.
        groups: Jackknife groups (rows by a hash of their tokens, mod ``groups``) of the
            sample's linear CKA.
        rbf_scale: RBF bandwidth as a multiple of the median distance between rows.
        keep: SVCCA/PWCCA keep the directions holding this share of each side's variance.
        sketch: Project the right-hand side of every cross-product onto this many random
            Gaussian directions (0: exact). The moments shrink by ``d/sketch``; each squared
            norm is then unbiased with relative standard deviation at most ``√(2/sketch)``.
        max_state_gb: Refuse (before the run) moments larger than this; set ``sketch``.
        absolute, ratio, bins_per_decade: The massive dimensions, as ``massive`` defines them.
        seed: Draws the sample's rows and the sketch.
    """

    name = "similarity"
    aliases = ("cka",)
    description = "Layer×layer CKA, CCA, Procrustes and block influence, outlier-aware"
    depth_profiles = ("similarity_blocks.cka_next", "similarity_blocks.block_influence")

    sample: int = 512
    per_batch: int = 64
    per_row: int = 8
    groups: int = 8
    rbf_scale: float = 1.0
    keep: float = 0.99
    sketch: int = 0
    max_state_gb: float = 4.0
    absolute: float = 100.0
    ratio: float = 1000.0
    bins_per_decade: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.per_row <= self.per_batch <= self.sample:
            raise ValueError("need 1 <= per_row <= per_batch <= sample")
        if self.groups < 2:
            raise ValueError(f"groups must be at least 2, got {self.groups}")
        if not 0 < self.keep <= 1 or self.rbf_scale <= 0:
            raise ValueError("keep must be in (0, 1] and rbf_scale positive")
        if self.sketch < 0 or self.max_state_gb <= 0:
            raise ValueError("sketch must be 0 or more and max_state_gb positive")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def width(self, info: ModelInfo) -> int:
        """Columns per state on the right of the cross-products: ``d``, or the sketch's."""
        return self.sketch or info.d_model

    def state_bytes(self, info: ModelInfo) -> int:
        """Bytes of the moments (``2 (L+1)² d d'``) and the sample."""
        L1 = info.n_layers + 1
        moments = 2 * (L1 * info.d_model) * (L1 * self.width(info))
        return 8 * (moments + self.sample * L1 * info.d_model)

    def setup(self, model: object, info: ModelInfo) -> None:
        refuse_large_state(
            "similarity",
            self.state_bytes(info),
            self.max_state_gb,
            f" (2·(L+1)²·d·d' float64 with L={info.n_layers}, d={info.d_model}, "
            f"d'={self.width(info)})",
            "-O similarity.sketch=256 projects the states first (or raise max_state_gb)",
        )

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.mask
        if not keep.any():
            return
        info, device = step.info, keep.device
        L = info.n_layers
        h = [step.resid(layer).to(device) for layer in range(L + 1)]
        first = first_positions(keep)
        rest = keep & ~first
        last = last_positions(keep) & keep
        for name, where in (("all", keep), ("no_sink", rest)):
            signals = signal_sums(h, where, last, 1)
            state.add(f"n_{name}", where.sum())
            state.add(f"bi_{name}", signals["bi"])
            state.add(f"ang_{name}", signals["ang_all"][:, 0])
        counts, _ = massive_counts(h, keep, self.absolute, self.ratio, self.bins_per_decade)
        state.add("massive", counts)
        P = None
        if self.sketch:
            P = step.cached(
                ("similarity-sketch", self.sketch, self.seed, str(device)),
                lambda: sketch_matrix(info.d_model, self.sketch, self.seed, device),
            )
        for part, where in (("rest", rest), ("first", first)):
            rows = torch.cat([x[where].double() for x in h], 1)
            right = rows if P is None else torch.cat([x[where].double() @ P for x in h], 1)
            state.add(f"n_{part}", float(where.sum()))
            state.add(f"s_{part}", rows.sum(0))
            if P is not None:
                state.add(f"p_{part}", right.sum(0))
            shape = (rows.shape[1], right.shape[1])
            state.zeros(f"m_{part}", shape, device).addmm_(rows.T, right)
        write_sample(
            state, step, torch.stack(h), self.sample, self.per_batch, self.per_row, self.seed
        )

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if float(state.get("n_all", 0.0)) == 0:
            raise ValueError("no real position was seen")
        return present(SimilarityNumbers.from_state(state, self, info), self, info)


# -- the sample ----------------------------------------------------------------------------------
def row_keys(tokens: Tensor, mask: Tensor) -> list[int]:
    """A 63-bit key per row from its real tokens: the same row gets the same key in any batch,
    shard or process (what draws its sampled positions and its jackknife group)."""
    keys = []
    for row, keep in zip(tokens.cpu(), mask.cpu(), strict=True):
        digest = hashlib.blake2b(row[keep].numpy().astype("<i8").tobytes(), digest_size=8)
        keys.append(int.from_bytes(digest.digest(), "little") >> 1)
    return keys


def write_sample(
    state: Stats, step: Step, h: Tensor, sample: int, per_batch: int, per_row: int, seed: int
) -> None:
    """Write sampled positions of this batch into its own slots of the sample, from the stacked
    states ``h`` ``[L+1, batch, pos, d]``: batch ``b < sample / per_batch`` fills slots
    ``b·per_batch …`` (disjoint, so sums merge them exactly), each row giving ``per_row``
    positions drawn from its key and ``seed`` (a row's draw is the same however it is batched).
    Beside the states: which slots are filled, the position and the row's key."""
    index, keep = step.batch.index, step.batch.mask
    if index >= sample // per_batch:
        return
    picks: list[tuple[int, int, int]] = []
    for r, key in enumerate(row_keys(step.batch.tokens, keep)):
        real = keep[r].nonzero()[:, 0].cpu()
        g = torch.Generator().manual_seed((seed * 1_000_003 + key) % (1 << 63))
        chosen = real[torch.randperm(len(real), generator=g)[:per_row]].sort().values
        picks += [(r, int(p), key) for p in chosen]
    picks = picks[:per_batch]
    if not picks:
        return
    rows = torch.tensor([p[0] for p in picks], device=keep.device)
    pos = torch.tensor([p[1] for p in picks], device=keep.device)
    start, m = index * per_batch, len(picks)
    x = state.zeros("sample_x", (sample, h.shape[0], h.shape[-1]), keep.device)
    x[start : start + m] = h[:, rows, pos].transpose(0, 1).double()
    values = {
        "filled": torch.ones(m, dtype=torch.float64),
        "pos": pos.double().cpu(),
        "group": torch.tensor([float(p[2] % (1 << 40)) for p in picks], dtype=torch.float64),
    }
    for name, value in values.items():
        state.zeros(f"sample_{name}", (sample,), keep.device)[start : start + m] = value.to(
            keep.device
        )


# -- the numbers ---------------------------------------------------------------------------------
def moments_cka(
    n: float,
    s: Tensor,
    m: Tensor | Sequence[Tensor],
    layers: int,
    dims: Tensor | None,
    sp: Tensor | None = None,
) -> np.ndarray:
    """The ``(L+1) × (L+1)`` linear CKA of every pair of states from the stacked moments: the
    count, ``Σx`` and ``Σ x x'ᵀ`` of the states ``x = [h_0 … h_L]`` side by side (``m``: one
    tensor, or parts to add), ``x' = x`` or each state sketched (``x' = [h_0 P … h_L P]``, with
    ``sp = Σx'``); ``dims``: the features kept in every state (``None``: all; not with a
    sketch). A sketch estimates each ``‖C_ij‖²_F`` by ``‖C_ij P‖²_F`` (unbiased: ``E[P Pᵀ] =
    I``), averaged over ``(i, j)`` and ``(j, i)``. One block row at a time: no copy of ``m``."""
    parts = [m] if isinstance(m, Tensor) else list(m)
    sp = s if sp is None else sp
    d = parts[0].shape[0] // layers
    f = torch.zeros(layers, layers, dtype=torch.float64)
    for i in range(layers):
        rows = slice(i * d, (i + 1) * d)
        c = sum(part[rows] for part in parts) - torch.outer(s[rows], sp) / n
        c = c.reshape(d, layers, -1)
        if dims is not None:
            c = c[dims][:, :, dims]
        f[i] = (c * c).sum((0, 2)).cpu()  # ‖C_ij‖²_F, or ‖C_ij P‖²_F
    f = (f + f.T) / 2
    norm = f.diagonal().sqrt()
    with np.errstate(invalid="ignore", divide="ignore"):
        return (f / torch.outer(norm, norm)).numpy()


def gram_cka(grams: list[Tensor]) -> np.ndarray:
    """Biased CKA of every pair of centred Grams (``⟨K_i, K_j⟩ / ‖K_i‖ ‖K_j‖``)."""
    flat = torch.stack([k.reshape(-1) for k in grams])
    inner = flat @ flat.T
    norm = inner.diagonal().sqrt()
    with np.errstate(invalid="ignore", divide="ignore"):
        return (inner / torch.outer(norm, norm)).cpu().numpy()


def sample_matrices(xs: list[Tensor], options: Similarity) -> dict[str, np.ndarray]:
    """The kernel forms on the sample's states ``xs`` (one ``[n, d]`` per layer)."""
    k = len(xs)
    linear = [x @ x.T for x in xs]
    unbiased = np.full((k, k), math.nan)
    for i in range(k):
        for j in range(i, k):
            unbiased[i, j] = unbiased[j, i] = hsic_unbiased(linear[i], linear[j])
    diag = np.sqrt(np.diagonal(unbiased).clip(min=0))
    with np.errstate(invalid="ignore", divide="ignore"):
        unbiased = unbiased / np.outer(diag, diag)
    out = {
        "linear_sample": gram_cka([center_gram(g) for g in linear]),
        "unbiased": unbiased,
        "rbf": gram_cka([center_gram(rbf_gram(x, options.rbf_scale)) for x in xs]),
    }
    bases = [Basis.of(x) for x in xs]
    cap = max(1, xs[0].shape[0] // 2)  # CCA on fewer directions than half the rows
    out["pwcca"] = np.array(
        [[pwcca(a, b, options.keep, cap) for b in bases] for a in bases], dtype=float
    )
    out["svcca"] = _symmetric(k, lambda i, j: svcca(bases[i], bases[j], options.keep, cap))
    out["procrustes"] = _symmetric(k, lambda i, j: procrustes(bases[i], bases[j]))
    return out


def _symmetric(k: int, fn: Callable[[int, int], float]) -> np.ndarray:
    """A symmetric ``k × k`` matrix from ``fn`` on the upper triangle."""
    out = np.zeros((k, k))
    for i in range(k):
        for j in range(i, k):
            out[i, j] = out[j, i] = fn(i, j)
    return out


@dataclass(frozen=True)
class SimilarityNumbers:
    """Everything ``similarity`` reports (``[L+1, L+1]`` matrices over ``h_0 … h_L``).

    Args:
        matrices: ``{"measure.variant": matrix}`` for :data:`MEASURES` × :data:`VARIANTS`.
        linear_se: Jackknife standard error of the sample's linear CKA (all positions).
        linear_sample: The sample's linear CKA (all positions), the jackknife's centre.
        block_influence: ``{variant: [L]}`` ``1 − cos(h_ℓ, h_{ℓ+1})`` (all; no sink).
        angular: ``{variant: [L]}`` ``arccos(cos(h_ℓ, h_{ℓ+1}))/π``.
        massive_dims: The massive dimensions (any residual state, any batch).
        tokens: Positions in the moments; ``sample``: rows of the sample; ``sink``: its rows at
            position 0.
    """

    matrices: dict[str, np.ndarray]
    linear_se: np.ndarray
    linear_sample: np.ndarray
    block_influence: dict[str, np.ndarray]
    angular: dict[str, np.ndarray]
    massive_dims: list[int]
    tokens: int
    sample: int
    sink: int

    @classmethod
    def from_state(cls, state: Stats, options: Similarity, info: ModelInfo) -> SimilarityNumbers:
        L1 = info.n_layers + 1
        dims = [int(j) for j in torch.nonzero(state["massive"].sum(0) > 0)[:, 0]]
        kept = torch.tensor([j for j in range(info.d_model) if j not in dims], dtype=torch.long)
        n = {p: float(state[f"n_{p}"]) for p in ("rest", "first")}
        s = {p: state[f"s_{p}"].cpu() for p in ("rest", "first")}
        m = {p: state[f"m_{p}"].cpu() for p in ("rest", "first")}
        sp = {p: state[f"p_{p}"].cpu() if options.sketch else s[p] for p in ("rest", "first")}
        n_all, s_all, m_all = (
            n["rest"] + n["first"],
            s["rest"] + s["first"],
            [m["rest"], m["first"]],
        )
        sp_all = sp["rest"] + sp["first"]
        matrices = {
            "linear.all": moments_cka(n_all, s_all, m_all, L1, None, sp_all),
            "linear.no_sink": moments_cka(n["rest"], s["rest"], m["rest"], L1, None, sp["rest"]),
            # A sketch mixes every dimension into every column: none can be removed after it.
            "linear.no_massive": np.full((L1, L1), math.nan)
            if dims and options.sketch
            else moments_cka(n_all, s_all, m_all, L1, kept if dims else None, sp_all),
        }
        filled = (
            state["sample_filled"].cpu() > 0
            if "sample_filled" in state
            else torch.zeros(0, dtype=torch.bool)
        )
        x = state["sample_x"].cpu()[filled] if filled.any() else torch.zeros(0, L1, info.d_model)
        pos = state["sample_pos"].cpu()[filled] if filled.any() else torch.zeros(0)
        group = state["sample_group"].cpu()[filled] if filled.any() else torch.zeros(0)
        rows = {"all": torch.ones(len(x), dtype=torch.bool), "no_sink": pos != 0}
        rows["no_massive"] = rows["all"]
        feats = {"all": None, "no_sink": None, "no_massive": kept if dims else None}
        first_se = np.full((L1, L1), math.nan)
        centre = np.full((L1, L1), math.nan)
        for variant in VARIANTS:
            xs = [_cut(x[rows[variant], layer], feats[variant]) for layer in range(L1)]
            if xs[0].shape[0] < 4:
                for measure in SAMPLED:
                    matrices[f"{measure}.{variant}"] = np.full((L1, L1), math.nan)
                continue
            got = sample_matrices(xs, options)
            for measure in SAMPLED:
                matrices[f"{measure}.{variant}"] = got[measure]
            if variant == "all":
                centre = got["linear_sample"]
                first_se = _jackknife(x, group, options.groups)
        return cls(
            matrices=matrices,
            linear_se=first_se,
            linear_sample=centre,
            block_influence={
                v: (state[f"bi_{v}"].cpu() / float(state[f"n_{v}"])).numpy()
                for v in ("all", "no_sink")
            },
            angular={
                v: (state[f"ang_{v}"].cpu() / float(state[f"n_{v}"])).numpy()
                for v in ("all", "no_sink")
            },
            massive_dims=dims,
            tokens=int(n_all),
            sample=len(x),
            sink=int((pos == 0).sum()),
        )

    def change(self) -> dict[str, list[Any]]:
        """How much leaving out the sink and the massive dimensions moves each measure: the mean
        and the largest ``|Δ|`` over the off-diagonal entries, against all positions."""
        out: dict[str, list[Any]] = {
            "measure": [],
            "variant": [],
            "mean_abs_change": [],
            "max_abs_change": [],
        }
        for measure in MEASURES:
            base = self.matrices[f"{measure}.all"]
            off = ~np.eye(len(base), dtype=bool)
            for variant in VARIANTS[1:]:
                delta = np.abs(self.matrices[f"{measure}.{variant}"] - base)[off]
                finite = delta[np.isfinite(delta)]
                out["measure"].append(measure)
                out["variant"].append(variant)
                out["mean_abs_change"].append(float(finite.mean()) if finite.size else math.nan)
                out["max_abs_change"].append(float(finite.max()) if finite.size else math.nan)
        return out


def _cut(x: Tensor, feats: Tensor | None) -> Tensor:
    return x if feats is None else x[:, feats]


def _jackknife(x: Tensor, key: Tensor, groups: int) -> np.ndarray:
    """Delete-one-group jackknife standard error of the sample's linear CKA, a row's group being
    its key mod ``groups`` (the uncentred Grams computed once, centred per subset)."""
    L1 = x.shape[1]
    grams = [x[:, layer] @ x[:, layer].T for layer in range(L1)]
    group = key.long() % groups
    leave: list[np.ndarray] = []
    for g in range(groups):
        sub = group != g
        if int(sub.sum()) < 4 or bool(sub.all()):
            return np.full((L1, L1), math.nan)
        leave.append(gram_cka([center_gram(k[sub][:, sub]) for k in grams]))
    stack = np.stack(leave)
    se = np.zeros((L1, L1))
    for i in range(L1):
        for j in range(L1):
            se[i, j] = jackknife(0.0, stack[:, i, j].tolist())
    return se


# -- the result ----------------------------------------------------------------------------------
def present(numbers: SimilarityNumbers, options: Similarity, info: ModelInfo) -> Result:
    """Tables, arrays, plots and summary of a similarity run."""
    L = info.n_layers
    linear = numbers.matrices["linear.all"]
    nxt = np.array([linear[i, i + 1] for i in range(L)])
    se = np.array([numbers.linear_se[i, i + 1] for i in range(L)])
    blocks = {
        "block": list(range(L)),
        "cka_next": nxt,
        "cka_next_lo": nxt - Z * se,
        "cka_next_hi": nxt + Z * se,
        "cka_next_no_sink": [numbers.matrices["linear.no_sink"][i, i + 1] for i in range(L)],
        "cka_next_no_massive": [numbers.matrices["linear.no_massive"][i, i + 1] for i in range(L)],
        "block_influence": numbers.block_influence["all"],
        "block_influence_no_sink": numbers.block_influence["no_sink"],
        "angular": numbers.angular["all"],
        "angular_no_sink": numbers.angular["no_sink"],
    }
    arrays = {key.replace(".", "_"): value for key, value in numbers.matrices.items()}
    arrays["linear_se"] = numbers.linear_se
    arrays["linear_sample"] = numbers.linear_sample
    arrays["linear_outlier_change"] = numbers.matrices["linear.no_massive"] - linear
    tables = {
        "similarity_blocks": Table(
            "similarity_blocks",
            blocks,
            "Block l: linear CKA(h_l, h_l+1) with a 95 % jackknife interval, block influence "
            "1 − cos and angular distance (prune's), with and without the outliers",
        ),
        "similarity_change": Table(
            "similarity_change",
            numbers.change(),
            "How much leaving out the sink position or the massive dimensions moves each matrix "
            "(|Δ| over off-diagonal entries)",
        ),
    }
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, nxt, L),
        tables=tables,
        arrays=arrays,
        plots=_plots(L),
        meta={
            "tokens": numbers.tokens,
            "sample_rows": numbers.sample,
            "sample_sink_rows": numbers.sink,
            "massive_dims": numbers.massive_dims,
            "sketch": options.sketch,
            "state_bytes": options.state_bytes(info),
            "estimators": {
                "linear": "streamed float64 moments, feature space (all positions)",
                "unbiased": "Song et al. HSIC_1 on the sample",
                "rbf": f"Gaussian kernel, sigma = {options.rbf_scale} x median distance, sample",
                "svcca": f"{options.keep} of the variance, at most sample/2 directions",
                "pwcca": "Morcos et al. weights of the row state's features",
                "procrustes": "2 - 2 ||X^T Y||_* on centred unit-Frobenius states (a distance)",
            },
            "interval": f"95 % normal, jackknife over {options.groups} row groups of the sample",
        },
    )


def _summary(numbers: SimilarityNumbers, nxt: np.ndarray, L: int) -> str:
    low = int(np.nanargmin(nxt)) if np.isfinite(nxt).any() else 0
    change = numbers.matrices["linear.no_massive"] - numbers.matrices["linear.all"]
    sink = numbers.matrices["linear.no_sink"] - numbers.matrices["linear.all"]
    text = (
        f"Linear CKA of consecutive states: mean {np.nanmean(nxt):.3f}, lowest {nxt[low]:.3f} at "
        f"block {low} (block influence {numbers.block_influence['all'][low]:.3g}); "
        f"CKA(h_0, h_{L}) = {numbers.matrices['linear.all'][0, L]:.3f}, over {numbers.tokens} "
        f"positions. Leaving out the sink moves linear CKA by up to {np.nanmax(np.abs(sink)):.3f}"
    )
    if numbers.massive_dims and np.isfinite(change).any():
        dims = ", ".join(map(str, numbers.massive_dims[:4]))
        text += (
            f"; removing the massive dimension(s) {dims} by up to {np.nanmax(np.abs(change)):.3f}."
        )
    elif numbers.massive_dims:  # a sketch mixes every dimension into every column
        text += "; the massive dimensions cannot be removed from a sketch (-O similarity.sketch=0)."
    else:
        text += "; no massive dimension was found."
    return text


def _plots(L: int) -> tuple[Plot, ...]:
    def heat(source: str, title: str, clabel: str, **kw: Any) -> Plot:
        return Plot(
            "heatmap",
            f"similarity_{source}",
            title,
            source,
            xlabel="relative depth l/L of h_l",
            ylabel="relative depth l/L of h_l",
            clabel=clabel,
            depth=L,
            **kw,
        )

    fixed = "fixed scale 0–1"
    return (
        heat(
            "linear_all",
            "Linear CKA between residual states",
            f"linear CKA ({fixed})",
            limits=(0.0, 1.0),
            caption="Streamed over every real position (float64 moments).",
        ),
        heat(
            "linear_no_massive",
            "Linear CKA, massive dimensions removed",
            f"linear CKA ({fixed})",
            limits=(0.0, 1.0),
        ),
        heat(
            "unbiased_all",
            "Unbiased CKA (HSIC_1) on the sample",
            f"CKA ({fixed})",
            limits=(0.0, 1.0),
            caption="Song et al.'s estimator can leave [0, 1] slightly.",
        ),
        heat(
            "linear_outlier_change",
            "Linear CKA: massive dimensions removed minus all",
            "Δ linear CKA",
            signed=True,
            caption="Zero everywhere when the run found no massive dimension.",
        ),
        Plot(
            "line",
            "similarity_blocks",
            "Consecutive states: CKA and block influence",
            "similarity_blocks",
            x="block",
            y=("cka_next", "cka_next_no_sink", "cka_next_no_massive", "block_influence"),
            labels=(
                "linear CKA(h_l, h_l+1)",
                "the same, position 0 left out",
                "the same, massive dimensions removed",
                "block influence 1 − cos",
            ),
            xlabel="block l",
            ylabel="CKA(h_l, h_l+1); 1 − cos",
        ),
    )
