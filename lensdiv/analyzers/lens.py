"""``lens`` — the logit lens (SCIENCE.md A2): read every block input through the final norm and
unembedding and compare with the model's output.

Per residual state ``h_l`` (``l = 0..L``): ``KL(p_l ‖ p_out)``, top-k overlap with the output's
top-k, entropy, and the cross-entropy, probability, rank and top-1 accuracy of the true next
token. Built on TransformerLens' ``logit_readout`` (the kernel under its ``logit_lens``), which
recomputes the final norm per vector and applies the adapter's output transform; at ``h_L`` the
lens is the model's own output, so KL = 0 and overlap = 1 there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.errors import OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats

# Elements of the [layers, rows, vocab] log-prob block held at once (~256 MB in fp32).
_BLOCK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class LogitLens(Analyzer):
    """Logit lens over all block inputs and the final residual.

    Args:
        top_k: Size of the top-k sets whose overlap with the output's is reported.
        exclude_bos: Leave the BOS position out of every statistic.
    """

    name = "lens"
    aliases = ("logit-lens", "logitlens")
    description = (
        "Logit lens: KL to the output, top-k overlap, next-token CE/rank, entropy per layer"
    )

    top_k: int = 5
    exclude_bos: bool = False

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def setup(self, model: Any, info: ModelInfo) -> None:
        if self.top_k >= info.d_vocab:  # every top-k set would be the whole vocabulary
            raise OptionError(
                f"lens.top_k={self.top_k} is not below the {info.d_vocab} tokens of "
                f"{info.name}'s vocabulary, so every top-k overlap would be a perfect 1",
                hint=f"use -O lens.top_k={min(5, info.d_vocab - 1)} (at most {info.d_vocab - 1})",
            )

    def update(self, state: Stats, step: Step) -> None:
        from transformer_lens.tools.analysis.logit_lens import logit_readout

        info = step.info
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        targets, has_target = step.batch.next_tokens()
        stack = torch.stack([step.resid(layer)[keep] for layer in range(info.n_layers + 1)])
        targets, has_target = targets[keep], has_target[keep]
        n_states, n_rows = stack.shape[0], stack.shape[1]
        k = min(self.top_k, info.d_vocab)
        rows_per_block = max(1, _BLOCK_ELEMENTS // (n_states * info.d_vocab))
        for start in range(0, n_rows, rows_per_block):
            rows = slice(start, start + rows_per_block)
            readout = logit_readout(
                step.model, stack[:, rows], return_type="log_probs", chunk_size=4096
            )
            logp: Float[Tensor, "layer row d_vocab"] = readout.values.float()
            entropy = readout.entropy.float()  # full-vocabulary, computed by the readout
            self._accumulate(state, logp, entropy, targets[rows], has_target[rows], k)

    @staticmethod
    def _accumulate(
        state: Stats,
        logp: Float[Tensor, "layer row d_vocab"],
        entropy: Float[Tensor, "layer row"],
        targets: Int[Tensor, " row"],
        has_target: Bool[Tensor, " row"],
        k: int,
    ) -> None:
        # Full-vocabulary passes dominate the lens's cost: einsum reduces without a product
        # temporary, and the rank count sums in int32 (a bool sum upcasts to int64).
        probs = logp.exp()
        kl = torch.einsum("lrv,lrv->lr", probs, logp - logp[-1:]).clamp_min(0.0)
        top = logp.topk(k, dim=-1).indices
        overlap = (top.unsqueeze(-1) == top[-1:].unsqueeze(-2)).any(-1).sum(-1).double() / k
        target_logp = logp.gather(-1, targets.view(1, -1, 1).expand(logp.shape[0], -1, 1))[..., 0]
        rank = (logp > target_logp.unsqueeze(-1)).sum(-1, dtype=torch.int32).double()
        w = has_target.double()
        state.add("n", logp.shape[1])
        state.add("kl", kl.sum(1))
        state.add("kl_sq", (kl.double() ** 2).sum(1))
        state.add("overlap", overlap.sum(1))
        state.add("entropy", entropy.sum(1))
        state.add("n_target", w.sum())
        state.add("ce", -(target_logp * w).sum(1))
        state.add("target_prob", (target_logp.exp() * w).sum(1))
        state.add("top1", ((rank == 0) * w).sum(1))
        state.add("rank", (rank * w).sum(1))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        n = float(state["n"])
        nt = max(float(state["n_target"]), 1.0)
        kl = (state["kl"] / n).tolist()
        kl_var = (state["kl_sq"] / n - (state["kl"] / n) ** 2).clamp_min(0.0)
        kl_sem = (kl_var.sqrt() / math.sqrt(max(n - 1, 1.0))).tolist()
        layers = list(range(info.n_layers + 1))
        table = Table(
            "lens",
            {
                "layer": layers,
                "state": [f"h{layer}" for layer in layers],
                "kl": kl,
                "kl_sem": kl_sem,
                f"top{self.top_k}_overlap": (state["overlap"] / n).tolist(),
                "entropy": (state["entropy"] / n).tolist(),
                "ce": (state["ce"] / nt).tolist(),
                "target_prob": (state["target_prob"] / nt).tolist(),
                "top1_acc": (state["top1"] / nt).tolist(),
                "mean_rank": (state["rank"] / nt).tolist(),
            },
            "Logit lens per residual state (h0 = embedding, hL = final residual)",
        )
        ce = table["ce"]
        overlap = table[f"top{self.top_k}_overlap"]
        summary = (
            f"KL(p_l || p_out) falls from {kl[0]:.3g} nats at the embedding to {kl[-2]:.3g} at the "
            f"input of the last block (0 at the output); top-{self.top_k} overlap "
            f"{overlap[0]:.2f} -> {overlap[-2]:.2f}. Lens cross-entropy on the next token: "
            f"{ce[0]:.3g} -> {ce[-1]:.3g} nats over {int(n)} positions."
        )
        return Result(
            analyzer=self.name,
            summary=summary,
            tables={"lens": table},
            plots=(
                Plot(
                    "line",
                    "lens_kl",
                    "Logit lens: KL to the output",
                    "lens",
                    x="layer",
                    y=("kl",),
                    xlabel="residual state h_l (0 = embedding, L = final)",
                    ylabel="KL(p_l ‖ p_out) (nats)",
                    caption="p_l: h_l read through the final norm and unembedding; mean over "
                    "positions. 0 at h_L by definition.",
                ),
                Plot(
                    "line",
                    "lens_agreement",
                    "Logit lens: agreement",
                    "lens",
                    x="layer",
                    y=(f"top{self.top_k}_overlap", "top1_acc", "target_prob"),
                    xlabel="residual state h_l (0 = embedding, L = final)",
                    ylabel="fraction (0 to 1)",
                    caption=f"top{self.top_k}_overlap: share of the output's top {self.top_k} "
                    "tokens in p_l's; top1_acc: p_l's top token is the true next token; "
                    "target_prob: p_l of the true next token.",
                ),
                Plot(
                    "line",
                    "lens_ce",
                    "Logit lens: loss and entropy",
                    "lens",
                    x="layer",
                    y=("ce", "entropy"),
                    xlabel="residual state h_l (0 = embedding, L = final)",
                    ylabel="cross-entropy, entropy (nats)",
                    caption="ce: −log p_l(next token); entropy: H(p_l). Means over positions.",
                ),
            ),
            meta={"positions": int(n), "positions_with_target": int(nt)},
        )
