"""``attn-entropy`` — a third-party lensdiv plugin: attention entropy and attention-sink mass.

Per layer ``l`` and head ``h``, from ``blocks.{l}.attn.hook_pattern`` (softmax probabilities
``p[batch, head, query_pos, key_pos]``), averaged over real query positions ``q``:

- ``entropy``: ``H_q = -Σ_k p_qk ln p_qk`` in nats;
- ``norm_entropy``: ``H_q / ln(q + 1)``, the entropy relative to the uniform distribution over the
  ``q + 1`` keys a causal query at ``q`` can see; query 0 (one key, ``ln 1 = 0``) is skipped;
- ``bos_mass``: ``p_q0``, the attention on position 0 (BOS, the usual "attention sink").

Sequences are right-padded and attention is causal, so a real query never attends to a pad; only
pad *queries* must be dropped, which ``Batch.positions`` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lensdiv import Analyzer, ModelInfo, Plot, Result, Stats, Step, Table

__all__ = ["AttentionEntropy", "__version__", "head_statistics"]
__version__ = "0.1.0"


def _pattern_hook(layer: int) -> str:
    return f"blocks.{layer}.attn.hook_pattern"


def head_statistics(
    pattern: Float[Tensor, "batch head query_pos key_pos"],
    keep: Bool[Tensor, "batch query_pos"],
) -> tuple[
    Float[Tensor, " head"], Float[Tensor, " head"], Float[Tensor, " head"], int, int
]:
    """Sums over the kept queries of one layer's attention pattern.

    Args:
        pattern: Softmax attention probabilities of one layer.
        keep: Query positions that count (real tokens, optionally without BOS).

    Returns:
        ``(entropy_sum, norm_entropy_sum, bos_mass_sum, n_queries, n_normalised)``: per-head
        sums (float64) over kept queries of the entropy in nats, of the entropy over
        ``ln(q + 1)`` (queries ``q ≥ 1`` only) and of the mass on key 0, plus the two counts.
    """
    # entr(p) = -p ln p with entr(0) = 0, so masked-out (zero-probability) keys add nothing.
    # float32 at least: bf16/fp16 patterns would lose the small terms of the sum.
    entropy: Float[Tensor, "batch head query_pos"] = torch.special.entr(
        pattern.float()
    ).sum(-1)
    # Boolean indexing (not multiplying by the mask) so a NaN in a pad row cannot leak in.
    per_query: Float[Tensor, "n head"] = entropy.transpose(1, 2)[keep].double()
    bos: Float[Tensor, "n head"] = pattern[..., 0].transpose(1, 2)[keep].double()
    pos = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)[keep]
    visible = pos >= 1
    log_keys = torch.log1p(pos[visible].double())  # ln(q + 1), > 0 for q ≥ 1
    normalised = per_query[visible] / log_keys.unsqueeze(-1)
    return (
        per_query.sum(0),
        normalised.sum(0),
        bos.sum(0),
        int(per_query.shape[0]),
        int(normalised.shape[0]),
    )


@dataclass(frozen=True)
class AttentionEntropy(Analyzer):
    """Attention entropy, normalised entropy and BOS ("sink") mass per layer and head.

    Args:
        exclude_bos: Leave the BOS position out as a *query* (its row is a one-hot on itself:
            entropy 0, BOS mass 1). BOS stays a key either way, so ``bos_mass`` still measures
            attention to it.
    """

    name = "attn-entropy"
    aliases = ("attent",)
    description = "Attention entropy, normalised entropy and BOS (sink) mass per layer and head"

    exclude_bos: bool = True

    def hooks(self, info: ModelInfo) -> list[str]:
        return [_pattern_hook(layer) for layer in range(info.n_layers)]

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        if not keep.any():
            return
        sums: dict[str, list[Tensor]] = {"entropy": [], "norm_entropy": [], "bos_mass": []}
        n = n_norm = 0
        # One layer at a time: the float32 entropy temporary is the size of one pattern only.
        for layer in range(step.info.n_layers):
            pattern = step.cache[_pattern_hook(layer)]
            ent, norm, bos, n, n_norm = head_statistics(pattern, keep.to(pattern.device))
            sums["entropy"].append(ent)
            sums["norm_entropy"].append(norm)
            sums["bos_mass"].append(bos)
        # Counts as floats: Stats.add's annotation has not always admitted int.
        state.add("n", float(n))
        state.add("n_norm", float(n_norm))
        for key, values in sums.items():
            state.add(key, torch.stack(values))  # [layer, head]

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        n = float(state.get("n", 0.0))
        if n == 0:
            raise ValueError("no query positions were seen (empty data, or only BOS tokens)")
        n_norm = float(state["n_norm"])
        entropy = (state["entropy"] / n).cpu().numpy()
        norm = (state["norm_entropy"] / n_norm).cpu().numpy() if n_norm else (
            entropy * float("nan"))
        bos = (state["bos_mass"] / n).cpu().numpy()
        layers = list(range(info.n_layers))
        most, least = entropy.argmax(1), entropy.argmin(1)
        table = Table(
            "attn_entropy",
            {
                "layer": layers,
                "entropy": entropy.mean(1),
                "norm_entropy": norm.mean(1),
                "bos_mass": bos.mean(1),
                "max_entropy_head": most,
                "max_entropy": entropy.max(1),
                "min_entropy_head": least,
                "min_entropy": entropy.min(1),
            },
            "Attention per layer, mean over heads (entropy in nats; most/least entropic head)",
        )
        heads = Table(
            "attn_entropy_heads",
            {
                "layer": [layer for layer in layers for _ in range(info.n_heads)],
                "head": [head for _ in layers for head in range(info.n_heads)],
                "entropy": entropy.reshape(-1),
                "norm_entropy": norm.reshape(-1),
                "bos_mass": bos.reshape(-1),
            },
            "Attention per (layer, head)",
        )
        return Result(
            analyzer=self.name,
            summary=self._summary(table, bos, n),
            tables={"attn_entropy": table, "attn_entropy_heads": heads},
            arrays={"entropy": entropy, "norm_entropy": norm, "bos_mass": bos},
            plots=(
                Plot("heatmap", "attn_entropy_heatmap", "Attention entropy (nats)", "entropy",
                     xlabel="head", ylabel="layer"),
                Plot("heatmap", "attn_bos_mass_heatmap", "Attention mass on BOS", "bos_mass",
                     xlabel="head", ylabel="layer"),
                Plot("line", "attn_entropy_layers", "Attention entropy per layer", "attn_entropy",
                     x="layer", y=("entropy", "max_entropy", "min_entropy"), xlabel="layer",
                     ylabel="nats"),
                Plot("line", "attn_fractions_layers", "Normalised entropy and BOS mass",
                     "attn_entropy", x="layer", y=("norm_entropy", "bos_mass"), xlabel="layer",
                     ylabel="fraction"),
            ),
            meta={"positions": int(n), "positions_normalised": int(n_norm),
                  "entropy_units": "nats"},
        )

    def _summary(self, table: Table, bos: Float[np.ndarray, "layer head"], n: float) -> str:
        ent, norm = table["entropy"], table["norm_entropy"]
        lo, hi = int(ent.argmin()), int(ent.argmax())
        sink_layer, sink_head = divmod(int(bos.argmax()), bos.shape[1])
        first, last = float(norm[0]), float(norm[-1])
        return (
            f"Mean attention entropy per layer ranges from {ent[lo]:.3g} nats (layer {lo}) to "
            f"{ent[hi]:.3g} (layer {hi}); normalised entropy {first:.2f} at layer 0 -> "
            f"{last:.2f} at the last layer (1 = uniform over visible keys). Heads put "
            f"{float(bos.mean()):.2f} of their attention on the first position on average "
            f"(most: layer {sink_layer} head {sink_head}, {float(bos.max()):.2f}). Over "
            f"{int(n)} query positions" + (" (BOS excluded)." if self.exclude_bos else ".")
            + ("" if math.isfinite(first) else " No query saw more than one key.")
        )
