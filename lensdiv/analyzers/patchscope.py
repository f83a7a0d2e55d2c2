"""``patchscope`` — the (source ℓ × target ℓ*) sweep of Patchscopes (docs/science.md P1): every
residual state ``h_ℓ`` patched into the inspection prompt as the input of every block ``ℓ*``,
read at the prompt's last position, and compared with the model's output at the source position.

Per pair ``(ℓ, ℓ*)``: ``KL(p_{ℓ→ℓ*} ‖ p_out)``, top-1 agreement with the output, and the
next-token cross-entropy, means over the read positions (``t mod every = 0``). The Patchscopes
paper's layer-to-layer figure; its diagonal is the ``lens`` analyzer through ``--lens
patchscope``, its column ``ℓ* = L − 1`` through ``--lens patchscope:target=last``. The readout is
:func:`lensdiv.ops.rowstats.lens_statistics` through a :class:`~lensdiv.ops.blocklens.PatchscopeLens`
per target block (its prefix cached once, every source layer and position of a batch in one
continuation per target).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.blocklens import DEFAULT_PROMPT, PatchscopeLens
from lensdiv.ops.readout import final_readout, workspace
from lensdiv.ops.rowstats import lens_statistics

_MEASURES = (
    ("kl", "KL(p_ℓ→ℓ* ‖ p_out) (nats)", "KL to the output"),
    ("top1", "top-1 agreement with the output (0 to 1)", "top-1 agreement"),
    ("ce", "next-token cross-entropy (nats)", "cross-entropy"),
)


@dataclass(frozen=True)
class PatchscopeSweep(Analyzer):
    """Patchscopes from every source state into every target block.

    Args:
        prompt: The inspection prompt (default: the token-identity prompt).
        position: The patched position of the prompt (negative from the end).
        every: Read positions ``t`` with ``t mod every = 0`` (each costs ``L`` continuations
            of ``Σ_ℓ* (L − ℓ*)`` one-token block evaluations).
        exclude_bos: Leave the BOS position out.
    """

    name = "patchscope"
    description = "Patchscopes: every h_l patched into every block l* of an inspection prompt"

    prompt: str = DEFAULT_PROMPT
    position: int = -1
    every: int = 16
    exclude_bos: bool = True

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be at least 1, got {self.every}")
        PatchscopeLens(self.prompt, self.position)  # a bad prompt: refused at once

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state: Stats, step: Step) -> None:
        info, batch = step.info, step.batch
        L = info.n_layers
        keep = batch.positions(exclude_bos=self.exclude_bos)
        pos = torch.arange(keep.shape[1], device=keep.device)
        keep = keep & (pos % self.every == 0)
        targets, has_target = batch.next_tokens()
        rows = keep.reshape(-1).nonzero()[:, 0]
        w = has_target.reshape(-1)[rows].double()
        readout = final_readout(step.model)
        states = [step.resid(layer) for layer in range(L + 1)]
        kl = torch.zeros(L, L, dtype=torch.float64)
        top1 = torch.zeros(L, L, dtype=torch.float64)
        ce = torch.zeros(L, L, dtype=torch.float64)
        for target in range(L):
            lens = PatchscopeLens(self.prompt, self.position, target)
            out = lens_statistics(
                readout,
                states,
                rows,
                targets.reshape(-1)[rows],
                k=1,
                workspace=workspace(step),
                translator=lens,
                model=step.model,
                tokens=batch.tokens,
            )
            kl[:, target] = out.kl[:L].sum(1).cpu()
            top1[:, target] = out.overlap[:L].sum(1).cpu()
            ce[:, target] = (-(out.target_logp[:L] * w).sum(1)).cpu()
        state.fix("lens", PatchscopeLens(self.prompt, self.position).describe())
        state.fix("readout", readout.precision)
        state.add("n", rows.numel())
        state.add("n_target", w.sum())
        state.add("kl", kl)
        state.add("top1", top1)
        state.add("ce", ce)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        L = info.n_layers
        n, nt = max(float(state["n"]), 1.0), max(float(state["n_target"]), 1.0)
        means = {
            "kl": (state["kl"] / n).numpy(),
            "top1": (state["top1"] / n).numpy(),
            "ce": (state["ce"] / nt).numpy(),
        }
        return _present(means, L, int(state["n"]), state.get("lens"), state.get("readout"))


def _present(means: dict[str, np.ndarray], L: int, n: int, lens: Any, readout: Any) -> Result:
    """The sweep's table (one row per pair), heatmaps and summary."""
    source, target = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    table = Table(
        "pairs",
        {
            "source": source.reshape(-1).tolist(),
            "target": target.reshape(-1).tolist(),
            **{key: value.reshape(-1).tolist() for key, value in means.items()},
        },
        "Patchscope of h_source patched into block target: means over the read positions",
    )
    diagonal = np.diag(means["kl"])
    best = means["kl"].argmin(1)
    summary = (
        f"Patchscope sweep over {n} positions: KL to the output on the diagonal (target = "
        f"source) falls from {diagonal[0]:.3g} at h0 to {diagonal[-1]:.3g} at h{L - 1}; "
        f"the lowest-KL target per source: {', '.join(f'h{s}→{int(t)}' for s, t in enumerate(best))}."
    )
    plots = tuple(
        Plot(
            "heatmap",
            f"patchscope_{key}",
            f"Patchscope: {title} by source and target layer",
            key,
            xlabel="target block ℓ* (where the state enters)",
            ylabel="source state h_ℓ",
            clabel=clabel,
            limits=(0.0, 1.0) if key == "top1" else None,
            caption="Each cell: h_ℓ of the data patched into the inspection prompt's last "
            "position as block ℓ*'s input, read at the prompt's last position; mean over "
            "positions.",
        )
        for key, clabel, title in _MEASURES
    )
    return Result(
        analyzer="patchscope",
        summary=summary,
        tables={"pairs": table},
        arrays={key: value for key, value in means.items()},
        plots=plots,
        meta={"positions": n, "lens": lens, "readout": readout},
    )
