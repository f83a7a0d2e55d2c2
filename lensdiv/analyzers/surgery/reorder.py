"""``reorder`` — run blocks in another order (docs/science.md E2).

Variants, each measured by the same output metrics as ``prune`` (KL to the full output in the
``lens`` direction, next-token CE and its change, top-1 agreement and accuracy):

- ``swap{ℓ}``: blocks ``ℓ`` and ``ℓ+1`` exchanged, for every ``ℓ`` (Lad et al. 2024);
- ``remove{ℓ}``: block ``ℓ`` removed, beside each swap for comparison;
- on the middle range ``[a, b)`` (``start``, ``stop``; default the middle half): ``reverse``,
  ``shuffle{seed}`` (a random permutation per seed), ``repeat_centre`` (every block of the range
  replaced by a copy of its centre block), ``parallel`` (all blocks of the range read ``h_a``
  and their mean update is added: ``h_b = h_a + mean_j (B_j(h_a) − h_a)``) (Sun et al. 2024);
- ``loop{k}``: the centre block run ``k`` times in its place (Sun et al.).

Every variant runs on every row at every position (BOS included); the blocks before the
intervened range are not run again (each block is applied by resuming at it). With ``task``,
each variant's accuracy on task examples, as ``prune`` measures each removal's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lensdiv.analyzers.surgery.base import (
    Surgery,
    add_answers,
    answer_positions,
    count_answers,
)
from lensdiv.analyzers.surgery.numbers import ReorderNumbers
from lensdiv.analyzers.surgery.present import present_reorder
from lensdiv.core.analyzer import ModelInfo, Step
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.surgery import SUMS, Program, output_sums, program_final


@dataclass(frozen=True)
class Reorder(Surgery):
    """Swap, reverse, shuffle, repeat, loop or parallelise blocks, and measure the output.

    Options ``exclude_bos``, ``task`` and ``per_grade``: see
    :class:`~lensdiv.analyzers.surgery.base.Surgery` (with ``task``, each variant's accuracy).

    Args:
        start: First block of the middle range (``-1``: a quarter of the depth).
        stop: One past its last block (``-1``: three quarters of the depth).
        shuffles: Random permutations of the middle range (seeds ``0..shuffles−1``).
        loops: How many times the centre block is looped, one variant per value.
    """

    name = "reorder"
    aliases = ("reorder-blocks", "painters")
    description = "Depth surgery: swap, reverse, shuffle, repeat, loop or parallelise blocks"
    depth_profiles = ("swaps.kl_swap", "swaps.kl_remove")

    start: int = -1
    stop: int = -1
    shuffles: int = 3
    loops: tuple[int, ...] = (2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shuffles < 0:
            raise ValueError(f"shuffles must be 0 or more, got {self.shuffles}")
        if any(k < 1 for k in self.loops):
            raise ValueError(f"every loop count must be at least 1, got {self.loops}")

    def middle(self, info: ModelInfo) -> tuple[int, int]:
        """The middle range ``[a, b)`` on this model."""
        L = info.n_layers
        a = L // 4 if self.start < 0 else self.start
        b = L - L // 4 if self.stop < 0 else self.stop
        if not 0 <= a < b <= L:
            raise ValueError(f"reorder range {a}..{b} is not within 0..{L} (start < stop)")
        return a, b

    def variants(self, info: ModelInfo) -> list[tuple[str, Program]]:
        """Every variant's name and program, in a fixed order."""
        L = info.n_layers
        a, b = self.middle(info)
        c = (a + b) // 2
        out = []
        for s in range(L - 1):
            out.append((f"swap{s}", Program(s, s + 2, (s + 1, s))))
            out.append((f"remove{s}", Program(s, s + 1, ())))
        out.append((f"remove{L - 1}", Program(L - 1, L, ())))
        out.append(("reverse", Program(a, b, tuple(range(b - 1, a - 1, -1)))))
        for seed in range(self.shuffles):
            perm = torch.randperm(b - a, generator=torch.Generator().manual_seed(seed)) + a
            out.append((f"shuffle{seed}", Program(a, b, tuple(perm.tolist()))))
        out.append(("repeat_centre", Program(a, b, (c,) * (b - a))))
        out.append(("parallel", Program(a, b, tuple(range(a, b)), mode="parallel")))
        for k in self.loops:
            out.append((f"loop{k}", Program(c, c + 1, (c,) * k)))
        return out

    def interventions(self, info: ModelInfo, index: int) -> int:
        """Every variant, on every sequence."""
        return len(self.variants(info))

    def measure(self, state: Stats, step: Step, keep: torch.Tensor) -> None:
        resumer = resumer_for(step)
        variants = self.variants(step.info)
        finals = [program_final(step, program, resumer) for _, program in variants]
        sums = output_sums(step, finals, keep)
        state.add("sums", torch.stack([sums[key] for key in SUMS], 1))
        clean = output_sums(step, [step.resid(step.info.n_layers)], keep)
        state.add("clean", torch.stack([clean[key][0] for key in SUMS]))
        measure = answer_positions(step.batch)
        if measure is not None:
            right = torch.tensor(count_answers(resumer, step, finals, measure))
            add_answers(state, step, resumer, measure, right.double())
        if resumer.mode is not None:
            state.include("resume", resumer.mode)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if "sums" not in state:
            raise ValueError("no position was measured; use longer sequences or more data")
        return present_reorder(ReorderNumbers.from_state(state, info, self), self)
