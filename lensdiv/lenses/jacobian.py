"""Fitting a Jacobian lens (docs/science.md D2) through lensdiv's feeds, in TransformerLens' format.

``J_l = E_prompt[(1/|V|) Σ_{t∈V} Σ_{t'≥t} ∂h_{L,t'}/∂h_{l,t}]`` with ``h_L`` the last block's output
(before the final norm) and ``V`` the positions from ``skip_first`` to the last but one.

**Exact** (the reference estimator): per prompt, TransformerLens' own step
(``transformer_lens.tools.analysis.jacobian_lens._jacobian_for_prompt``: one forward of the prompt
copied ``dim_batch`` times, then ``⌈d_model/dim_batch⌉`` backward passes of one-hot cotangents),
so a lensdiv fit equals ``JacobianLens.fit`` on the same prompts. Every packed row of the data
(its real tokens only) is one prompt.

**Sketch** (faster, unbiased): per prompt, ``K`` orthonormal random directions ``q_k`` (fresh
per prompt, seeded by the prompt's place in the data) planted at every valid target in one
batched backward (``torch.autograd.grad(..., is_grads_batched=True)``) give the rows
``q_kᵀ J_p``; then ``Ĵ_p = R + (d/K) Σ_k q_k q_kᵀ (J_p − R)``, unbiased for any ``R``. ``R`` is a
control variate: the exact mean Jacobian of the prompts of the first ``warmup`` batches, fitted
in a first pass and fixed in the state, so the sketch's noise scales with how much a prompt's Jacobian differs
from the mean, not with the Jacobian itself. ``K = d/8`` does about an eighth of the exact
backward work per prompt.

The state holds float64 sums of the per-prompt Jacobians (``exact/l``, ``sketch/l``) and the prompt
counts (sums: shards and ranks merge exactly); the result carries the lens as TransformerLens' file
(``jacobian_lens.pt``: ``J``, ``n_prompts``, ``source_layers``, ``d_model`` and its metadata), which
``JacobianLens.load`` and ``lensdiv --lens jacobian:FILE`` read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import UnsupportedModelError
from lensdiv.core.provenance import versions
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.ops.lens_files import JACOBIAN_FILE, JacobianLensFile

Estimator = Literal["exact", "sketch"]


@dataclass(frozen=True)
class JacobianFit(Analyzer):
    """Fit a Jacobian lens: the mean Jacobian of the last block's output w.r.t. each layer's.

    Args:
        estimator: ``exact`` (TransformerLens' reference estimator) or ``sketch`` (random
            orthonormal probes with a control variate: unbiased, about ``probes/d_model`` of
            the backward work; two passes).
        dim_batch: Exact: output dimensions per backward pass (TransformerLens' default 8).
        skip_first: Leading positions that are neither sources nor targets (BOS and the
            first tokens; TransformerLens' default 16).
        probes: Sketch: probe directions per prompt (0: ``d_model / 8``).
        warmup: Sketch: batches whose prompts are fitted exactly in the first pass; their
            mean is the control variate.
        seed: Sketch: seed of the probe directions.
        save_dtype: Storage dtype of the lens file (TransformerLens saves float16 by default).
    """

    name = "fit-jacobian"
    description = "Fit a Jacobian lens (mean ∂h_L/∂h_l over prompts) in TransformerLens' format"
    depth_profiles = ()  # a fit, not a depth analysis: nothing for a study to compare

    estimator: Estimator = "exact"
    dim_batch: int = 8
    skip_first: int = 16
    probes: int = 0
    warmup: int = 1
    seed: int = 0
    save_dtype: Literal["float32", "float16"] = "float32"

    def __post_init__(self) -> None:
        for name in ("dim_batch", "warmup"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.skip_first < 0 or self.probes < 0:
            raise ValueError("skip_first and probes must be >= 0")

    def n_passes(self, info: ModelInfo) -> int:
        return 2 if self.estimator == "sketch" else 1

    def hooks(self, info: ModelInfo) -> list[str]:
        return []

    def setup(self, model: Bridge, info: ModelInfo) -> None:
        if info.n_layers < 2:
            raise UnsupportedModelError("a Jacobian lens needs at least 2 blocks")
        if self.probes > info.d_model:
            raise ValueError(f"probes={self.probes} exceeds d_model={info.d_model}")

    def update(self, state: Stats, step: Step) -> None:
        batch, info = step.batch, step.info
        layers = list(range(info.n_layers - 1))
        for row in range(batch.tokens.shape[0]):
            tokens = batch.tokens[row][batch.mask[row]][None]
            if tokens.shape[1] <= self.skip_first + 1:
                if step.pass_index == 0:
                    state.add("too_short", 1)
                continue
            exact = self.estimator == "exact" or step.pass_index == 0
            if self.estimator == "sketch" and (batch.index < self.warmup) != exact:
                continue  # the warm-up batches in pass 0, the others sketched in pass 1
            if exact:
                per = exact_jacobians(step.model, tokens, layers, self.dim_batch, self.skip_first)
            else:
                per = sketch_jacobians(
                    step.model,
                    tokens,
                    layers,
                    self.skip_first,
                    self._probes(info, batch.index, row),
                    {k: state[f"control/{k}"] for k in layers},
                )
            tag = "exact" if exact else "sketch"  # a pass writes names of its own
            for k in layers:
                state.add(f"{tag}/{k}", per[k].double())
            state.add(f"prompts/{tag}", 1)
            state.add(f"tokens/{tag}", tokens.shape[1])

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        """Sketch: the exact mean of the warm-up prompts becomes the control variate."""
        n = float(state["prompts/exact"]) if "prompts/exact" in state else 0.0
        if n == 0:
            raise ValueError("no prompt of the warm-up batches was long enough to fit exactly")
        for k in range(info.n_layers - 1):
            state.fix(f"control/{k}", (state[f"exact/{k}"] / n).float())

    def _probes(self, info: ModelInfo, batch: int, row: int) -> Float[Tensor, "k d_model"]:
        """Fresh orthonormal directions for the prompt at ``row`` of batch ``batch`` (the same
        in every process and shard)."""
        k = self.probes or max(1, info.d_model // 8)
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + batch) * 65_537 + row)
        gauss = torch.randn(info.d_model, k, generator=gen, dtype=torch.float64)
        q, _ = torch.linalg.qr(gauss)  # orthonormal columns
        return q.T.contiguous()

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(MeanJacobians.from_state(state, info), self, info)


# -- the numbers -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeanJacobians:
    """The fitted Jacobian lens: no tables, no prose.

    Args:
        means: Per TransformerLens layer ``k`` (reading ``h_{k+1}``, ``k = 0..L-2``) the mean
            Jacobian over prompts (float32, CPU).
        prompts_exact: Prompts fitted exactly.
        prompts_sketched: Prompts fitted by the sketch.
        too_short: Rows too short to fit.
        tokens: Tokens of the prompts fitted.
        frobenius: Per layer ``‖J_k‖``.
        distance_from_identity: Per layer ``‖J_k − I‖/‖I‖``.
        cosine_with_identity: Per layer ``cos(J_k, I)``.
    """

    means: dict[int, Tensor]
    prompts_exact: int
    prompts_sketched: int
    too_short: int
    tokens: int
    frobenius: list[float]
    distance_from_identity: list[float]
    cosine_with_identity: list[float]

    @property
    def prompts(self) -> int:
        return self.prompts_exact + self.prompts_sketched

    @classmethod
    def from_state(cls, state: Stats, info: ModelInfo) -> MeanJacobians:
        """The mean over prompts of the summed per-prompt Jacobians, and how far each is from
        the identity.

        Raises:
            ValueError: No prompt was long enough.
        """
        n_exact = int(state.get("prompts/exact", 0))
        n_sketch = int(state.get("prompts/sketch", 0))
        n = n_exact + n_sketch
        if n == 0:
            raise ValueError("no prompt was long enough (raise --seq-len or lower skip_first)")
        layers = range(info.n_layers - 1)
        means = {
            k: (
                sum(state[f"{tag}/{k}"] for tag in ("exact", "sketch") if f"{tag}/{k}" in state) / n
            )
            .float()
            .cpu()
            for k in layers
        }
        eye = torch.eye(info.d_model)
        return cls(
            means,
            n_exact,
            n_sketch,
            int(state.get("too_short", 0)),
            int(state.get("tokens/exact", 0)) + int(state.get("tokens/sketch", 0)),
            [float(means[k].norm()) for k in layers],
            [float((means[k] - eye).norm() / eye.norm()) for k in layers],
            [float((means[k] * eye).sum() / (means[k].norm() * eye.norm())) for k in layers],
        )


# -- the presentation ------------------------------------------------------------------------------


def present(fitted: MeanJacobians, options: JacobianFit, info: ModelInfo) -> Result:
    """The fit's table, plot and summary, and the lens as TransformerLens' file."""
    layers = list(range(info.n_layers - 1))
    table = Table(
        "jacobian",
        {
            "layer": layers,
            "state": [f"h{k + 1}" for k in layers],
            "frobenius": fitted.frobenius,
            "distance_from_identity": fitted.distance_from_identity,
            "cosine_with_identity": fitted.cosine_with_identity,
        },
        "Mean Jacobian ∂h_L/∂h_l of each layer (h_l = output of block l - 1)",
    )
    dtype = torch.float16 if options.save_dtype == "float16" else torch.float32
    artifact = JacobianLensFile(
        JACOBIAN_FILE,
        fitted.means,
        fitted.prompts,
        info.d_model,
        _metadata(fitted, options, info),
        dtype,
    )
    summary = (
        f"Jacobian lens ({options.estimator}) from {fitted.prompts} prompts ({fitted.tokens} "
        f"tokens): ‖J_l − I‖/‖I‖ {fitted.distance_from_identity[0]:.3g} at h1 → "
        f"{fitted.distance_from_identity[-1]:.3g} at h{info.n_layers - 1}; saved as "
        f"{JACOBIAN_FILE} (TransformerLens' format)."
    )
    return Result(
        options.name,
        summary,
        tables={"jacobian": table},
        plots=(
            Plot(
                "line",
                "jacobian_identity",
                "Jacobian lens: how far each J_l is from the identity",
                "jacobian",
                x="layer",
                y=("distance_from_identity", "cosine_with_identity"),
                xlabel="block l (J_l reads its output h_{l+1})",
                ylabel="‖J_l − I‖/‖I‖, cos(J_l, I)",
                caption="A Jacobian lens equal to the identity is the logit lens.",
            ),
        ),
        meta={
            "prompts": fitted.prompts,
            "prompts_exact": fitted.prompts_exact,
            "prompts_sketched": fitted.prompts_sketched,
            "too_short": fitted.too_short,
            "tokens": fitted.tokens,
        },
        artifacts=(artifact,),
    )


def _metadata(fitted: MeanJacobians, options: JacobianFit, info: ModelInfo) -> dict[str, Any]:
    """The lens file's metadata, in TransformerLens' keys (plus lensdiv's)."""
    return {
        "model_name": info.name,
        "model_revision": None,
        "transformer_lens_version": versions().get("transformer-lens", "unknown"),
        "model_system": "TransformerBridge",
        "estimator": "jacobian_lens" if options.estimator == "exact" else "lensdiv_sketch",
        "processing": {"compatibility_mode": False, "weight_basis": "raw_huggingface"},
        "hook_convention": "blocks.{layer}.hook_out",
        "corpus": "lensdiv",
        "n_prompts": fitted.prompts,
        "fit_dtype": "float32",
        "target_layer": info.n_layers - 1,
        "dim_batch": options.dim_batch,
        "skip_first_positions": options.skip_first,
        "fitted_by": "lensdiv",
        "lensdiv_estimator": options.estimator,
        **({"probes": options.probes or info.d_model // 8} if fitted.prompts_sketched else {}),
    }


# -- the per-prompt estimators ---------------------------------------------------------------------


def exact_jacobians(
    model: Bridge, tokens: Int[Tensor, "one seq"], layers: Sequence[int], dim_batch: int, skip: int
) -> dict[int, Float[Tensor, "d_model d_model"]]:
    """TransformerLens' exact per-prompt Jacobians (float32, on the CPU) for ``layers``."""
    from transformer_lens.tools.analysis import jacobian_lens as tl

    with tl._frozen_parameters(model):
        return tl._jacobian_for_prompt(
            model,
            tokens,
            source_layers=list(layers),
            dim_batch=dim_batch,
            skip_first_positions=skip,
            backward_provider=tl._ordinary_vjp,
        )


def sketch_jacobians(
    model: Bridge,
    tokens: Int[Tensor, "one seq"],
    layers: Sequence[int],
    skip: int,
    probes: Float[Tensor, "k d_model"],
    control: dict[int, Tensor],
) -> dict[int, Float[Tensor, "d_model d_model"]]:
    """Unbiased per-prompt Jacobians from ``k`` orthonormal probe rows and a control variate:
    ``R + (d/k) Qᵀ Q (J_p − R)`` (float32, on the CPU)."""
    from transformer_lens.tools.analysis import jacobian_lens as tl

    d, k, seq = model.cfg.d_model, probes.shape[0], tokens.shape[1]
    target_layer = model.cfg.n_layers - 1
    names = {layer: f"blocks.{layer}.hook_out" for layer in {*layers, target_layer}}
    root = names[min(layers)]
    captured: dict[str, Tensor] = {}

    def capture(activation: Tensor, hook: Any) -> Tensor:
        if hook.name == root and not activation.requires_grad:
            activation.requires_grad_(True)
        captured[hook.name] = activation
        return activation

    with tl._frozen_parameters(model), torch.enable_grad():
        with model.hooks(fwd_hooks=[(name, capture) for name in names.values()]):
            model(tokens, return_type=None)
        target = captured[names[target_layer]]
        valid = torch.arange(skip, seq - 1, device=target.device)
        q = probes.to(target.device, target.dtype)
        cotangent = torch.zeros((k, *target.shape), dtype=target.dtype, device=target.device)
        cotangent[:, 0, valid, :] = q[:, None, :]
        grads = torch.autograd.grad(
            target,
            [captured[names[layer]] for layer in layers],
            grad_outputs=cotangent,
            is_grads_batched=True,
        )
    out = {}
    scale = d / k
    q32 = probes.float()
    for layer, grad in zip(layers, grads, strict=True):
        rows = grad[:, 0, valid.to(grad.device), :].float().mean(1).cpu()  # q_kᵀ J_p, [k, d]
        base = control[layer].float().cpu()
        out[layer] = base + scale * q32.T @ (rows - q32 @ base)
    return out


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two matrices (as vectors)."""
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / max(math.sqrt(float(a @ a) * float(b @ b)), 1e-300))
