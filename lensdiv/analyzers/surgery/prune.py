"""``prune`` — remove a range of blocks (docs/science.md E1).

For every start ``ℓ`` and length ``n ≤ max_n``: the true effect of removing blocks
``ℓ..ℓ+n−1`` (``h_{ℓ+n} := h_ℓ`` at every position, BOS included) on the output — KL to the full
model's output (``KL(p_removed ‖ p_out)``, the ``lens`` direction), next-token cross-entropy and
its change, top-1 agreement with the full model and top-1 accuracy — at every real position
(``exclude_bos`` leaves the first out of every statistic). Beside it, the cheap signals of the
clean pass: block influence (ShortGPT), angular distance (Gromov et al.; last token and all
tokens), nonlinearity ``1 − R²`` (of Razzhigaev et al.'s linearity score ``R²``); which start
each signal picks per ``n``, and its regret.

Passes: the grid and the signals in pass 0; with ``curves``, pass ``k ≥ 1`` removes the ``k``
blocks of least block influence and runs greedy step ``k`` (every remaining block tried on top of
the blocks greedy removed so far). Every statistic is a sum over positions: shards merge.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from lensdiv.analyzers.surgery.base import (
    Surgery,
    add_answers,
    answer_positions,
    count_answers,
)
from lensdiv.analyzers.surgery.numbers import PruneNumbers, greedy_chosen
from lensdiv.analyzers.surgery.present import present
from lensdiv.core.analyzer import ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.progress import note
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.surgery import (
    SUMS,
    SurgeryCost,
    grid_cells,
    last_positions,
    moment_update,
    output_sums,
    range_mask,
    read_together,
    removal_cost,
    removed_finals,
    set_mask,
    signal_sums,
)


@dataclass(frozen=True)
class Prune(Surgery):
    """True effect of removing every range of blocks, and the cheap signals that should predict it.

    Options ``exclude_bos``, ``task`` and ``per_grade``: see
    :class:`~lensdiv.analyzers.surgery.base.Surgery` (with ``task``, each removal's accuracy).

    Args:
        max_n: Longest range removed (``0``: half the depth, at most :data:`DEFAULT_LONGEST`
            unless ``full``; at least 1).
        full: With ``max_n=0``: ranges up to half the depth, and curves that long (on a
            30-layer model 16 passes and about 6× the removals of the default).
        curves: Also draw the pruning curves of block-influence order and of greedy true
            removal (one more pass over the data per block removed).
        linearity: Compute the linearity score ``R²`` of each block (the ``blocks`` table's
            ``linearity_r2``) and the signal ``nonlinearity``, ``1 − R²`` summed over a range
            (``d_model²`` moments per state).
        chunk: Interventions stacked in one forward pass (``0``: all that resume at one block).
        resume: Resume each removal from the cached clean residual (``False``: run every block
            of every intervened pass, the full-forward-pass reference of ``bench/``).
    """

    name = "prune"
    aliases = ("prune-blocks", "shortgpt")
    description = "Depth surgery: true effect of removing each range of blocks vs cheap signals"
    depth_profiles = ("blocks.kl_remove", "blocks.block_influence")

    max_n: int = 0
    full: bool = False
    curves: bool = True
    linearity: bool = True
    chunk: int = 0
    resume: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_n < 0:
            raise ValueError(f"max_n must be 0 (half the depth) or positive, got {self.max_n}")
        if self.chunk < 0:
            raise ValueError(f"chunk must be 0 (auto) or positive, got {self.chunk}")

    def longest(self, info: ModelInfo) -> int:
        """``N``: the longest range removed on this model."""
        if self.max_n:
            return min(self.max_n, info.n_layers)
        half = max(1, info.n_layers // 2)
        return half if self.full else min(half, DEFAULT_LONGEST)

    def n_passes(self, info: ModelInfo) -> int:
        """The grid, then one pass per point of the block-influence and greedy curves."""
        return 1 + (self.longest(info) if self.curves else 0)

    def interventions(self, info: ModelInfo, index: int) -> int:
        """Per sequence: every ``(ℓ, n)`` cell in pass 0; in pass ``k``, the ``k`` blocks of
        least influence and greedy step ``k`` (each of the ``L − k + 1`` blocks left)."""
        if index == 0:
            return len(grid_cells(info.n_layers, self.longest(info)))
        return 1 + info.n_layers - index + 1

    def costs(self, info: ModelInfo, *, full: bool | None = None) -> list[SurgeryCost]:
        """Per pass, what it costs per sequence (the curve passes: an upper bound, as the blocks
        they remove depend on the data); ``full``: of the full grid instead."""
        plan = self if full is None else Prune(max_n=self.max_n, full=full, curves=self.curves)
        L, N = info.n_layers, plan.longest(info)
        grid = removal_cost(L, [range_mask(L, s, n) for s, n in grid_cells(L, N)])
        curve = [
            SurgeryCost(plan.interventions(info, k), plan.interventions(info, k) * (L - 1), True)
            for k in range(1, plan.n_passes(info))
        ]
        return [grid, *curve]

    def setup(self, model: Bridge, info: ModelInfo) -> None:
        """Say what the run will cost before it starts (a time follows the first batch)."""
        note(plan_line(self, info))

    def measure(self, state: Stats, step: Step, keep: torch.Tensor) -> None:
        started = time.perf_counter()
        if step.pass_index == 0:
            self._grid(state, step, keep)
        else:
            self._curve_step(state, step, keep, step.pass_index)
        told = step.cached("prune-timed", lambda: [False])
        if step.pass_index == 0 and not told[0]:
            told[0] = True
            note(time_line(self, step, time.perf_counter() - started))

    def _grid(self, state: Stats, step: Step, keep: torch.Tensor) -> None:
        info = step.info
        L, N = info.n_layers, self.longest(info)
        resumer = resumer_for(step, fast=self.resume)
        cells = grid_cells(L, N)
        masks = [range_mask(L, s, n) for s, n in cells]
        grid = torch.zeros(len(SUMS), L, N, dtype=torch.float64, device=keep.device)
        measure = answer_positions(step.batch)
        right = torch.zeros(L, N, dtype=torch.float64)  # task examples answered whole
        runs_before = resumer.blocks_run
        removals = removed_finals(step, masks, resumer, chunk=self.chunk)
        for indices, finals, sums in read_together(step, removals, keep):
            answers = count_answers(resumer, step, finals, measure) if measure is not None else []
            for j, index in enumerate(indices):
                s, n = cells[index]
                for i, key in enumerate(SUMS):
                    grid[i, s, n - 1] = sums[key][j]
                if answers:
                    right[s, n - 1] = answers[j]
        if measure is not None:
            add_answers(state, step, resumer, measure, right)
        state.add("block_runs", resumer.blocks_run - runs_before)
        state.add("rows", step.batch.tokens.shape[0])
        state.add("grid", grid)
        if resumer.mode is not None:
            state.include("resume", resumer.mode)
        clean = output_sums(step, [step.resid(L)], keep)
        state.add("clean", torch.stack([clean[key][0] for key in SUMS]))
        h = [step.resid(layer) for layer in range(L + 1)]
        last = last_positions(step.batch.mask)
        signals = signal_sums(h, keep, last & keep, N)
        state.add("n_all", keep.sum())
        state.add("n_last", (last & keep).sum())
        for key, value in signals.items():
            state.add(key, value)
        if self.linearity:
            moment_update(state.add, h, keep)

    def _curve_step(self, state: Stats, step: Step, keep: torch.Tensor, k: int) -> None:
        """Pass ``k``: the ``k`` blocks of least block influence, and greedy step ``k``."""
        L = step.info.n_layers
        resumer = resumer_for(step, fast=self.resume)
        order = influence_order(state["bi"])
        chosen = greedy_chosen(state, k - 1)
        candidates = [b for b in range(L) if b not in chosen]
        masks = [set_mask(L, order[:k])] + [set_mask(L, [*chosen, b]) for b in candidates]
        sums = torch.zeros(len(masks), len(SUMS), dtype=torch.float64, device=keep.device)
        removals = removed_finals(step, masks, resumer, chunk=self.chunk)
        for indices, _, out in read_together(step, removals, keep):
            for i, key in enumerate(SUMS):
                sums[indices, i] = out[key]
        greedy = torch.zeros(L, len(SUMS), dtype=torch.float64, device=keep.device)
        greedy[candidates] = sums[1:]
        state.add(f"bi_curve{k}", sums[0])
        state.add(f"greedy{k}", greedy)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if "grid" not in state:
            raise ValueError("no position was measured; use longer sequences or more data")
        return present(PruneNumbers.from_state(state, info, self), self)


#: The longest range ``max_n=0`` removes unless ``full`` (deeper models: ranges of 1..4 blocks).
DEFAULT_LONGEST = 4


def _total(costs: list[SurgeryCost]) -> SurgeryCost:
    total = costs[0]
    for cost in costs[1:]:
        total = total + cost
    return total


def plan_line(options: Prune, info: ModelInfo) -> str:
    """What a prune run will cost per sequence: removals and block evaluations per token (in
    forward passes), the default plan beside the full grid."""
    L = info.n_layers
    costs = options.costs(info)
    total = _total(costs)
    up = "up to " if total.bound else ""
    line = (
        f"prune on {L} blocks: ranges of 1..{options.longest(info)} blocks, {len(costs)} "
        f"pass(es); per sequence {total.interventions:,} removals (each a readout of every "
        f"position), {up}{total.blocks:,} block evaluations a token "
        f"(≈ {total.forwards(L):,.0f} forward passes)"
    )
    if (
        not options.max_n
        and not options.full
        and Prune(full=True).longest(info) > (options.longest(info))
    ):
        full = _total(options.costs(info, full=True))
        line += (
            f"; the full grid (-O prune.full=true): {len(options.costs(info, full=True))} "
            f"passes, {full.interventions:,} removals, ≈ {full.forwards(L):,.0f} forward passes"
        )
    return line


def time_line(options: Prune, step: Step, seconds: float) -> str:
    """After the first batch: its time, and the whole run's per 1,000 tokens, from the block
    evaluations and readouts each pass adds (a readout of the vocabulary counted as
    ``d_vocab / 12 d_model`` blocks)."""
    info = step.info
    rows, width = step.batch.tokens.shape
    costs = options.costs(info)
    readout = info.d_vocab / (12 * info.d_model)

    def work(cost: SurgeryCost) -> float:
        return cost.blocks + cost.interventions * readout + info.n_layers  # + its clean pass

    per_token = seconds / max(rows * width, 1) * sum(work(c) for c in costs) / work(costs[0])
    return (
        f"prune: the first batch ({rows} sequences of {width}) took {seconds:.1f} s; all "
        f"{len(costs)} pass(es) ≈ {per_token * 1000:,.0f} s per 1,000 tokens (rough)"
    )


def influence_order(bi: torch.Tensor) -> list[int]:
    """Blocks in the order ShortGPT removes them: least block influence first (ties: earlier)."""
    values = bi.tolist()
    return sorted(range(len(values)), key=lambda b: (values[b], b))
