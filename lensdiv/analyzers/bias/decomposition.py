"""The decompositions of ``bias`` on plain tensors, and the :class:`Decomposition` of a run.

The functions take member predictions (or the Gram terms that stand for them) and return the
per-position terms of the two exact identities of docs/science.md B2–B3; :meth:`Decomposition.from_state`
turns a run's summed terms into the per-member and per-depth numbers the result shows. Nothing here
builds a table, a plot or a sentence (that is :mod:`lensdiv.analyzers.bias.present`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.stats import Stats
from lensdiv.ops.members import member_layers, member_names
from lensdiv.ops.rowstats import log_partition

Weighting = Literal["mean", "sum"]
Members = Literal["sublayers", "states"]


# -- the decompositions, on plain tensors ---------------------------------------------------------


def direct_decomposition(
    f: Float[Tensor, "member n vocab"], y: Int[Tensor, " n"]
) -> dict[str, Tensor]:
    """Both forms from member predictions ``f_i`` (their mean is the ensemble's logits ``z``).

    Returns per position (float64): ``sq_bias``/``sq_div`` ``[member, n]`` (``||f_i − y||²``,
    ``||f_i − z||²``), ``sq_ens`` ``[n]`` (``||z − y||²``), ``ce``/``kl`` ``[member, n]``
    (``CE(y, q_i)``, ``KL(softmax z ‖ q_i)``), ``ce_ens`` ``[n]`` and top-1 hits ``correct``
    ``[member, n]`` / ``correct_ens`` ``[n]``. Materialises everything: small vocabularies only.
    """
    f = f.double()
    z = f.mean(0)
    onehot = torch.nn.functional.one_hot(y, f.shape[-1]).double()
    logq = torch.log_softmax(f, -1)
    logp = torch.log_softmax(z, -1)
    return {
        "sq_bias": (f - onehot).pow(2).sum(-1),
        "sq_div": (f - z).pow(2).sum(-1),
        "sq_ens": (z - onehot).pow(2).sum(-1),
        "ce": -logq.gather(-1, y.expand(f.shape[0], -1).unsqueeze(-1))[..., 0],
        "kl": (logp.exp() * (logp - logq)).sum(-1),
        "ce_ens": -logp.gather(-1, y.unsqueeze(-1))[..., 0],
        "correct": (f.argmax(-1) == y).double(),
        "correct_ens": (z.argmax(-1) == y).double(),
    }


def gram_squared_error(
    u: Float[Tensor, "member n d_model"],
    gram: Float[Tensor, "d_model d_model"],
    w_c: Float[Tensor, " d_model"],
    c_sq: float,
    g_y: Float[Tensor, "n d_model"],
    c_y: Float[Tensor, " n"],
    sizes: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """The squared-error form over the full vocabulary without member logits.

    For each prefix size ``m`` in ``sizes`` (the ensemble of the first ``m`` members, each
    predicting ``f_i = m u_i·W_U + c``): ``||f_i − y||²`` and ``||f_i − z||²`` for ``i < m``
    (zero beyond), and ``||z − y||²``.

    Args:
        u: Normalised member vectors (``z_i = u_i·W_U``).
        gram: ``G = W_U W_Uᵀ``.
        w_c: ``W_U c`` for the constant ``c``.
        c_sq: ``||c||²``.
        g_y: ``W_U[:, y]``, the target's unembedding column, per position.
        c_y: ``c[y]`` per position.
        sizes: Prefix sizes (``M`` alone for the full ensemble).

    Returns:
        ``(bias, div, ens)`` in float64: ``[prefix, member, n]``, ``[prefix, member, n]``,
        ``[prefix, n]``.
    """
    n_members = u.shape[0]
    gu = (u @ gram).double()  # G is symmetric: rows of u·G are G·u_i
    ud = u.double()
    q = (gu * ud).sum(-1)  # u_iᵀ G u_i
    a = ud @ w_c.double()  # u_i · W_U c
    b = (ud * g_y.double()).sum(-1)  # u_i · W_U[:, y]
    prefix = ud.cumsum(0)[[m - 1 for m in sizes]]  # U_S, [prefix, n, d_model]
    s = torch.einsum("ind,pnd->pin", gu, prefix)  # u_iᵀ G U_S
    member = torch.arange(n_members, device=u.device)
    m = torch.tensor(sizes, device=u.device, dtype=torch.float64).view(-1, 1, 1)
    inside = (member.view(1, -1) < m.view(-1, 1).long()).unsqueeze(-1).double()  # [p, M, 1]
    s = s * inside
    big_q = s.sum(1)  # U_Sᵀ G U_S, [prefix, n]
    c_y = c_y.double()
    bias = (m * m * q + 2 * m * a + c_sq - 2 * (m * b + c_y) + 1.0) * inside
    # A squared norm: clamp the rounding of the expanded form (it cancels for equal members).
    div = (m * m * q - 2 * m * s + big_q.unsqueeze(1)).clamp_min(0.0) * inside
    a_s, b_s = (a * inside).sum(1), (b * inside).sum(1)
    ens = big_q + 2 * a_s + c_sq - 2 * (b_s + c_y) + 1.0
    return bias, div, ens


def ce_terms(f: Float[Tensor, "member n vocab"], y: Int[Tensor, " n"]) -> dict[str, Tensor]:
    """The cross-entropy form over a large vocabulary, one pass over the member logits.

    ``KL(p ‖ q_i) = lse(f_i) − lse(z) − p·(f_i − z)`` with ``p = softmax z`` (exact), so no
    log-softmax of the members is materialised. Same keys and meaning as
    :func:`direct_decomposition`'s ``ce``, ``kl``, ``ce_ens``, ``correct``, ``correct_ens``.
    """
    z = f.mean(0)
    lse_f = log_partition(f)
    lse_z = log_partition(z)
    p = torch.softmax(z, -1)
    pf = torch.einsum("mnv,nv->mn", f, p).double()
    pz = (p * z).sum(-1).double()
    f_y = f.gather(-1, y.expand(f.shape[0], -1).unsqueeze(-1))[..., 0].double()
    z_y = z.gather(-1, y.unsqueeze(-1))[..., 0].double()
    return {
        "ce": lse_f - f_y,
        "kl": (lse_f - lse_z - (pf - pz)).clamp_min(0.0),
        "ce_ens": lse_z - z_y,
        "correct": (f.argmax(-1) == y).double(),
        "correct_ens": (z.argmax(-1) == y).double(),
    }


def prefix_sizes(info: ModelInfo, members: Members = "sublayers") -> list[int]:
    """Members of the prefix ensemble at ``h_l`` for ``l = 0..L``: the ``2l + 1`` sublayer
    members written before it, or the ``l + 1`` states ``h_0 .. h_l``."""
    if members == "states":
        return [layer + 1 for layer in range(info.n_layers + 1)]
    return [2 * layer + 1 for layer in range(info.n_layers + 1)]


def member_names_of(info: ModelInfo, members: Members) -> tuple[list[str], list[int]]:
    """The members' names and layers: sublayer members (``embed``, ``attn0``, ... with their
    block, -1 for the embedding), or the residual states ``h0 .. hL`` (with their index)."""
    if members == "states":
        return [f"h{layer}" for layer in range(info.n_layers + 1)], list(range(info.n_layers + 1))
    return member_names(info), member_layers(info)


# -- the numbers of a run -------------------------------------------------------------------------
@dataclass(frozen=True)
class Form:
    """One form of the identity ``ensemble loss = bias − diversity``, over the members.

    Args:
        bias: Sum over members of their (weighted) bias terms.
        diversity: Sum over members of their (weighted) diversity terms.
        ensemble_loss: The ensemble's loss (scaled like the terms).
        positions: Positions the form was taken at.
    """

    bias: float
    diversity: float
    ensemble_loss: float
    positions: float

    @property
    def identity_gap(self) -> float:
        """``bias − diversity − ensemble loss``: zero up to rounding."""
        return self.bias - self.diversity - self.ensemble_loss

    @property
    def diversity_share(self) -> float:
        """``diversity / bias`` (NaN for a zero bias)."""
        return self.diversity / self.bias if self.bias else math.nan


@dataclass(frozen=True)
class MemberTerms:
    """Each member's share of the full ensemble's decomposition (NaN where not measured).

    Args:
        sq_bias: ``w ||f_i − y||²`` (squared-error form).
        sq_diversity: ``w ||f_i − z||²``.
        ce_bias: ``w CE(y, q_i)`` (cross-entropy form).
        ce_diversity: ``w KL(softmax z ‖ q_i)``.
        top1_acc: Top-1 accuracy of the member's own prediction ``f_i``.
    """

    sq_bias: list[float]
    sq_diversity: list[float]
    ce_bias: list[float]
    ce_diversity: list[float]
    top1_acc: list[float]


@dataclass(frozen=True)
class PrefixTerms:
    """One form of the decomposition for each prefix ensemble ``h_0 .. h_L`` (the members
    written before ``h_l``).

    Args:
        bias: Bias of the prefix ensemble.
        diversity: Its diversity.
        loss: Its loss.
        accuracy: Its top-1 accuracy (cross-entropy form only).
    """

    bias: list[float]
    diversity: list[float]
    loss: list[float]
    accuracy: list[float] | None = None


@dataclass(frozen=True)
class Decomposition:
    """Bias and diversity of a run, per member and along depth: no tables, no prose.

    Terms are means over positions, ``mean``-weighted (divided by the ensemble's members) or
    ``sum``-weighted (ensemble losses times the members) as ``weighting`` says.

    Args:
        names: The members' names (``embed``, ``attn0``, ``mlp0``, ...).
        layers: Each member's block (``-1`` for the embedding).
        sizes: Members of the prefix ensemble at ``h_l``, ``l = 0..L``.
        weighting: ``mean`` or ``sum``.
        members: Each member's terms in the full ensemble.
        depth: The squared-error form of every prefix ensemble.
        depth_ce: Its cross-entropy form (``None`` where it was not taken per prefix).
        squared: The squared-error form of the full ensemble.
        ce: Its cross-entropy form (NaN when it was taken at no position).
        label_words: The label set (label mode; ``None`` on the corpus).
        kind: What the members are: ``sublayers`` or ``states`` (read through ``lens``).
        lens: The run's fitted lens (``states`` members; ``None`` for the logit lens).
    """

    names: list[str]
    layers: list[int]
    sizes: list[int]
    weighting: Weighting
    members: MemberTerms
    depth: PrefixTerms
    depth_ce: PrefixTerms | None
    squared: Form
    ce: Form
    label_words: list[str] | None = None
    kind: Members = "sublayers"
    lens: Any = None

    @classmethod
    def from_state(
        cls, state: Stats, info: ModelInfo, weighting: Weighting, members: Members = "sublayers"
    ) -> Decomposition:
        """The means of a merged state's sums (at least one position with a target)."""
        n, n_ce = float(state["n"]), float(state["n_ce"])
        if n == 0:
            raise ValueError("no position had a target, so there is nothing to decompose")
        names, layers = member_names_of(info, members)
        n_members = len(names)
        w = 1.0 / n_members if weighting == "mean" else 1.0
        scale_ens = 1.0 if weighting == "mean" else float(n_members)
        per_ce = 1.0 / n_ce if n_ce else math.nan
        nan = [math.nan] * n_members
        terms = MemberTerms(
            sq_bias=(state["sq_bias"] / n * w).tolist(),
            sq_diversity=(state["sq_div"] / n * w).tolist(),
            ce_bias=(state["ce"] * per_ce * w).tolist() if "ce" in state else list(nan),
            ce_diversity=(state["kl"] * per_ce * w).tolist() if "kl" in state else list(nan),
            top1_acc=(state["correct"] * per_ce).tolist() if "correct" in state else list(nan),
        )
        sizes = prefix_sizes(info, members)
        m = torch.tensor(sizes, dtype=torch.float64)
        wm = 1.0 / m if weighting == "mean" else torch.ones_like(m)
        em = torch.ones_like(m) if weighting == "mean" else m
        depth = PrefixTerms(
            bias=(state["depth/sq_bias"] / n * wm).tolist(),
            diversity=(state["depth/sq_div"] / n * wm).tolist(),
            loss=(state["depth/sq_ens"] / n * em).tolist(),
        )
        depth_ce = None
        if "depth/ce" in state:
            depth_ce = PrefixTerms(
                bias=(state["depth/ce"] * per_ce * wm).tolist(),
                diversity=(state["depth/kl"] * per_ce * wm).tolist(),
                loss=(state["depth/ce_ens"] * per_ce * em).tolist(),
                accuracy=(state["depth/correct_ens"] * per_ce).tolist(),
            )
        squared = Form(
            sum(terms.sq_bias),
            sum(terms.sq_diversity),
            float(state["depth/sq_ens"][-1]) / n * scale_ens,
            n,
        )
        ce = Form(
            sum(terms.ce_bias),
            sum(terms.ce_diversity),
            float(state.get("ce_ens", math.nan)) * per_ce * scale_ens,
            n_ce,
        )
        words = state.get("label_words")
        return cls(
            names=names,
            layers=layers,
            sizes=sizes,
            weighting=weighting,
            members=terms,
            depth=depth,
            depth_ce=depth_ce,
            squared=squared,
            ce=ce,
            label_words=None if words is None else list(words),
            kind=members,
            lens=state.get("lens"),
        )
