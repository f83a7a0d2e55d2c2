"""The result of a ``prune`` or ``reorder`` run: tables, arrays, figures (with what each source
claimed) and the summary, from :class:`~lensdiv.analyzers.surgery.numbers.PruneNumbers` and
:class:`~lensdiv.analyzers.surgery.numbers.ReorderNumbers`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lensdiv.analyzers.surgery.numbers import METRICS, PruneNumbers, ReorderNumbers
from lensdiv.core.results import Plot, Result, Table

if TYPE_CHECKING:  # the analyzers import this module; their types are only annotations here
    from lensdiv.analyzers.surgery import Prune, Reorder

# Colour-bar labels (short: a long one is cut at the figure's edge); what they mean is in
# _SIGNAL_MEANING, the caption.
_SIGNAL_LABELS = {
    "block_influence": "Σ block influence (1 − cos)",
    "angular_last": "angular distance / π (last token)",
    "angular_all": "angular distance / π (all tokens)",
    "nonlinearity": "Σ (1 − R²)",
}
_SIGNAL_MEANING = {
    "block_influence": "Σ over the range of 1 − cos(h_j, h_{j+1}), ShortGPT's block influence",
    "angular_last": "arccos(cos(h_ℓ, h_{ℓ+n}))/π at the last token, Gromov et al.'s distance",
    "angular_all": "arccos(cos(h_ℓ, h_{ℓ+n}))/π over all tokens",
    "nonlinearity": "Σ over the range of 1 − R², the complement of Razzhigaev et al.'s "
    "linearity score",
}


def present(numbers: PruneNumbers, options: Prune) -> Result:
    """Tables, arrays, plots and summary of a prune run."""
    L, N = numbers.n_layers, numbers.longest
    grid: dict[str, list[Any]] = {"start": [], "n": []}
    for s in range(L):
        for n in range(1, min(N, L - s) + 1):
            grid["start"].append(s)
            grid["n"].append(n)
    cells = list(zip(grid["start"], grid["n"], strict=True))
    for name, (mean, sem) in numbers.effects.items():
        grid[name] = [float(mean[s, n - 1]) for s, n in cells]
        grid[f"{name}_sem"] = [float(sem[s, n - 1]) for s, n in cells]
    if numbers.accuracy is not None:
        grid["accuracy"] = [float(numbers.accuracy[0][s, n - 1]) for s, n in cells]
    for name, values in numbers.signals.items():
        grid[name] = [float(values[s, n - 1]) for s, n in cells]
    picks = numbers.picks("kl")
    pick_cols = {key: [row.get(key, math.nan) for row in picks] for key in picks[0]}
    curve_cols = {"removed": list(range(N + 1)), **numbers.curves}
    kl, dce = numbers.effects["kl"][0], numbers.effects["dce"][0]
    blocks: dict[str, list[Any]] = {
        "block": list(range(L)),
        "kl_remove": kl[:, 0].tolist(),
        "dce_remove": dce[:, 0].tolist(),
        "agree_remove": numbers.effects["agree"][0][:, 0].tolist(),
        "block_influence": numbers.block_influence.tolist(),
    }
    if numbers.linearity_r2 is not None:
        blocks["linearity_r2"] = numbers.linearity_r2.tolist()
    task: dict[str, Any] = {}
    if numbers.accuracy is not None:
        blocks["accuracy_remove"] = numbers.accuracy[0][:, 0].tolist()
        arrays_acc = {"true_accuracy": numbers.accuracy[0].numpy()}
        task = {
            "task": options.task,
            "examples": numbers.examples,
            "clean_accuracy": numbers.accuracy[1],
        }
    else:
        arrays_acc = {}
    tables = {
        "grid": Table(
            "grid", grid, "True effect of removing blocks ℓ..ℓ+n−1, and each signal", keys=2
        ),
        "picks": Table("picks", pick_cols, "Per length n: best start vs each signal's pick (KL)"),
        "curves": Table("curves", curve_cols, "KL to the full output after removing k blocks"),
        "blocks": Table("blocks", blocks, "Removing one block at a time, and its signals"),
    }
    arrays = {f"true_{name}": numbers.effects[name][0].numpy() for name in METRICS}
    arrays.update({f"signal_{name}": grid_.numpy() for name, grid_ in numbers.signals.items()})
    arrays.update(arrays_acc)
    return Result(
        analyzer=options.name,
        summary=_summary(numbers),
        tables=tables,
        arrays=arrays,
        plots=_plots(numbers),
        meta={
            "positions": numbers.positions,
            "longest": N,
            "clean_ce": numbers.clean["ce"],
            "clean_top1": numbers.clean["top1"],
            "greedy_order": numbers.greedy_order,
            "block_runs_per_row": numbers.block_runs_per_row,
            "block_runs_floor_per_row": sum(L - s - n for s, n in cells),
            "resume": numbers.resume,
            "spearman_overall": numbers.overall_spearman("kl"),
            "bos": "intervened on; "
            + ("left out of" if options.exclude_bos else "in")
            + " every statistic",
            **task,
        },
    )


def _summary(numbers: PruneNumbers) -> str:
    L = numbers.n_layers
    kl = numbers.effects["kl"][0][:, 0]
    easiest = int(kl.argmin())
    hardest = int(kl.argmax())
    picks = numbers.picks("kl")
    regrets = {
        name: sum(row.get(f"{name}_regret", 0.0) for row in picks) / len(picks)
        for name in numbers.signals
    }
    best_signal = min(regrets, key=lambda k: regrets[k])
    rho = numbers.overall_spearman("kl")
    return (
        f"Removing one of the {L} blocks moves the output least for block {easiest} "
        f"(KL {float(kl[easiest]):.3g} nats) and most for block {hardest} "
        f"(KL {float(kl[hardest]):.3g}). Of the cheap signals, {best_signal} picks the "
        f"cheapest range best (mean regret {regrets[best_signal]:.3g} nats over n = "
        f"1..{numbers.longest}); rank correlations with the true KL over the grid: "
        + ", ".join(f"{k} {v:.2f}" for k, v in rho.items())
        + f". Full model: CE {numbers.clean['ce']:.3g} nats over {numbers.positions} positions."
        + _task_line(numbers)
    )


def _task_line(numbers: PruneNumbers) -> str:
    """The task accuracy, where the run measured on task examples."""
    if numbers.accuracy is None:
        return ""
    grid, clean = numbers.accuracy
    one = grid[:, 0]
    best = int(torch.nan_to_num(one, nan=-1.0).argmax())
    return (
        f" Task accuracy over {numbers.examples} examples: full model {clean:.0%}; removing "
        f"block {best} alone keeps {float(one[best]):.0%}, the most of any single block."
    )


def _plots(numbers: PruneNumbers) -> tuple[Plot, ...]:
    starts, lengths = numbers.n_layers, numbers.longest
    # columns are n = 1..N, rows the first removed block ℓ = 0..L−1: whole-number cell centres
    extent = (0.5, lengths + 0.5, -0.5, starts - 0.5)
    heat = [
        Plot(
            "heatmap",
            "prune_true_kl",
            "True effect of removing n blocks from ℓ",
            "true_kl",
            xlabel="blocks removed n",
            ylabel="first removed block ℓ",
            clabel="KL (nats, log scale)",
            caption="KL(p_removed ‖ p_out) on a logarithmic scale (removing block 0 costs far "
            "more than the rest). Blank cells: ℓ + n > L. Gromov et al. report that ranges "
            "ending at the last blocks (but not the very last) are the cheapest to remove.",
            extent=extent,
            logc=True,
        )
    ]
    for name in numbers.signals:
        heat.append(
            Plot(
                "heatmap",
                f"prune_signal_{name}",
                f"Cheap signal: {name}",
                f"signal_{name}",
                xlabel="blocks removed n",
                extent=extent,
                ylabel="first removed block ℓ",
                clabel=_SIGNAL_LABELS[name],
                caption=f"{_SIGNAL_MEANING[name]}. "
                "Lower = predicted more removable; compare with the true KL heatmap. "
                "Gromov et al. remove the range of least angular distance, ShortGPT the blocks "
                "of least block influence.",
            )
        )
    curves = tuple(k for k in numbers.curves)
    names = {
        "contiguous_best": "best range of k blocks",
        "greedy": "greedy: the cheapest block, one at a time",
        "block_influence_order": "the k blocks of least influence (ShortGPT)",
    }
    return (
        *heat,
        Plot(
            "line",
            "prune_curves",
            "Pruning curves",
            "curves",
            x="removed",
            y=curves,
            xlabel="blocks removed k",
            ylabel="KL to the full output (nats)",
            labels=tuple(names.get(k, k) for k in curves),
            caption="contiguous_best: the best range of k blocks; block_influence_order: the "
            "k blocks of least influence (ShortGPT's claim: close to the best); greedy: one "
            "block at a time, each the truly cheapest. No healing (fine-tuning) afterwards.",
        ),
        Plot(
            "line",
            "prune_blocks",
            "Removing one block",
            "blocks",
            x="block",
            y=("kl_remove", "block_influence"),
            labels=("true KL of removing it (nats)", "block influence 1 − cos (its signal)"),
            xlabel="removed block ℓ",
            ylabel="KL (nats); 1 − cos",
            caption="The sources claim deeper blocks are more removable than early ones, and "
            "the first and the last block are the most critical.",
        ),
    )


# -- reorder ---------------------------------------------------------------------------------------
def present_reorder(numbers: ReorderNumbers, options: Reorder) -> Result:
    """Tables (every variant; swaps beside removals per block), plot and summary of a reorder
    run."""
    columns: dict[str, list] = {"variant": numbers.names}
    for metric, (mean, sem) in numbers.effects.items():
        columns[metric] = mean.tolist()
        columns[f"{metric}_sem"] = sem.tolist()
    task_meta: dict[str, Any] = {}
    if numbers.accuracy is not None:
        columns["accuracy"] = numbers.accuracy[0].tolist()
        task_meta = {
            "task": options.task,
            "examples": numbers.examples,
            "clean_accuracy": numbers.accuracy[1],
        }
    swaps: dict[str, list[Any]] = {"block": list(range(numbers.n_layers)), **numbers.swaps()}
    swaps = {k: swaps[k] for k in ("block", "kl_swap", "kl_remove", "dce_swap", "dce_remove")}
    a, b = numbers.middle
    return Result(
        analyzer=options.name,
        summary=_reorder_summary(numbers),
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
                labels=("blocks ℓ and ℓ+1 swapped", "block ℓ removed"),
                xlabel="block ℓ",
                ylabel="KL(p ‖ p_out) (nats)",
                caption="kl_swap: blocks ℓ and ℓ+1 exchanged; kl_remove: block ℓ removed. "
                "Lad et al. report that swapping adjacent middle blocks costs little, less "
                "than removing one, and that the first and last blocks are fragile.",
            ),
        ),
        meta={
            "middle": [a, b],
            "clean_ce": numbers.clean_ce,
            "resume": numbers.resume,
            "bos": "intervened on; "
            + ("left out of" if options.exclude_bos else "in")
            + " every statistic",
            **task_meta,
        },
    )


def _reorder_summary(numbers: ReorderNumbers) -> str:
    a, b = numbers.middle
    L = numbers.n_layers
    gentlest, worst = numbers.gentlest_and_worst()
    summary = (
        f"On the middle range of blocks {a}..{b - 1}, {gentlest} moves the output least "
        f"(KL {numbers.of('kl', gentlest):.3g} nats) and {worst} most "
        f"(KL {numbers.of('kl', worst):.3g}). Swapping blocks ℓ, ℓ+1 costs less than removing "
        f"block ℓ for {numbers.cheaper_swaps()} of {L - 1} blocks. Full model: CE "
        f"{numbers.clean_ce:.3g} nats."
    )
    kept = numbers.most_accurate()
    if kept is not None and numbers.accuracy is not None:
        share = float(numbers.accuracy[0][numbers.names.index(kept)])
        summary += (
            f" Task accuracy over {numbers.examples} examples: full model "
            f"{numbers.accuracy[1]:.0%}; {kept} keeps {share:.0%}, the most of the middle-range "
            "variants."
        )
    return summary
