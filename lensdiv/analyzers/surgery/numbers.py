"""The numbers of a ``prune`` or ``reorder`` run, from its merged state alone: ``prune``'s
true-effect grids, the cheap signals' grids, each signal's pick and regret per length, rank
correlations, pruning curves; ``reorder``'s effect of each variant, swaps beside removals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lensdiv.analyzers.linmap import spearman
from lensdiv.analyzers.surgery.base import accuracy
from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.stats import Stats
from lensdiv.ops.surgery import SUMS, linearity, mean_sem

if TYPE_CHECKING:  # the analyzers import this module; their types are only annotations here
    from lensdiv.analyzers.surgery import Prune, Reorder

# The true effects (name: (sum key, square key, count key)).
METRICS = {
    "kl": ("kl", "kl_sq", "n"),
    "ce": ("ce", "ce_sq", "n_target"),
    "dce": ("dce", "dce_sq", "n_target"),
    "agree": ("agree", "agree", "n"),
    "top1": ("top1", "top1", "n_target"),
}
# The cheap signals: a predicted cost per (ℓ, n), lower = more removable.
SIGNALS = ("block_influence", "angular_last", "angular_all", "nonlinearity")


def summarize(sums: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """``{metric: (mean, sem)}`` from sums stacked along the first axis in :data:`SUMS` order."""
    at = {key: sums[i] for i, key in enumerate(SUMS)}
    return {name: mean_sem(at[s], at[q], at[c]) for name, (s, q, c) in METRICS.items()}


@dataclass(frozen=True)
class PruneNumbers:
    """Everything ``prune`` reports, as tensors and small lists (NaN where ``ℓ + n > L``).

    Args:
        n_layers: ``L``.
        longest: ``N``.
        effects: ``{metric: (mean, sem)}`` grids ``[ℓ, n−1]`` (kl, ce, dce, agree, top1).
        clean: The full model's ``ce`` and ``top1`` over the same positions.
        signals: ``{signal: [ℓ, n−1]}`` predicted costs (lower = more removable).
        block_influence: ``1 − cos(h_ℓ, h_{ℓ+1})`` per block (all tokens).
        linearity_r2: The linearity score ``R²`` per block (``None`` when not computed); the
            signal ``nonlinearity`` sums ``1 − R²`` over a range.
        curves: ``{curve: [KL after removing k = 0..N blocks]}`` (contiguous best,
            block influence order, greedy), NaN where not measured.
        greedy_order: Blocks in the order greedy removal took them.
        positions: Positions measured.
        block_runs_per_row: Block evaluations per sequence for the grid.
        resume: The resume modes used.
        accuracy: Task examples (option ``task``): the share answered whole per ``[ℓ, n−1]``
            and by the full model (``None`` on the corpus).
        examples: Task examples measured (0 on the corpus).
    """

    n_layers: int
    longest: int
    effects: dict[str, tuple[Tensor, Tensor]]
    clean: dict[str, float]
    signals: dict[str, Tensor]
    block_influence: Tensor
    linearity_r2: Tensor | None
    curves: dict[str, list[float]]
    greedy_order: list[int]
    positions: int
    block_runs_per_row: float
    resume: list[str]
    accuracy: tuple[Tensor, float] | None = None
    examples: int = 0

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, options: Prune) -> PruneNumbers:
        """The numbers of a merged state."""
        L, N = info.n_layers, options.longest(info)
        valid = torch.tensor([[s + n <= L for n in range(1, N + 1)] for s in range(L)])
        effects = {
            name: (m.masked_fill(~valid, math.nan), e.masked_fill(~valid, math.nan))
            for name, (m, e) in summarize(state["grid"].cpu()).items()
        }
        clean_stats = summarize(state["clean"].cpu()[:, None])
        bi = state["bi"].cpu() / max(float(state["n_all"]), 1.0)
        lin = None
        if "lin_n" in state:
            lin = linearity(
                float(state["lin_n"]), state["lin_sx"], state["lin_sxx"], state["lin_sxy"]
            )
        signals = signal_grids(state, bi, lin, L, N, valid)
        curves, greedy = _curves(state, effects["kl"][0], L, N, options.curves)
        if options.curves:
            greedy = greedy_chosen(state, N)
            curves["block_influence_order"] = [0.0] + [
                _mean_kl(state.get(f"bi_curve{k}")) for k in range(1, N + 1)
            ]
        return cls(
            n_layers=L,
            longest=N,
            effects=effects,
            clean={k: float(clean_stats[k][0][0]) for k in ("ce", "top1")},
            signals=signals,
            block_influence=bi,
            linearity_r2=lin,
            curves=curves,
            greedy_order=greedy,
            positions=int(float(state["clean"][SUMS.index("n")])),
            block_runs_per_row=float(state["block_runs"]) / max(float(state["rows"]), 1.0),
            resume=sorted(state.get("resume", ())),
            accuracy=accuracy(state, valid),
            examples=int(float(state.get("answers_n", 0))),
        )

    def picks(self, metric: str = "kl") -> list[dict[str, Any]]:
        """Per length ``n``: the truly best start, and each signal's pick, its true cost, its
        regret (true cost of the pick minus the best's) and its Spearman correlation with the
        true cost over the starts."""
        true = self.effects[metric][0]
        rows = []
        for n in range(1, self.longest + 1):
            starts = list(range(self.n_layers - n + 1))
            cost = true[: len(starts), n - 1]
            best = _argmin(cost)
            row: dict[str, Any] = {"n": n, "best_start": best, "best": float(cost[best])}
            for name, grid in self.signals.items():
                pred = grid[: len(starts), n - 1]
                if torch.isnan(pred).all():
                    continue
                pick = _argmin(pred)
                row[f"{name}_pick"] = pick
                row[f"{name}_regret"] = float(cost[pick] - cost[best])
                row[f"{name}_spearman"] = spearman(pred.tolist(), cost.tolist())
            rows.append(row)
        return rows

    def overall_spearman(self, metric: str = "kl") -> dict[str, float]:
        """Each signal's Spearman correlation with the true cost over the whole grid."""
        true = self.effects[metric][0].flatten()
        return {
            name: spearman(grid.flatten().tolist(), true.tolist())
            for name, grid in self.signals.items()
        }


def signal_grids(
    state: Stats, bi: Tensor, lin: Tensor | None, L: int, N: int, valid: Tensor
) -> dict[str, Tensor]:
    """Predicted cost of removing ``(ℓ, n)`` by each signal: the sum of block influence over the
    range, the angular distance ``d(h_ℓ, h_{ℓ+n})`` (last token; all tokens), the sum of
    ``1 − R²`` over the range (``nonlinearity``)."""

    def range_sum(per_block: Tensor) -> Tensor:
        grid = torch.full((L, N), math.nan, dtype=torch.float64)
        for s in range(L):
            for n in range(1, min(N, L - s) + 1):
                grid[s, n - 1] = per_block[s : s + n].sum()
        return grid

    out = {
        "block_influence": range_sum(bi),
        "angular_last": (state["ang_last"].cpu() / max(float(state["n_last"]), 1.0)),
        "angular_all": (state["ang_all"].cpu() / max(float(state["n_all"]), 1.0)),
    }
    out["angular_last"] = out["angular_last"].masked_fill(~valid, math.nan)
    out["angular_all"] = out["angular_all"].masked_fill(~valid, math.nan)
    if lin is not None:
        out["nonlinearity"] = range_sum(1.0 - lin)
    return out


def _curves(
    state: Stats, kl: Tensor, L: int, N: int, measured: bool
) -> tuple[dict[str, list[float]], list[int]]:
    """The contiguous-best curve (from the grid), and the greedy one (from passes 1..N)."""
    best = [0.0] + [
        float(torch.nan_to_num(kl[:, n - 1], nan=math.inf).min()) for n in range(1, N + 1)
    ]
    curves = {"contiguous_best": best}
    if not measured:
        return curves, []
    greedy = [0.0]
    for k in range(1, N + 1):
        sums = state.get(f"greedy{k}")
        if sums is None:
            greedy.append(math.nan)
            continue
        means = sums[:, SUMS.index("kl")] / sums[:, SUMS.index("n")].clamp_min(1.0)
        counted = sums[:, SUMS.index("n")] > 0
        greedy.append(float(means[counted].min()) if counted.any() else math.nan)
    curves["greedy"] = greedy
    return curves, []


def _mean_kl(sums: Tensor | None) -> float:
    if sums is None:
        return math.nan
    return float(sums[SUMS.index("kl")] / max(float(sums[SUMS.index("n")]), 1.0))


def _argmin(values: Tensor) -> int:
    """Index of the smallest value (NaN never; ties: the earliest)."""
    v = torch.nan_to_num(values.double(), nan=math.inf).tolist()
    return min(range(len(v)), key=lambda i: (v[i], i))


def greedy_chosen(state: Stats, steps: int) -> list[int]:
    """The blocks greedy removal chose in its first ``steps`` steps (least mean KL each step)."""
    chosen: list[int] = []
    for k in range(1, steps + 1):
        sums = state.get(f"greedy{k}")
        if sums is None:
            break
        kl = sums[:, SUMS.index("kl")] / sums[:, SUMS.index("n")].clamp_min(1.0)
        free = [b for b in range(kl.shape[0]) if b not in chosen]
        chosen.append(min(free, key=lambda b: (float(kl[b]), b)))
    return chosen


@dataclass(frozen=True)
class ReorderNumbers:
    """Everything ``reorder`` reports, as tensors and small lists.

    Args:
        n_layers: ``L``.
        middle: The middle range ``[a, b)``.
        names: The variants, in the analyzer's order.
        effects: ``{metric: (mean, sem)}`` per variant (kl, ce, dce, agree, top1).
        clean_ce: The full model's next-token CE over the same positions.
        resume: The resume modes used.
        accuracy: Task examples (option ``task``): the share answered whole per variant and by
            the full model (``None`` on the corpus).
        examples: Task examples measured (0 on the corpus).
    """

    n_layers: int
    middle: tuple[int, int]
    names: list[str]
    effects: dict[str, tuple[Tensor, Tensor]]
    clean_ce: float
    resume: list[str]
    accuracy: tuple[Tensor, float] | None = None
    examples: int = 0

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, options: Reorder) -> ReorderNumbers:
        """The numbers of a merged state (at least one position measured)."""
        clean = summarize(state["clean"].cpu()[:, None])
        return cls(
            n_layers=info.n_layers,
            middle=options.middle(info),
            names=[name for name, _ in options.variants(info)],
            effects=summarize(state["sums"].cpu().T),
            clean_ce=float(clean["ce"][0][0]),
            resume=sorted(state.get("resume", ())),
            accuracy=accuracy(state),
            examples=int(float(state.get("answers_n", 0))),
        )

    def of(self, metric: str, name: str) -> float:
        """The mean of ``metric`` for the variant ``name``."""
        return float(self.effects[metric][0][self.names.index(name)])

    def swaps(self) -> dict[str, list[float]]:
        """Per block ``ℓ``: KL and CE change of swapping ``ℓ, ℓ+1`` (NaN for the last block: none
        after it) and of removing ``ℓ``."""
        L = self.n_layers
        out: dict[str, list[float]] = {}
        for metric in ("kl", "dce"):
            out[f"{metric}_swap"] = [
                self.of(metric, f"swap{s}") if s < L - 1 else math.nan for s in range(L)
            ]
            out[f"{metric}_remove"] = [self.of(metric, f"remove{s}") for s in range(L)]
        return out

    @property
    def middle_variants(self) -> list[str]:
        """The variants of the middle range (neither a swap nor a removal)."""
        return [n for n in self.names if not n.startswith(("swap", "remove"))]

    def gentlest_and_worst(self) -> tuple[str, str]:
        """The middle-range variants of least and of most KL (ties: the earlier)."""
        middle = self.middle_variants
        return (
            min(middle, key=lambda n: self.of("kl", n)),
            max(middle, key=lambda n: self.of("kl", n)),
        )

    def cheaper_swaps(self) -> int:
        """Blocks ``ℓ < L − 1`` whose swap with ``ℓ+1`` costs less KL than removing ``ℓ``."""
        swaps = self.swaps()
        pairs = zip(swaps["kl_swap"][:-1], swaps["kl_remove"][:-1], strict=True)
        return sum(s < r for s, r in pairs)

    def most_accurate(self) -> str | None:
        """The middle-range variant that keeps the most task accuracy (``None`` on the corpus)."""
        if self.accuracy is None:
            return None
        shares = self.accuracy[0]
        return max(self.middle_variants, key=lambda n: float(shares[self.names.index(n)]))
