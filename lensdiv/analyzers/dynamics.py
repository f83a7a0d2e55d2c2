"""``dynamics`` — hidden-state dynamics along depth (docs/science.md C1).

Every token's residual states form a trajectory ``h_0, h_1, …, h_L`` (``h_L`` before the final
norm, or after it with ``final_state="post"``, which is what Hugging Face's ``hidden_states[-1]``
holds and what the source paper measured). Per token and block ``l`` with ``Δ_l = h_{l+1} − h_l``:

    θ_l  = ∠(h_l, h_{l+1})               rotation of the state by block l
    θΔ_l = ∠(Δ_l, Δ_{l+1})                ≈ 90°: neighbouring updates uncorrelated; small: smooth
    ‖h_l‖, ‖Δ_l‖, ‖Δ_l‖ / ‖h_l‖
    ∠(h_l, h_L)                           angle to the final state
    s_l  = ⟨h_l − h_0, h_L − h_0⟩ / ‖h_L − h_0‖²   chord progress (s_0 = 0, s_L = 1)

Angles use ``2·atan2(‖â − b̂‖, ‖â + b̂‖)``, which is exact near 0 and π where ``arccos`` of a
cosine is not. Across tokens the analyzer streams per-layer sums (mean and standard error),
angle histograms, the ``L × L`` second moment of the token × layer angle profiles (so their PCA
is exact without holding the tokens), the layer at which each token stops updating, and the
*last-block lens*: ``h_l`` pushed through the final block, the final norm and the unembedding,
scored by next-token cross-entropy (at ``l = L − 1`` this is the model's own loss).

The last-block lens reuses the clean residuals: every ``h_l`` goes through the final block alone
(:class:`~lensdiv.ops.resume.Resumer`, stacked along the batch, in the model's dtype), and is read
out (:mod:`lensdiv.ops.readout`: float32 final norm and unembedding) at the scored positions ``t``
with ``t mod every = 0``, recorded in the result. Everything else is elementwise work on the
cached residuals (in float32, float64 for a float64 model), so ``dynamics`` rides along with
``lens`` in one forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.errors import HookError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.blocklens import last_block_passes
from lensdiv.ops.readout import final_readout, lens_of, readout_dtype, workspace
from lensdiv.ops.resume import resumer_for
from lensdiv.ops.rowstats import cross_entropy
from lensdiv.ops.translators import PHRASES

FinalState = Literal["pre", "post"]

EPS = 1e-12


def angle(a: Float[Tensor, "*batch d"], b: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch"]:
    """The angle between ``a`` and ``b`` along the last axis, in ``[0, π]``.

    ``2·atan2(‖â − b̂‖, ‖â + b̂‖)`` is accurate for nearly parallel and nearly opposite vectors.
    A zero vector has no direction; its angle to anything is π/2 (as a clamped cosine gives).
    """
    unit_a = a / a.norm(dim=-1, keepdim=True).clamp_min(EPS)
    unit_b = b / b.norm(dim=-1, keepdim=True).clamp_min(EPS)
    return 2 * torch.atan2((unit_a - unit_b).norm(dim=-1), (unit_a + unit_b).norm(dim=-1))


@dataclass
class TokenDynamics:
    """Per-token quantities of a batch of trajectories (docs/science.md C1).

    Args:
        theta: ``θ_l = ∠(h_l, h_{l+1})``, ``l = 0..L-1``.
        theta_update: ``θΔ_l = ∠(Δ_l, Δ_{l+1})``, ``l = 0..L-2``.
        norm: ``‖h_l‖``, ``l = 0..L``.
        update: ``‖Δ_l‖``, ``l = 0..L-1``.
        to_final: ``∠(h_l, h_L)``, ``l = 0..L``.
        progress: chord progress ``s_l``, ``l = 0..L``.
    """

    theta: Float[Tensor, "n block"]
    theta_update: Float[Tensor, "n pair"]
    norm: Float[Tensor, "n state"]
    update: Float[Tensor, "n block"]
    to_final: Float[Tensor, "n state"]
    progress: Float[Tensor, "n state"]


def token_dynamics(states: Float[Tensor, "state n d"]) -> TokenDynamics:
    """Angles, norms and progress of ``n`` trajectories ``h_0..h_L`` (``states[l]`` = ``h_l``),
    computed in the readout dtype (float32; float64 for float64 states)."""
    states = states.to(readout_dtype(states.dtype))
    updates = states[1:] - states[:-1]
    chord = states[-1] - states[0]
    progress = torch.einsum("lnd,nd->nl", states - states[0], chord)
    progress = progress / (chord * chord).sum(-1, keepdim=True).clamp_min(EPS)
    return TokenDynamics(
        theta=angle(states[:-1], states[1:]).T,
        theta_update=angle(updates[:-1], updates[1:]).T,
        norm=states.norm(dim=-1).T,
        update=updates.norm(dim=-1).T,
        to_final=angle(states, states[-1:].expand_as(states)).T,
        progress=progress,
    )


def stop_layer(theta: Float[Tensor, "n block"], settle: float) -> Int[Tensor, " n"]:
    """The block after which a token has stopped updating: the first ``k`` such that blocks
    ``k..L-2`` together rotate it by at most ``1 − settle`` of its total rotation over blocks
    ``0..L-2``. The last block is not counted: in language models it usually makes a large,
    readout-specific update of every token, which would hide the early stoppers.
    """
    body = theta[:, :-1] if theta.shape[1] > 1 else theta
    remaining = body.flip(-1).cumsum(-1).flip(-1)  # rotation left from block k on
    total = remaining[:, :1].clamp_min(EPS)
    still_moving = remaining > (1 - settle) * total
    # Last block still moving, plus one; 0 if none moves (a token that never rotates).
    index = torch.arange(1, body.shape[1] + 1, device=theta.device)
    return (still_moving * index).amax(-1)


@dataclass(frozen=True)
class Dynamics(Analyzer):
    """Hidden-state dynamics: angles, norms, progress, the last-block lens and angle PCA.

    Args:
        final_state: ``pre``: ``h_L`` is the last block's output; ``post``: the final norm's
            output (Hugging Face's ``hidden_states[-1]``, as in the source paper).
        exclude_bos: Leave the BOS position out of every statistic.
        every: Score the last-block lens at positions ``t`` with ``t mod every = 0`` that have
            a next token (1 = all, 0 = no lens; its readouts cost a full-vocabulary matmul per
            layer).
        settle: A token has stopped updating once at most ``1 − settle`` of its rotation is
            left; "early" means by the middle block.
        components: Principal components of the angle profiles to report.
        bins: Histogram bins of the angles over ``[0, π]``.
    """

    name = "dynamics"
    reads_lens = True  # through lens_of (--lens)
    aliases = ("hidden-dynamics", "hidden")
    description = (
        "Hidden-state dynamics: per-layer rotation, update angles, norms, chord progress, "
        "last-block lens loss, angle PCA"
    )
    depth_profiles = ("updates.rel_update", "updates.theta", "updates.theta_update")
    extra_forwards = True

    final_state: FinalState = "pre"
    exclude_bos: bool = False
    every: int = 8
    settle: float = 0.9
    components: int = 3
    bins: int = 90

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"every must be 0 (no lens) or positive, got {self.every}")
        if not 0 < self.settle <= 1:
            raise ValueError(f"settle must be in (0, 1], got {self.settle}")
        if self.components < 1 or self.bins < 1:
            raise ValueError("components and bins must be at least 1")

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state: Stats, step: Step) -> None:
        info = step.info
        L = info.n_layers
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        states = [step.resid(layer) for layer in range(L)]
        states.append(self._final(step))
        with torch.no_grad():
            self._accumulate(state, token_dynamics(torch.stack([h[keep] for h in states])))
            if self.every:
                self._last_block_lens(state, step, keep)

    def _final(self, step: Step) -> Float[Tensor, "batch pos d_model"]:
        h_last = step.resid(step.info.n_layers)
        if self.final_state == "pre":
            return h_last
        if getattr(step.model, "ln_final", None) is None:
            raise HookError(
                "final_state=post needs the model's final norm (ln_final), which it does not have",
                hint="use -O dynamics.final_state=pre",
            )
        # The final norm in the readout dtype (the model's own norm, decomposed and verified).
        normed = final_readout(step.model).normalize(h_last.reshape(-1, h_last.shape[-1]))
        return normed.to(h_last.device).view(*h_last.shape[:-1], -1)

    def _accumulate(self, state: Stats, token: TokenDynamics) -> None:
        n, L = token.theta.shape
        rel_update = token.update / token.norm[:, :-1].clamp_min(EPS)
        state.add("n", n)
        for key, value in (
            ("theta", token.theta),
            ("theta_update", token.theta_update),
            ("norm", token.norm),
            ("update", token.update),
            ("rel_update", rel_update),
            ("to_final", token.to_final),
            ("progress", token.progress),
        ):
            value = value.double()
            state.add(key, value.sum(0))
            state.add(f"{key}_sq", (value * value).sum(0))
        theta = token.theta.double()
        state.add("profile_outer", theta.T @ theta)
        state.add("theta_hist", _histogram(token.theta, self.bins))
        state.add("theta_update_hist", _histogram(token.theta_update, self.bins))
        stops = stop_layer(token.theta, self.settle)
        state.add("stop_hist", torch.bincount(stops, minlength=max(L, 1))[: max(L, 1)])
        gap = token.to_final[:, 0] - token.theta.sum(-1)  # ∠(h_0, h_L) − Σ θ_l ≤ 0
        state.max("triangle_gap", gap.max() if n else torch.tensor(-math.inf))

    def _last_block_lens(self, state: Stats, step: Step, keep: Bool[Tensor, "b p"]) -> None:
        """Next-token CE of ``readout(f_{L-1}(h_l))`` at the scored positions ``t`` with
        ``t mod every = 0``."""
        info, batch = step.info, step.batch
        L = info.n_layers
        targets, has_target = batch.next_tokens()
        pos = torch.arange(keep.shape[1], device=keep.device)
        rows = (keep & has_target & (pos % self.every == 0)).flatten().nonzero()[:, 0]
        if rows.numel() == 0:
            return
        resumer = resumer_for(step)
        readout, ws = final_readout(step.model), workspace(step)
        tokens = batch.tokens
        n_seq, n_pos = tokens.shape
        wanted = targets.flatten()[rows]
        ce = torch.zeros(L, dtype=torch.float64, device=tokens.device)
        passes = last_block_passes(resumer, tokens, step.resid, L)
        for layers, out in passes:
            lo = layers[0]
            # Every state's scored rows in one readout: large unembedding blocks.
            final = out.reshape(len(layers), n_seq * n_pos, -1)[:, rows]
            losses = cross_entropy(
                readout, final.flatten(0, 1), wanted.repeat(len(layers)), workspace=ws
            )
            ce[lo : lo + len(layers)] = losses.view(len(layers), -1).sum(1).to(ce.device)
        last = step.resid(L).reshape(n_seq * n_pos, -1)[rows]
        ce[L - 1] = cross_entropy(readout, last, wanted, workspace=ws).sum().to(ce.device)
        state.add("lens_ce", ce)
        lens = lens_of(step)
        if not lens.identity:  # the run's lens beside it: R_l(h_l), same rows
            fitted = torch.zeros(L, dtype=torch.float64, device=tokens.device)
            flat = [step.resid(layer).reshape(n_seq * n_pos, -1) for layer in range(L + 1)]
            read = lens.reader(step.model, tokens, dtype=readout.dtype, device=readout.device)
            for layer in range(L):
                h = read(flat, layer, rows)
                fitted[layer] = cross_entropy(readout, h, wanted, workspace=ws).sum()
            state.add("fitted_lens_ce", fitted)
            state.fix("lens", lens.describe())
        state.add("lens_n", rows.numel())
        state.add("lens_blocks", max(L - 1, 0) * n_seq)
        state.fix("resume_mode", resumer.mode)
        state.fix("readout", readout.precision)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(LayerDynamics.from_state(state, info, components=self.components), self)


_KEYS = ("theta", "theta_update", "norm", "update", "rel_update", "to_final", "progress")


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerDynamics:
    """The per-layer statistics over tokens of a run (docs/science.md C1): no tables, no prose.

    Args:
        n_layers: Blocks ``L``.
        positions: Tokens whose trajectories were measured.
        mean: Mean over tokens of every :class:`TokenDynamics` quantity and of ``rel_update``
            (``‖Δ_l‖ / ‖h_l‖``), as listed there: ``L`` blocks, ``L − 1`` pairs, ``L + 1``
            states.
        sem: Their standard errors.
        lens_positions: Positions scored by the last-block lens.
        lens_ce: Last-block lens cross-entropy of ``h_l`` per block (NaN without the lens).
        stops: Fraction of tokens that stop updating after block ``k``.
        explained: Explained-variance ratios of the leading angle-profile components.
        components: Their loadings on ``θ_l`` (largest loading positive).
        theta_hist: Fraction of tokens per angle bin of ``θ_l``, ``[bin, block]``.
        theta_update_hist: The same for ``θΔ_l``, ``[bin, pair]``.
        triangle_gap_max: The largest ``∠(h_0, h_L) − Σ θ_l`` (at most 0 up to rounding).
        readout: Precision of the lens' readout (``None`` without the lens).
        lens_resume: How the lens ran the final block (``None`` without the lens).
        fitted: The run's fitted lens (``--lens``), if any: its description.
        fitted_ce: Its next-token cross-entropy of ``h_l`` per block, at the same positions.
    """

    n_layers: int
    positions: int
    mean: Mapping[str, list[float]]
    sem: Mapping[str, list[float]]
    lens_positions: int
    lens_ce: list[float]
    stops: Float[Tensor, " block"]
    explained: list[float]
    components: list[list[float]]
    theta_hist: Float[Tensor, "bin block"]
    theta_update_hist: Float[Tensor, "bin pair"]
    triangle_gap_max: float
    readout: Any
    lens_resume: Any
    fitted: Any = None
    fitted_ce: list[float] | None = None

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo, *, components: int) -> LayerDynamics:
        """Means, standard errors, stops, PCA and histograms from the merged sums."""
        L = info.n_layers
        n = float(state["n"])
        stats = {key: _mean_sem(state, key, n) for key in _KEYS}
        lens_n = float(state.get("lens_n", 0.0))
        ratios, loadings = _pca(state, n, components)
        return cls(
            n_layers=L,
            positions=int(n),
            mean={key: stats[key][0] for key in _KEYS},
            sem={key: stats[key][1] for key in _KEYS},
            lens_positions=int(lens_n),
            lens_ce=(state["lens_ce"] / lens_n).tolist() if lens_n else [math.nan] * L,
            stops=state["stop_hist"] / max(n, 1.0),
            explained=ratios,
            components=loadings,
            theta_hist=(state["theta_hist"] / max(n, 1.0)).T,
            theta_update_hist=(state["theta_update_hist"] / max(n, 1.0)).T,
            triangle_gap_max=float(state["triangle_gap"]),
            readout=state.get("readout"),
            lens_resume=state.get("resume_mode"),
            fitted=state.get("lens"),
            fitted_ce=(state["fitted_lens_ce"] / lens_n).tolist()
            if "fitted_lens_ce" in state and lens_n
            else None,
        )

    def per_block(self, key: str, values: Mapping[str, list[float]] | None = None) -> list[float]:
        """``mean`` (or ``values``) of ``key`` for blocks ``0..L−1``; ``θΔ`` of the last block,
        which has no next update, is NaN."""
        column = list((self.mean if values is None else values)[key])
        return (column + [math.nan])[: self.n_layers] if key == "theta_update" else column

    @property
    def middle(self) -> list[int]:
        """The middle blocks (:func:`middle_blocks`)."""
        return middle_blocks(self.n_layers)

    def middle_mean(self, key: str) -> float:
        """Mean over the middle blocks of the per-block mean of ``key`` (NaN entries skipped)."""
        return _mean_of(self.per_block(key), self.middle)

    @property
    def early_blocks(self) -> int:
        """Blocks counted as early: the first half (at least one)."""
        return max(self.n_layers // 2, 1)

    @property
    def early_stop_fraction(self) -> float:
        """Fraction of tokens that stop updating by the middle block."""
        return float(self.stops[: self.early_blocks].sum())


# -- the result ----------------------------------------------------------------------------------
def present(dynamics: LayerDynamics, options: Dynamics) -> Result:
    """Tables, histograms, PCA loadings, plots, summary and metadata of the dynamics."""
    middle, ratios = dynamics.middle, dynamics.explained
    meta = {
        "positions": dynamics.positions,
        "lens_positions": dynamics.lens_positions,
        "every": options.every,
        "readout": dynamics.readout,
        "final_state": options.final_state,
        "middle_blocks": [middle[0], middle[-1]],
        "mean_middle_update": dynamics.middle_mean("update"),
        "mean_middle_rel_update": dynamics.middle_mean("rel_update"),
        "mean_middle_theta": dynamics.middle_mean("theta"),
        "mean_middle_theta_update": dynamics.middle_mean("theta_update"),
        "early_stop_fraction": dynamics.early_stop_fraction,
        "triangle_gap_max": dynamics.triangle_gap_max,
        "last_block_lens": dynamics.lens_resume,
        **({"lens": dynamics.fitted} if dynamics.fitted else {}),
    }
    summary = (
        f"Middle blocks {middle[0]}-{middle[-1]} rotate each token by "
        f"{math.degrees(meta['mean_middle_theta']):.1f}° and change it by "
        f"{meta['mean_middle_rel_update']:.1%} of its norm; neighbouring updates are "
        f"{math.degrees(meta['mean_middle_theta_update']):.0f}° apart (90° = uncorrelated). "
        f"{dynamics.early_stop_fraction:.0%} of tokens stop updating by block "
        f"{dynamics.early_blocks - 1}. The first angle-profile component explains "
        f"{ratios[0] if ratios else math.nan:.0%} of the variance over {dynamics.positions} "
        "tokens."
    )
    return Result(
        analyzer=options.name,
        summary=summary,
        tables=_tables(dynamics, options.settle),
        arrays={
            "theta_hist": dynamics.theta_hist.tolist(),
            "theta_update_hist": dynamics.theta_update_hist.tolist(),
            "pca_components": dynamics.components,
        },
        plots=(
            *_line_plots(dynamics.fitted),
            *_heatmaps(dynamics.n_layers, options.bins, len(ratios)),
        ),
        meta=meta,
    )


def _tables(dynamics: LayerDynamics, settle: float) -> dict[str, Table]:
    """``updates`` (per block), ``states`` (per residual state), ``stop`` and ``pca``."""
    L = dynamics.n_layers
    mean, sem = dynamics.mean, dynamics.sem
    updates = Table(
        "updates",
        {
            "block": list(range(L)),
            "theta": mean["theta"],
            "theta_sem": sem["theta"],
            "theta_update": dynamics.per_block("theta_update"),
            "theta_update_sem": dynamics.per_block("theta_update", sem),
            "update": mean["update"],
            "rel_update": mean["rel_update"],
            "last_block_lens_ce": dynamics.lens_ce,
            **(
                {f"{dynamics.fitted['kind']}_lens_ce": dynamics.fitted_ce}
                if dynamics.fitted and dynamics.fitted_ce is not None
                else {}
            ),
        },
        "Per block l: θ_l = ∠(h_l, h_{l+1}) and θΔ_l = ∠(Δ_l, Δ_{l+1}) in radians (mean, sem "
        "over tokens), ‖Δ_l‖, ‖Δ_l‖/‖h_l‖, and the last-block lens cross-entropy of h_l",
    )
    states_table = Table(
        "states",
        {
            "layer": list(range(L + 1)),
            "norm": mean["norm"],
            "norm_sem": sem["norm"],
            "to_final": mean["to_final"],
            "progress": mean["progress"],
            "progress_sem": sem["progress"],
        },
        "Per residual state h_l: norm, angle to the final state (rad), chord progress s_l",
    )
    stops = dynamics.stops
    stop_table = Table(
        "stop",
        {
            "block": list(range(L)),
            "fraction": stops.tolist(),
            "cumulative": stops.cumsum(0).tolist(),
        },
        f"Fraction of tokens that stop updating after block k ({settle:.0%} of their "
        "rotation done; the last block not counted)",
    )
    ratios = dynamics.explained
    pca_table = Table(
        "pca",
        {
            "component": list(range(1, len(ratios) + 1)),
            "explained": ratios,
            "cumulative": torch.tensor(ratios).cumsum(0).tolist() if ratios else [],
        },
        "PCA of the token × block angle profiles θ_l: explained variance ratio",
    )
    return {"updates": updates, "states": states_table, "stop": stop_table, "pca": pca_table}


def _line_plots(fitted: Any = None) -> tuple[Plot, ...]:
    """The curves along depth: angles, update sizes, progress, angle to the end, norms, lens."""
    state_axis = "residual state h_l (0 = embedding, L = final)"
    return (
        Plot(
            "line",
            "dynamics_angles",
            "Rotation per block and angle between neighbouring updates",
            "updates",
            x="block",
            y=("theta", "theta_update"),
            xlabel="block l",
            ylabel="angle (rad; π/2 = orthogonal)",
            labels=("θ_l: h_l to h_{l+1}", "θΔ_l: update l to update l+1"),
            ylim=(0.0, math.pi),
            thresholds=((math.pi / 2, "π/2: orthogonal"),),
            caption="theta: θ_l = ∠(h_l, h_{l+1}); theta_update: ∠(Δ_l, Δ_{l+1}) (π/2 = "
            "uncorrelated updates). Means over tokens.",
        ),
        Plot(
            "line",
            "dynamics_updates",
            "Relative update size per block",
            "updates",
            x="block",
            y=("rel_update",),
            xlabel="block l",
            ylabel="‖Δ_l‖ / ‖h_l‖ (ratio)",
        ),
        Plot(
            "line",
            "dynamics_progress",
            "Chord progress along depth",
            "states",
            x="layer",
            y=("progress",),
            xlabel=state_axis,
            ylabel="chord progress s_l (0 = h_0, 1 = h_L)",
            caption="s_l = ⟨h_l − h_0, h_L − h_0⟩ / ‖h_L − h_0‖²; mean over tokens.",
        ),
        Plot(
            "line",
            "dynamics_to_final",
            "Angle to the final state",
            "states",
            x="layer",
            y=("to_final",),
            xlabel=state_axis,
            ylabel="∠(h_l, h_L) (rad)",
            ylim=(0.0, math.pi),
            thresholds=((math.pi / 2, "π/2: orthogonal"),),
        ),
        Plot(
            "line",
            "dynamics_norm",
            "Residual norm",
            "states",
            x="layer",
            y=("norm",),
            xlabel=state_axis,
            ylabel="‖h_l‖ (L2 norm, log scale)",
            logy=True,
        ),
        Plot(
            "line",
            "dynamics_last_block_lens",
            "Last-block lens: loss of h_l through the final block"
            + (f", and the {PHRASES[fitted['kind']]}" if fitted else ""),
            "updates",
            x="block",
            y=("last_block_lens_ce", *((f"{fitted['kind']}_lens_ce",) if fitted else ())),
            xlabel="input state h_l",
            ylabel="next-token cross-entropy (nats)",
            caption="h_l pushed through the final block, the final norm and the unembedding; "
            "at l = L − 1 this is the model's own loss."
            + (
                f" {fitted['kind']}_lens_ce: h_l through the run's lens (R_l), then the "
                "final norm and unembedding."
                if fitted
                else ""
            ),
        ),
    )


def _heatmaps(n_layers: int, bins: int, components: int) -> tuple[Plot, ...]:
    """The angle histogram and the PCA loadings (their axes depend on the depth, the bins and
    the components)."""
    return (
        Plot(
            "heatmap",
            "dynamics_theta_hist",
            "Distribution of the rotation θ_l per block",
            "theta_hist",
            xlabel="block l",
            ylabel="θ_l = ∠(h_l, h_{l+1}) (degrees)",
            clabel=f"fraction of tokens (per {180 / bins:.3g}° bin)",
            extent=(-0.5, n_layers - 0.5, 0.0, 180.0),
        ),
        Plot(
            "heatmap",
            "dynamics_pca",
            "Angle-profile PCA loadings",
            "pca_components",
            xlabel="block l",
            ylabel="principal component",
            clabel="loading on θ_l (unit-vector component)",
            signed=True,
            yticklabels=tuple(f"PC{i + 1}" for i in range(components)),
            caption="Rows: the leading principal components of the token × block angle "
            "profiles θ_l (largest loading positive).",
        ),
    )


def _histogram(values: Float[Tensor, "n k"], bins: int) -> Int[Tensor, "k bins"]:
    """Per-column counts of angles in ``bins`` equal bins over ``[0, π]``."""
    n, k = values.shape
    index = (values / math.pi * bins).long().clamp(0, bins - 1)
    index = index + torch.arange(k, device=values.device) * bins
    return torch.bincount(index.flatten(), minlength=k * bins).reshape(k, bins)


def _mean_sem(state: Stats, key: str, n: float) -> tuple[list[float], list[float]]:
    total, squares = state[key], state[f"{key}_sq"]
    mean = total / max(n, 1.0)
    var = (squares / max(n, 1.0) - mean * mean).clamp_min(0.0)
    sem = var.sqrt() / math.sqrt(max(n - 1, 1.0))
    return mean.tolist(), sem.tolist()


def _pca(state: Stats, n: float, k: int) -> tuple[list[float], list[list[float]]]:
    """Explained-variance ratios and loadings of the top ``k`` components of the angle profiles,
    from the streamed first and second moments (signs fixed: largest loading positive)."""
    if n < 2:
        return [], []
    mean = state["theta"] / n
    cov = state["profile_outer"] / n - torch.outer(mean, mean)
    values, vectors = torch.linalg.eigh(cov)
    values, vectors = values.flip(0).clamp_min(0.0), vectors.flip(1)
    total = float(values.sum())
    k = min(k, values.shape[0])
    vectors = vectors[:, :k]
    signs = torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))
    ratios = (values[:k] / total).tolist() if total > 0 else [0.0] * k
    return ratios, (vectors * signs).T.tolist()


def middle_blocks(n_layers: int) -> list[int]:
    """Blocks ``l`` with ``L/4 ≤ l < 3L/4``, never the first or the last (the embedding-facing
    block 0 and the readout-facing block ``L−1`` behave unlike the rest); all blocks for L ≤ 2."""
    inner = range(1, n_layers - 1)
    middle = [b for b in inner if n_layers / 4 <= b < 3 * n_layers / 4]
    return middle or list(inner) or list(range(n_layers))


def _mean_of(values: Any, index: list[int]) -> float:
    picked = [float(values[i]) for i in index if not math.isnan(float(values[i]))]
    return sum(picked) / len(picked) if picked else math.nan


def update_scaling(results: Sequence[Result], key: str = "rel_update") -> dict[str, Any]:
    """Across models of different depth: the log–log slope of the mean middle-block update
    against depth (docs/science.md C1; about −1 in LLMs, where many similar small updates add up).

    Args:
        results: ``dynamics`` results of models of at least two different depths.
        key: ``rel_update`` (``‖Δ_l‖/‖h_l‖``), ``update`` (``‖Δ_l‖``) or ``theta``.

    Returns:
        ``{"depths", "values", "slope", "intercept"}`` (least squares in log–log).
    """
    import numpy as np

    depths, values = [], []
    for result in results:
        column = result.table("updates")[key]
        depths.append(len(column))
        values.append(_mean_of(column, middle_blocks(len(column))))
    if len(set(depths)) < 2:
        raise ValueError("update_scaling needs models of at least two different depths")
    slope, intercept = np.polyfit(np.log(depths), np.log(values), 1)
    return {
        "depths": depths,
        "values": values,
        "slope": float(slope),
        "intercept": float(intercept),
    }
