"""Training a tuned lens (docs/science.md D1; Belrose et al. 2023) as a run: through the runner's
feeds, manifest, interrupts and process group, like every analyzer.

Translators ``T_l(h) = h + A_l h + b_l`` for ``l = 0..L-1`` (zero at the start: the logit lens, or
an affine lens to start from), trained with the model frozen to minimise
``Σ_l E[KL(p_L ‖ p_l)]`` over the positions of the data, where ``p_l`` reads ``T_l(h_l)`` through
the model's final norm and unembedding (:mod:`lensdiv.ops.readout`, in float32 whatever the
model's dtype) and ``p_L`` is the model's own output. The recipe is tuned-lens's
(``scripts/train_loop.py``): SGD with Nesterov momentum 0.9, learning rate ``lr × (1 − momentum)``
(``lr`` = 1), weight decay 1e-3, gradient norm clipped at 1, a linear decay to 0 without
warm-up, 250 steps of 2^18 tokens (:data:`PRESETS`; smaller presets for a CPU and the toy zoo).
A fit that names no preset takes the fast path (:data:`DEFAULT_PRESET`: a closed-form start, the
affine lens, then 15 SGD steps at ``lr`` 4), which reached the recipe's held-out KL in about a
seventh of its time on the toy models.
A batch's gradient is :func:`kl_gradients`: the layers' readouts as one stacked product, the KL
fused into the log-softmax with its gradient taken analytically (:mod:`lensdiv.ops.kl_grad`);
``bf16`` (a recipe field, ``-O bf16=true``) takes the unembedding's products in bfloat16 with
float32 accumulation.

**A training is an analyzer** (:class:`TunedFit`, ``fit-tuned``) whose passes read the data
onward (:meth:`~lensdiv.core.analyzer.Analyzer.pass_tokens`): pass ``p`` is step ``p``, the next
whole batches of ``tokens_per_step`` real tokens. ``update`` adds each batch's gradient of the
summed KL to float64 sums in the state; the end of the pass combines the states as for every
analyzer (nothing in one process; under ``torchrun`` the runner's
:class:`~lensdiv.run.distributed.DataParallelFeed` all-reduces them: the gradient all-reduce of
data parallel training, batch ``i`` of a step on rank ``i mod world``); ``start_pass`` then
takes the optimiser step (:class:`NesterovSGD`) on the mean gradient, identically on every rank,
and keeps the translators and the momentum in the state. ``finalize`` takes the last step and
returns the lens as an artifact. So ``--overwrite``, the manifest, Ctrl-C (the lens of the
steps done, marked partial) and ``torchrun`` are the runner's, as for an affine or Jacobian fit.

The loss of a step is the sum of the KL over its positions divided by the step's real tokens,
so the step is the same however the step is split between ranks.

To train otherwise (another optimiser, start or schedule): an object with
:class:`NesterovSGD`'s ``step`` returned by :meth:`TunedFit.optimizer`, an initial state from
:meth:`TunedFit.start_state`.

The lens is written in tuned-lens's layout (``tuned_lens/config.json`` + ``params.pt``), with
how it was trained in ``config.json``; an interrupted training writes what it has (marked
``"complete": false``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import OptionError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.lenses.affine import add_moments
from lensdiv.ops.kl_grad import fused_kl, target_probabilities
from lensdiv.ops.lens_files import TunedLensFolder
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.readout import Workspace, final_readout, workspace
from lensdiv.ops.ridge import fit_affine
from lensdiv.ops.translators import Translator
from lensdiv.run.engine import Engine
from lensdiv.run.feed import take_step

TUNED_FOLDER = "tuned_lens"
#: The state's entries: the translators, the optimiser's slots, what the training did so far
#: (fixed, frozen between steps), and what a step sums (the gradient, the KL, the tokens).
PARAMS = ("weight", "bias")
GRAD, MOMENTUM = "grad/", "momentum/"
#: The closed-form start's moments, and its ridge (the affine lens' default, relative to the
#: mean eigenvalue of each state's covariance).
XTX, XTY, SEEN = "moments/xtx", "moments/xty", "moments/batches"
# The moments of the closed-form passes before this one (fixed: a pass's sums are its own, so a
# second closed-form pass counts its tokens afresh and adds these).
SO_FAR = {XTX: "moments/xtx_so_far", XTY: "moments/xty_so_far"}
START_RIDGE = 1e-4


@dataclass(frozen=True)
class TunedRecipe:
    """How a tuned lens is trained.

    Args:
        steps: Optimiser steps.
        tokens_per_step: Real tokens per step (whole batches: rounded up).
        lr: Learning-rate scale; the step size is ``lr × (1 − momentum)`` (tuned-lens's).
        momentum: Nesterov momentum.
        weight_decay: Decoupled from nothing: SGD's L2 penalty, pulling ``A_l`` and ``b_l`` to
            zero (the logit lens).
        clip: Gradient-norm clip per step.
        exclude_bos: Leave the BOS position out of the loss.
        affine_passes: The first passes (of ``steps``) gather the least-squares moments of
            ``h_l → h_L`` instead of taking a step; the translators then start at their closed
            form, the affine lens (:mod:`lensdiv.lenses.affine`), and the remaining
            ``steps − affine_passes`` SGD steps decay to 0. 0: the published recipe (from the
            identity, or from ``start``).
        bf16: The unembedding's products (the target's and every layer's readout, and the
            readouts' backward) take bfloat16 operands with float32 accumulation; the
            translators, the norm, the log-softmax, the KL and the gradient sums stay in the
            readout dtype (float32) and float64 (:mod:`lensdiv.ops.kl_grad`). Faster where the
            hardware multiplies bfloat16 (AVX-512 BF16 or AMX CPUs, tensor cores); the logits
            carry bfloat16's rounding, as under tuned-lens's bf16 autocast.
    """

    steps: int = 250
    tokens_per_step: int = 2**18
    lr: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 1e-3
    clip: float = 1.0
    exclude_bos: bool = True
    affine_passes: int = 0
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1 or self.tokens_per_step < 1:
            raise OptionError("a tuned lens needs at least 1 step of at least 1 token")
        if not 0 <= self.affine_passes < self.steps:
            raise OptionError(
                f"affine_passes must be in [0, steps) (got {self.affine_passes} of "
                f"{self.steps} steps): at least one SGD step follows the closed-form start"
            )
        if not (self.lr > 0 and 0 <= self.momentum < 1 and self.weight_decay >= 0):
            raise OptionError("lr must be > 0, momentum in [0, 1), weight_decay >= 0")

    @property
    def sgd_steps(self) -> int:
        """The optimiser steps: the passes after the closed-form ones."""
        return self.steps - self.affine_passes


#: The reference recipe, and smaller ones (fewer, smaller steps) for a CPU and the toy zoo; each
#: small one also as the fast path (``-fast``): one closed-form pass (the affine lens) and 15 SGD
#: steps of 4× the step size (from a good start the clipped steps can be longer), which reach the
#: recipe's held-out KL at every layer in a quarter of its time or less (bench/README.md, "Tuned
#: lens: time to quality"). ``paper``, ``cpu`` and ``toy`` are the published recipe exactly.
PRESETS = {
    "paper": TunedRecipe(),
    "cpu": TunedRecipe(steps=120, tokens_per_step=2**14),
    "toy": TunedRecipe(steps=60, tokens_per_step=2**11),
    "cpu-fast": TunedRecipe(steps=16, tokens_per_step=2**14, lr=4.0, affine_passes=1),
    "toy-fast": TunedRecipe(steps=16, tokens_per_step=2**11, lr=4.0, affine_passes=1),
}
#: The preset of a fit that names none: the fast path, which reached the ``cpu`` recipe's held-out
#: KL (every layer within 2 % or below) in 0.09–0.16 of its wall time on ``toy:d8`` and
#: ``toy:d4-w128`` (``bench/tuned_cpu.json``).
DEFAULT_PRESET = "cpu-fast"


class Translators(nn.Module):
    """``h + A_l h + b_l`` for every layer at once (``A``: ``[L, d, d]``, ``b``: ``[L, d]``)."""

    def __init__(self, n_layers: int, d_model: int, start: Translator | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_layers, d_model, d_model))
        self.bias = nn.Parameter(torch.zeros(n_layers, d_model))
        if start is not None and not start.identity:
            with torch.no_grad():
                for layer, found in start.maps.items():
                    if not found.residual:  # h W^T + c = h + h (W - I)^T + c
                        self.weight[layer] = found.weight - torch.eye(d_model)
                    else:
                        self.weight[layer] = found.weight
                    if found.bias is not None:
                        self.bias[layer] = found.bias

    def forward(self, h: Tensor, layer: int) -> Tensor:
        return h + h @ self.weight[layer].T + self.bias[layer]


@dataclass
class TunedProgress:
    """What training did: steps, tokens and the mean KL per layer of the last step; whether it
    ran every step (``complete``) or was stopped (``interrupted``; else the data ran out)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0
    loss: list[float] | None = None
    complete: bool = False
    interrupted: bool = False


class NesterovSGD:
    """tuned-lens's optimiser, as ``torch.optim.SGD`` + ``clip_grad_norm_`` + ``LambdaLR`` do it:
    the gradient norm (over every parameter) clipped at ``clip``, L2 weight decay, Nesterov
    momentum, step size ``lr × (1 − momentum) × (1 − step / steps)``. Computed in float64 from
    the state alone, so every rank takes the same step.
    """

    def __init__(self, recipe: TunedRecipe) -> None:
        self.recipe = recipe

    def step(
        self,
        params: dict[str, Tensor],
        grads: dict[str, Tensor],
        slots: dict[str, Tensor],
        done: int,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """The parameters and slots after step ``done + 1`` (``slots``: the momentum buffers;
        empty before the first step)."""
        r = self.recipe
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        coef = min(1.0, r.clip / (norm + 1e-6))
        lr = r.lr * (1 - r.momentum) * max(0.0, 1.0 - done / r.sgd_steps)
        new, moved = {}, {}
        for name, p in params.items():
            g = grads[name].double()  # where the gradient was summed: the readout's device
            p64 = p.to(g.device, torch.float64)
            g = g * coef + r.weight_decay * p64
            if r.momentum > 0:
                buf = g if name not in slots else r.momentum * slots[name].to(g).double() + g
                moved[name] = buf.to(p.dtype)
                g = g + r.momentum * buf  # Nesterov
            new[name] = (p64 - lr * g).to(p.dtype)
        return new, moved


def kl_gradients(
    readout: Any,
    states: list[Tensor],
    weight: Tensor,
    bias: Tensor,
    *,
    bf16: bool = False,
    rows_per_block: int | None = None,
    workspace: Workspace | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of ``Σ_positions KL(p_L ‖ p_l)`` with respect to every layer's ``A_l``
    and ``b_l``, and the summed KL per layer: a step's work on one batch.

    The layers' translated states are normed together (autograd tracks the translators and the
    norm only: ``[L·n, d]``), read out in blocks of rows as one stacked product with the KL
    fused into the log-softmax and its gradient ``q_l − p_L`` taken analytically
    (:func:`lensdiv.ops.kl_grad.fused_kl`), and that gradient carried back through the norm
    and the translators.

    Args:
        readout: The model's :class:`~lensdiv.ops.readout.FinalReadout`.
        states: ``h_0 .. h_L`` of the positions, ``[n, d]`` each, in the readout's dtype.
        weight, bias: ``A`` ``[L, d, d]`` and ``b`` ``[L, d]``.
        bf16: The unembedding's products (the target's, the readouts' and their backward) in
            bfloat16 with float32 accumulation; everything else in the readout dtype.
        rows_per_block: Rows of one readout block (default: about ``BLOCK_ELEMENTS`` logits).
        workspace: The buffers, reused between calls (a fresh set otherwise).

    Returns:
        ``(∂A, ∂b, KL)``: ``[L, d, d]``, ``[L, d]`` in the readout dtype, ``[L]`` in float64.
    """
    with torch.no_grad():
        p, neg_entropy = target_probabilities(readout, states[-1], bf16=bf16, workspace=workspace)
    w = weight.detach().requires_grad_(True)
    b = bias.detach().requires_grad_(True)
    with torch.enable_grad():
        h = torch.stack(states[:-1])  # [L, n, d]
        x = readout.normalize((h + torch.baddbmm(b.unsqueeze(1), h, w.mT)).flatten(0, 1))
    grad_x, kl = fused_kl(
        readout,
        x,
        p,
        neg_entropy,
        bf16=bf16,
        rows_per_block=rows_per_block,
        workspace=workspace,
    )
    with torch.enable_grad():
        grad_w, grad_b = torch.autograd.grad(x, (w, b), grad_x)
    return grad_w, grad_b, kl


@dataclass(frozen=True)
class TunedFit(TunedRecipe, Analyzer):
    """Train a tuned lens (KL(p_L ‖ p_l) by SGD; one pass per step, the data read onward).

    Args:
        steps: Optimiser steps (passes).
        tokens_per_step: Real tokens per step (whole batches: rounded up).
        lr: Learning-rate scale; the step size is ``lr × (1 − momentum)``.
        momentum: Nesterov momentum.
        weight_decay: SGD's L2 penalty, pulling ``A_l`` and ``b_l`` to zero (the logit lens).
        clip: Gradient-norm clip per step.
        exclude_bos: Leave the BOS position out of the loss.
        affine_passes: The first passes gather the affine lens' moments; the translators start
            at its closed form (then ``start`` must be unset).
        bf16: The unembedding's products in bfloat16 with float32 accumulation.
        start: A lens to start from (``affine:DIR``, say); the identity (logit lens) otherwise.
    """

    name = "fit-tuned"
    description = "Train a tuned lens (SGD on KL(p_L ‖ p_l)) in tuned-lens's layout"
    depth_profiles = ()  # a fit, not a depth analysis: nothing for a study to compare

    # The recipe's fields (declared once, in TunedRecipe) are its options, then the start.
    start: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()  # the recipe's checks
        if self.affine_passes and self.start is not None:
            raise OptionError(
                "a tuned lens starts either from a lens (--init) or from the closed form "
                "(affine_passes), not both"
            )

    @classmethod
    def from_recipe(cls, recipe: TunedRecipe, start: str | None = None) -> TunedFit:
        """The fit of ``recipe``, from the lens ``start`` (a spec) or the identity."""
        return cls(**asdict(recipe), start=start)

    @property
    def recipe(self) -> TunedRecipe:
        """The training recipe of these options."""
        fields = {f.name for f in dataclasses.fields(TunedRecipe)}
        return TunedRecipe(**{k: v for k, v in self.options().items() if k in fields})

    def optimizer(self) -> NesterovSGD:
        """The optimiser of a step (the place to plug another one in)."""
        return NesterovSGD(self.recipe)

    def n_passes(self, info: ModelInfo) -> int:
        return self.steps

    def pass_tokens(self, info: ModelInfo) -> int:
        return self.tokens_per_step

    def min_tokens(self, info: ModelInfo) -> int:
        """One step's tokens."""
        return self.tokens_per_step

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def setup(self, model: Bridge, info: ModelInfo) -> Any:
        """The lens to start from is one this model can read and an affine one (before any pass)."""
        self._start(info)
        return None

    def init(self, info: ModelInfo) -> Stats:
        return self.start_state(info, self._start(info))

    def _start(self, info: ModelInfo) -> Translator | None:
        """``start`` read and checked: ``None`` (the identity) or an affine translator."""
        start = None if self.start is None else parse_lens(self.start)
        if start is None:
            return None
        start.check(info)
        if not isinstance(start, Translator):
            raise OptionError(
                f"a tuned lens starts from an affine lens, not {start.spec}",
                hint="start from a fitted lens: tuned:PATH, affine:PATH or jacobian:PATH",
            )
        return start

    def start_state(self, info: ModelInfo, start: Translator | None = None) -> Stats:
        """The state before the first step: the translators of ``start`` (or zero), frozen
        (every rank holds them; no exchange)."""
        lens = Translators(info.n_layers, info.d_model, start)
        state = Stats()
        for name in PARAMS:
            state.fix(name, getattr(lens, name).detach().clone())
        state.fix("steps", 0)
        state.fix("tokens", 0)
        state.fix("history", [])
        state.fix("loss", [])
        state.fix("moment_passes", self.affine_passes)
        state.freeze()
        return state

    def update(self, state: Stats, step: Step) -> None:
        info = step.info
        readout = step.cached("tuned-readout", lambda: final_readout(step.model))
        keep = step.batch.positions(exclude_bos=self.exclude_bos).to(step.batch.tokens.device)
        device, dtype = readout.device, readout.dtype
        weight, bias = (state[name].to(device, dtype) for name in PARAMS)
        # Every pass that saw a batch has a gradient (zero if no position counted), so every
        # such pass is a step.
        if int(state["moment_passes"]) > 0:
            self._moments(state, step)
            return
        grad_w = state.zeros(GRAD + "weight", tuple(weight.shape), device)
        grad_b = state.zeros(GRAD + "bias", tuple(bias.shape), device)
        kl_sums = state.zeros("kl", (info.n_layers,), device)
        state.add("positions", step.batch.n_tokens)  # the step's loss: mean over real tokens
        if not keep.any():
            return
        states = [step.resid(layer)[keep].to(device, dtype) for layer in range(info.n_layers + 1)]
        gw, gb, kl = kl_gradients(
            readout, states, weight, bias, bf16=self.bf16, workspace=workspace(step)
        )
        grad_w.add_(gw)
        grad_b.add_(gb)
        kl_sums.add_(kl)

    def _moments(self, state: Stats, step: Step) -> None:
        """A closed-form pass: ``Σ [h_l, 1][h_l, 1]ᵀ`` and ``Σ [h_l, 1] h_Lᵀ`` in float64 (as
        :class:`~lensdiv.lenses.affine.AffineFit`; summed over the ranks like a gradient)."""
        state.add(SEEN, 1)
        add_moments(state, step, self.exclude_bos, XTX, XTY)

    def _closed_form(self, state: Stats) -> dict[str, Any] | None:
        """The state's fixed entries after a closed-form pass (``None``: none pending): the
        moments so far (this pass's sums added to the earlier passes') and, after the last such
        pass, the translators set to their solution."""
        if int(state["moment_passes"]) <= 0 or SEEN not in state:
            return None
        left = int(state["moment_passes"]) - 1
        totals = {}
        for name, earlier in SO_FAR.items():
            parts = [state[n] for n in (name, earlier) if n in state]
            if parts:
                totals[name] = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        if left > 0 or not totals:  # the sums carry on into the next pass (or nothing was
            kept = {SO_FAR[n]: t for n, t in totals.items()} if left > 0 else {}
            return {"moment_passes": left, **kept}  # counted: the start stays as it is)
        xtx, xty = totals[XTX], totals[XTY]
        d = xtx.shape[-1] - 1
        eye = torch.eye(d, dtype=torch.float64, device=xtx.device)
        weights, biases = [], []
        for layer in range(xtx.shape[0]):
            maps, _, _ = fit_affine(xtx[layer], xty[layer], START_RIDGE)
            weights.append(maps[:d].T - eye)  # tuned-lens's A = W − I
            biases.append(maps[d])
        like = state["weight"]
        return {
            "moment_passes": 0,
            "weight": torch.stack(weights).to(like.device, like.dtype),
            "bias": torch.stack(biases).to(like.device, like.dtype),
        }

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        """Step ``index``: the optimiser step on the gradient pass ``index - 1`` summed (over
        every rank), written into the state in place of it (or the closed-form start, after a
        pass of moments)."""
        solved = self._closed_form(state)
        if solved is not None:
            for name in (XTX, XTY, SEEN, *SO_FAR.values()):  # this pass's sums, now in solved
                state.drop(name)
            for name, value in solved.items():
                state.drop(name)
                state.fix(name, value)
            return
        taken = self._advanced(state)
        if taken is None:  # the data ran out: nothing to step on
            return
        for name in state.names():
            if name.startswith(GRAD) or name in taken or name in ("kl", "positions"):
                state.drop(name)
        for name, value in taken.items():
            state.fix(name, value)

    def _advanced(self, state: Stats) -> dict[str, Any] | None:
        """The state's fixed entries after the step on its pending gradient (``None``: no
        gradient pending)."""
        if GRAD + "weight" not in state:
            return None
        n = max(float(state["positions"]), 1.0)
        params = {name: state[name] for name in PARAMS}
        grads = {name: state[GRAD + name] / n for name in PARAMS}
        slots = {name: state[MOMENTUM + name] for name in PARAMS if MOMENTUM + name in state}
        done = int(state["steps"])
        params, slots = self.optimizer().step(params, grads, slots, done)
        loss = (state["kl"] / n).tolist()
        return {
            **params,
            **{MOMENTUM + name: value for name, value in slots.items()},
            "steps": done + 1,
            "tokens": int(state["tokens"]) + int(float(state["positions"])),
            "loss": loss,
            "history": [*state["history"], sum(loss)],
        }

    def progress(self, state: Stats) -> TunedProgress:
        """What the training did, its pending step counted (without taking it)."""
        pending = GRAD + "weight" in state
        n = max(float(state["positions"]), 1.0) if "positions" in state else 1.0
        steps = int(state["steps"]) + pending
        return TunedProgress(
            steps=steps,
            tokens=int(state["tokens"]) + (int(n) if "positions" in state else 0),
            loss=(state["kl"] / n).tolist() if pending else list(state["loss"]) or None,
            complete=steps >= self.recipe.sgd_steps,
        )

    def trained(self, state: Stats, info: ModelInfo) -> tuple[Translators, TunedProgress]:
        """The translators after every step (the pending one taken) and what training did."""
        taken = (
            self._advanced(state)
            or self._closed_form(state)
            or {name: state[name] for name in PARAMS}
        )
        if "weight" not in taken:  # stopped between two passes of moments: the identity
            taken = {name: state[name] for name in PARAMS}
        lens = Translators(info.n_layers, info.d_model)
        with torch.no_grad():
            for name in PARAMS:
                getattr(lens, name).copy_(taken[name].detach().cpu())
        return lens, self.progress(state)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(TunedOutcome.from_state(self, state, info), self, info)


# -- the numbers ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class TunedOutcome:
    """What a fit's state holds once finished: the translators (its pending step taken), what
    training did, and the summed KL of every step.

    Args:
        lens: The translators (float32, on the CPU).
        progress: Steps, tokens, the last step's KL per layer, completeness.
        history: ``Σ_l KL(p_L ‖ p_l)`` of each step, before its update (the pending one too).
    """

    lens: Translators
    progress: TunedProgress
    history: list[float]

    @classmethod
    def from_state(cls, fit: TunedFit, state: Stats, info: ModelInfo) -> TunedOutcome:
        """The outcome of a merged state."""
        lens, done = fit.trained(state, info)
        history = [*state["history"]]
        if GRAD + "weight" in state:
            history.append(sum(done.loss or []))
        return cls(lens, done, history)

    def loss(self, n_layers: int) -> list[float]:
        """The last step's mean KL per residual state (NaN before any step)."""
        return self.progress.loss or [math.nan] * n_layers

    def stopped_early(self, recipe: TunedRecipe) -> bool:
        """Whether fewer SGD steps were taken than the recipe plans."""
        return self.progress.steps < recipe.sgd_steps


# -- the result ----------------------------------------------------------------------------------
def present(outcome: TunedOutcome, fit: TunedFit, info: ModelInfo) -> Result:
    """The tables, training curve, summary and lens folder of a fit."""
    done, history = outcome.progress, outcome.history
    layers = list(range(info.n_layers))
    tables = {
        "tuned": Table(
            "tuned",
            {
                "layer": layers,
                "state": [f"h{layer}" for layer in layers],
                "kl": outcome.loss(info.n_layers),
            },
            "Tuned lens: mean KL(p_L ‖ p_l) per residual state on the last step's tokens "
            "(before its update)",
        ),
        "training": Table(
            "training",
            {"step": list(range(1, len(history) + 1)), "kl": history},
            "Tuned lens: the summed KL over the layers, step by step",
        ),
    }
    warnings: tuple[str, ...] = ()
    if outcome.stopped_early(fit.recipe):
        warnings = (
            f"trained {done.steps} of {fit.recipe.sgd_steps} steps (the data ran out, or the run "
            "was stopped): the learning rate had not decayed to 0",
        )
    meta = {"steps": done.steps, "tokens": done.tokens, "complete": done.complete}
    return Result(
        fit.name,
        f"Tuned lens after {done.steps} of {fit.steps} steps ({done.tokens} tokens): "
        f"summed KL {history[0] if history else math.nan:.4g} at the first step, "
        f"{history[-1] if history else math.nan:.4g} at the last; saved in tuned-lens's "
        f"layout ({TUNED_FOLDER}/).",
        tables=tables,
        plots=(
            Plot(
                "line",
                "tuned_training",
                "Tuned lens: training loss",
                "training",
                x="step",
                y=("kl",),
                xlabel="step",
                ylabel="Σ_l KL(p_L ‖ p_l) (nats)",
                caption="The loss of each step, before its update.",
            ),
        ),
        meta={**meta, "final_kl": done.loss},
        warnings=warnings,
        artifacts=(tuned_folder(outcome.lens, info, fit.recipe, done),),
    )


def tuned_folder(
    lens: Translators, info: ModelInfo, recipe: TunedRecipe, progress: TunedProgress
) -> TunedLensFolder:
    """The translators as a tuned-lens folder, with the recipe and progress in its config."""
    return TunedLensFolder(
        TUNED_FOLDER,
        {layer: lens.weight[layer].detach() for layer in range(info.n_layers)},
        {layer: lens.bias[layer].detach() for layer in range(info.n_layers)},
        d_model=info.d_model,
        n_layers=info.n_layers,
        model_name=info.name,
        extra=_config(recipe, progress),
    )


def _config(recipe: TunedRecipe, progress: TunedProgress) -> dict[str, Any]:
    return {
        "fitted_by": "lensdiv",
        "lensdiv_lens": "tuned",
        "recipe": asdict(recipe),
        "steps_done": progress.steps,
        "tokens": progress.tokens,
        "complete": progress.complete,
        "final_kl": progress.loss,
    }


def train_tuned(
    model: Bridge,
    info: ModelInfo,
    batches: Callable[[], Iterable[Batch]],
    recipe: TunedRecipe,
    *,
    start: Translator | None = None,
    on_step: Callable[[TunedProgress], None] | None = None,
) -> tuple[Translators, TunedProgress]:
    """Train translators on ``batches()`` (read once, in order) by ``recipe``, in this process:
    :class:`TunedFit`'s passes through an :class:`~lensdiv.run.engine.Engine`, without a run
    folder (:func:`lensdiv.lenses.fit_lens` fits through the runner, ``torchrun`` included).

    Args:
        model: The frozen ``TransformerBridge``.
        info: Its facts.
        batches: The data stream; it is cut into steps of ``recipe.tokens_per_step``.
        recipe: The training recipe.
        start: A lens to start from (an affine lens, say); the identity otherwise.
        on_step: Called after every step (progress).

    Returns:
        The translators (float32, on the CPU) and what the training did. A ``KeyboardInterrupt``
        stops it between two batches with what it has (``complete`` false).

    Raises:
        RuntimeError: The training failed (the line the engine recorded).
    """
    fit = TunedFit.from_recipe(recipe)
    engine = Engine(model, info, [fit])
    states = {fit.name: fit.start_state(info, start)}
    stream = iter(batches())
    started = time.perf_counter()
    interrupted = False
    try:
        for index in range(engine.n_passes):
            engine.begin_pass(index, states)
            engine.feed(index, take_step(stream, recipe.tokens_per_step), states)
            if engine.failures:
                raise RuntimeError(engine.failures[fit.name])
            if on_step is not None:
                on_step(_timed(fit.progress(states[fit.name]), started, engine))
    except KeyboardInterrupt:
        interrupted = True
    lens, done = fit.trained(states[fit.name], info)
    done = _timed(done, started, engine)
    done.complete, done.interrupted = done.complete and not interrupted, interrupted
    return lens, done


def _timed(progress: TunedProgress, started: float, engine: Engine) -> TunedProgress:
    progress.seconds = time.perf_counter() - started
    progress.forward_s = engine.forward_s
    return progress


def save_trained(
    folder: str | Path,
    lens: Translators,
    info: ModelInfo,
    recipe: TunedRecipe,
    progress: TunedProgress,
) -> list[Path]:
    """Write the translators in tuned-lens's layout, with the recipe and progress in its config."""
    return tuned_folder(lens, info, recipe, progress).write(Path(folder))
