"""``massive`` — activation outliers by depth: massive activations (docs/science.md F2).

For every residual state ``h_ℓ`` (``0 ≤ ℓ ≤ L``) and every attention and MLP output (blocks
``0..L−1``), over the real positions: the largest ``|x|``, the median ``|x|`` (from a mergeable
log histogram, to a stated precision: :mod:`lensdiv.ops.outliers`) and their ratio. An entry is
*massive* when ``|x| > absolute`` and ``|x| > ratio ×`` the median ``|x|`` of its site in its batch
(the median of that batch's real positions from their log histogram, within the histogram's
precision: a per-batch threshold is what makes the count mergeable without a second pass); per site the massive entries are counted by dimension, by
position (0 or later) and, over the residual states, by token. They *appear* at the first
residual state that holds any and *vanish* at the first later one that holds none; the block
before the appearance says which sublayer wrote them (the larger ``|x|`` in those dimensions).

The truth (``truth``), Sun et al.'s test that they act as biases: in each batch, at the first
residual state holding massive entries, set them to zero, and separately to their mean, resume
the pass from there and compare the output with the clean one (``KL(p_edited ‖ p_out)``, the
change of the next-token cross-entropy, top-1 agreement) at every real position. The mean is
taken over the whole data, per residual state and dimension (Sun et al. average over many
inputs): a first pass sums the massive entries, the truth runs in a second pass. A mean over
one batch would be each entry itself where a batch holds one row or one carrier (a shared BOS),
making the edit a no-op by construction.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.attention import final_with
from lensdiv.ops.outliers import histogram_median, massive_entries
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.surgery import output_sums

KINDS = ("resid", "attn", "mlp")
EDITS = ("zero", "mean")


@dataclass(frozen=True)
class Massive(Analyzer):
    """Massive activations per residual state and sublayer output, and what removing them does.

    Args:
        absolute: An entry is massive only when ``|x|`` exceeds this (Sun et al.: 100).
        ratio: ... and exceeds this many times the median ``|x|`` of its site (Sun et al.: 1000).
        bins_per_decade: Resolution of the median's log histogram: the median is within a factor
            ``10^(1/(2·bins_per_decade))`` of the exact one (1.16 % at 100).
        truth: Set the massive entries to zero and to their mean where they appear, and measure
            the output (two resumed passes per batch).
        top: Rows of the tables of dimensions and tokens.
    """

    name = "massive"
    aliases = ("massive-activations",)
    description = "Massive activations per layer: max/median |x|, where they appear, their removal"
    depth_profiles = ("massive.log10_ratio", "massive.massive_share")
    extra_forwards = True

    absolute: float = 100.0
    ratio: float = 1000.0
    bins_per_decade: int = 100
    truth: bool = True
    top: int = 8

    def __post_init__(self) -> None:
        if self.absolute < 0 or self.ratio < 0:
            raise ValueError("absolute and ratio must be 0 or more")
        if not 1 <= self.bins_per_decade <= 10_000:
            raise ValueError(f"bins_per_decade must be 1..10000, got {self.bins_per_decade}")
        if self.top < 1:
            raise ValueError(f"top must be at least 1, got {self.top}")

    def sites(self, info: ModelInfo) -> dict[str, list[str]]:
        """Hook names by kind: residual states ``h_0..h_L``, then the blocks' outputs."""
        L = info.n_layers
        return {
            "resid": [info.resid(layer) for layer in range(L + 1)],
            "attn": [f"blocks.{layer}.hook_attn_out" for layer in range(L)],
            "mlp": [f"blocks.{layer}.hook_mlp_out" for layer in range(L)],
        }

    def hooks(self, info: ModelInfo) -> list[str]:
        return [name for names in self.sites(info).values() for name in names]

    def n_passes(self, info: ModelInfo) -> int:
        """Statistics and the data's means of the massive entries, then the truth."""
        return 2 if self.truth else 1

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        """The mean of the massive entries per residual state and dimension, over the data."""
        sums, counts = state.get("mass_sum"), state.get("mass_count")
        if sums is not None and counts is not None:
            state.fix("mass_mean", sums / counts.clamp_min(1))

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.mask
        if not keep.any():
            return
        if step.pass_index == 1:
            self._truth(state, step, self._found(step))
            return
        device = keep.device
        state.add("n", float(keep.sum()))
        found: list[Tensor] = []  # massive entries of each residual state
        carrier = torch.zeros_like(keep)  # positions with a massive entry in some state
        for kind, names in self.sites(step.info).items():
            per: dict[str, list[Tensor]] = {"hist": [], "count": [], "first": [], "max": []}
            for name in names:
                x = step.cache[name].to(device)
                massive, hist, _, _ = massive_entries(
                    x, keep, self.absolute, self.ratio, self.bins_per_decade
                )
                per["hist"].append(hist)
                per["count"].append(massive.sum((0, 1)).double())
                per["first"].append(massive[:, 0].sum().double())
                per["max"].append(x.abs()[keep].amax(0).double())
                if kind == "resid":
                    found.append(massive)
                    carrier |= massive.any(-1)
            for key in ("hist", "count", "first"):
                state.add(f"{key}_{kind}", torch.stack(per[key]))
            state.max(f"max_{kind}", torch.stack(per["max"]))
        self._tokens(state, step, carrier)
        if self.truth:  # the data's sums of the massive entries, for pass 1's mean edit
            d = step.info.d_model
            sums = state.zeros("mass_sum", (len(found), d), device)
            counts = state.zeros("mass_count", (len(found), d), device)
            for layer, massive in enumerate(found):
                if massive.any():
                    h = step.cache[self.sites(step.info)["resid"][layer]].to(device).double()
                    sums[layer] += (h * massive).sum((0, 1))
                    counts[layer] += massive.sum((0, 1)).double()

    def _found(self, step: Step) -> Iterator[Tensor]:
        """The massive entries of each residual state of this batch (as pass 0 found them),
        lazily: the edit needs only the first state that has any."""
        keep = step.batch.mask
        for name in self.sites(step.info)["resid"]:
            x = step.cache[name].to(keep.device)
            yield massive_entries(x, keep, self.absolute, self.ratio, self.bins_per_decade)[0]

    def _tokens(self, state: Stats, step: Step, carrier: Tensor) -> None:
        """Tokens at positions that carry a massive entry in some residual state."""
        ids = step.batch.tokens[carrier]
        V = step.info.d_vocab
        state.add("tok_massive", torch.bincount(ids, minlength=V)[:V].double())
        tokenizer = getattr(step.model, "tokenizer", None)
        for token in ids.unique().tolist():
            text = tokenizer.decode([token]) if tokenizer is not None else ""
            state.include("token_text", json.dumps([token, text]))

    def _truth(self, state: Stats, step: Step, found: Iterable[Tensor]) -> None:
        """At the first residual state of this batch with massive entries: set them to zero, and
        to the data's mean of that state and dimension (pass 0); resume; compare the outputs."""
        first = next(((layer, m) for layer, m in enumerate(found) if m.any()), None)
        L = step.info.n_layers
        if first is None:
            state.add("truth_none", 1.0)
            return
        at, massive = first
        tokens = step.batch.tokens
        h = step.resid(at).to(tokens.device)
        mean = state["mass_mean"][at].to(h.device)
        edited = {
            "zero": torch.where(massive, torch.zeros_like(h), h),
            "mean": torch.where(massive, mean.to(h.dtype)[None, None], h),
        }
        resumer = resumer_for(step)
        finals = [final_with(resumer, tokens, at, edited[e]) for e in EDITS]
        for key, value in output_sums(step, finals, step.batch.mask).items():
            state.add(f"truth_{key}", value)
        state.zeros("truth_layer", (L + 1,), tokens.device)[at] += 1.0

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if float(state.get("n", 0.0)) == 0:
            raise ValueError("no real position was seen")
        numbers = MassiveNumbers.from_state(state, self)
        return present(numbers, self, info)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Site:
    """One kind of site (residual states, attention or MLP outputs) over depth.

    Args:
        max_abs: Largest ``|x|`` per site.
        median: Median ``|x|`` per site (log histogram, see :mod:`lensdiv.ops.outliers`).
        counts: Massive entries per site and dimension.
        first: Massive entries at position 0 per site.
        dim_max: Largest ``|x|`` per site and dimension.
    """

    max_abs: np.ndarray
    median: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    dim_max: np.ndarray

    @property
    def ratio(self) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return self.max_abs / self.median


@dataclass(frozen=True)
class MassiveNumbers:
    """The outliers of a run: no tables, no prose.

    Args:
        sites: By kind (``resid``, ``attn``, ``mlp``).
        tokens: Positions read.
        appear: First residual state with massive entries (``None``: none).
        vanish: First later residual state without any (``None``: they last to the end).
        writer: ``attn`` or ``mlp``: the sublayer of block ``appear − 1`` with the larger
            ``|x|`` in the dimensions that are massive at ``appear`` (``None`` at ``h_0``).
        dims: The massive dimensions at ``appear``, most entries first.
        carriers: ``(token, text, positions)`` of the tokens carrying massive entries.
        truth: ``{zero, mean}`` → ``{kl, dce, agree}`` means, when measured.
        truth_layers: Batches intervened at each residual state.
    """

    sites: dict[str, Site]
    tokens: int
    appear: int | None
    vanish: int | None
    writer: str | None
    dims: list[int]
    carriers: list[tuple[int, str | None, int]]
    truth: dict[str, dict[str, float]] | None
    truth_layers: np.ndarray | None

    @classmethod
    def from_state(cls, state: Stats, options: Massive) -> MassiveNumbers:
        sites = {}
        for kind in KINDS:
            hist = state[f"hist_{kind}"]
            sites[kind] = Site(
                max_abs=state[f"max_{kind}"].amax(1).cpu().numpy(),
                median=np.array(
                    [histogram_median(row, options.bins_per_decade) for row in hist.cpu()]
                ),
                counts=state[f"count_{kind}"].cpu().numpy(),
                first=state[f"first_{kind}"].cpu().numpy(),
                dim_max=state[f"max_{kind}"].cpu().numpy(),
            )
        resid = sites["resid"].counts.sum(1)
        appear = next((i for i, c in enumerate(resid) if c > 0), None)
        vanish = None
        if appear is not None:
            vanish = next((i for i in range(appear, len(resid)) if resid[i] == 0), None)
        dims, writer = [], None
        if appear is not None:
            at = sites["resid"].counts[appear]
            dims = [int(j) for j in np.argsort(-at, kind="stable") if at[j] > 0]
            if appear > 0:
                block = appear - 1
                attn = sites["attn"].dim_max[block, dims].max()
                mlp = sites["mlp"].dim_max[block, dims].max()
                writer = "attn" if attn > mlp else "mlp"
        return cls(
            sites=sites,
            tokens=int(float(state["n"])),
            appear=appear,
            vanish=vanish,
            writer=writer,
            dims=dims,
            carriers=_carriers(state, options.top),
            truth=_truth(state),
            truth_layers=(state["truth_layer"].cpu().numpy() if "truth_layer" in state else None),
        )


def _carriers(state: Stats, top: int) -> list[tuple[int, str | None, int]]:
    counts = state["tok_massive"].cpu().numpy()
    texts = dict(json.loads(item) for item in state.get("token_text", frozenset()))
    order = [int(i) for i in np.argsort(-counts, kind="stable")[:top] if counts[i] > 0]
    return [(i, texts.get(i), int(counts[i])) for i in order]


def _truth(state: Stats) -> dict[str, dict[str, float]] | None:
    if "truth_n" not in state:
        return None
    sums = {
        key[len("truth_") :]: state[key].cpu().numpy()
        for key in state.names()
        if key.startswith("truth_") and key not in ("truth_layer", "truth_none")
    }
    out = {}
    for i, edit in enumerate(EDITS):
        n, n_target = float(sums["n"][i]), float(sums["n_target"][i])
        out[edit] = {
            "kl": float(sums["kl"][i]) / n,
            "dce": float(sums["dce"][i]) / n_target if n_target else math.nan,
            "agree": float(sums["agree"][i]) / n,
        }
    return out


# -- the result ----------------------------------------------------------------------------------
def present(numbers: MassiveNumbers, options: Massive, info: ModelInfo) -> Result:
    """Tables, arrays, plots and summary of a massive run."""
    resid = numbers.sites["resid"]
    per_token = resid.counts.sum(1) / numbers.tokens
    states = Table(
        "massive",
        {
            "layer": list(range(len(resid.max_abs))),
            "max_abs": resid.max_abs,
            "median": resid.median,
            "log10_ratio": np.log10(resid.ratio),
            "massive": resid.counts.sum(1),
            "massive_share": per_token,
            "dims": (resid.counts > 0).sum(1),
            "at_first": resid.first,
        },
        "Residual states h_l: largest and median |x|, massive entries (count, per position)",
    )
    blocks: dict[str, Any] = {"block": list(range(info.n_layers))}
    for kind in ("attn", "mlp"):
        site = numbers.sites[kind]
        blocks[f"{kind}_max_abs"] = site.max_abs
        blocks[f"{kind}_log10_ratio"] = np.log10(site.ratio)
        blocks[f"{kind}_massive"] = site.counts.sum(1)
    dims = numbers.dims[: options.top]
    tables = {
        "massive": states,
        "massive_blocks": Table("massive_blocks", blocks, "Attention and MLP outputs per block"),
        "massive_dims": Table(
            "massive_dims",
            {
                "dim": dims,
                "count": [float(resid.counts[:, j].sum()) for j in dims],
                "max_abs": [float(resid.dim_max[:, j].max()) for j in dims],
                "first_layer": [int(np.argmax(resid.counts[:, j] > 0)) for j in dims],
            },
            "Massive dimensions: massive entries counted over every residual state, the largest "
            "|x| anywhere, the first state holding one",
        ),
        "massive_tokens": Table(
            "massive_tokens",
            {
                "token": [c[0] for c in numbers.carriers],
                "text": [repr(c[1]) if c[1] is not None else "" for c in numbers.carriers],
                "positions": [c[2] for c in numbers.carriers],
            },
            "Tokens at positions carrying a massive entry in some residual state",
        ),
    }
    if numbers.truth is not None:
        tables["massive_truth"] = Table(
            "massive_truth",
            {
                "edit": list(EDITS),
                **{k: [numbers.truth[e][k] for e in EDITS] for k in ("kl", "dce", "agree")},
            },
            "Massive entries set to zero or to their mean over the data (per state and dimension) "
            "where they appear: the output",
        )
    arrays = {"dim_max": resid.dim_max[:, dims] if dims else np.zeros((len(resid.max_abs), 0))}
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, options),
        tables=tables,
        arrays=arrays,
        plots=_plots(options, list(dims), float(resid.dim_max[:, dims].max()) if dims else 1.0),
        meta={
            "tokens": numbers.tokens,
            "appear": numbers.appear,
            "vanish": numbers.vanish,
            "writer": numbers.writer,
            "absolute": options.absolute,
            "ratio": options.ratio,
            "median_precision": 10 ** (1 / (2 * options.bins_per_decade)) - 1,
            "truth_layers": None if numbers.truth_layers is None else numbers.truth_layers.tolist(),
            "kl_direction": "KL(p_edited || p_out)",
        },
    )


def _summary(numbers: MassiveNumbers, options: Massive) -> str:
    resid = numbers.sites["resid"]
    peak = int(np.nanargmax(resid.ratio))
    text = (
        f"Largest |x| / median |x| of the residual states: {resid.ratio[peak]:.3g} at h_{peak} "
        f"(max {resid.max_abs[peak]:.3g}). "
    )
    if numbers.appear is None:
        return text + (
            f"No massive activation (|x| > {options.absolute:g} and > {options.ratio:g}× the "
            f"median) in {numbers.tokens} positions."
        )
    text += (
        f"Massive activations appear at h_{numbers.appear}"
        + (f" (written by block {numbers.appear - 1}'s {numbers.writer})" if numbers.writer else "")
        + (f" and vanish at h_{numbers.vanish}" if numbers.vanish is not None else ", to the end")
        + f", in dimension(s) {', '.join(map(str, numbers.dims[:4]))}."
    )
    if numbers.truth is not None:
        zero, mean = numbers.truth["zero"], numbers.truth["mean"]
        text += (
            f" Set to zero: KL {zero['kl']:.3g} nats, cross-entropy {zero['dce']:+.3g}; set to "
            f"their mean: KL {mean['kl']:.3g}, cross-entropy {mean['dce']:+.3g}."
        )
    return text


def _plots(options: Massive, dims: list[int], top: float) -> tuple[Plot, ...]:
    plots = [
        Plot(
            "line",
            "massive_layers",
            "Largest and median |activation| of the residual states",
            "massive",
            x="layer",
            y=("max_abs", "median"),
            labels=("largest |x|", "median |x|"),
            xlabel="residual state h_l",
            ylabel="|x| (log scale)",
            logy=True,
            thresholds=((options.absolute, f"|x| = {options.absolute:g} (absolute cut-off)"),),
            caption="Median from a log histogram (within the stated precision). An entry is "
            f"massive above {options.absolute:g} and {options.ratio:g}× its state's median.",
        ),
        Plot(
            "line",
            "massive_blocks",
            "Largest/median |x| of each sublayer output (log10)",
            "massive_blocks",
            x="block",
            y=("attn_log10_ratio", "mlp_log10_ratio"),
            labels=("attention output", "MLP output"),
            xlabel="block l",
            ylabel="log10(max |x| / median |x|)",
            ylim=(0.0, None),  # from 0: a narrow range is not stretched into a drama
            thresholds=((math.log10(options.ratio), f"{options.ratio:g}× the median"),)
            if options.ratio > 1
            else (),
        ),
    ]
    if dims:
        plots.append(
            Plot(
                "heatmap",
                "massive_dims",
                "Largest |x| of the massive dimensions per residual state",
                "dim_max",
                xlabel="massive dimension",
                ylabel="residual state h_l",
                clabel="max |x| (from 0)",
                xticklabels=tuple(str(d) for d in dims),
                limits=(0.0, top),
                caption="Each column one dimension that holds massive entries (its index "
                "below), the scale from 0 so that near-equal values look equal.",
            )
        )
    return tuple(plots)
