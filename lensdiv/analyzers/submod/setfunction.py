"""Statistics of a set function ``F`` over subsets of units (docs/science.md B4), pure and exact.

Subsets are bit masks (unit ``i`` is in ``S`` when ``S >> i & 1``). The ``submod`` analyzer
measures ``F`` on the data; everything here works on any table or callable of ``F``: the prefix
curve and its gains, the log fit, the sampled violations of diminishing returns and the greedy
order. The tests check these on hand-made set functions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SetFunction = Callable[[int], float]  # subsets are bit masks: unit i is in S when S >> i & 1


def units_mask(units: Sequence[int]) -> int:
    """The bit mask of a collection of unit indices."""
    mask = 0
    for unit in units:
        mask |= 1 << unit
    return mask


def prefix_masks(n_units: int) -> list[int]:
    """Masks of the first ``k`` units, ``k = 0..n_units``."""
    return [(1 << k) - 1 for k in range(n_units + 1)]


def sample_nested(n_units: int, samples: int, seed: int) -> list[tuple[int, int, int]]:
    """``samples`` triples ``(S, T, j)``, drawn with replacement uniformly over all triples with
    ``S ⊊ T ⊆ U∖{j}``: ``j`` uniform, every other unit in ``S``, ``T∖S`` or outside ``T`` with
    probability 1/3 each, redrawn when ``S = T``. None exist with fewer than two units."""
    if n_units < 2:
        return []
    rng = random.Random(f"submod-{seed}")
    out: list[tuple[int, int, int]] = []
    while len(out) < samples:
        j = rng.randrange(n_units)
        s = t = 0
        for unit in range(n_units):
            if unit == j:
                continue
            label = rng.randrange(3)
            if label == 0:
                s |= 1 << unit
            if label < 2:
                t |= 1 << unit
        if s != t:
            out.append((s, t, j))
    return out


def violation_margins(F: SetFunction, triples: Sequence[tuple[int, int, int]]) -> list[float]:
    """``[F(S∪j) − F(S)] − [F(T∪j) − F(T)]`` per triple: negative where submodularity fails."""
    return [(F(s | 1 << j) - F(s)) - (F(t | 1 << j) - F(t)) for s, t, j in triples]


def log_fit(values: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``F(k) ≈ a + b log k`` for ``values[k − 1] = F(k)``, ``k = 1..K``.

    Returns ``(a, b, r2)``; ``b`` and ``r2`` are NaN with fewer than two points, ``r2`` also when
    ``F`` is constant.
    """
    y = np.asarray(values, dtype=np.float64)
    if y.size == 0:
        return math.nan, math.nan, math.nan
    if y.size == 1:
        return float(y[0]), math.nan, math.nan
    x = np.log(np.arange(1, y.size + 1, dtype=np.float64))
    xc, yc = x - x.mean(), y - y.mean()
    b = float((xc * yc).sum() / (xc * xc).sum())
    a = float(y.mean() - b * x.mean())
    ss_res = float(((y - a - b * x) ** 2).sum())
    ss_tot = float((yc * yc).sum())
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else math.nan
    return a, b, r2


def greedy_choice(F: SetFunction, chosen: int, n_units: int) -> int:
    """The unit outside ``chosen`` whose addition gives the largest ``F`` (ties: the lowest)."""
    best, best_value = -1, -math.inf
    for unit in range(n_units):
        if chosen >> unit & 1:
            continue
        value = F(chosen | 1 << unit)
        if best < 0 or value > best_value:
            best, best_value = unit, value
    return best


def greedy_order(F: SetFunction, n_units: int, steps: int) -> list[int]:
    """The first ``min(steps, n_units − 1)`` greedy choices, plus the forced last unit once only
    one is left."""
    order: list[int] = []
    chosen = 0
    for _ in range(min(steps, n_units - 1)):
        unit = greedy_choice(F, chosen, n_units)
        order.append(unit)
        chosen |= 1 << unit
    if len(order) == n_units - 1:
        order += [u for u in range(n_units) if not chosen >> u & 1]
    return order


@dataclass(frozen=True)
class Plan:
    """The subsets a run evaluates in its first pass.

    Args:
        n_units: Number of units ``K``.
        prefixes: Masks of the first ``k`` units, ``k = 0..K``.
        triples: Sampled ``(S, T, j)`` for the violation rate.
        first: Every mask evaluated in the first pass, without repeats: the prefixes, the four
            subsets of every triple, every singleton and every leave-one-out set.
    """

    n_units: int
    prefixes: tuple[int, ...]
    triples: tuple[tuple[int, int, int], ...]
    first: tuple[int, ...]


@lru_cache(maxsize=32)
def make_plan(n_units: int, samples: int, seed: int) -> Plan:
    """The first-pass subsets of ``n_units`` units (deterministic in ``samples`` and ``seed``)."""
    prefixes = prefix_masks(n_units)
    triples = sample_nested(n_units, samples, seed)
    full = (1 << n_units) - 1
    masks = list(prefixes)
    for s, t, j in triples:
        masks += [s, s | 1 << j, t, t | 1 << j]
    masks += [1 << u for u in range(n_units)]
    masks += [full & ~(1 << u) for u in range(n_units)]
    return Plan(n_units, tuple(prefixes), tuple(triples), tuple(dict.fromkeys(masks)))


def greedy_round_masks(F: SetFunction, n_units: int, step: int) -> list[int]:
    """Candidates of greedy step ``step + 1`` (``step ≥ 1``) given the first ``step`` choices
    (read off ``F``); empty once only the forced last unit is left."""
    if step >= n_units - 1:
        return []
    chosen = units_mask(greedy_order(F, n_units, step))
    return [chosen | 1 << u for u in range(n_units) if not chosen >> u & 1]


def new_round_masks(table: Mapping[int, float], n_units: int, step: int) -> list[int]:
    """The greedy candidates of step ``step + 1`` not measured yet."""
    return [m for m in greedy_round_masks(table.__getitem__, n_units, step) if m not in table]


@dataclass(frozen=True)
class Curve:
    """A curve ``F(k)``, ``k = 0..K``, and its shape.

    Args:
        values: ``F(0), ..., F(K)``.
        gains: ``Δ_k = F(k) − F(k−1)``, ``k = 1..K``.
        diminishing: ``Δ_{k+1} ≤ Δ_k + tol``, ``k = 1..K−1``.
        fit: ``(a, b, r2)`` of the least-squares ``F(k) ≈ a + b log k`` over ``k = 1..K``.
    """

    values: list[float]
    gains: list[float]
    diminishing: list[bool]
    fit: tuple[float, float, float]

    @property
    def diminishing_fraction(self) -> float:
        """Fraction of ``k`` with ``Δ_{k+1} ≤ Δ_k`` (NaN with fewer than two gains)."""
        return sum(self.diminishing) / len(self.diminishing) if self.diminishing else math.nan


def curve(values: Sequence[float], tol: float) -> Curve:
    """Gains, diminishing steps and log fit of ``values = [F(0), ..., F(K)]``."""
    values = [float(v) for v in values]
    gains = [values[k] - values[k - 1] for k in range(1, len(values))]
    diminishing = [gains[k + 1] <= gains[k] + tol for k in range(len(gains) - 1)]
    return Curve(values, gains, diminishing, log_fit(values[1:]))


@dataclass(frozen=True)
class SetStats:
    """Statistics of one set function over ``K`` units (see the module docstring).

    Args:
        prefix: The prefix curve over the first ``k`` units.
        margins: Violation margins of the sampled triples.
        violations: Margins below ``−tol``.
        alone: ``F({i}) − F(∅)`` per unit.
        last: ``F(U) − F(U∖{i})`` per unit.
        greedy: The greedy order (as many steps as were measured).
        greedy_values: ``F`` of the greedy prefixes, from ``F(∅)``.
    """

    prefix: Curve
    margins: list[float]
    violations: int
    alone: list[float]
    last: list[float]
    greedy: list[int]
    greedy_values: list[float]

    @property
    def violation_rate(self) -> float:
        """Fraction of sampled triples that violate submodularity (NaN with none sampled)."""
        return self.violations / len(self.margins) if self.margins else math.nan


def set_function_stats(F: SetFunction, plan: Plan, *, tol: float, greedy_steps: int) -> SetStats:
    """Every statistic of ``F`` on ``plan`` (``F`` is called on the plan's masks and on the
    greedy candidates of ``greedy_steps`` steps; with a table, missing masks raise KeyError)."""
    n = plan.n_units
    full = (1 << n) - 1
    given = F

    def as_float(mask: int) -> float:  # values as floats, whatever the callable returns
        return float(given(mask))

    F = as_float

    margins = violation_margins(F, plan.triples)
    order = greedy_order(F, n, greedy_steps)
    chosen, values = 0, [F(0)]
    for unit in order:
        chosen |= 1 << unit
        values.append(F(chosen))
    return SetStats(
        prefix=curve([F(m) for m in plan.prefixes], tol),
        margins=margins,
        violations=sum(m < -tol for m in margins),
        alone=[F(1 << u) - F(0) for u in range(n)],
        last=[F(full) - F(full & ~(1 << u)) for u in range(n)],
        greedy=order,
        greedy_values=values,
    )
