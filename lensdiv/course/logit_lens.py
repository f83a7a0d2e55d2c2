"""Lesson 1, the logit lens by hand: the final norm, the readout, KL to the output, the mean.

References: :class:`lensdiv.ops.norms.LayerNorm` and :class:`lensdiv.ops.readout.FinalReadout`
(what every analyzer reads out with), :meth:`lensdiv.core.analyzer.Batch.positions` (which
positions enter a statistic); docs/science.md#lens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lensdiv.core.analyzer import Batch
from lensdiv.course import toy
from lensdiv.course.checker import Case, Exercise, Mistake, randn
from lensdiv.ops.norms import LayerNorm
from lensdiv.ops.readout import FinalReadout

# -- the references: lensdiv's own readout ---------------------------------------------------------


def final_norm(h: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    dtype = h.dtype if h.is_floating_point() else torch.float32  # float64 in, float64 out
    norm = LayerNorm(w.to(dtype), b.to(dtype), eps)
    flat = h.reshape(-1, h.shape[-1])
    return norm.apply(flat, dtype=dtype, device=flat.device).reshape(h.shape)


def lens_logits(
    h: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float, W_U: Tensor, b_U: Tensor
) -> Tensor:
    readout = FinalReadout(
        LayerNorm(ln_w.float(), ln_b.float(), eps), W_U.float(), b_U.float(), torch.float32
    )
    flat = h.reshape(-1, h.shape[-1])
    return readout.logits(flat).reshape(*h.shape[:-1], -1)


def kl_to_output(logits: Tensor, out_logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.double(), -1)
    logq = torch.log_softmax(out_logits.double(), -1)
    return (logp.exp() * (logp - logq)).sum(-1)


def mean_per_layer(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    keep = Batch(tokens=torch.zeros_like(mask, dtype=torch.long), mask=mask, bos=True).positions(
        exclude_bos=exclude_bos
    )
    return values.double()[:, keep].mean(-1)


# -- the mistakes ---------------------------------------------------------------------------------


def _norm_no_centre(h: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return h / (h.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w + b


def _norm_unbiased(h: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    x = h - h.mean(-1, keepdim=True)
    return x / (h.var(-1, keepdim=True, unbiased=True) + eps).sqrt() * w + b


def _norm_no_affine(h: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return final_norm(h, torch.ones_like(w), torch.zeros_like(b), eps)


def _norm_no_weight(h: Tensor, w: Tensor, b: Tensor, eps: float) -> Tensor:
    return final_norm(h, torch.ones_like(w), b, eps)


def _logits_with(norm: Any) -> Any:
    def compute(
        h: Tensor, ln_w: Tensor, ln_b: Tensor, eps: float, W_U: Tensor, b_U: Tensor
    ) -> Tensor:
        return norm(h, ln_w, ln_b, eps) @ W_U + b_U

    return compute


def _kl_reversed(logits: Tensor, out_logits: Tensor) -> Tensor:
    return kl_to_output(out_logits, logits)


def _kl_log2(logits: Tensor, out_logits: Tensor) -> Tensor:
    return kl_to_output(logits, out_logits) / math.log(2)


def _kl_mean_vocab(logits: Tensor, out_logits: Tensor) -> Tensor:
    return kl_to_output(logits, out_logits) / logits.shape[-1]


def _kl_raw_logits(logits: Tensor, out_logits: Tensor) -> Tensor:
    p = torch.softmax(logits.double(), -1)
    return (p * (logits.double() - out_logits.double())).sum(-1)


def _mean_pads(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    keep = torch.ones_like(mask)
    if exclude_bos:
        keep[:, 0] = False
    return values.double()[:, keep].mean(-1)


def _mean_batch(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    keep = mask.clone()
    if exclude_bos:
        keep[:, 0] = False
    v = values.double() * keep
    return (v.sum(-1) / keep.sum(-1)).mean(-1)


def _mean_bos_counted(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    return mean_per_layer(values, mask, False)


def _mean_bos_dropped(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    return mean_per_layer(values, mask, True)


def _mean_off_by_one(values: Tensor, mask: Tensor, exclude_bos: bool) -> Tensor:
    keep = torch.zeros_like(mask)
    keep[:, :-1] = mask[:, 1:]  # drops each row's last real token instead of its first
    if not exclude_bos:
        keep = mask
    return values.double()[:, keep].mean(-1)


# -- the inputs ------------------------------------------------------------------------------------


def _real_states() -> tuple[Tensor, Tensor, Tensor, dict[str, Any]]:
    model = toy.toy()
    tokens, mask = toy.tokens(model, toy.PROMPTS)
    logits, states = toy.residual_states(model, tokens)
    return states, logits, mask, toy.readout_params(model)


def _norm_cases() -> list[Case]:
    d = 16
    w, b = randn(d, seed=1, scale=0.5, shift=1.0), randn(d, seed=2, scale=0.3)
    states, _, _, p = _real_states()
    one = states[2, :1, :1]  # one token: [1, 1, d_model]
    return [
        Case(
            "1 random vector of 16 numbers, offset by 3",
            (randn(1, d, seed=3, shift=3.0), w, b, 1e-5),
            16,
        ),
        Case("4 random vectors of 16 numbers", (randn(4, d, seed=4, scale=2.0), w, b, 1e-5), 64),
        Case("a one-token row of the toy's h_2", (one, p["ln_w"], p["ln_b"], p["eps"]), 100),
        Case(
            "h_2 of 3 toy prompts [3, pos, d_model]",
            (states[2], p["ln_w"], p["ln_b"], p["eps"]),
            10**6,
            True,
        ),
    ]


def _logit_cases() -> list[Case]:
    d, V = 8, 11
    states, _, _, p = _real_states()
    rand = (
        randn(d, seed=5, shift=1.0),
        randn(d, seed=6),
        1e-5,
        randn(d, V, seed=7),
        randn(V, seed=8),
    )
    real = (p["ln_w"], p["ln_b"], p["eps"], p["W_U"], p["b_U"])
    return [
        Case(
            "2 random vectors, d_model 8, vocabulary 11",
            (randn(2, d, seed=9, shift=2.0), *rand),
            16,
        ),
        Case("h_1 of 3 toy prompts", (states[1], *real), 10**6),
        Case("h_L (the last state) of 3 toy prompts", (states[-1], *real), 10**6 + 1, True),
    ]


def _kl_cases() -> list[Case]:
    states, logits, _, p = _real_states()
    h0 = lens_logits(states[0], p["ln_w"], p["ln_b"], p["eps"], p["W_U"], p["b_U"])
    return [
        Case("2 rows over a vocabulary of 5", (randn(2, 5, seed=10), randn(2, 5, seed=11)), 10),
        Case("1 row: identical logits (KL must be 0)", (randn(1, 7, seed=12),) * 2, 7),
        Case(
            "8 rows of random logits over 260 tokens",
            (randn(8, 260, seed=13, scale=3.0), randn(8, 260, seed=14, scale=3.0)),
            2080,
        ),
        Case("toy: h_0's lens logits against the output", (h0, logits), 10**6, True),
    ]


def _mean_cases() -> list[Case]:
    mask = torch.tensor(
        [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool
    )
    values = randn(3, 3, 6, seed=15).abs()
    _, _, real_mask, _ = _real_states()
    real = randn(5, *real_mask.shape, seed=16).abs()
    return [
        Case(
            "3 layers × 3 rows (lengths 6, 3 and a one-token row), BOS kept",
            (values, mask, False),
            54,
        ),
        Case(
            "the same 3 rows, BOS excluded (the one-token row adds nothing)",
            (values, mask, True),
            55,
        ),
        Case("3 padded toy prompts, BOS excluded", (real, real_mask, True), 10**4, True),
    ]


# -- the exercises ---------------------------------------------------------------------------------

NORM_DIAG = {
    "no_centre": "the mean is not subtracted: that is an RMSNorm; a LayerNorm centres h first (h − mean(h)).",
    "unbiased": "the variance divides by d − 1 (torch.var/std's default, unbiased=True); LayerNorm divides by d: use unbiased=False or mean((h − mean h)²).",
    "no_affine": "the scale w and the shift b are not applied: LayerNorm ends with … * w + b.",
    "no_weight": "the scale w is not applied (the shift b is): LayerNorm ends with … * w + b.",
}
FINAL_NORM = Exercise(
    "final_norm",
    final_norm,
    _norm_cases,
    [
        Mistake("no_centre", NORM_DIAG["no_centre"], _norm_no_centre),
        Mistake("unbiased", NORM_DIAG["unbiased"], _norm_unbiased),
        Mistake("no_affine", NORM_DIAG["no_affine"], _norm_no_affine),
        Mistake("no_weight", NORM_DIAG["no_weight"], _norm_no_weight),
    ],
    describe=lambda out: (
        f"h_2 normalised has mean {float(out.mean()):+.3f}, std {float(out.std()):.3f}"
    ),
)

LENS_LOGITS = Exercise(
    "lens_logits",
    lens_logits,
    _logit_cases,
    [
        Mistake(
            "norm_forgotten",
            "the final norm is forgotten: the logit lens reads N(h) (final_norm) through W_U, not h itself.",
            lambda h, w, b, eps, W, c: h @ W + c,
        ),
        Mistake(
            "bias_forgotten",
            "the unembedding bias b_U is missing: logits = final_norm(h) @ W_U + b_U.",
            lambda h, w, b, eps, W, c: final_norm(h, w, b, eps) @ W,
        ),
        Mistake(
            "softmax",
            "these are probabilities (a softmax of the logits): lens_logits returns the logits themselves, final_norm(h) @ W_U + b_U; the KL takes their softmax later.",
            lambda h, w, b, eps, W, c: lens_logits(h, w, b, eps, W, c).softmax(-1),
        ),
        Mistake(
            "log_softmax",
            "these are log-probabilities (a log_softmax of the logits): lens_logits returns the logits themselves, final_norm(h) @ W_U + b_U; the KL normalises them later.",
            lambda h, w, b, eps, W, c: lens_logits(h, w, b, eps, W, c).log_softmax(-1),
        ),
        *[
            Mistake(f"norm_{k}", f"your final norm is wrong: {NORM_DIAG[k]}", _logits_with(f))
            for k, f in (
                ("no_centre", _norm_no_centre),
                ("unbiased", _norm_unbiased),
                ("no_affine", _norm_no_affine),
            )
        ],
    ],
    describe=lambda out: f"logits of shape {list(out.shape)} at h_L",
    rtol=1e-4,
    atol=1e-4,
    shape_hint="[..., d_vocab]: one logit per token of the vocabulary",
)

KL_TO_OUTPUT = Exercise(
    "kl_to_output",
    kl_to_output,
    _kl_cases,
    [
        Mistake(
            "reversed",
            "the KL is in the wrong direction: this is KL(p_out ‖ p_l); the logit lens measures KL(p_l ‖ p_out) = Σ p_l (log p_l − log p_out). (F.kl_div(input, target) computes KL(target ‖ input).)",
            _kl_reversed,
        ),
        Mistake(
            "log2",
            "the logarithm is in base 2 (bits); lensdiv reports nats: use the natural log (torch.log, log_softmax).",
            _kl_log2,
        ),
        Mistake(
            "mean_vocab",
            "the sum over the vocabulary is a mean: KL sums p_l(v)(log p_l(v) − log p_out(v)) over v.",
            _kl_mean_vocab,
        ),
        Mistake(
            "raw_logits",
            "logits are used as log-probabilities: take log_softmax of both first (logits are log-probabilities only up to a constant per row).",
            _kl_raw_logits,
        ),
    ],
    describe=lambda out: f"h_0 reads {float(out.mean()):.2f} nats from the output on average",
    rtol=1e-4,
    atol=1e-5,
    shape_hint="one KL per row: the input's shape without its last (vocabulary) axis",
)

MEAN_PER_LAYER = Exercise(
    "mean_per_layer",
    mean_per_layer,
    _mean_cases,
    [
        Mistake(
            "pads_counted",
            "pad positions are counted: average only where mask is True (padding is not text).",
            _mean_pads,
        ),
        Mistake(
            "batch_mean",
            "this is a mean over the batch of each row's mean: rows of different length then weigh alike. Average over all kept tokens at once (sum of values / number of tokens).",
            _mean_batch,
        ),
        Mistake(
            "bos_counted",
            "BOS is counted although exclude_bos=True: leave position 0 of every row out.",
            _mean_bos_counted,
        ),
        Mistake(
            "bos_dropped",
            "BOS is left out although exclude_bos=False: keep every real token then.",
            _mean_bos_dropped,
        ),
        Mistake(
            "off_by_one",
            "positions off by one: each row's last real token is left out instead of its first (BOS).",
            _mean_off_by_one,
        ),
    ],
    describe=lambda out: "per layer " + ", ".join(f"{float(v):.3f}" for v in out),
    shape_hint="one number per layer",
)

check_final_norm = FINAL_NORM.check
check_lens_logits = LENS_LOGITS.check
check_kl_to_output = KL_TO_OUTPUT.check
check_mean_per_layer = MEAN_PER_LAYER.check
EXERCISES = (FINAL_NORM, LENS_LOGITS, KL_TO_OUTPUT, MEAN_PER_LAYER)
