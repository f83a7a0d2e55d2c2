"""``linmap`` — cross-model linear maps (docs/science.md A6): how well does each residual state of the
analysed (shallow) model predict each residual state of a second (deep) model with the same
tokenizer, and does the best target layer follow *relative* depth?

For every source state ``h^src_s`` (``s = 0..L_src``) and target state ``h^tgt_j``
(``j = 0..L_tgt``) an affine map ``h^tgt_j ≈ W h^src_s + b`` is fitted by closed-form ridge
regression on the positions of *training* documents and scored on the positions of *held-out*
documents: relative error ``mean_t ||ŷ_t - y_t|| / ||y_t||`` and
``R² = 1 - SSE / SST`` (pooled over dimensions, SST around the held-out mean).

Design:

- **Moments, not activations.** Pass 0 streams ``Σ x̃ x̃ᵀ`` per source state (``x̃ = [x; 1]``,
  ``[S, d_src+1, d_src+1]``) and ``Σ x̃ yᵀ`` with every target state side by side
  (``[S, d_src+1, J·d_tgt]``), and each target's ``Σ y yᵀ`` (``[J, d_tgt, d_tgt]``), in float64,
  updated in place. Memory is fixed by the two models' shapes, never by the token count, and two
  shards' states merge (``Stats.merge``).
- **Linear CKA across the models** comes from the same moments before the fit (no second pass):
  ``‖C_xy‖²_F / (‖C_xx‖_F ‖C_yy‖_F)`` for every source and target state, on the training
  positions — the layer × layer similarity of two models (``compare``), as ``similarity`` gives
  it within one.
- **One solve per source state** gives the maps to all target states at once. The fit uses the
  centred form of the same equations, ``(Σ_xx + λI) W = Σ_xy``, ``b = ȳ - Wᵀx̄``, which is ridge
  with an unregularised bias; ``λ = ridge × trace(Σ_xx)/d_src`` (the mean eigenvalue of the source
  covariance), so ``ridge`` is scale-free and independent of the token count. Cholesky first; a
  singular system (``ridge=0`` on rank-deficient states) falls back to the minimum-norm solution.
- **Size budget.** The cross-moment holds ``S·(d_src+1)·J·d_tgt`` float64 numbers (gpt2 onto
  gpt2-medium: 2.1 GB). When that exceeds ``max_moment_gb``, only every k-th target state (plus
  the last) is fitted — the smallest k that fits, or ``target_stride`` when set — and the other
  columns of the matrices are NaN. The fit overwrites the moments in place (no second copy).
- **Evaluation** needs the fitted maps, hence a second pass (``passes = 2``): the maps are fitted
  in :meth:`~LinearMaps.start_pass` and pass 1 scores held-out positions only (the target model
  runs on the rows that hold some). A document is held out when a seeded hash of its index falls
  below ``heldout`` (the first document always trains): the split is deterministic, by document,
  and independent of batching. When the data holds no held-out document (very short runs), the
  maps are scored on the training positions instead, and the result says so.
- **Target** ``"self"`` maps the analysed model onto itself (its own activations, no second
  forward): R² = 1 on the diagonal, a sanity check. Any other target is a model spec, loaded once
  before the first forward pass, where its tokenizer is checked against the source's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import input_device, masked_stack
from lensdiv.core.errors import LensdivError, OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.models.load import load_model
from lensdiv.ops.capture import capture
from lensdiv.ops.geometry import cka_from_covariances, covariance
from lensdiv.ops.ridge import augment, fit_affine

SELF = "self"
EPS = 1e-6
_GB = 1024**3
# Doubles held at once by one chunk of rows × stacked target states (pass 0 and pass 1): 128 MB.
_CHUNK_ELEMENTS = 1 << 24
# The source-state × target-state heatmaps: (array, title, colour-bar label).
_HEATMAPS = (
    ("r2", "R² of the affine map h_s (source) → h_j (target)", "R² on held-out tokens (1 = exact)"),
    (
        "rel_error",
        "Relative error of the affine map h_s → h_j",
        "‖ŷ − y‖ / ‖y‖ (relative, 0 = exact)",
    ),
)


# -- pure functions, tested on synthetic data (the closed-form fit is lensdiv.ops.ridge) ---------


def spearman(x: Any, y: Any) -> float:
    """Spearman rank correlation (ties get average ranks); NaN when either side is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = ~(np.isnan(x) | np.isnan(y))
    x, y = _ranks(x[ok]), _ranks(y[ok])
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / math.sqrt((x * x).sum() * (y * y).sum()))


def _ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    sorted_vals = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_vals[end] != sorted_vals[start]:
            ranks[order[start:end]] = (start + end - 1) / 2
            start = end
    return ranks


def is_heldout(doc: int, seed: int, fraction: float) -> bool:
    """Whether document ``doc`` is held out: a seeded hash of its index, uniform in [0, 1),
    falls below ``fraction``. The first document (0) always trains, so any data gives a fit."""
    if doc == 0:
        return False
    digest = hashlib.blake2b(f"linmap:{seed}:{doc}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


def heldout_mask(batch: Batch, seed: int, fraction: float) -> Bool[Tensor, "batch pos"]:
    """True at positions of held-out documents (by :attr:`Batch.doc`; without document ids each
    row counts as its own document, numbered by batch and row)."""
    doc = batch.doc
    if doc is None:
        rows = torch.arange(batch.tokens.shape[0], device=batch.tokens.device)
        doc = (batch.index * (1 << 20) + rows)[:, None].expand_as(batch.tokens)
    ids = torch.unique(doc)
    flags = torch.tensor(
        [is_heldout(int(i), seed, fraction) for i in ids.tolist()], device=doc.device
    )
    return flags[torch.searchsorted(ids, doc.contiguous())]


def moment_gb(n_source: int, d_source: int, n_target: int, d_target: int) -> float:
    """GiB of the float64 moment state: ``Σ x̃x̃ᵀ``, the cross-moments to every target and the
    targets' own ``Σ yyᵀ`` (for CKA)."""
    source = n_source * (d_source + 1) * (d_source + 1 + n_target * d_target)
    return 8 * (source + n_target * d_target * d_target) / _GB


def target_layers(n_layers: int, stride: int) -> tuple[int, ...]:
    """``0, k, 2k, ...`` and always the last state ``n_layers``."""
    layers = list(range(0, n_layers + 1, stride))
    if layers[-1] != n_layers:
        layers.append(n_layers)
    return tuple(layers)


# -- what a run needs beyond the options (Analyzer.setup) ----------------------------------------


@dataclass(frozen=True)
class Target:
    """The target model of one run, loaded and checked by :meth:`LinearMaps.setup`.

    Args:
        model: The target bridge; ``None`` when the target is the analysed model itself.
        info: Its facts.
        label: How results name it.
        layers: Target states fitted (every ``stride``-th, and the last).
        stride: See ``target_stride``.
    """

    model: Bridge | None
    info: ModelInfo
    label: str
    layers: tuple[int, ...]
    stride: int

    def facts(self) -> dict[str, Any]:
        """What finalize needs to know of the target (kept in the state)."""
        spec = getattr(self.model, "lensdiv_spec", None)
        return {
            "label": self.label,
            "resolved": spec.resolved if spec is not None else self.info.name,
            "self": self.model is None,
            "n_layers": self.info.n_layers,
            "d_model": self.info.d_model,
            "layers": list(self.layers),
            "stride": self.stride,
        }


@dataclass(frozen=True)
class LinearMaps(Analyzer):
    """Affine maps from every residual state of this model onto every state of a deeper one.

    Args:
        target: Model spec of the deep model (hub name, local folder, ``toy:d8``), or ``"self"``
            to map the analysed model onto itself. It must use the same tokenizer.
        ridge: Ridge penalty relative to the mean eigenvalue of the source covariance (0 for
            ordinary least squares).
        heldout: Fraction of documents held out for scoring.
        exclude_bos: Leave the BOS position out of fit and scores.
        seed: Seed of the document split.
        max_moment_gb: Budget for the float64 moment state; beyond it only every k-th target
            state is fitted.
        target_stride: Fit every k-th target state (and the last); 0 chooses the smallest k that
            fits ``max_moment_gb``.
    """

    name = "linmap"
    aliases = ("linear-maps", "linmaps", "crossmap")
    description = "Cross-model linear maps: R² from each layer onto each layer of a deeper model"
    depth_profiles = ("linmap.best_rel_depth", "linmap.r2")
    passes = 2

    target: str = SELF
    ridge: float = 1e-4
    heldout: float = 0.2
    exclude_bos: bool = True
    seed: int = 0
    max_moment_gb: float = 4.0
    target_stride: int = 0

    def __post_init__(self) -> None:
        if not self.target.strip():
            raise ValueError("target must be a model spec or 'self'")
        if self.ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge}")
        if not 0 < self.heldout < 1:
            raise ValueError(f"heldout must lie strictly between 0 and 1, got {self.heldout}")
        if self.max_moment_gb <= 0:
            raise ValueError(f"max_moment_gb must be positive, got {self.max_moment_gb}")
        if self.target_stride < 0:
            raise ValueError(f"target_stride must be >= 0 (0: automatic), got {self.target_stride}")

    # -- target model -----------------------------------------------------------------------------
    def setup(self, model: Bridge, info: ModelInfo) -> Target:
        """Load and check the target before any forward pass (bad targets fail fast)."""
        if self.target.strip().lower() == SELF:
            target, target_info, label = None, info, f"{info.name} (itself)"
        else:
            target, target_info = self._load_target(model, info)
            label = self.target
        stride = self.target_stride or self._auto_stride(info, target_info)
        layers = target_layers(target_info.n_layers, stride)
        size = moment_gb(info.n_layers + 1, info.d_model, len(layers), target_info.d_model)
        if size > self.max_moment_gb:
            raise OptionError(
                f"linmap from {info.name} onto {label} needs {size:.1f} GB of moments at "
                f"target_stride={stride}, over max_moment_gb={self.max_moment_gb:g}",
                hint="raise -O linmap.max_moment_gb or -O linmap.target_stride",
            )
        return Target(target, target_info, label, layers, stride)

    def _auto_stride(self, info: ModelInfo, target_info: ModelInfo) -> int:
        for stride in range(1, target_info.n_layers + 1):
            n = len(target_layers(target_info.n_layers, stride))
            if moment_gb(info.n_layers + 1, info.d_model, n, target_info.d_model) <= (
                self.max_moment_gb
            ):
                return stride
        return target_info.n_layers

    def _load_target(self, model: Bridge, info: ModelInfo) -> tuple[Any, ModelInfo]:
        param = next(model.parameters())  # its dtype; the device is where tokens go
        try:
            target = load_model(self.target, device=input_device(model), dtype=param.dtype)
        except LensdivError as err:
            raise type(err)(f"linmap target: {err.message}", hint=err.hint) from None
        target_info = ModelInfo.from_model(target, name=self.target)
        check_same_tokenizer(model, target, info.name, self.target)
        return target, target_info

    def min_tokens(self, info: ModelInfo) -> int:
        """Enough training positions for the ``d_model + 1`` parameters of each map (fewer fit
        any target perfectly), plus the held-out share."""
        return math.ceil((info.d_model + 1) / (1 - self.heldout))

    # -- streaming --------------------------------------------------------------------------------
    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state: Stats, step: Step) -> None:
        target: Target | None = step.resource(self.name)
        if target is None:  # a step made by hand, outside a run
            target = self.setup(step.model, step.info)
        batch = step.batch
        keep = batch.positions(exclude_bos=self.exclude_bos)
        held = heldout_mask(batch, self.seed, self.heldout)
        if step.pass_index == 0:
            state.fix("target", target.facts())
            state.add("heldout_positions", (keep & held).sum())
            if batch.doc is not None and bool((batch.doc >= 0).any()):
                real = batch.doc[batch.doc >= 0]
                state.max("doc_max", real.max())
                state.min("doc_min", real.min())
            select = keep & ~held
        else:
            select = keep & (held if state["on_heldout"] else ~held)
        if not select.any():
            return
        x = masked_stack([step.resid(s) for s in range(step.info.n_layers + 1)], select)
        y = self._targets(target, step, select)
        rows = max(1, _CHUNK_ELEMENTS // (y.shape[1] * y.shape[2]))
        for start in range(0, x.shape[1], rows):
            part = slice(start, start + rows)
            if step.pass_index == 0:
                self._accumulate(state, x[:, part], y[part])
            else:
                self._score(state, state["maps"], x[:, part], y[part])

    def _targets(
        self, target: Target, step: Step, select: Bool[Tensor, "batch pos"]
    ) -> Float[Tensor, "n n_target d_target"]:
        """The target states at the selected positions; runs the target on the rows holding some."""
        names = [target.info.resid(j) for j in target.layers]
        if target.model is None:
            cache, mask = step.cache, select
        else:
            rows = select.any(dim=1)
            tokens = step.batch.tokens[rows].to(input_device(target.model))
            _, cache = capture(target.model, tokens, names, need_logits=False)
            mask = select[rows]
        return masked_stack([cache[name] for name in names], mask.to(select.device)).transpose(0, 1)

    @staticmethod
    def _accumulate(
        state: Stats,
        x: Float[Tensor, "n_source n d_source"],
        y: Float[Tensor, "n n_target d_target"],
    ) -> None:
        # In place: a Stats.add of the cross-moment would allocate a second copy of it.
        xa = augment(x)
        ys = y.reshape(y.shape[0], -1).double()
        n_src, d = xa.shape[0], xa.shape[2]
        state.zeros("xtx", (n_src, d, d), xa.device).baddbmm_(xa.transpose(1, 2), xa)
        xty = state.zeros("xty", (n_src, d, ys.shape[1]), xa.device)
        for s in range(xa.shape[0]):
            xty[s].addmm_(xa[s].T, ys)
        per_target = y.double().transpose(0, 1)  # [n_target, n, d_target]
        state.zeros("yty", (y.shape[1], y.shape[2], y.shape[2]), xa.device).baddbmm_(
            per_target.transpose(1, 2), per_target
        )

    @staticmethod
    def _score(
        state: Stats,
        maps: Float[Tensor, "n_source d_aug n_target_d"],
        x: Float[Tensor, "n_source n d_source"],
        y: Float[Tensor, "n n_target d_target"],
    ) -> None:
        xa = augment(x)
        y = y.double()
        y_norm = y.norm(dim=-1).clamp_min(EPS)
        sse = y.new_zeros((xa.shape[0], y.shape[1]))
        ratio = torch.zeros_like(sse)
        for s in range(xa.shape[0]):
            err = (xa[s] @ maps[s]).view_as(y) - y
            sse[s] = err.square().sum(dim=(0, 2))
            ratio[s] = (err.norm(dim=-1) / y_norm).sum(dim=0)
        state.add("eval_n", y.shape[0])
        state.add("eval_sse", sse)
        state.add("eval_ratio", ratio)
        state.add("eval_y", y.sum(dim=0))
        state.add("eval_yy", y.square().sum(dim=(0, 2)))

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        """Fit every map from the pass-0 moments (in place: the cross-moments become the maps)."""
        if "xtx" not in state:
            raise RuntimeError(
                "no training positions: every document fell in the held-out split; "
                "use more data or a smaller linmap.heldout"
            )
        xtx = state["xtx"]
        maps = state["xty"]
        state.fix("cka", cross_cka(xtx, maps, state["yty"]))  # before the fit overwrites them
        state.drop("yty")
        state.drop("xty")
        lambdas, inexact = [], []
        for s in range(maps.shape[0]):
            fitted, lam, exact = fit_affine(xtx[s], maps[s], self.ridge)
            maps[s].copy_(fitted)
            del fitted
            lambdas.append(lam)
            if not exact:
                inexact.append(s)
        state.fix("maps", maps)
        state.fix("lambdas", lambdas)
        state.fix("inexact", inexact)
        state.fix("on_heldout", float(state.get("heldout_positions", 0.0)) > 0)

    # -- results ----------------------------------------------------------------------------------
    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if "maps" not in state or "eval_n" not in state:
            raise RuntimeError("the maps were never scored (the run stopped before pass 2)")
        return present(LinmapNumbers.from_state(state, info, self), self)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinmapNumbers:
    """The maps of a run, scored: plain arrays and lists, no tables, no prose.

    Args:
        source: The analysed model's name.
        n_src: Its blocks ``L_src``.
        target: What the state recorded of the target (``label``, ``n_layers``, ``layers``,
            ``stride``, ``d_model``, ...).
        r2: ``R²`` per ``[source state, target state]`` (NaN where a target was not fitted).
        cka: Linear CKA per ``[source state, target state]`` on the training positions (NaN
            likewise).
        rel_error: Mean relative error, likewise.
        best: Per source state, the fitted target state of highest ``R²``.
        same: Per source state, the fitted target state nearest the same relative depth.
        diagonality: Spearman correlation of ``s / L_src`` with ``best / L_tgt``.
        train_positions: Positions the maps were fitted on.
        eval_positions: Positions they were scored on.
        on_heldout: Whether those were held-out documents.
        lambdas: The ridge penalty of each source state's fit.
        inexact: Source states whose fit fell back to the pseudo-inverse.
        documents: How the data was split (``split``, and the documents when it had ids).
        moment_gb: The moments' size in GB.
    """

    source: str
    n_src: int
    target: dict[str, Any]
    r2: np.ndarray
    cka: np.ndarray
    rel_error: np.ndarray
    best: list[int]
    same: list[int]
    diagonality: float
    train_positions: int
    eval_positions: int
    on_heldout: bool
    lambdas: list[float]
    inexact: list[int]
    documents: dict[str, Any]
    moment_gb: float

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, options: LinearMaps) -> LinmapNumbers:
        """The scores of a merged state whose maps were scored (pass 2 done)."""
        target = state["target"]
        n = float(state["eval_n"])
        mean_y = state["eval_y"] / n
        sst = (state["eval_yy"] - n * mean_y.square().sum(-1)).clamp_min(1e-300)
        fitted_r2 = (1 - state["eval_sse"] / sst).cpu().numpy()
        fitted_err = (state["eval_ratio"] / n).cpu().numpy()
        n_src, n_tgt = info.n_layers, target["n_layers"]
        r2 = np.full((n_src + 1, n_tgt + 1), np.nan)
        rel_error = np.full_like(r2, np.nan)
        cols = list(target["layers"])
        r2[:, cols], rel_error[:, cols] = fitted_r2, fitted_err
        cka = np.full_like(r2, np.nan)
        cka[:, cols] = np.asarray(state["cka"].cpu(), dtype=float)
        best = [cols[int(np.argmax(row))] for row in fitted_r2]
        rel_src = [s / n_src for s in range(n_src + 1)]
        same = [cols[int(np.argmin([abs(j / n_tgt - r) for j in cols]))] for r in rel_src]
        return cls(
            source=info.name,
            n_src=n_src,
            target=dict(target),
            r2=r2,
            cka=cka,
            rel_error=rel_error,
            best=best,
            same=same,
            diagonality=spearman(rel_src, [j / n_tgt for j in best]),
            train_positions=int(float(state["xtx"][0, -1, -1])),
            eval_positions=int(n),
            on_heldout=bool(state["on_heldout"]),
            lambdas=state["lambdas"],
            inexact=state["inexact"],
            documents=_documents(state, options),
            moment_gb=round(moment_gb(n_src + 1, info.d_model, len(cols), target["d_model"]), 4),
        )

    @property
    def rel_src(self) -> list[float]:
        """Relative depth ``s / L_src`` of each source state."""
        return [s / self.n_src for s in range(self.n_src + 1)]

    @property
    def rel_best(self) -> list[float]:
        """Relative depth ``best / L_tgt`` of each source state's best target."""
        return [j / self.target["n_layers"] for j in self.best]

    @property
    def best_r2(self) -> list[float]:
        """``R²`` of each source state onto its best target."""
        return [self.r2[s, j] for s, j in enumerate(self.best)]


def cross_cka(
    xtx: Float[Tensor, "n_source d_aug d_aug"],
    xty: Float[Tensor, "n_source d_aug n_target_d"],
    yty: Float[Tensor, "n_target d_target d_target"],
) -> Float[Tensor, "n_source n_target"]:
    """Linear CKA of every source state with every target state, from pass 0's moments of
    ``[x; 1]`` (its last row and column hold ``Σx`` and the count) and the targets' own
    ``Σ y yᵀ``: the same positions the maps are fitted on, centred as
    :func:`~lensdiv.ops.geometry.covariance` centres them."""
    n_src, d = xtx.shape[0], xtx.shape[1] - 1
    n_tgt, e = yty.shape[0], yty.shape[1]
    out = torch.full((n_src, n_tgt), math.nan, dtype=torch.float64)
    for s in range(n_src):
        n, s_x = float(xtx[s, d, d]), xtx[s, :d, d]
        c_xx = covariance(n, s_x, s_x, xtx[s, :d, :d])
        for j in range(n_tgt):
            cols = slice(j * e, (j + 1) * e)
            s_y = xty[s, d, cols]
            c_xy = covariance(n, s_x, s_y, xty[s, :d, cols])
            out[s, j] = cka_from_covariances(c_xy, c_xx, covariance(n, s_y, s_y, yty[j]))
    return out


def _documents(state: Stats, options: LinearMaps) -> dict[str, Any]:
    if "doc_max" not in state:
        return {"split": "row (no document ids)"}
    first, last = int(state["doc_min"]), int(state["doc_max"])
    held = sum(is_heldout(d, options.seed, options.heldout) for d in range(first, last + 1))
    return {"split": "document", "documents": last - first + 1, "heldout_documents": held}


# -- the result ----------------------------------------------------------------------------------
def present(numbers: LinmapNumbers, options: LinearMaps) -> Result:
    """The table, heatmaps, depth plot, summary and metadata of scored maps."""
    target, cols = numbers.target, list(numbers.target["layers"])
    r2, rel_error, best, same = numbers.r2, numbers.rel_error, numbers.best, numbers.same
    table = Table(
        "linmap",
        {
            "source_layer": list(range(numbers.n_src + 1)),
            "rel_depth": numbers.rel_src,
            "best_target": best,
            "best_rel_depth": numbers.rel_best,
            "r2": numbers.best_r2,
            "rel_error": [rel_error[s, j] for s, j in enumerate(best)],
            "same_depth_target": same,
            "r2_same_depth": [r2[s, j] for s, j in enumerate(same)],
        },
        f"Best target state of {target['label']} for each source state h_s",
    )
    hatched = (
        "Hatched columns: target states not fitted (target_stride)."
        if len(cols) < target["n_layers"] + 1
        else ""
    )
    meta: dict[str, Any] = {
        "target": {
            "spec": options.target,
            **{k: target[k] for k in ("resolved", "self", "n_layers", "d_model")},
        },
        "target_layers": cols,
        "target_stride": target["stride"],
        "diagonality": numbers.diagonality,
        "ridge_lambda": numbers.lambdas,
        "pinv_fallback_layers": numbers.inexact,
        "train_positions": numbers.train_positions,
        "eval_positions": numbers.eval_positions,
        "evaluation": "held-out documents"
        if numbers.on_heldout
        else "training documents (the data held no held-out document)",
        "moment_gb": numbers.moment_gb,
        **numbers.documents,
    }
    return Result(
        analyzer=options.name,
        summary=_summary(numbers),
        tables={"linmap": table},
        arrays={"r2": r2, "rel_error": rel_error, "cka": numbers.cka},
        plots=(
            *(
                Plot(
                    "heatmap",
                    f"linmap_{array}",
                    title,
                    array,
                    xlabel="target residual state j",
                    ylabel="source residual state s",
                    clabel=clabel,
                    caption=hatched,
                )
                for array, title, clabel in _HEATMAPS
            ),
            Plot(
                "heatmap",
                "linmap_cka",
                f"Linear CKA of {numbers.source} with {target['label']}",
                "cka",
                xlabel="target residual state j",
                ylabel="source residual state s",
                clabel="linear CKA (fixed scale 0–1)",
                limits=(0.0, 1.0),
                caption="Linear CKA of every pair of states on the training positions, from the "
                f"maps' own moments (no fit). {hatched}".strip(),
            ),
            Plot(
                "line",
                "linmap_depth",
                "Best target depth vs source depth (diagonal = same relative depth)",
                "linmap",
                x="rel_depth",
                y=("best_rel_depth", "rel_depth"),
                xlabel="relative source depth s / L_src (fraction)",
                ylabel="relative target depth j / L_tgt (fraction)",
                caption="best_rel_depth: the target state with the highest R² for each "
                "source state; rel_depth: the diagonal (same relative depth).",
            ),
        ),
        meta=meta,
    )


def _summary(numbers: LinmapNumbers) -> str:
    target, rho = numbers.target, numbers.diagonality
    r2, best = numbers.best_r2, numbers.best
    # Spearman measures order only: a map can keep the order and still bunch its targets.
    follows = (
        "keeps the layer order closely"
        if rho >= 0.9
        else "roughly keeps the layer order"
        if rho >= 0.5
        else "does not keep the layer order"
        if not math.isnan(rho)
        else "is constant (no rank correlation)"
    )
    where = (
        "held-out documents"
        if numbers.on_heldout
        else "the training documents, as the data held no held-out document"
    )
    skipped = (
        f" Only every {target['stride']}-th target state was fitted (memory budget)."
        if target["stride"] > 1
        else ""
    )
    return (
        f"Affine maps from the {numbers.n_src + 1} residual states of {numbers.source} onto the "
        f"{target['n_layers'] + 1} of {target['label']}, fitted on {numbers.train_positions} "
        f"positions and scored on {numbers.eval_positions} positions of {where}. The best target "
        f"state {follows} (Spearman {rho:.2f}; best targets by source state: "
        f"{', '.join(str(int(b)) for b in best)}). Best R² ranges from {np.nanmin(r2):.3f} to "
        f"{np.nanmax(r2):.3f}; the final state h_{numbers.n_src} maps best onto target "
        f"h_{best[-1]}.{skipped}"
    )


def check_same_tokenizer(source: Any, target: Any, source_name: str, target_name: str) -> None:
    """Raise :class:`OptionError` unless both models read the same token ids the same way.

    Compares the vocabularies (token → id) and the special-token ids; without a tokenizer on
    either side, the vocabulary sizes. A larger embedding matrix than the vocabulary (padded
    rows, as in some model families) is fine: those ids never occur.
    """

    def fail(why: str) -> None:
        raise OptionError(
            f"linmap needs two models with the same tokenizer, but {source_name} and "
            f"{target_name} differ: {why}",
            hint="choose a target from the same model family",
        )

    src_tok, tgt_tok = getattr(source, "tokenizer", None), getattr(target, "tokenizer", None)
    src_vocab, tgt_vocab = int(source.W_U.shape[1]), int(target.W_U.shape[1])
    if src_tok is None or tgt_tok is None:
        if src_vocab != tgt_vocab:
            fail(f"vocabulary sizes {src_vocab} and {tgt_vocab}")
        return
    a, b = src_tok.get_vocab(), tgt_tok.get_vocab()
    if a != b:
        if len(a) != len(b):
            fail(f"{len(a)} and {len(b)} tokens")
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: (kv[1], kv[0]))
        token = diff[0][0]
        fail(f"token {token!r} has id {a.get(token)} in one and {b.get(token)} in the other")
    for special in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        ids = getattr(src_tok, special, None), getattr(tgt_tok, special, None)
        if ids[0] != ids[1]:
            fail(f"{special} {ids[0]} vs {ids[1]}")
    if len(a) > tgt_vocab or len(b) > src_vocab:
        fail(f"{len(a)} tokens but embedding sizes {src_vocab} and {tgt_vocab}")
