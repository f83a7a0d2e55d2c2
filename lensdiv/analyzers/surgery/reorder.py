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
from typing import Any

import torch

from lensdiv.analyzers.surgery.base import (
    Surgery,
    accuracy,
    add_answers,
    answer_positions,
    count_answers,
)
from lensdiv.analyzers.surgery.numbers import summarize
from lensdiv.core.analyzer import ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
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
        names = [name for name, _ in self.variants(info)]
        stats = summarize(state["sums"].cpu().T)
        clean = summarize(state["clean"].cpu()[:, None])
        return _present(self, info, names, stats, clean, sorted(state.get("resume", ())), state)


def _present(
    options: Reorder,
    info: ModelInfo,
    names: list[str],
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]],
    clean: dict[str, tuple[torch.Tensor, torch.Tensor]],
    resume: list[str],
    state: Stats,
) -> Result:
    """Tables (every variant; swaps beside removals per block), plots and summary."""
    L = info.n_layers
    a, b = options.middle(info)
    at = {name: i for i, name in enumerate(names)}
    columns: dict[str, list] = {"variant": names}
    for metric, (mean, sem) in stats.items():
        columns[metric] = mean.tolist()
        columns[f"{metric}_sem"] = sem.tolist()
    task = accuracy(state)
    task_meta: dict[str, Any] = {}
    if task is not None:
        columns["accuracy"] = task[0].tolist()
        task_meta = {
            "task": options.task,
            "examples": int(float(state["answers_n"])),
            "clean_accuracy": task[1],
        }
    kl = stats["kl"][0]
    dce = stats["dce"][0]
    nan = float("nan")  # the last block has no block after it to swap with
    swaps: dict[str, list[Any]] = {
        "block": list(range(L)),
        "kl_swap": [float(kl[at[f"swap{s}"]]) if s < L - 1 else nan for s in range(L)],
        "kl_remove": [float(kl[at[f"remove{s}"]]) for s in range(L)],
        "dce_swap": [float(dce[at[f"swap{s}"]]) if s < L - 1 else nan for s in range(L)],
        "dce_remove": [float(dce[at[f"remove{s}"]]) for s in range(L)],
    }
    middle = [n for n in names if not n.startswith(("swap", "remove"))]
    worst = max(middle, key=lambda n: float(kl[at[n]]))
    gentlest = min(middle, key=lambda n: float(kl[at[n]]))
    cheaper = sum(
        s < r for s, r in zip(swaps["kl_swap"][:-1], swaps["kl_remove"][:-1], strict=True)
    )
    summary = (
        f"On the middle range of blocks {a}..{b - 1}, {gentlest} moves the output least "
        f"(KL {float(kl[at[gentlest]]):.3g} nats) and {worst} most "
        f"(KL {float(kl[at[worst]]):.3g}). Swapping blocks ℓ, ℓ+1 costs less than removing "
        f"block ℓ for {cheaper} of {L - 1} blocks. Full model: CE "
        f"{float(clean['ce'][0][0]):.3g} nats."
    )
    if task is not None:
        kept = max(middle, key=lambda n: float(task[0][at[n]]))
        summary += (
            f" Task accuracy over {task_meta['examples']} examples: full model {task[1]:.0%}; "
            f"{kept} keeps {float(task[0][at[kept]]):.0%}, the most of the middle-range variants."
        )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables={
            "variants": Table("variants", columns, "Output effect of each variant (mean, sem)"),
            "swaps": Table("swaps", swaps, "Swapping blocks ℓ, ℓ+1 vs removing block ℓ"),
        },
        plots=(
            Plot(
                "line",
                "reorder_swaps",
                "Swapping adjacent blocks vs removing one",
                "swaps",
                x="block",
                y=("kl_swap", "kl_remove"),
                xlabel="block ℓ",
                ylabel="KL(p ‖ p_out) (nats)",
                caption="kl_swap: blocks ℓ and ℓ+1 exchanged; kl_remove: block ℓ removed. "
                "Lad et al. report that swapping adjacent middle blocks costs little, less "
                "than removing one, and that the first and last blocks are fragile.",
            ),
        ),
        meta={
            "middle": [a, b],
            "clean_ce": float(clean["ce"][0][0]),
            "resume": resume,
            "bos": "intervened on; "
            + ("left out of" if options.exclude_bos else "in")
            + " every statistic",
            **task_meta,
        },
    )
