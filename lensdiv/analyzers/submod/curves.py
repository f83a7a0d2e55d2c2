"""The numbers of ``submod``: every statistic of ``F`` over the measured subsets, as
:class:`SubmodCurves` (no tables, no prose: that is :mod:`lensdiv.analyzers.submod.present`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from lensdiv.analyzers.submod.setfunction import Curve, Plan, SetStats, curve, set_function_stats


@dataclass(frozen=True)
class SubmodCurves:
    """The set-function statistics of a run (docs/science.md B4).

    Args:
        stats: Prefix curve, violation margins, alone/last gains and the greedy curve.
        blocks: Direct mode: the curve over whole blocks (the embedding and the first ``k``
            blocks, every other point of the member prefix curve); ``None`` in removal mode.
        subsets: Mean ``F`` of every subset measured (bit mask → ``F``).
        plan: The subsets of the first pass (units, prefixes, sampled triples).
        units: The units' names in depth order.
        tol: The tolerance of every gain comparison.
        positions: Positions ``F`` was averaged over.
        resume: Removal mode: the resume mode of the passes (a list if they differ, ``None``
            if none was decided).
    """

    stats: SetStats
    blocks: Curve | None
    subsets: Mapping[int, float]
    plan: Plan
    units: list[str]
    tol: float
    positions: int
    resume: str | list[str] | None = None

    @classmethod
    def from_table(
        cls,
        subsets: Mapping[int, float],
        plan: Plan,
        *,
        units: list[str],
        tol: float,
        greedy: int,
        blocks: bool,
        positions: int,
        resume: str | list[str] | None = None,
    ) -> SubmodCurves:
        """The statistics of ``F`` given as a table of measured subsets, with as many greedy
        steps (at most ``greedy``) as the table has measured."""
        steps = min(greedy, plan.n_units)
        while True:
            try:
                stats = set_function_stats(subsets.__getitem__, plan, tol=tol, greedy_steps=steps)
                break
            except KeyError:
                steps -= 1
        # Whole blocks (embedding + blocks 0..k−1) lie on the member prefix curve: the same
        # granularity as removal mode, without the attention/MLP alternation.
        block_curve = curve(stats.prefix.values[1::2], tol) if blocks else None
        return cls(stats, block_curve, subsets, plan, units, tol, positions, resume)

    @property
    def greedy_gains(self) -> list[float]:
        """``F`` gained by each greedy step."""
        values = self.stats.greedy_values
        return [values[i + 1] - values[i] for i in range(len(values) - 1)]

    @property
    def alone_ge_last(self) -> int:
        """Units that help at least as much added first as added last (up to ``tol``)."""
        stats = self.stats
        return sum(x >= y - self.tol for x, y in zip(stats.alone, stats.last, strict=True))

    def triple_gains(self) -> tuple[list[float], list[float]]:
        """``F(S∪j) − F(S)`` and ``F(T∪j) − F(T)`` of every sampled triple."""
        F, triples = self.subsets, self.plan.triples
        return (
            [F[s | 1 << j] - F[s] for s, _, j in triples],
            [F[t | 1 << j] - F[t] for _, t, j in triples],
        )

    @property
    def headline(self) -> dict[str, float]:
        """The headline statistics: ``F`` of none and all, the log fit, the diminishing and
        violation rates, the margins, and (direct mode) the same for whole blocks."""
        stats, K, nan = self.stats, self.plan.n_units, math.nan
        margins = stats.margins
        a, b, r2 = stats.prefix.fit
        headline = {
            "F_empty": stats.prefix.values[0],
            "F_all": stats.prefix.values[-1],
            "fit_a": a,
            "fit_b": b,
            "fit_r2": r2,
            "diminishing_fraction": stats.prefix.diminishing_fraction,
            "violation_rate": stats.violation_rate,
            "mean_margin": float(np.mean(margins)) if margins else nan,
            "min_margin": float(np.min(margins)) if margins else nan,
            "alone_ge_last_fraction": self.alone_ge_last / K if K else nan,
        }
        if self.blocks is not None:
            headline.update(
                {
                    "block_fit_a": self.blocks.fit[0],
                    "block_fit_b": self.blocks.fit[1],
                    "block_fit_r2": self.blocks.fit[2],
                    "block_diminishing_fraction": self.blocks.diminishing_fraction,
                }
            )
        return headline
