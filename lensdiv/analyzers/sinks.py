"""``sinks`` — where attention goes, layer by layer: attention sinks (docs/science.md F1).

Per layer ``l`` and head ``h``, from the pattern ``p[q, k]`` (``blocks.{l}.attn.hook_pattern``),
averaged over the real queries ``q ≥ min_query``:

- ``mass0 = p[q, 0]`` and ``mass_first = Σ_{k < first} p[q, k]`` (the sink: the first ``first``
  positions, BOS when the rows start with one);
- ``entropy = −Σ_k p[q, k] ln p[q, k]`` (nats);
- ``top_first``: the share of queries whose most-attended key is one of the first positions.

A head is a *sink head* when its mean ``mass_first`` exceeds ``eps`` (0.3, as Gu et al. 2024);
``sink_share`` is the share of a layer's heads that are. Which tokens act as sinks: the attention
every key receives, summed over layers, heads and queries, pooled by token id and by where the
key sits (among the first positions or later), over the attention the same queries would give
each key if they spread it evenly (``ratio``: > 1 draws more than its share).

The truth beside it (``truth``): the sink of layer ``l`` removed — keys ``< first`` masked for
every query ``q ≥ first``, each row renormalised over the keys left (queries ``< first`` see no
other key and are left as they are) — the pass resumed at block ``l`` from the clean residual,
and the output compared with the clean one (``KL(p_removed ‖ p_out)``, the change of the
next-token cross-entropy, top-1 agreement) at the same queries. ``per_head``: each head alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, DataFacts, ModelInfo, Step
from lensdiv.core.errors import OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.attention import (
    final_with,
    head_sums,
    key_mass,
    pattern_hook,
    remove_sink,
    uniform_mass,
)
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.surgery import output_sums

HEAD_STATS = ("mass0", "mass_first", "entropy", "top_first")
TRUTH = ("kl", "dce", "agree")


@dataclass(frozen=True)
class Sinks(Analyzer):
    """Attention sinks per layer and head, the tokens that act as sinks, and what removing them
    does to the output.

    Args:
        first: The sink is the first ``first`` key positions (1: position 0, BOS).
        min_query: Queries at positions below this are left out of every average (``None``:
            ``first``, so no query that sees only sink keys counts).
        eps: A head is a sink head when its mean attention on the sink exceeds this.
        truth: Also remove each layer's sink and measure the output (one resumed pass per layer).
        per_head: With ``truth``, also remove each head's sink alone (one pass per head).
        top_tokens: Rows of the table of sink tokens.
    """

    name = "sinks"
    aliases = ("attention-sinks",)
    description = "Attention sinks per layer and head: mass on the first tokens, and its removal"
    depth_profiles = ("sinks.mass_first", "sinks.sink_share", "sinks.entropy", "sinks.kl")
    extra_forwards = True

    first: int = 1
    min_query: int | None = None
    eps: float = 0.3
    truth: bool = True
    per_head: bool = False
    top_tokens: int = 12

    def __post_init__(self) -> None:
        if self.first < 1:
            raise ValueError(f"first must be at least 1, got {self.first}")
        if self.min_query is not None and self.min_query < 0:
            raise ValueError(f"min_query must be 0 or more, got {self.min_query}")
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps must be between 0 and 1, got {self.eps}")
        if self.top_tokens < 1:
            raise ValueError(f"top_tokens must be at least 1, got {self.top_tokens}")
        if self.per_head and not self.truth:
            raise ValueError(
                "per_head removes each head's sink as part of the truth: it needs truth=true "
                "(-O sinks.truth=true), or drop per_head"
            )

    def check_data(self, data: DataFacts, info: ModelInfo) -> None:
        """Some query must sit at a position ``≥ start``: rows longer than the sink (``first``)
        and ``min_query``, checked before any forward pass."""
        if data.longest <= self.start:
            option = "min_query" if self.min_query is not None else "first"
            value = self.min_query if self.min_query is not None else self.first
            raise OptionError(
                f"sinks.{option}={value} leaves no query: the queries start at position "
                f"{self.start}, but {data.limit}",
                hint=f"use -O sinks.{option}={max(data.longest - 1, 1 if option == 'first' else 0)}"
                " or less, or longer rows (--seq-len)",
            )

    @property
    def start(self) -> int:
        """The first query position averaged."""
        return self.first if self.min_query is None else self.min_query

    def hooks(self, info: ModelInfo) -> list[str]:
        names = [pattern_hook(layer) for layer in range(info.n_layers)]
        if self.truth:
            names += [info.resid(layer) for layer in range(info.n_layers + 1)]
        return names

    def queries(self, step: Step) -> Tensor:
        """Real queries at positions ``≥ start``."""
        mask = step.batch.mask
        pos = torch.arange(mask.shape[1], device=mask.device)
        return mask & (pos >= self.start)

    def update(self, state: Stats, step: Step) -> None:
        queries = self.queries(step)
        if not queries.any():
            return
        L = step.info.n_layers
        sums: dict[str, list[Tensor]] = {key: [] for key in HEAD_STATS}
        received = torch.zeros(queries.shape, dtype=torch.float64, device=queries.device)
        for layer in range(L):
            pattern = step.cache[pattern_hook(layer)]
            q, keys = queries.to(pattern.device), step.batch.mask.to(pattern.device)
            for key, value in head_sums(pattern, q, keys, self.first).items():
                sums[key].append(value.to(queries.device))
            top = pattern.argmax(-1) < self.first  # [batch, head, query]
            sums["top_first"].append(top.transpose(1, 2)[q].double().sum(0).to(queries.device))
            received += key_mass(pattern, q).to(queries.device)
        state.add("n", float(queries.sum()))
        for key, values in sums.items():
            state.add(key, torch.stack(values))  # [layer, head]
        self._tokens(state, step, received, uniform_mass(queries) * (L * step.info.n_heads))
        if self.truth:
            self._truth(state, step, queries)

    def _tokens(self, state: Stats, step: Step, received: Tensor, even: Tensor) -> None:
        """Attention received, and its even-spread baseline, pooled by token and place."""
        tokens, mask = step.batch.tokens, step.batch.mask
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        V = step.info.d_vocab
        for place, where in (("first", pos < self.first), ("later", pos >= self.first)):
            keep = mask & where
            ids = tokens[keep]
            state.add(f"tok_{place}", torch.bincount(ids, received[keep], minlength=V)[:V])
            state.add(f"even_{place}", torch.bincount(ids, even[keep], minlength=V)[:V])
        # Named: every occurrence that receives, over layers and heads, at least eps of a whole
        # query's attention per (layer, head) — a property of the occurrence, not of the batch.
        strong = mask & (received >= self.eps * step.info.n_layers * step.info.n_heads)
        tokenizer = getattr(step.model, "tokenizer", None)
        for token in tokens[strong].unique().tolist():
            text = tokenizer.decode([token]) if tokenizer is not None else ""
            state.include("token_text", json.dumps([token, text]))

    def _truth(self, state: Stats, step: Step, queries: Tensor) -> None:
        """The sink of each layer (and head) removed; the output's change at the queries."""
        info, resumer = step.info, resumer_for(step)
        tokens = step.batch.tokens
        resumer.prepare(tokens)
        finals = []
        for layer in range(info.n_layers):
            h = step.resid(layer).to(tokens.device)
            hook = (pattern_hook(layer), _removing(self.first, None))
            finals.append(final_with(resumer, tokens, layer, h, [hook]))
        for key, value in output_sums(step, finals, queries).items():
            state.add(f"removed_{key}", value)
        if not self.per_head:
            return
        for layer in range(info.n_layers):
            h = step.resid(layer).to(tokens.device)
            heads = [
                final_with(
                    resumer, tokens, layer, h, [(pattern_hook(layer), _removing(self.first, [j]))]
                )
                for j in range(info.n_heads)
            ]
            for key, value in output_sums(step, heads, queries).items():
                state.zeros(f"head_{key}", (info.n_layers, info.n_heads), value.device)[layer] += (
                    value
                )

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if float(state.get("n", 0.0)) == 0:
            raise ValueError(
                f"no query at a position ≥ {self.start} was seen: rows too short for "
                f"sinks.min_query={self.start}"
            )
        return present(SinkNumbers.from_state(state, self), self, info)


def _removing(first: int, heads: list[int] | None) -> Any:
    def hook(pattern: Tensor, *, hook: Any) -> Tensor:
        return remove_sink(pattern, first, heads)

    return hook


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SinkNumbers:
    """The sink statistics of a run: no tables, no prose.

    Args:
        heads: ``{mass0, mass_first, entropy, top_first}``: means over queries, ``[layer, head]``.
        sink_share: Share of each layer's heads whose ``mass_first`` exceeds ``eps``.
        queries: Queries averaged.
        removal: ``{kl, dce, agree}`` per layer when ``truth`` ran (means over queries;
            ``dce`` over queries with a next token).
        removal_heads: The same per ``[layer, head]`` when ``per_head`` ran.
        tokens: Sink tokens, most attended first: ``(id, text, share, share_first,
            share_later, ratio)``; the text is ``None`` for a token none of whose occurrences
            received at least ``eps`` of a query's attention per layer and head.
    """

    heads: dict[str, np.ndarray]
    sink_share: np.ndarray
    queries: int
    removal: dict[str, np.ndarray] | None
    removal_heads: dict[str, np.ndarray] | None
    tokens: list[tuple[int, str | None, float, float, float, float]]

    @classmethod
    def from_state(cls, state: Stats, options: Sinks) -> SinkNumbers:
        n = float(state["n"])
        heads = {key: (state[key] / n).cpu().numpy() for key in HEAD_STATS}
        sink_share = (heads["mass_first"] > options.eps).mean(1)
        return cls(
            heads=heads,
            sink_share=sink_share,
            queries=int(n),
            removal=_means(state, "removed_"),
            removal_heads=_means(state, "head_"),
            tokens=_sink_tokens(state, options.top_tokens),
        )


def _means(state: Stats, prefix: str) -> dict[str, np.ndarray] | None:
    """``kl``, ``dce`` and ``agree`` means from the sums ``output_sums`` returned."""
    if f"{prefix}n" not in state:
        return None
    n = state[f"{prefix}n"].cpu().numpy()
    n_target = state[f"{prefix}n_target"].cpu().numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "kl": state[f"{prefix}kl"].cpu().numpy() / n,
            "dce": state[f"{prefix}dce"].cpu().numpy() / n_target,
            "agree": state[f"{prefix}agree"].cpu().numpy() / n,
        }


def _sink_tokens(
    state: Stats, top: int
) -> list[tuple[int, str | None, float, float, float, float]]:
    first, later = state["tok_first"].cpu().numpy(), state["tok_later"].cpu().numpy()
    even = (state["even_first"] + state["even_later"]).cpu().numpy()
    total = float((first + later).sum())
    texts = dict(json.loads(item) for item in state.get("token_text", frozenset()))
    mass = first + later
    order = [int(i) for i in np.argsort(-mass, kind="stable")[:top] if mass[i] > 0]
    return [
        (
            i,
            texts.get(i),
            float(mass[i] / total),
            float(first[i] / total),
            float(later[i] / total),
            float(mass[i] / even[i]) if even[i] > 0 else math.nan,
        )
        for i in order
    ]


# -- the result ----------------------------------------------------------------------------------
def present(numbers: SinkNumbers, options: Sinks, info: ModelInfo) -> Result:
    """Tables, arrays, plots and summary of a sinks run."""
    L, H = numbers.heads["mass0"].shape
    layers = list(range(L))
    columns: dict[str, Any] = {"layer": layers}
    for key in HEAD_STATS:
        columns[key] = numbers.heads[key].mean(1)
    columns["sink_share"] = numbers.sink_share
    if numbers.removal is not None:
        columns.update(numbers.removal)
    main = Table("sinks", columns, f"Attention on the first {options.first} position(s), per layer")
    per_head: dict[str, Any] = {
        "layer": [layer for layer in layers for _ in range(H)],
        "head": [head for _ in layers for head in range(H)],
    }
    for key in HEAD_STATS:
        per_head[key] = numbers.heads[key].reshape(-1)
    per_head["sink"] = (numbers.heads["mass_first"] > options.eps).reshape(-1).astype(np.int64)
    if numbers.removal_heads is not None:
        for key, value in numbers.removal_heads.items():
            per_head[key] = value.reshape(-1)
    heads = Table("sinks_heads", per_head, "Attention on the sink per (layer, head)")
    tokens = Table(
        "sink_tokens",
        {
            "token": [t[0] for t in numbers.tokens],
            "text": [repr(t[1]) if t[1] is not None else "" for t in numbers.tokens],
            "share": [t[2] for t in numbers.tokens],
            "share_first": [t[3] for t in numbers.tokens],
            "share_later": [t[4] for t in numbers.tokens],
            "ratio": [t[5] for t in numbers.tokens],
        },
        "Tokens by the attention they receive (all layers and heads)",
    )
    arrays = {f"{key}": numbers.heads[key] for key in HEAD_STATS}
    if numbers.removal_heads is not None:
        arrays.update({f"removed_{k}": v for k, v in numbers.removal_heads.items()})
    return Result(
        analyzer=options.name,
        summary=_summary(numbers, options),
        tables={"sinks": main, "sinks_heads": heads, "sink_tokens": tokens},
        arrays=arrays,
        plots=_plots(options, numbers),
        meta={
            "queries": numbers.queries,
            "first": options.first,
            "min_query": options.start,
            "eps": options.eps,
            "kl_direction": "KL(p_removed || p_out)",
        },
    )


def _summary(numbers: SinkNumbers, options: Sinks) -> str:
    share = numbers.sink_share
    L = len(share)
    formed = next((layer for layer in range(L) if share[layer] > 0.5), None)
    mass = numbers.heads["mass_first"].mean(1)
    where = (
        f"more than half of the heads are sinks from layer {formed} on"
        if formed is not None
        else "no layer has a majority of sink heads"
    )
    text = (
        f"Attention on the first {options.first} position(s), averaged over {numbers.queries} "
        f"queries: {float(mass[0]):.2f} at layer 0, {float(mass[1:].mean()) if L > 1 else math.nan:.2f} "
        f"on average over layers 1-{L - 1}; {where} (sink head: mean mass > {options.eps:g})."
    )
    if numbers.tokens:
        top = numbers.tokens[0]
        name = repr(top[1]) if top[1] is not None else f"id {top[0]}"
        text += f" Most attended token: {name} ({top[2]:.0%} of all attention)."
    if numbers.removal is not None:
        kl = numbers.removal["kl"]
        worst = int(np.nanargmax(kl))
        text += (
            f" Removing the sink changes the output most at layer {worst} (KL {kl[worst]:.3g} "
            f"nats, cross-entropy {numbers.removal['dce'][worst]:+.3g}, top-1 agreement "
            f"{numbers.removal['agree'][worst]:.0%})."
        )
    return text


def _plots(options: Sinks, numbers: SinkNumbers) -> tuple[Plot, ...]:
    sink = "position 0" if options.first == 1 else f"positions 0-{options.first - 1}"
    plots = [
        Plot(
            "heatmap",
            "sinks_mass",
            f"Attention on the sink ({sink})",
            "mass_first",
            xlabel="head",
            ylabel="layer",
            clabel="mean attention on the sink",
            caption=f"Mean over queries at positions ≥ {options.start} of the attention on "
            f"{sink}, on a fixed 0-1 scale; a head above {options.eps:g} (the red mark on the "
            "scale) is a sink head.",
            limits=(0.0, 1.0),
            thresholds=((options.eps, f"sink head > {options.eps:g}"),),
        ),
        Plot(
            "heatmap",
            "sinks_entropy",
            "Attention entropy",
            "entropy",
            xlabel="head",
            ylabel="layer",
            clabel="entropy (nats)",
        ),
        Plot(
            "line",
            "sinks_layers",
            "Sink mass and share of sink heads per layer",
            "sinks",
            x="layer",
            y=("mass_first", "sink_share", "top_first"),
            labels=(
                "mean attention on the sink",
                f"share of heads above {options.eps:g} (sink heads)",
                "share of queries whose most-attended key is the sink",
            ),
            xlabel="layer",
            ylabel="share (0 to 1)",
            ylim=(0.0, 1.0),
            thresholds=((options.eps, f"sink-head cut-off {options.eps:g}"),),
        ),
    ]
    if numbers.removal is not None:
        plots.append(
            Plot(
                "line",
                "sinks_removed",
                "Output change when the sink of a layer is removed",
                "sinks",
                x="layer",
                y=("kl", "dce"),
                labels=("KL(p_removed ‖ p_out)", "Δ next-token cross-entropy"),
                xlabel="layer whose sink is removed",
                ylabel="nats",
                signed=True,
            )
        )
    if numbers.removal_heads is not None:
        plots.append(
            Plot(
                "heatmap",
                "sinks_removed_heads",
                "Output KL when one head's sink is removed",
                "removed_kl",
                xlabel="head",
                ylabel="layer",
                clabel="KL(p_removed ‖ p_out) (nats)",
            )
        )
    return tuple(plots)
