"""``lens`` — the logit lens (docs/science.md A2): read every block input through the final norm
and unembedding and compare with the model's output; or, with another lens (``--lens
tuned:PATH``, ``jacobian:PATH``, ``affine:PATH``, docs/science.md D1–D3: each state through its
translator first; ``--lens last-block`` or ``patchscope``, C1 and P1: through model blocks).

Per residual state ``h_l`` (``l = 0..L``): ``KL(p_l ‖ p_out)``, top-k overlap with the output's
top-k, entropy, and the cross-entropy, probability, rank and top-1 accuracy of the true next
token. The readout is :mod:`lensdiv.ops.readout`: the final norm (decomposed and verified against
the model's own module) and the unembedding in float32 whatever the model's dtype (float64 for a
float64 model), and every statistic from the logits and one log-partition per row. At ``h_L``
the lens is the model's own output, so KL = 0 and overlap = 1 there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.readout import final_readout, lens_of, workspace
from lensdiv.ops.rowstats import lens_statistics
from lensdiv.ops.translators import LABELS, PHRASES


@dataclass(frozen=True)
class LogitLens(Analyzer):
    """Logit lens (or the run's fitted lens) over all block inputs and the final residual.

    Args:
        top_k: Size of the top-k sets whose overlap with the output's is reported.
        exclude_bos: Leave the BOS position out of every statistic.
        every: Read out positions ``t`` with ``t mod every = 0`` only (1 = every position; the
            readouts are the lens's whole cost, so ``every=K`` costs about ``1/K`` of it).
    """

    name = "lens"
    reads_lens = True  # through lens_of (--lens)
    aliases = ("logit-lens", "logitlens")
    description = (
        "Logit lens: KL to the output, top-k overlap, next-token CE/rank, entropy per layer"
    )
    depth_profiles = ("lens.kl", "lens.ce")

    top_k: int = 5
    exclude_bos: bool = False
    every: int = 1

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.every < 1:
            raise ValueError(f"every must be at least 1, got {self.every}")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def setup(self, model: Bridge, info: ModelInfo) -> None:
        if self.top_k >= info.d_vocab:  # every top-k set would be the whole vocabulary
            raise OptionError(
                f"lens.top_k={self.top_k} is not below the {info.d_vocab} tokens of "
                f"{info.name}'s vocabulary, so every top-k overlap would be a perfect 1",
                hint=f"use -O lens.top_k={min(5, info.d_vocab - 1)} (at most {info.d_vocab - 1})",
            )

    def update(self, state: Stats, step: Step) -> None:
        info = step.info
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        if self.every > 1:
            pos = torch.arange(keep.shape[1], device=keep.device)
            keep = keep & (pos % self.every == 0)
        targets, has_target = step.batch.next_tokens()
        rows = keep.reshape(-1).nonzero()[:, 0]
        readout = final_readout(step.model)
        translator = lens_of(step)
        lens = lens_statistics(
            readout,
            [step.resid(layer) for layer in range(info.n_layers + 1)],
            rows,
            targets.reshape(-1)[rows],
            k=min(self.top_k, info.d_vocab),
            workspace=workspace(step),
            translator=translator,
            model=step.model,
            tokens=step.batch.tokens,
        )
        w = has_target.reshape(-1)[rows].double()
        state.fix("readout", readout.precision)
        if not translator.identity:  # the logit lens' state (and result) stay as they were
            state.fix("lens", translator.describe())
        state.add("n", rows.numel())
        state.add("kl", lens.kl.sum(1))
        state.add("kl_sq", (lens.kl**2).sum(1))
        state.add("overlap", lens.overlap.sum(1))
        state.add("entropy", lens.entropy.sum(1))
        state.add("n_target", w.sum())
        state.add("ce", -(lens.target_logp * w).sum(1))
        state.add("target_prob", (lens.target_logp.exp() * w).sum(1))
        state.add("top1", ((lens.rank == 0) * w).sum(1))
        state.add("rank", (lens.rank * w).sum(1))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return _present(LensNumbers.from_state(state, info), self)


@dataclass(frozen=True)
class LensNumbers:
    """Everything ``lens`` reports, from its merged state alone: per residual state ``h_l``
    (``l = 0..L``) the means over positions (``target`` ones over the positions with a next
    token).

    Args:
        positions: Positions read.
        positions_with_target: Of them, those with a next token.
        kl: ``KL(p_l ‖ p_out)``; ``kl_sem`` its standard error over positions.
        overlap: Share of the output's top-k among ``p_l``'s top-k.
        entropy: ``H(p_l)``.
        ce: ``−log p_l(next token)``; ``target_prob``: ``p_l(next token)``.
        top1_acc: ``p_l``'s top token is the next token; ``mean_rank``: tokens ranked above it.
        readout: What the readout computed in (:attr:`FinalReadout.precision`).
        lens: The run's fitted lens (its description), ``None`` for the logit lens.
    """

    positions: int
    positions_with_target: int
    kl: list[float]
    kl_sem: list[float]
    overlap: list[float]
    entropy: list[float]
    ce: list[float]
    target_prob: list[float]
    top1_acc: list[float]
    mean_rank: list[float]
    readout: Any
    lens: dict[str, Any] | None

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo) -> LensNumbers:
        """The numbers of a merged state."""
        n = float(state["n"])
        nt = max(float(state["n_target"]), 1.0)
        kl_var = (state["kl_sq"] / n - (state["kl"] / n) ** 2).clamp_min(0.0)
        return cls(
            positions=int(n),
            positions_with_target=int(nt),
            kl=(state["kl"] / n).tolist(),
            kl_sem=(kl_var.sqrt() / math.sqrt(max(n - 1, 1.0))).tolist(),
            overlap=(state["overlap"] / n).tolist(),
            entropy=(state["entropy"] / n).tolist(),
            ce=(state["ce"] / nt).tolist(),
            target_prob=(state["target_prob"] / nt).tolist(),
            top1_acc=(state["top1"] / nt).tolist(),
            mean_rank=(state["rank"] / nt).tolist(),
            readout=state.get("readout"),
            lens=state.get("lens"),
        )


def _present(numbers: LensNumbers, options: LogitLens) -> Result:
    """The ``lens`` table, summary, plots and meta of the numbers."""
    lens, k = numbers.lens, options.top_k
    label = LABELS[lens["kind"]] if lens else LABELS["logit"]
    layers = list(range(len(numbers.kl)))
    table = Table(
        "lens",
        {
            "layer": layers,
            "state": [f"h{layer}" for layer in layers],
            "kl": numbers.kl,
            "kl_sem": numbers.kl_sem,
            f"top{k}_overlap": numbers.overlap,
            "entropy": numbers.entropy,
            "ce": numbers.ce,
            "target_prob": numbers.target_prob,
            "top1_acc": numbers.top1_acc,
            "mean_rank": numbers.mean_rank,
        },
        f"{label} per residual state (h0 = embedding, hL = final residual)",
    )
    kl, ce, overlap = numbers.kl, numbers.ce, numbers.overlap
    summary = (
        ("" if lens is None else f"{label}: ")
        + f"KL(p_l || p_out) falls from {kl[0]:.3g} nats at the embedding to {kl[-2]:.3g} at the "
        f"input of the last block (0 at the output); top-{k} overlap "
        f"{overlap[0]:.2f} -> {overlap[-2]:.2f}. Lens cross-entropy on the next token: "
        f"{ce[0]:.3g} -> {ce[-1]:.3g} nats over {numbers.positions} positions."
    )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables={"lens": table},
        plots=(
            _line(
                "lens_kl",
                f"{label}: KL to the output",
                ("kl",),
                "KL(p_l ‖ p_out) (nats)",
                "p_l: h_l read through the final norm and unembedding"
                + (_through(lens) if lens else "")
                + "; mean over positions. 0 at h_L by definition.",
            ),
            _line(
                "lens_agreement",
                f"{label}: agreement",
                (f"top{k}_overlap", "top1_acc", "target_prob"),
                "fraction (0 to 1)",
                f"top{k}_overlap: share of the output's top {k} "
                "tokens in p_l's; top1_acc: p_l's top token is the true next token; "
                "target_prob: p_l of the true next token.",
            ),
            _line(
                "lens_ce",
                f"{label}: loss and entropy",
                ("ce", "entropy"),
                "cross-entropy, entropy (nats)",
                "ce: −log p_l(next token); entropy: H(p_l). Means over positions.",
            ),
        ),
        meta={
            "positions": numbers.positions,
            "positions_with_target": numbers.positions_with_target,
            "every": options.every,
            "readout": numbers.readout,
            **({"lens": lens} if lens else {}),
        },
    )


def _through(lens: dict[str, Any]) -> str:
    """How the run's lens reached the readout, for a caption."""
    phrase = PHRASES[lens["kind"]]
    if "source" in lens:  # a fitted (affine) lens
        return f" after the {phrase}' translator T_l"
    return f" after the {phrase}'s blocks (docs/science.md)"


def _line(name: str, title: str, y: tuple[str, ...], ylabel: str, caption: str) -> Plot:
    """A line plot of the ``lens`` table's ``y`` columns along the residual states."""
    xlabel = "residual state h_l (0 = embedding, L = final)"
    return Plot(
        "line", name, title, "lens", x="layer", y=y, xlabel=xlabel, ylabel=ylabel, caption=caption
    )
