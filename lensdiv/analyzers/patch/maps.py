"""The numbers of ``patch``: end-aligned maps over the pairs, and each pair's metrics.

:meth:`PatchingMaps.from_state` turns a run's sums (one set per prompt length ``T``) into mean
and standard-error maps whose column ``j`` is the position ``j - (T - 1)`` tokens before the
answer; a column averages only the pairs long enough to have it. Nothing here builds a table, a
plot or a sentence (that is :mod:`lensdiv.analyzers.patch.present`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.stats import Stats

#: Clean and corrupt metrics closer than this cannot normalise a patching score.
EPS = 1e-6


@dataclass(frozen=True)
class Aligned:
    """A ``[row, pos]`` map averaged over pairs, aligned at the answer position (last column).

    Args:
        mean: Mean over the pairs (NaN where no pair reaches the column).
        stderr: Standard error of the mean (NaN with fewer than two pairs).
        pairs: Pairs that entered each column.
    """

    mean: Float[Tensor, "row pos"]
    stderr: Float[Tensor, "row pos"]
    pairs: Float[Tensor, " pos"]

    def best(self) -> tuple[list[float], list[int]]:
        """Per row, the largest finite mean and its column (NaN and ``-1`` for a row without
        one)."""
        grid = self.mean
        finite = torch.isfinite(grid)
        filled = torch.where(finite, grid, torch.full_like(grid, -math.inf))
        best, where = filled.max(1)
        has = finite.any(1)
        return (
            [float(b) if h else math.nan for b, h in zip(best, has, strict=True)],
            [int(w) if h else -1 for w, h in zip(where, has, strict=True)],
        )


@dataclass(frozen=True)
class PairMetrics:
    """What the metric does on one pair's clean and corrupt prompt.

    Args:
        line: The pair's line (its key; pairs are in line order).
        tokens: Its prompt length ``T`` in tokens.
        target: The answer token.
        foil: The foil token.
        clean: The metric on the clean prompt.
        corrupt: The metric on the corrupt prompt.
        text: The clean prompt's tokens as text (empty without a tokenizer).
    """

    line: int
    tokens: int
    target: int
    foil: int
    clean: float
    corrupt: float
    text: tuple[str, ...] = ()

    @property
    def normalised(self) -> bool:
        """Whether the clean and corrupt metrics differ enough to normalise a patching score."""
        return abs(self.clean - self.corrupt) >= EPS

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PairMetrics:
        """A pair's row of the state."""
        return cls(
            line=int(record["line"]),
            tokens=int(record["tokens"]),
            target=int(record["target"]),
            foil=int(record["foil"]),
            clean=float(record["clean"]),
            corrupt=float(record["corrupt"]),
            text=tuple(record.get("text") or ()),
        )


@dataclass(frozen=True)
class PatchingMaps:
    """Patching, erasure and integrated-gradient maps of a run: no tables, no prose.

    Args:
        n_layers: Blocks ``L``.
        offsets: The position axis: offsets from the answer position, ``-(T-1) .. 0`` for the
            longest prompt.
        patch: Normalised patching score per site, ``[L, T]``.
        metric_mean: Mean raw metric of the patched run per site, ``[L, T]``, over every pair.
        erasure: ``||p − p̃||₂`` after erasing ``h_l(t)``, ``[L + 1, T]`` (``None``: not run).
        ig: Integrated-gradients attribution of ``h_l(t)``, ``[L + 1, T]`` (``None``: not run).
        ig_abs_error: Worst absolute completeness error of IG per layer (``None``: no IG).
        ig_rel_error: Worst relative completeness error per layer (``None``: no IG).
        pairs: Every pair's metrics, in line order.
        intervention: ``resume`` when every intervened pass resumed from the cached clean
            residual, else ``rerun``.
    """

    n_layers: int
    offsets: list[int]
    patch: Mapping[str, Aligned]
    metric_mean: Mapping[str, Float[Tensor, "layer pos"]]
    erasure: Aligned | None
    ig: Aligned | None
    ig_abs_error: Float[Tensor, " state"] | None
    ig_rel_error: Float[Tensor, " state"] | None
    pairs: tuple[PairMetrics, ...]
    intervention: str

    @property
    def n_pos(self) -> int:
        """Columns of the maps: the longest prompt's length."""
        return len(self.offsets)

    @property
    def degenerate(self) -> int:
        """Pairs left out of the patching scores (equal clean and corrupt metric)."""
        return sum(not pair.normalised for pair in self.pairs)

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, sites: Sequence[str]) -> PatchingMaps:
        """The maps of a merged state (after both passes; erasure only where it ran)."""
        L = info.n_layers
        lengths = sorted(int(t) for t in state.get("lengths", ()))
        if not lengths:
            raise RuntimeError("no pair was processed")
        n_pos = max(lengths)
        patch: dict[str, Aligned] = {}
        metric_mean: dict[str, Tensor] = {}
        for site in sites:
            patch[site] = _aligned(state, lengths, site, lambda t: f"n/{t}", L)
            raw_sum = torch.zeros(L, n_pos, dtype=torch.float64)
            count = torch.zeros(n_pos, dtype=torch.float64)
            for length in lengths:
                raw_sum[:, n_pos - length :] += state[f"{site}/{length}/raw"].cpu()
                count[n_pos - length :] += float(state[f"all/{length}"])
            metric_mean[site] = raw_sum / count.clamp_min(1)
        extra: dict[str, Aligned | None] = {}
        for kind, prefix in (("erasure", "erase"), ("ig", "ig")):
            ran = any(f"{prefix}/{length}/sum" in state for length in lengths)
            count_name = f"{prefix}/{{}}/n".format
            extra[kind] = _aligned(state, lengths, prefix, count_name, L + 1) if ran else None
        modes = state.get("intervention", frozenset()) | state.get(
            "erase/intervention", frozenset()
        )
        return cls(
            n_layers=L,
            offsets=list(range(-(n_pos - 1), 1)),
            patch=patch,
            metric_mean=metric_mean,
            erasure=extra["erasure"],
            ig=extra["ig"],
            ig_abs_error=state.get("ig/abs_error"),
            ig_rel_error=state.get("ig/rel_error"),
            pairs=tuple(PairMetrics.from_record(r) for r in state["pairs"]),
            intervention="resume" if modes == {"resume"} else "rerun",
        )


def _aligned(
    state: Stats, lengths: list[int], prefix: str, count: Callable[[int], str], n_rows: int
) -> Aligned:
    """The ``prefix/T/sum|sq`` sums of every length ``T``, aligned at the end, as an
    :class:`Aligned` map (``count(T)`` names the pairs behind them)."""
    n_pos = max(lengths)
    total = torch.zeros(n_rows, n_pos, dtype=torch.float64)
    squares, n = torch.zeros_like(total), torch.zeros(n_pos, dtype=torch.float64)
    for length in lengths:
        if f"{prefix}/{length}/sum" not in state:
            continue
        total[:, n_pos - length :] += state[f"{prefix}/{length}/sum"].cpu()
        squares[:, n_pos - length :] += state[f"{prefix}/{length}/sq"].cpu()
        n[n_pos - length :] += float(state[count(length)])
    return Aligned(*_mean_stderr(total, squares, n))


def _mean_stderr(
    total: Float[Tensor, "row pos"], squares: Float[Tensor, "row pos"], n: Float[Tensor, " pos"]
) -> tuple[Float[Tensor, "row pos"], Float[Tensor, "row pos"], Float[Tensor, " pos"]]:
    """Mean and standard error (unbiased std / sqrt(n)) from sums; NaN where undefined."""
    mean = torch.where(n > 0, total / n.clamp_min(1), torch.full_like(total, math.nan))
    var = (squares / n.clamp_min(1) - mean**2).clamp_min(0) * n / (n - 1).clamp_min(1)
    stderr = torch.where(n > 1, (var / n.clamp_min(1)).sqrt(), torch.full_like(total, math.nan))
    return mean, stderr, n
