"""``submod`` — are the gains from adding layers submodular? (SCIENCE.md B4)

``F(S)`` is next-token performance (``metric``: negative cross-entropy or top-1 accuracy, a
mean over positions) of the model using only the units in ``S``, in one of two ``mode`` s:

- ``direct``: units are the members of B1 (``embed, attn0, mlp0, ...``, ``M = 2L + 1``), read
  through the final residual's norm scale, and ``S`` predicts with the sum of its members' logits.
  ``constant = full`` always adds the whole constant ``β·W_U + b_U`` (no member writes it):
  ``z_S = Σ_{i∈S} z_i + const``, so ``F(all)`` is the model's own performance and ``F(∅)`` that of
  the constant alone. ``constant = shared`` gives each member ``const / M`` instead
  (``z_S = Σ_{i∈S} z_i + |S|/M · const``). One forward pass; each subset costs a sum of member
  logits and a softmax per position.
- ``removal``: units are whole blocks; ``S`` keeps its blocks and skips the others
  (``h_{l+1} := h_l`` for ``l ∉ S``), a real forward pass per subset that resumes from the clean
  residual at the first skipped block (:class:`~lensdiv.ops.resume.Resumer`), several subsets
  stacked along the batch. ``F(all)`` is the model's performance, ``F(∅)`` the embedding's.

Reported, from per-subset sums over positions (so shards merge):

- the prefix curve ``F(k)`` over the first ``k`` units in depth order (``k = 0..K``), its gains
  ``Δ_k = F(k) − F(k−1)``, the fraction of ``k`` with ``Δ_{k+1} ≤ Δ_k + tol`` and the
  least-squares fit ``F(k) ≈ a + b log k`` over ``k = 1..K`` with its R²; in direct mode also
  the same for whole blocks (the embedding and the first ``k`` blocks, every other point of the
  member curve), which removes the attention/MLP alternation and matches removal mode's units;
- the violation rate of ``F(S∪j) − F(S) ≥ F(T∪j) − F(T)`` (violated when short by more than
  ``tol``) over ``samples`` triples drawn with replacement, uniformly over all
  ``(j, S, T)`` with ``S ⊊ T ⊆ U∖{j}``: ``j`` uniform, then every other unit independently in
  ``S``, in ``T∖S`` or outside ``T`` with probability 1/3 each, redrawn when ``S = T`` (where the
  inequality is an identity);
- each unit's gain alone, ``F({i}) − F(∅)``, and last, ``F(U) − F(U∖{i})`` (a submodular ``F``
  has alone ≥ last);
- the greedy curve: at each step add the unit with the largest ``F`` (ties: the shallowest).
  Choosing step ``r`` needs ``F`` on all the data for the candidates of step ``r``, so step 1 is
  measured in the first pass and each later step costs one more pass over the data
  (``greedy`` steps in all, at most ``K − 1`` passes: the last unit is forced and free).

Every subset of the first pass is fixed up front from ``seed``; the greedy candidates of a later
pass follow from the sums of the earlier ones, so a state is plain sums and merges.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.resume import Resumer

Mode = Literal["direct", "removal"]
Metric = Literal["neg_ce", "accuracy"]
ConstantMode = Literal["full", "shared"]
SetFunction = Callable[[int], float]  # subsets are bit masks: unit i is in S when S >> i & 1

# Logits alive at once (member logits, or subset logits), ~128 MB in float32.
_BLOCK_ELEMENTS = 1 << 25
# Rows (subsets × sequences) per removal forward pass when ``chunk`` is automatic.
_REMOVAL_ROWS = 64


# -- set-function statistics (pure; the analyzer and the tests share them) -----------------------


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


def _new_round_masks(table: Mapping[int, float], n_units: int, step: int) -> list[int]:
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
    set_function = F

    def F(mask: int) -> float:  # values as floats, whatever the callable returns
        return float(set_function(mask))

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


# -- measuring F on a batch --------------------------------------------------------------------


def _scores(
    logits: Float[Tensor, "subset n d_vocab"], targets: Int[Tensor, " n"], metric: Metric
) -> Float[Tensor, "subset n"]:
    """Per-position score: log-probability of the target (negative CE) or top-1 hit (a hit when
    no logit is strictly larger than the target's, the logit lens's rank-0 rule)."""
    index = targets.view(1, -1, 1).expand(logits.shape[0], -1, 1)
    target = logits.gather(-1, index)
    if metric == "neg_ce":
        return (target - logits.logsumexp(-1, keepdim=True))[..., 0]
    return ((logits > target).sum(-1) == 0).to(logits.dtype)


def _subset_matrix(masks: Sequence[int], n_units: int, device: Any) -> Float[Tensor, "subset unit"]:
    rows = [[float(m >> u & 1) for u in range(n_units)] for m in masks]
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(len(masks), n_units)


def direct_scores(
    step: Step,
    masks: Sequence[int],
    keep: Bool[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    *,
    metric: Metric = "neg_ce",
    constant: ConstantMode = "full",
    max_elements: int = _BLOCK_ELEMENTS,
) -> Float[Tensor, " subset"]:
    """Sum over kept positions of each subset's score, predicting with its members' logits.

    Args:
        step: The clean pass; its cache must hold :func:`lensdiv.ops.members.member_hooks`.
        masks: Subsets of the ``2L + 1`` members (bit ``i`` = member ``i`` of
            :func:`lensdiv.ops.members.member_names`).
        keep: Positions scored (each must have a next token).
        targets: Next tokens.
        metric: ``neg_ce`` or ``accuracy``.
        constant: ``full`` (the whole constant for every subset) or ``shared`` (``|S|/M`` of it).
        max_elements: Logits alive at once.

    Returns:
        ``[len(masks)]`` float64 sums.
    """
    from lensdiv.ops.members import final_readout, iter_member_logits

    info = step.info
    n_members = 2 * info.n_layers + 1
    device = keep.device
    out = torch.zeros(len(masks), dtype=torch.float64, device=device)
    if not masks or not keep.any():
        return out
    weights = _subset_matrix(masks, n_members, device)
    const = final_readout(step.model).const
    share = weights.sum(1, keepdim=True) / n_members if constant == "shared" else None
    flat_targets = targets[keep]
    chunks = iter_member_logits(
        step.model, step.cache, info, keep, constant="separate", max_elements=max_elements
    )
    for rows, z in chunks:
        n_rows, d_vocab = z.shape[1], z.shape[2]
        per = max(1, max_elements // max(n_rows * d_vocab, 1))
        flat = z.reshape(n_members, -1)
        for lo in range(0, len(masks), per):
            w = weights[lo : lo + per]
            logits = (w @ flat).view(w.shape[0], n_rows, d_vocab)
            if share is None:
                logits = logits + const
            else:
                logits = logits + share[lo : lo + per, :, None] * const
            out[lo : lo + per] += _scores(logits, flat_targets[rows], metric).double().sum(1)
    return out


def _first_removed(mask: int, n_layers: int) -> int:
    """The first block not in ``mask`` (``n_layers`` when all are kept)."""
    for layer in range(n_layers):
        if not mask >> layer & 1:
            return layer
    return n_layers


def _next_kept(mask: int, start: int, n_layers: int) -> int:
    """The first block in ``mask`` at or after ``start`` (``n_layers`` when none)."""
    for layer in range(start, n_layers):
        if mask >> layer & 1:
            return layer
    return n_layers


def removal_finals(
    step: Step, masks: Sequence[int], resumer: Resumer, *, chunk: int = 0
) -> Iterator[tuple[list[int], Float[Tensor, "subset batch pos d_model"]]]:
    """Final residuals ``h_L`` with only the blocks of each mask kept (``h_{l+1} := h_l`` for
    the others), as ``(indices into masks, residuals)`` chunks.

    A subset whose first skipped block is ``s0`` and whose next kept block is ``s1`` has
    ``h_{s1} = h_{s0}`` of the clean pass; the subsets of a chunk (sorted by ``s1``) resume
    together from the smallest ``s1``, skipped blocks are overwritten row by row, and subsets with
    no kept block after ``s0`` need no forward pass at all.
    """
    info = step.info
    L = info.n_layers
    h = [step.resid(layer) for layer in range(L + 1)]
    batch = step.batch.tokens.shape[0]
    plans = []
    for index, mask in enumerate(masks):
        s0 = _first_removed(mask, L)
        plans.append((_next_kept(mask, s0, L), s0, index))
    still = [p for p in plans if p[0] == L]
    if still:
        yield [i for _, _, i in still], torch.stack([h[s0] for _, s0, _ in still])
    running = sorted(p for p in plans if p[0] < L)
    per = chunk or max(1, _REMOVAL_ROWS // batch)
    for lo in range(0, len(running), per):
        group = running[lo : lo + per]
        start = group[0][0]
        n = len(group)
        resid = torch.cat([h[min(start, s0)] for _, s0, _ in group])
        tokens = step.batch.tokens.repeat(n, 1)
        kept = torch.tensor(
            [[masks[i] >> layer & 1 for layer in range(L)] for _, _, i in group],
            dtype=torch.bool,
            device=resid.device,
        ).repeat_interleave(batch, dim=0)
        hooks, current = _skip_hooks(resid, ~kept, start)
        resumer.run(tokens, start, resid, hooks, logits=False)
        out = current["h"].view(n, batch, *current["h"].shape[1:])
        yield [i for _, _, i in group], out


def _skip_hooks(
    resid: Float[Tensor, "row pos d_model"], skip: Bool[Tensor, "row layer"], start: int
) -> tuple[list[tuple[str, Callable[..., Any]]], dict[str, Tensor]]:
    """Hooks on ``blocks.{l}.hook_resid_post`` (``l ≥ start``) that replace the output of every
    skipped block by its input, row by row; the returned dict ends up holding ``h_L``."""
    current = {"h": resid}  # the input of the next block to run
    hooks = []
    for layer in range(start, skip.shape[1]):
        rows = skip[:, layer, None, None]
        any_skip = bool(rows.any())

        def overwrite(
            tensor: Tensor, *, hook: Any, rows: Tensor = rows, any_skip: bool = any_skip
        ) -> Tensor:
            out = torch.where(rows, current["h"], tensor) if any_skip else tensor
            current["h"] = out
            return out

        hooks.append((f"blocks.{layer}.hook_resid_post", overwrite))
    return hooks, current


def removal_scores(
    step: Step,
    masks: Sequence[int],
    keep: Bool[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    resumer: Resumer,
    *,
    metric: Metric = "neg_ce",
    chunk: int = 0,
    max_elements: int = _BLOCK_ELEMENTS,
) -> Float[Tensor, " subset"]:
    """Sum over kept positions of each block subset's score, by true removal of the other
    blocks (see :func:`removal_finals`); read out with the model's own final norm and
    unembedding."""
    out = torch.zeros(len(masks), dtype=torch.float64, device=keep.device)
    if not masks or not keep.any():
        return out
    resumer.prepare(step.batch.tokens)
    flat_targets = targets[keep]
    d_vocab = step.info.d_vocab
    rows_per = max(1, max_elements // d_vocab)
    for indices, finals in removal_finals(step, masks, resumer, chunk=chunk):
        vectors = finals[:, keep]  # [subset, n, d_model]
        n = vectors.shape[1]
        flat = vectors.reshape(-1, vectors.shape[-1])  # subset-major rows
        which = torch.tensor(indices, device=out.device).repeat_interleave(n)
        goal = flat_targets.repeat(len(indices))
        for lo in range(0, flat.shape[0], rows_per):
            logits = resumer.readout(flat[lo : lo + rows_per]).float()
            scores = _scores(logits[None], goal[lo : lo + rows_per], metric)[0]
            out.index_add_(0, which[lo : lo + rows_per], scores.double())
    return out


# -- the analyzer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submodularity(Analyzer):
    """Diminishing returns of depth: prefix curve, log fit, submodularity violations, greedy.

    Args:
        mode: ``direct`` (units are the embedding and every attention/MLP output; a subset
            predicts with the sum of its members' logits, one forward pass) or ``removal``
            (units are blocks; the other blocks are truly skipped, a forward pass per subset).
        metric: ``neg_ce`` (negative next-token cross-entropy, nats) or ``accuracy`` (top-1).
        samples: Nested pairs ``S ⊊ T`` (and a unit ``j ∉ T``) drawn to test submodularity.
        seed: Seed of that draw.
        tol: A gain comparison fails only when short by more than this (float noise).
        greedy: Greedy steps measured; every step after the first costs one more pass over
            the data (0: no greedy curve).
        constant: Direct mode: every subset gets the ``full`` constant ``β·W_U + b_U`` (so
            ``F(all)`` is the model's own performance), or ``shared`` (``|S|/M`` of it).
        exclude_bos: Leave the BOS position out.
        chunk: Removal mode: subsets per forward pass (0: about 64 sequences per pass).
    """

    name = "submod"
    aliases = ("submodularity", "diminishing")
    description = "Submodularity of depth: prefix gains, log fit, violations, greedy curve"
    extra_forwards = True

    mode: Mode = "direct"
    metric: Metric = "neg_ce"
    samples: int = 64
    seed: int = 0
    tol: float = 1e-5
    greedy: int = 8
    constant: ConstantMode = "full"
    exclude_bos: bool = False
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.samples < 0:
            raise ValueError(f"samples must be >= 0, got {self.samples}")
        if self.greedy < 0:
            raise ValueError(f"greedy must be >= 0, got {self.greedy}")
        if not self.tol >= 0:
            raise ValueError(f"tol must be >= 0, got {self.tol}")
        if self.chunk < 0:
            raise ValueError(f"chunk must be 0 (auto) or positive, got {self.chunk}")

    def n_passes(self, info: ModelInfo) -> int:
        """One pass, plus one per greedy step after the first; only the steps that choose
        (the last unit is forced)."""
        return max(1, min(self.greedy, self.n_units(info) - 1))

    def n_units(self, info: ModelInfo) -> int:
        """Members (direct) or blocks (removal)."""
        return 2 * info.n_layers + 1 if self.mode == "direct" else info.n_layers

    def unit_names(self, info: ModelInfo) -> list[str]:
        """Names of the units in depth order."""
        if self.mode == "direct":
            from lensdiv.ops.members import member_names

            return member_names(info)
        return [f"block{layer}" for layer in range(info.n_layers)]

    def hooks(self, info: ModelInfo) -> list[str]:
        if self.mode == "direct":
            from lensdiv.ops.members import member_hooks

            return member_hooks(info)
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def plan(self, info: ModelInfo) -> Plan:
        """The subsets of the first pass."""
        return make_plan(self.n_units(info), self.samples, self.seed)

    def init(self, info: ModelInfo) -> Stats:
        state = Stats()
        state.resumer = None  # type: ignore[attr-defined]  # removal mode, built on first use
        return state

    def update(self, state: Stats, step: Step) -> None:
        plan = self.plan(step.info)
        index = step.pass_index
        if index == 0:
            masks = list(plan.first)
        else:
            masks = _new_round_masks(self.table(state, plan, index - 1), plan.n_units, index)
            if not masks:
                return
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        targets, has_target = step.batch.next_tokens()
        keep = keep & has_target
        if self.mode == "direct":
            sums = direct_scores(
                step, masks, keep, targets, metric=self.metric, constant=self.constant
            )
        else:
            if getattr(state, "resumer", None) is None:
                state.resumer = Resumer(step.model)  # type: ignore[attr-defined]
            sums = removal_scores(
                step,
                masks,
                keep,
                targets,
                state.resumer,  # type: ignore[attr-defined]
                metric=self.metric,
                chunk=self.chunk,
            )
        if index == 0:
            state.add("n", keep.sum())
            state.add("F0", sums)
        else:
            state.add(f"round{index + 1}", sums)

    def table(self, state: Stats, plan: Plan, last_pass: int) -> dict[int, float]:
        """Mean ``F`` of every subset measured in passes ``0..last_pass`` (``{mask: F}``)."""
        n = max(float(state["n"]), 1.0)
        table = dict(zip(plan.first, (state["F0"] / n).tolist(), strict=True))
        for index in range(1, last_pass + 1):
            masks = _new_round_masks(table, plan.n_units, index)
            key = f"round{index + 1}"
            if not masks:
                continue
            if key not in state:  # an interrupted run: later steps were never measured
                break
            table.update(zip(masks, (state[key] / n).tolist(), strict=True))
        return table

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if "F0" not in state or float(state["n"]) == 0:
            raise ValueError("no position with a next token was seen; use longer sequences")
        plan = self.plan(info)
        table = self.table(state, plan, self.n_passes(info) - 1)
        steps = min(self.greedy, plan.n_units)
        while True:  # as many greedy steps as were measured
            try:
                stats = set_function_stats(
                    table.__getitem__, plan, tol=self.tol, greedy_steps=steps
                )
                break
            except KeyError:
                steps -= 1
        return self._result(stats, plan, info, state, table)

    # -- results -----------------------------------------------------------------------------------
    def _result(
        self,
        stats: SetStats,
        plan: Plan,
        info: ModelInfo,
        state: Stats,
        table: Mapping[int, float],
    ) -> Result:
        names = self.unit_names(info)
        K = plan.n_units
        nan = math.nan
        word = self._unit_word()
        tables = {
            "prefix": _curve_table(
                "prefix",
                stats.prefix,
                ["(none)", *names],
                f"F of the first k {word} in depth order; gain = F(k) − F(k−1); "
                "diminishing: the next gain is no larger",
            )
        }
        blocks = None
        if self.mode == "direct":
            # Whole blocks (embedding + blocks 0..k−1) lie on the member prefix curve: the same
            # granularity as removal mode, without the attention/MLP alternation.
            blocks = curve(stats.prefix.values[1::2], self.tol)
            tables["blocks"] = _curve_table(
                "blocks",
                blocks,
                ["embed", *[f"block{layer}" for layer in range(info.n_layers)]],
                "Direct path of the embedding and the first k blocks (k = 0..L); "
                "log fit over k = 1..L",
            )
        values = stats.greedy_values
        greedy_gains = [values[i + 1] - values[i] for i in range(len(values) - 1)]
        tables["greedy"] = Table(
            "greedy",
            {
                "step": list(range(len(stats.greedy_values))),
                "added": ["(none)", *[names[u] for u in stats.greedy]],
                "F": stats.greedy_values,
                "gain": [nan, *greedy_gains],
            },
            "Greedy curve: each step adds the unit with the largest F",
        )
        alone_ge_last = sum(x >= y - self.tol for x, y in zip(stats.alone, stats.last, strict=True))
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
            "alone_ge_last_fraction": alone_ge_last / K if K else nan,
        }
        if blocks is not None:
            headline.update(
                {
                    "block_fit_a": blocks.fit[0],
                    "block_fit_b": blocks.fit[1],
                    "block_fit_r2": blocks.fit[2],
                    "block_diminishing_fraction": blocks.diminishing_fraction,
                }
            )
        tables["fit"] = Table(
            "fit",
            {"statistic": list(headline), "value": list(headline.values())},
            "Headline statistics",
        )
        tables["units"] = Table(
            "units",
            {
                "unit": names,
                "alone": stats.alone,
                "last": stats.last,
                "alone_minus_last": [x - y for x, y in zip(stats.alone, stats.last, strict=True)],
            },
            "Each unit's gain added first (alone = F({i}) − F(∅)) and last (F(U) − F(U∖{i}))",
        )
        tables["triples"] = Table(
            "triples",
            {
                "j": [names[j] for _, _, j in plan.triples],
                "size_S": [bin(s).count("1") for s, _, _ in plan.triples],
                "size_T": [bin(t).count("1") for _, t, _ in plan.triples],
                "gain_S": [table[s | 1 << j] - table[s] for s, _, j in plan.triples],
                "gain_T": [table[t | 1 << j] - table[t] for _, t, j in plan.triples],
                "margin": margins,
            },
            "Sampled S ⊊ T, j ∉ T: margin = gain at S − gain at T (< −tol: violation)",
        )
        masks = sorted(table)
        arrays = {
            "prefix_F": np.asarray(stats.prefix.values),
            "greedy_F": np.asarray(stats.greedy_values),
            "subsets": np.asarray(
                [[m >> u & 1 for u in range(K)] for m in masks], dtype=float
            ).reshape(len(masks), K),
            "subset_F": np.asarray([table[m] for m in masks]),
        }
        label = self._metric_label()
        resumer = getattr(state, "resumer", None)
        return Result(
            analyzer=self.name,
            summary=self._summary(stats, blocks, names, alone_ge_last),
            tables=tables,
            arrays=arrays,
            plots=(
                Plot(
                    "line",
                    "submod_prefix",
                    f"F(k) over the first k {word} and a + b log k",
                    "prefix",
                    x="k",
                    y=("F", "fit"),
                    xlabel=f"k ({word} in depth order)",
                    ylabel=label,
                ),
                Plot(
                    "line",
                    "submod_gains",
                    "Marginal gains Δ_k = F(k) − F(k−1)",
                    "prefix",
                    x="k",
                    y=("gain",),
                    xlabel="k",
                    ylabel=f"Δ {label}",
                ),
                Plot(
                    "line",
                    "submod_greedy",
                    "Greedy curve",
                    "greedy",
                    x="step",
                    y=("F",),
                    xlabel="greedy step",
                    ylabel=label,
                ),
            ),
            meta={
                "units": names,
                "n_units": K,
                "positions": int(float(state["n"])),
                "subsets_evaluated": len(table),
                "constant_handling": self._constant_note(),
                "sampling": (
                    "with replacement, uniform over (j, S, T) with S ⊊ T ⊆ U∖{j}: j uniform, "
                    "other units in S / T∖S / outside T w.p. 1/3 each, redrawn if S = T"
                ),
                "triples": len(plan.triples),
                "greedy_steps": len(stats.greedy),
                "greedy_order": [names[u] for u in stats.greedy],
                "resume": getattr(resumer, "mode", None),
            },
        )

    def _unit_word(self) -> str:
        return "members" if self.mode == "direct" else "blocks"

    def _metric_label(self) -> str:
        return "−CE (nats)" if self.metric == "neg_ce" else "top-1 accuracy"

    def _constant_note(self) -> str:
        if self.mode == "removal":
            return "none: true removal; the final norm and unembedding read the reduced residual"
        if self.constant == "full":
            return "z_S = Σ_{i∈S} z_i + (β·W_U + b_U): every subset gets the whole constant"
        return "z_S = Σ_{i∈S} z_i + |S|/M·(β·W_U + b_U): the constant shared equally by members"

    def _summary(
        self, stats: SetStats, blocks: Curve | None, names: list[str], alone_ge_last: int
    ) -> str:
        K = len(names)
        what = "members (direct-path logit sums)" if self.mode == "direct" else "blocks (removal)"
        parts = [
            f"{self._metric_label()} of the first k of {K} {what}: F goes from "
            f"{stats.prefix.values[0]:.4g} (none) to {stats.prefix.values[-1]:.4g} (all)."
        ]
        parts.append("By " + self._unit_word() + ": " + _describe(stats.prefix))
        if blocks is not None:
            parts.append("By whole blocks (embedding first): " + _describe(blocks))
        if stats.margins:
            parts.append(
                f"Submodularity fails in {stats.violations}/{len(stats.margins)} sampled nested "
                f"pairs ({stats.violation_rate:.0%}, tol {self.tol:g}); a unit helps at least as "
                f"much added first as added last for {alone_ge_last}/{K}."
            )
        if stats.greedy:
            first = ", ".join(names[u] for u in stats.greedy[:4])
            parts.append(f"Greedy adds {first}{', …' if len(stats.greedy) > 4 else ''} first.")
        return " ".join(parts)


def _describe(c: Curve) -> str:
    """One sentence on a curve's shape."""
    frac = c.diminishing_fraction
    if not c.diminishing:
        return "too few points to judge the gains."
    verdict = (
        "diminishing"
        if frac >= 0.75
        else "partly diminishing"
        if frac >= 0.5
        else "not diminishing"
    )
    text = (
        f"gains are {verdict} (Δ_(k+1) ≤ Δ_k at {sum(c.diminishing)}/{len(c.diminishing)} "
        f"steps, {frac:.0%})"
    )
    a, b, r2 = c.fit
    if len(c.gains) >= 3:
        text += f"; F(k) ≈ {a:.4g} + {b:.4g}·log k, R² = {r2:.3f}"
    return text + "."


def _curve_table(name: str, c: Curve, added: list[str], description: str) -> Table:
    nan = math.nan
    a, b, _ = c.fit
    K = len(c.gains)
    return Table(
        name,
        {
            "k": list(range(K + 1)),
            "added": added,
            "F": c.values,
            "gain": [nan, *c.gains],
            "fit": [nan]
            + [a + b * math.log(k) if not math.isnan(b) else nan for k in range(1, K + 1)],
            "diminishing": [nan, *[float(d) for d in c.diminishing], nan] if K else [nan],
        },
        description,
    )
