"""``submod`` — are the gains from adding layers submodular? (docs/science.md B4)

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

The package: this module is the analyzer (options, plan, the measured sums);
:mod:`~lensdiv.analyzers.submod.setfunction` the statistics of any set function, pure and exact;
:mod:`~lensdiv.analyzers.submod.curves` those of a run as :class:`SubmodCurves` (the numbers);
:mod:`~lensdiv.analyzers.submod.present` turns them into the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lensdiv.analyzers.submod.curves import SubmodCurves
from lensdiv.analyzers.submod.present import present
from lensdiv.analyzers.submod.setfunction import (
    Plan,
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
from lensdiv.core.bridge import Bridge
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.ops.members import member_hooks, member_names, member_readout
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.subsets import ConstantMode, Metric, direct_scores, removal_scores

Mode = Literal["direct", "removal"]

__all__ = [
    "SubmodCurves",
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

    def setup(self, model: Bridge, info: ModelInfo) -> None:
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
        return present(self.curves(state, info), self)

    def curves(self, state: Stats, info: ModelInfo) -> SubmodCurves:
        """The statistics of ``F`` measured in a merged state (the computation of
        :meth:`finalize`, without the result)."""
        if "F0" not in state or float(state["n"]) == 0:
            raise ValueError("no position with a next token was seen; use longer sequences")
        plan = self.plan(info)
        passes = range(self.n_passes(info))
        modes = {m for index in passes for m in state.get(_resume_name(index), ())}
        return SubmodCurves.from_table(
            self.table(state, plan, self.n_passes(info) - 1),
            plan,
            units=self.unit_names(info),
            tol=self.tol,
            greedy=self.greedy,
            blocks=self.mode == "direct",
            positions=int(float(state["n"])),
            resume=modes.pop() if len(modes) == 1 else (sorted(modes) or None),
        )


def _resume_name(index: int) -> str:
    """The set of resume modes (:attr:`~lensdiv.ops.resume.Resumer.mode`) used in pass ``index``:
    a name of its own per pass, as a later pass writes only new names."""
    return "resume" if index == 0 else f"resume{index + 1}"
