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
pass follow from the sums of the earlier ones, so a state is plain sums and merges. The state,
pass by pass (a later pass writes only new names; earlier ones are frozen):

- pass 0: ``n`` (sum: scored positions), ``F0`` (sum: ``F`` summed over positions, one entry
  per subset of the plan), and in removal mode ``resume`` (set: the resume modes used);
- pass ``p ≥ 1``: ``round{p+1}`` (sum: the new greedy candidates of step ``p + 1``) and in
  removal mode ``resume{p+1}``; nothing when the step has no new candidate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from lensdiv.analyzers.submod.setfunction import (
    Curve,
    Plan,
    SetStats,
    curve,
    greedy_order,
    greedy_round_masks,
    log_fit,
    make_plan,
    new_round_masks,
    sample_nested,
    set_function_stats,
    units_mask,
)
from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.members import member_hooks, member_names, member_readout
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.subsets import ConstantMode, Metric, direct_scores, removal_scores

Mode = Literal["direct", "removal"]

__all__ = [
    "Submodularity",
    "curve",
    "greedy_order",
    "greedy_round_masks",
    "log_fit",
    "make_plan",
    "sample_nested",
    "set_function_stats",
    "units_mask",
]


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
    depth_profiles = ()
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
        """One pass, plus one per greedy step after the first that needs measuring: step 1
        chooses among the singletons and step ``K - 1`` among the leave-one-out sets, both
        measured in the first pass, and the last unit is forced."""
        return max(1, min(self.greedy, self.n_units(info) - 2))

    def n_units(self, info: ModelInfo) -> int:
        """Members (direct) or blocks (removal)."""
        return 2 * info.n_layers + 1 if self.mode == "direct" else info.n_layers

    def unit_names(self, info: ModelInfo) -> list[str]:
        """Names of the units in depth order."""
        if self.mode == "direct":
            return member_names(info)
        return [f"block{layer}" for layer in range(info.n_layers)]

    def hooks(self, info: ModelInfo) -> list[str]:
        if self.mode == "direct":
            return member_hooks(info)
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def setup(self, model: Any, info: ModelInfo) -> None:
        if self.mode == "direct":  # member sums cannot add up past a final logit soft-cap
            member_readout(model)  # (Gemma 2): UnsupportedModelError, so the run skips submod

    def plan(self, info: ModelInfo) -> Plan:
        """The subsets of the first pass."""
        return make_plan(self.n_units(info), self.samples, self.seed)

    def update(self, state: Stats, step: Step) -> None:
        plan = self.plan(step.info)
        index = step.pass_index
        if index == 0:
            masks = list(plan.first)
        else:
            masks = new_round_masks(self.table(state, plan, index - 1), plan.n_units, index)
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
            resumer = resumer_for(step)
            sums = removal_scores(
                step, masks, keep, targets, resumer, metric=self.metric, chunk=self.chunk
            )
            if resumer.mode is not None:  # undecided while no batch had a position to score
                state.include(_resume_name(index), resumer.mode)
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
            masks = new_round_masks(table, plan.n_units, index)
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
        if "(" not in label:  # an axis says its unit
            label += " (fraction)"
        passes = range(self.n_passes(info))
        modes = {m for index in passes for m in state.get(_resume_name(index), ())}
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
                    xlabel=f"k ({word} in depth order)",
                    ylabel=f"gain Δ_k of {label}",
                    signed=True,
                    caption="Diminishing returns (submodularity): each gain at most the one "
                    "before it.",
                ),
                Plot(
                    "line",
                    "submod_greedy",
                    "Greedy curve",
                    "greedy",
                    x="step",
                    y=("F",),
                    xlabel=f"greedy step (number of {word} chosen)",
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
                "resume": modes.pop() if len(modes) == 1 else (sorted(modes) or None),
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


def _resume_name(index: int) -> str:
    """The set of resume modes (:attr:`~lensdiv.ops.resume.Resumer.mode`) used in pass ``index``:
    a name of its own per pass, as a later pass writes only new names."""
    return "resume" if index == 0 else f"resume{index + 1}"


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
