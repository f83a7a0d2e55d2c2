"""Lesson 6, a translator for one layer: the affine map of ``h_l`` onto ``h_L`` by least squares
(the fast path's start of the tuned lens, ``fit-affine``), and the tuned lens' training loss.

References: :func:`lensdiv.ops.ridge.fit_affine` (``fit-affine``'s solver); the tuned lens'
objective ``KL(p_L ‖ p_l)`` (docs/science.md#tuned-lens, #fit-affine).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lensdiv.course import toy
from lensdiv.course.checker import (
    Case,
    Exercise,
    Mistake,
    Requirement,
    Unusable,
    describe_value,
    randn,
)
from lensdiv.course.logit_lens import lens_logits
from lensdiv.ops.ridge import augment, fit_affine

# -- the references ---------------------------------------------------------------------------------


def fit_translator(h: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    x = augment(h)
    maps, _, _ = fit_affine(x.T @ x, x.T @ target.double(), 0.0)
    return maps[:-1], maps[-1]


def tuned_loss(
    A: Tensor, b: Tensor, h: Tensor, out_logits: Tensor, params: dict[str, Any]
) -> Tensor:
    logits = lens_logits(h + h @ A + b, **params)
    logp = torch.log_softmax(out_logits.double(), -1)
    logq = torch.log_softmax(logits.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


# -- the mistakes --------------------------------------------------------------------------------------


def _no_bias(h: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    W = torch.linalg.lstsq(h.double(), target.double()).solution
    return W, torch.zeros(h.shape[-1], dtype=torch.float64)


def _transposed(h: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    W, c = fit_translator(h, target)
    return W.T, c


def _reversed(h: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    return fit_translator(target, h)


def _loss_lens_direction(
    A: Tensor, b: Tensor, h: Tensor, out_logits: Tensor, params: dict[str, Any]
) -> Tensor:
    logits = lens_logits(h + h @ A + b, **params)
    logq = torch.log_softmax(out_logits.double(), -1)
    logp = torch.log_softmax(logits.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1).mean()


def _loss_no_residual(
    A: Tensor, b: Tensor, h: Tensor, out_logits: Tensor, params: dict[str, Any]
) -> Tensor:
    return tuned_loss(A - torch.eye(A.shape[0]), b, h, out_logits, params)


def _loss_sum(
    A: Tensor, b: Tensor, h: Tensor, out_logits: Tensor, params: dict[str, Any]
) -> Tensor:
    return tuned_loss(A, b, h, out_logits, params) * h.shape[0]


def _no_gradient(out: Any, args: tuple[Any, ...]) -> str | None:
    """What keeps ``loss.backward()`` from training ``A`` and ``b`` (``None``: nothing)."""
    A, b = args[0], args[1]
    if not isinstance(out, Tensor):
        return f"{describe_value(out)}: .item(), float() or .tolist() leave no gradient"
    if not out.requires_grad:
        return "a tensor that does not require grad (computed under torch.no_grad(), or detached)"
    grads = torch.autograd.grad(out.sum(), [A, b], allow_unused=True, retain_graph=True)
    cut = [name for name, g in zip(("A", "b"), grads, strict=True) if g is None]
    if cut:
        return f"a tensor with no gradient path to {' and '.join(cut)} (detached on the way)"
    return None


# -- the inputs ----------------------------------------------------------------------------------------

TEXTS = (
    *toy.PROMPTS,
    "The big red bird flies over the old house",
    "boss(mi)=ka and friend(ka)=",
    "She walked to the market to buy some bread",
)


def _states(layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """``h_layer`` and ``h_L`` at every real position but BOS of :data:`TEXTS`, and the output."""
    model = toy.toy()
    ids, mask = toy.tokens(model, TEXTS)
    logits, states = toy.residual_states(model, ids)
    keep = mask.clone()
    keep[:, 0] = False
    return states[layer][keep], states[-1][keep], logits[keep]


def _predict(out: tuple[Tensor, Tensor], case: Case) -> Tensor:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise Unusable("return two things, the map W and the offset c: return W, c")
    W, c = out
    return case.args[0].double() @ torch.as_tensor(W).double() + torch.as_tensor(c).double()


def _fit_cases() -> list[Case]:
    x = randn(40, 4, seed=60)
    y = x @ randn(4, 4, seed=61) + randn(4, seed=62, shift=2.0) + randn(40, 4, seed=63, scale=0.1)
    h1, hL, _ = _states(1)
    return [
        Case("40 random vectors of 4 numbers (a map with an offset, plus noise)", (x, y), 160),
        Case(f"the toy's h_1 → h_L at {h1.shape[0]} positions", (h1, hL), 10**6, True),
    ]


def _loss_cases() -> list[Case]:
    model = toy.toy()
    params = toy.readout_params(model)
    d = model.cfg.d_model
    h1, _, out = _states(1)
    # The translator's parameters, as the notebook trains them: a loss must reach them.
    zero = (torch.zeros(d, d, requires_grad=True), torch.zeros(d, requires_grad=True))
    small = (
        randn(d, d, seed=64, scale=0.02).requires_grad_(),
        randn(d, seed=65, scale=0.1).requires_grad_(),
    )
    return [
        Case("toy h_1, A = 0, b = 0 (the logit lens)", (*zero, h1[:4], out[:4], params), 4),
        Case("toy h_1, a small random A and b", (*small, h1, out, params), 10**4, True),
    ]


# -- the exercises ------------------------------------------------------------------------------------

FIT_TRANSLATOR = Exercise(
    "fit_translator",
    fit_translator,
    _fit_cases,
    [
        Mistake(
            "no_bias",
            "no constant term: fit h W + c with c free (append a column of ones to h, or centre both sides).",
            _no_bias,
        ),
        Mistake(
            "transposed",
            "W is transposed: the translator is h @ W + c with W[d_in, d_out] (lstsq's solution as it comes).",
            _transposed,
        ),
        Mistake(
            "reversed",
            "the map goes the wrong way: fit h_l → h_L (from the layer to the last state), not back.",
            _reversed,
        ),
    ],
    describe=lambda out: f"h_L predicted from h_1 at {out.shape[0]} positions",
    measure=_predict,
    rtol=1e-3,
    atol=1e-3,
    shape_hint="(W [d_model, d_model], c [d_model]), checked by the predictions h @ W + c",
)

TUNED_LOSS = Exercise(
    "tuned_loss",
    tuned_loss,
    _loss_cases,
    [
        Mistake(
            "lens_direction",
            "the KL's direction: the tuned lens trains KL(p_out ‖ p_translated), the output first (the logit lens reports the other one).",
            _loss_lens_direction,
        ),
        Mistake(
            "no_residual",
            "the translator misses its residual form: T(h) = h + h A + b, so A = 0, b = 0 is the logit lens.",
            _loss_no_residual,
        ),
        Mistake("sum", "summed over positions: the loss is the mean KL per position.", _loss_sum),
    ],
    describe=lambda out: f"loss {float(torch.as_tensor(out).detach()):.3f} nats",
    grad=True,
    requirements=[
        Requirement(
            "no_grad",
            "the loss has no gradient, so the next cell's loss.backward() cannot train A and b: return the tensor itself (no .item() or float(), no torch.no_grad(), no .detach()).",
            "a 0-dim tensor with a gradient path to A and b",
            _no_gradient,
        )
    ],
    shape_hint="one number (a scalar to call .backward() on)",
)

check_fit_translator = FIT_TRANSLATOR.check
check_tuned_loss = TUNED_LOSS.check
EXERCISES = (FIT_TRANSLATOR, TUNED_LOSS)
