"""Lesson 4, the residual stream as an ensemble: the bias–diversity decomposition of its
members' predictions, in the squared-error and the cross-entropy form.

References: :func:`lensdiv.analyzers.bias.decomposition.direct_decomposition` (what ``bias``
computes on small vocabularies, tested against its Gram-matrix form); docs/science.md#bias.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lensdiv.analyzers.bias.decomposition import direct_decomposition
from lensdiv.course import toy
from lensdiv.course.checker import Case, Exercise, Mistake, randn

# -- the references: means over positions of bias's per-position terms ------------------------------


def squared_terms(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d = direct_decomposition(f, y)
    return d["sq_ens"].mean(), d["sq_bias"].mean(0).mean(), d["sq_div"].mean(0).mean()


def ce_terms(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    d = direct_decomposition(f, y)
    return d["ce_ens"].mean(), d["ce"].mean(0).mean(), d["kl"].mean(0).mean()


# -- the mistakes --------------------------------------------------------------------------------------


def _sq_sum_members(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ens, bias, div = squared_terms(f, y)
    return ens, bias * f.shape[0], div * f.shape[0]


def _sq_bias_of_mean(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ens, _, div = squared_terms(f, y)
    return ens, ens, div


def _sq_div_to_target(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ens, bias, _ = squared_terms(f, y)
    return ens, bias, bias


def _sq_mean_vocab(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    V = f.shape[-1]
    ens, bias, div = squared_terms(f, y)
    return ens / V, bias / V, div / V


def _ce_kl_reversed(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ens, ce, _ = ce_terms(f, y)
    logq = torch.log_softmax(f.double(), -1)
    logp = torch.log_softmax(f.double().mean(0), -1)
    return ens, ce, (logq.exp() * (logq - logp)).sum(-1).mean()


def _ce_mean_of_softmax(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    p = torch.softmax(f.double(), -1).mean(0)
    logq = torch.log_softmax(f.double(), -1)
    ens = -p.log().gather(-1, y[:, None])[:, 0].mean()
    kl = (p * (p.log() - logq)).sum(-1).mean()
    return ens, ce_terms(f, y)[1], kl


def _ce_log2(f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    ens, bias, kl = ce_terms(f, y)
    return ens / math.log(2), bias / math.log(2), kl / math.log(2)


# -- the inputs ----------------------------------------------------------------------------------------


def _cases() -> list[Case]:
    model = toy.toy()
    f, y = toy.member_predictions(model, toy.PROMPTS[0])
    same = randn(1, 2, 5, seed=41).expand(3, 2, 5)
    return [
        Case(
            "3 members, 2 positions, a vocabulary of 5",
            (randn(3, 2, 5, seed=40), torch.tensor([1, 4])),
            30,
        ),
        Case("3 identical members (diversity 0)", (same.clone(), torch.tensor([0, 2])), 31),
        Case(
            "5 members, 1 position, a vocabulary of 7",
            (randn(5, 1, 7, seed=42, scale=2.0), torch.tensor([3])),
            35,
        ),
        Case(f"the toy's {f.shape[0]} members on {toy.PROMPTS[0]!r}", (f, y), 10**6, True),
    ]


def _describe(out: tuple[Tensor, Tensor, Tensor]) -> str:
    ens, bias, div = (float(t) for t in out)
    return f"on the toy: {ens:.3f} = {bias:.3f} − {div:.3f}"


# -- the exercises ------------------------------------------------------------------------------------

SQUARED_TERMS = Exercise(
    "squared_terms",
    squared_terms,
    _cases,
    [
        Mistake(
            "sum_members",
            "bias and diversity are summed over the members: both are means, (1/M) Σ_i.",
            _sq_sum_members,
        ),
        Mistake(
            "bias_of_mean",
            "the bias is the ensemble's error ‖z − y‖²: it is the members' mean error, (1/M) Σ_i ‖f_i − y‖².",
            _sq_bias_of_mean,
        ),
        Mistake(
            "div_to_target",
            "the diversity is measured against the target: it is the spread around the ensemble, (1/M) Σ_i ‖f_i − z‖² with z = mean_i f_i.",
            _sq_div_to_target,
        ),
        Mistake(
            "mean_vocab",
            "a mean over the vocabulary: ‖·‖² sums the squares over every token.",
            _sq_mean_vocab,
        ),
    ],
    describe=_describe,
    shape_hint="three numbers: (ensemble error, bias, diversity)",
)

CE_TERMS = Exercise(
    "ce_terms",
    ce_terms,
    _cases,
    [
        Mistake(
            "kl_reversed",
            "the diversity's KL is reversed: it is KL(softmax z ‖ q_i), the ensemble's distribution first.",
            _ce_kl_reversed,
        ),
        Mistake(
            "mean_of_softmax",
            "the ensemble's distribution is the mean of the members' softmaxes: it is softmax of the mean logits z (their normalised geometric mean), for which the identity holds.",
            _ce_mean_of_softmax,
        ),
        Mistake("log2", "logarithms in base 2: lensdiv reports nats.", _ce_log2),
    ],
    describe=_describe,
    shape_hint="three numbers: (ensemble CE, mean member CE, mean KL)",
)

check_squared_terms = SQUARED_TERMS.check
check_ce_terms = CE_TERMS.check
EXERCISES = (SQUARED_TERMS, CE_TERMS)
