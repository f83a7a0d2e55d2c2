"""``skip`` — current and future effects of skipping each block (docs/science.md A3).

Skipping block ``s`` sets ``h_{s+1} := h_s`` (part ``block``) or zeroes only its attention or MLP
write (parts ``attn``, ``mlp``) at the skipped positions. For every later layer ``l`` the effect is

    E[s, l] = max_{t' measured} ||Δ_l(t') − Δ̃_l(t')|| / max(||Δ_l(t')||, 1e-6)
    O[s]    = max_{t' measured} ||softmax z(t') − softmax z̃(t')||₂        (0 ≤ O ≤ √2)

Modes:
- ``future``: skip at positions ``1 ≤ τ < t``, measure at ``t' ≥ t``, for ``splits`` random split
  points ``t ∈ range(stride, T − 4, stride)`` per prompt (the source's 4 points, ``range(8, T-4, 8)``);
  max over split points, then max or mean over prompts (both are kept).
- ``current``: skip at every position ``≥ 1``, measure at every position. With ``skip_bos`` the
  first position is skipped too: removing the block everywhere, which ``prune`` measures (its
  ``n = 1`` removal is this mode's ``output_kl``, ``exclude_bos`` alike).
- ``local``: the future split, but nothing downstream is recomputed at the skipped positions: the
  direct residual write of ``s`` is removed from every later residual there, so the effect reaches
  ``t' ≥ t`` only through attention.

Beside ``O``, the mean over measured positions of ``KL(p̃ ‖ p)`` (``lens``'s and ``prune``'s
direction) per skipped block.

Cost: blocks ``0..s`` are unchanged by skipping ``s``, so each intervened pass resumes from the
clean residual and runs only the blocks after ``s`` (:mod:`lensdiv.ops.skipping`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.analyzers.positions import FirstPosition
from lensdiv.core.analyzer import DataFacts, ModelInfo, Step
from lensdiv.core.errors import OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.skipping import Mode, Part, later_effect, skip_effects, split_intervals


@dataclass(frozen=True)
class LayerSkip(FirstPosition):
    """Effects of skipping each block on later layers' updates and on the output.

    Option ``exclude_bos``: see :class:`~lensdiv.analyzers.positions.FirstPosition` (it matters
    in ``current`` mode only: the others measure after a split point ``t ≥ stride``).

    Args:
        mode: ``future`` (skip before a split point, measure after it), ``current`` (skip and
            measure everywhere) or ``local`` (future split, direct write removed, no recompute).
        part: Skip the whole ``block``, or only its ``attn`` or ``mlp`` write.
        skip_bos: Skip at the first (BOS) position too (the source leaves it untouched); with
            ``mode=current`` the block is then removed at every position, as ``prune`` does.
        splits: Split points drawn per prompt (future/local).
        stride: Split points are drawn from ``range(stride, T - 4, stride)``.
        seed: Seed of the split-point draw.
        aggregate: ``max`` or ``mean`` over prompts for the headline table and plots (both are
            always computed and saved).
        chunk: Intervened sequences per forward pass (``0``: the batch's row count).
        resume: Resume each intervened pass from the cached clean residual (``False``: re-run
            every block, the exact but ~2× slower reference).
    """

    name = "skip"
    aliases = ("layer-skip", "skipping")
    description = "Layer skipping: effect of skipping each block on later layers and the output"
    depth_profiles = ("skip.later_mean", "skip.output_mean")
    extra_forwards = True

    mode: Mode = "future"
    part: Part = "block"
    skip_bos: bool = False
    splits: int = 4
    stride: int = 8
    seed: int = 0
    aggregate: Literal["max", "mean"] = "max"
    chunk: int = 0
    resume: bool = True

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise ValueError(f"splits must be at least 1, got {self.splits}")
        if self.stride < 1:
            raise ValueError(f"stride must be at least 1, got {self.stride}")
        if self.chunk < 0:
            raise ValueError(f"chunk must be 0 (auto) or positive, got {self.chunk}")

    def check_data(self, data: DataFacts, info: ModelInfo) -> None:
        """A split point needs a row longer than ``stride + 4`` tokens (``future``, ``local``)."""
        need = self.stride + 5
        if self.mode != "current" and data.longest < need:
            raise OptionError(
                f"skip.stride={self.stride} needs rows of at least {need} tokens for a split "
                f"point, but {data.limit}",
                hint=(
                    f"use -O skip.stride={data.longest - 5} or less, "
                    if data.longest > 5
                    else "use "
                )
                + "longer rows, or -O skip.mode=current",
            )

    def hooks(self, info: ModelInfo) -> list[str]:
        names = [info.resid(layer) for layer in range(info.n_layers + 1)]
        if self.mode == "local" and self.part != "block":
            names += [f"blocks.{layer}.hook_{self.part}_out" for layer in range(info.n_layers)]
        return names

    def update(self, state: Stats, step: Step) -> None:
        resumer = resumer_for(step, fast=self.resume)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step.batch.index)
        intervals = split_intervals(
            step.batch.mask,
            mode=self.mode,
            splits=self.splits,
            stride=self.stride,
            generator=generator,
            skip_bos=self.skip_bos,
        )
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        intervals = replace(intervals, measure=intervals.measure & keep[intervals.rows])
        state.add("rows_too_short", step.batch.tokens.shape[0] - intervals.rows.unique().numel())
        if intervals.rows.numel() == 0:
            return
        runs_before = resumer.blocks_run
        kl = torch.zeros(
            intervals.rows.numel(), step.info.n_layers, dtype=torch.float64, device=keep.device
        )
        effect, output = skip_effects(
            step,
            intervals,
            part=self.part,
            local=self.mode == "local",
            resumer=resumer,
            chunk=self.chunk,
            kl=kl,
        )
        state.fix("resume", {"mode": resumer.mode, "note": resumer.reason})
        state.add("block_runs", resumer.blocks_run - runs_before)
        # Max over the split points of each prompt, then max and mean over prompts.
        prompts, inverse = intervals.rows.unique(return_inverse=True)
        per_e = torch.stack([effect[inverse == i].amax(0) for i in range(len(prompts))])
        per_o = torch.stack([output[inverse == i].amax(0) for i in range(len(prompts))])
        state.add("prompts", len(prompts))
        state.add("pairs", intervals.rows.numel())
        state.add("E_sum", per_e.sum(0))
        state.max("E_max", per_e.amax(0))
        state.add("O_sum", per_o.sum(0))
        state.max("O_max", per_o.amax(0))
        state.add("KL_sum", kl.sum(0))
        state.add("measured", int(intervals.measure.sum()))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if "prompts" not in state:
            raise ValueError(
                f"no prompt was long enough for a split point (need more than {self.stride + 4} "
                "tokens); use longer sequences or a smaller stride"
            )
        return present(SkipEffects.from_state(state), self)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SkipEffects:
    """The skip sweep of a run, aggregated over prompts: no tables, no prose.

    Args:
        effect: ``E[s, l]`` by aggregate over prompts (``max``, ``mean``).
        output: ``O[s]`` by aggregate over prompts.
        kl: Mean ``KL(p̃ ‖ p)`` per skipped block over the measured positions (``None`` for a
            state saved before it was measured).
        prompts: Prompts with at least one split point.
        split_points: (prompt, split point) pairs measured.
        rows_too_short: Rows without a split point.
        resume: The resumer's mode (``resume`` or ``rerun``), ``None`` if unknown.
        resume_note: Why the resumer chose that mode.
        block_runs_per_prompt: Blocks run per split point (``None`` if not counted).
    """

    effect: Mapping[str, Float[Tensor, "skipped layer"]]
    output: Mapping[str, Float[Tensor, " skipped"]]
    kl: Float[Tensor, " skipped"] | None
    prompts: int
    split_points: int
    rows_too_short: int
    resume: str | None
    resume_note: str
    block_runs_per_prompt: float | None

    @classmethod
    def from_state(cls, state: Stats) -> SkipEffects:
        """The sweep from the merged state (at least one prompt measured)."""
        n = float(state["prompts"])
        resume = state.get("resume", {})
        return cls(
            effect={"max": state["E_max"], "mean": state["E_sum"] / n},
            output={"max": state["O_max"], "mean": state["O_sum"] / n},
            kl=(
                state["KL_sum"] / max(float(state["measured"]), 1.0) if "KL_sum" in state else None
            ),
            prompts=int(n),
            split_points=int(state["pairs"]),
            rows_too_short=int(state.get("rows_too_short", 0)),
            resume=resume.get("mode"),
            resume_note=resume.get("note", ""),
            block_runs_per_prompt=(
                float(state["block_runs"]) / max(float(state["pairs"]), 1.0)
                if "block_runs" in state
                else None
            ),
        )

    def later(self, aggregate: str) -> Float[Tensor, " skipped"]:
        """``e_s``: the mean effect of skipping ``s`` on the later layers' updates."""
        return later_effect(self.effect[aggregate])

    def halves(self, aggregate: str) -> tuple[float, float]:
        """Mean ``e_s`` over the blocks of the first half and of the second half; the last
        block has no later layers and is left out of the second (NaN if nothing is left)."""
        later = self.later(aggregate)
        L = later.shape[0]
        half = max(1, L // 2)
        rest = later[half : L - 1] if L > 2 else later[half:]
        return float(later[:half].mean()), float(rest.mean()) if len(rest) else math.nan


# -- the result ----------------------------------------------------------------------------------
def present(effects: SkipEffects, options: LayerSkip) -> Result:
    """Tables, arrays, plots, summary and metadata of a skip sweep."""
    agg = options.aggregate
    layers = list(range(effects.effect[agg].shape[0]))
    columns: dict[str, list] = {"skipped": layers}
    for name in ("max", "mean"):
        columns[f"output_{name}"] = effects.output[name].tolist()
        columns[f"later_{name}"] = effects.later(name).tolist()
    if effects.kl is not None:
        columns["output_kl"] = effects.kl.tolist()
    main = Table("skip", columns, "Effect of skipping each block (later layers, output)")
    head = effects.effect[agg]
    grid: dict[str, list] = {"skipped": layers}
    for layer in layers:
        grid[f"l{layer}"] = head[:, layer].tolist()
    effect_table = Table("effect", grid, f"E[s, l]: relative change of layer l's update ({agg})")
    first, second = effects.halves(agg)
    out = effects.output[agg]
    summary = (
        f"{options.mode.capitalize()} effect of skipping each {options.part} ({agg} over "
        f"{effects.prompts} prompts): skipping a block of the first half changes the updates of "
        f"later layers by {first:.3g} on average (relative), one of the second half by "
        f"{second:.3g} (last block excluded: no later layers); the output moves most when block "
        f"{int(out.argmax())} is skipped (L2 {float(out.max()):.3g}, at most √2)."
    )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables={"skip": main, "effect": effect_table},
        arrays={
            "effect_max": effects.effect["max"].cpu().numpy(),
            "effect_mean": effects.effect["mean"].cpu().numpy(),
            "output_max": effects.output["max"].cpu().numpy(),
            "output_mean": effects.output["mean"].cpu().numpy(),
            **({} if effects.kl is None else {"output_kl": effects.kl.cpu().numpy()}),
        },
        plots=_plots(agg),
        meta={
            "prompts": effects.prompts,
            "split_points": effects.split_points,
            "rows_too_short": effects.rows_too_short,
            "resume": effects.resume,
            "resume_note": effects.resume_note,
            "block_runs_per_prompt": effects.block_runs_per_prompt,
            "output_bound": math.sqrt(2),
            "bos": ("skipped" if options.skip_bos else "never skipped")
            + "; "
            + ("left out of" if options.exclude_bos else "in")
            + " every statistic",
        },
    )


def _plots(aggregate: str) -> tuple[Plot, ...]:
    """The heatmap of ``E[s, l]`` (for ``aggregate``) and the two per-block curves."""
    return (
        Plot(
            "heatmap",
            "skip_effect",
            f"Effect of skipping block s on layer l ({aggregate} over prompts)",
            f"effect_{aggregate}",
            xlabel="layer l (whose update Δ_l is measured)",
            ylabel="skipped block s",
            clabel="E[s, l] (relative change of Δ_l, log scale)",
            mask="col<=row",
            logc=True,
            caption="E[s, l] = ‖Δ_l − Δ̃_l‖ / ‖Δ_l‖. Hatched cells (l ≤ s) are undefined: "
            "skipping block s cannot change the updates of blocks before it, and its own "
            "is the one removed.",
        ),
        Plot(
            "line",
            "skip_output",
            "Output effect ||p - p~||₂ of skipping each block",
            "skip",
            x="skipped",
            y=("output_max", "output_mean"),
            xlabel="skipped block s",
            ylabel="O[s] = ‖p − p̃‖₂ (0 to √2)",
            ylim=(0.0, 2**0.5),
            labels=("max over prompts", "mean over prompts"),
            caption="L2 distance between the output distributions with and without "
            "block s; max and mean over prompts.",
        ),
        Plot(
            "line",
            "skip_later",
            "Mean effect on later layers' updates",
            "skip",
            x="skipped",
            y=("later_max", "later_mean"),
            xlabel="skipped block s",
            labels=("max over prompts", "mean over prompts"),
            ylabel="mean over l > s of E[s, l] (relative)",
            caption="How much skipping block s changes the updates of the blocks after "
            "it; the last block has none.",
        ),
    )
