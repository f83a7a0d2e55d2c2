"""``contrib`` — relative sublayer contributions (docs/science.md A1).

Per layer, averaged over tokens: ``r_attn = ||a_l||/||h_l||``, ``r_mlp = ||m_l||/||h_l + a_l||``
(``||m_l||/||h_l||`` for parallel-residual models, whose MLP reads ``h_l``),
``r_block = ||a_l + m_l||/||h_l||``; cosines of each write with what it was added to, of the
update ``Δ_l = h_{l+1} - h_l`` with ``h_l`` and of ``h_{l+1}`` with ``h_l``; mean and max norms.
Denominators are clamped at 1e-6. Computed in float32 whatever the model's dtype (float64 for a
float64 model), summed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.readout import readout_dtype

EPS = 1e-6
RATIOS = ("r_attn", "r_mlp", "r_block")
COSINES = ("cos_attn", "cos_mlp", "cos_update", "cos_next")
NORMS = ("resid", "attn", "mlp")


def _norm(x: Float[Tensor, "... d_model"]) -> Float[Tensor, ...]:
    return x.norm(dim=-1)


def _cos(x: Float[Tensor, "... d_model"], y: Float[Tensor, "... d_model"]) -> Float[Tensor, ...]:
    return (x * y).sum(-1) / (_norm(x) * _norm(y)).clamp_min(EPS)


@dataclass(frozen=True)
class Contribution(Analyzer):
    """How much each attention and MLP sublayer changes the residual stream.

    Args:
        exclude_bos: Leave the BOS position (huge norms in many models) out of the averages.
    """

    name = "contrib"
    aliases = ("contribution", "sublayer")
    description = "Relative contribution and cosines of each attention/MLP sublayer, per layer"
    depth_profiles = ("contrib.r_block", "contrib.cos_update")

    exclude_bos: bool = True

    def hooks(self, info: ModelInfo) -> list[str]:
        names = [info.resid(layer) for layer in range(info.n_layers + 1)]
        for layer in range(info.n_layers):
            names += [f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mlp_out"]
        return names

    def update(self, state: Stats, step: Step) -> None:
        info = step.info
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        if not keep.any():
            return
        L = info.n_layers
        # Layer by layer where each layer's tensors live (a model split across devices), in the
        # readout dtype (float32; float64 for a float64 model: norms never in half precision),
        # the positions weighted by the mask instead of gathered: no copy of the states.
        sums: dict[str, list[Tensor]] = {}
        maxima: dict[str, list[Tensor]] = {}
        for layer in range(L):
            h_in = step.resid(layer)
            dtype = readout_dtype(h_in.dtype)
            h_in = h_in.to(dtype)
            h_next = step.resid(layer + 1).to(h_in.device, dtype)
            a = step.cache[f"blocks.{layer}.hook_attn_out"].to(h_in.device, dtype)
            m = step.cache[f"blocks.{layer}.hook_mlp_out"].to(h_in.device, dtype)
            mask = keep.to(h_in.device)
            mlp_in = h_in if info.parallel_residual else h_in + a
            norms = {"resid": _norm(h_in), "attn": _norm(a), "mlp": _norm(m)}
            values = {
                "r_attn": norms["attn"] / norms["resid"].clamp_min(EPS),
                "r_mlp": norms["mlp"] / _norm(mlp_in).clamp_min(EPS),
                "r_block": _norm(a + m) / norms["resid"].clamp_min(EPS),
                "cos_attn": _cos(a, h_in),
                "cos_mlp": _cos(m, mlp_in),
                "cos_update": _cos(h_next - h_in, h_in),
                "cos_next": _cos(h_next, h_in),
            }
            for key, value in values.items():
                sums.setdefault(key, []).append(value[mask].sum().to(keep.device))
            for key, value in norms.items():
                sums.setdefault(f"norm_{key}", []).append(value[mask].sum().to(keep.device))
                maxima.setdefault(f"norm_{key}_max", []).append(value[mask].amax().to(keep.device))
        state.add("n", int(keep.sum()))
        for key, parts in sums.items():
            state.add(key, torch.stack(parts))
        for key, parts in maxima.items():
            state.max(key, torch.stack(parts))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(ContribNumbers.from_state(state, info), self)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContribNumbers:
    """The per-layer means and maxima of a run: plain arrays, no tables, no prose.

    Args:
        columns: Per block ``l``: the ratios, the cosines (means over positions), and
            ``norm_{resid,attn,mlp}_{mean,max}``, as float64 arrays ``[L]``.
        positions: Positions averaged over.
        parallel_residual: Whether the MLP reads ``h_l`` (else ``h_l + a_l``).
    """

    columns: dict[str, np.ndarray]
    positions: int
    parallel_residual: bool

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo) -> ContribNumbers:
        """The means of a merged state."""
        n = float(state["n"])
        columns: dict[str, np.ndarray] = {}
        for key in RATIOS + COSINES:
            columns[key] = np.asarray((state[key] / n).tolist())
        for key in NORMS:
            columns[f"norm_{key}_mean"] = np.asarray((state[f"norm_{key}"] / n).tolist())
            columns[f"norm_{key}_max"] = np.asarray(state[f"norm_{key}_max"].tolist())
        return cls(columns, int(n), info.parallel_residual)

    def halves(self) -> tuple[float, float] | None:
        """Mean ``r_block`` over the first and the second half of blocks ``1..L−1`` (``None``
        with fewer than two). Block 0 writes onto the bare embedding, whose norm is small: its
        ratio is large in every model and would decide any average."""
        rest = self.columns["r_block"][1:]
        if len(rest) < 2:
            return None
        half = len(rest) // 2
        return float(rest[:half].mean()), float(rest[half:].mean())


# -- the result ----------------------------------------------------------------------------------
def present(numbers: ContribNumbers, options: Contribution) -> Result:
    """The table, plots, summary and metadata of a run's contributions."""
    r = numbers.columns["r_block"]
    layers = list(range(len(r)))
    columns: dict[str, list] = {"layer": layers}
    columns.update({key: values.tolist() for key, values in numbers.columns.items()})
    table = Table("contrib", columns, "Relative contribution of each block's sublayers")
    halves = ""
    if (split := numbers.halves()) is not None:
        first, second = split
        halves = (
            f"; over blocks 1-{len(r) - 1}, first half {first:.3g}, second half "
            f"{second:.3g} (ratio {second / first if first else float('nan'):.2f})"
        )
    summary = (
        f"Relative block contribution ||a+m||/||h||: block 0 {float(r[0]):.3g}{halves}; "
        f"largest at layer {int(r.argmax())}. Averaged over {numbers.positions} positions"
        + (" (BOS excluded)." if options.exclude_bos else ".")
    )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables={"contrib": table},
        plots=_PLOTS,
        meta={
            "positions": numbers.positions,
            "mlp_reference": "h_l" if numbers.parallel_residual else "h_l + a_l",
        },
    )


_PLOTS = (
    Plot(
        "line",
        "contrib_ratios",
        "Relative contribution per layer",
        "contrib",
        x="layer",
        y=RATIOS,
        xlabel="block l",
        ylabel="‖write‖ / ‖residual‖ (ratio, log scale)",
        logy=True,
        labels=("attention: ‖a‖ / ‖h‖", "MLP: ‖m‖ / ‖h + a‖", "block: ‖a + m‖ / ‖h‖"),
        caption="r_attn = ‖a_l‖/‖h_l‖, r_mlp = ‖m_l‖/‖h_l + a_l‖, "
        "r_block = ‖a_l + m_l‖/‖h_l‖; means over positions.",
    ),
    Plot(
        "line",
        "contrib_cosines",
        "Cosines with the residual",
        "contrib",
        x="layer",
        y=COSINES,
        xlabel="block l",
        ylabel="cosine (−1 to 1)",
        signed=True,
        ylim=(-1.0, 1.0),
        labels=("attention write, h", "MLP write, h + a", "block update, h", "h, next h"),
        caption="Cosine of each write with the residual it is added to "
        "(< 0: the write erases part of the residual).",
    ),
    Plot(
        "line",
        "contrib_norms",
        "Mean norms",
        "contrib",
        x="layer",
        y=tuple(f"norm_{k}_mean" for k in NORMS),
        xlabel="block l",
        ylabel="mean L2 norm (log scale)",
        logy=True,
        labels=("residual h", "attention write a", "MLP write m"),
    ),
)
