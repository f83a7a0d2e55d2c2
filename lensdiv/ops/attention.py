"""Attention patterns and the residual entries an intervention edits (docs/science.md F1, F2):
per-head sums of a layer's pattern, the sink removed from a pattern, and a pass resumed at a
block with an edit made inside it.

A *pattern* is what ``blocks.{l}.attn.hook_pattern`` holds: the softmax probabilities
``p[batch, head, query, key]`` after every mask the model applies (causal, sliding window,
padding) and after attention-logit soft-capping, one row per query head (grouped-query models
repeat their key/value heads, so the pattern has ``n_heads`` rows). TransformerLens' attention
bridges compute attention themselves and pass the pattern through the hook inside the
computation, so an edited pattern re-weights the values: :func:`remove_sink` as a hook is the
intervention itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.ops.resume import Resumer

Hook = tuple[str, Any]


def pattern_hook(layer: int) -> str:
    """The hook holding layer ``layer``'s attention pattern."""
    return f"blocks.{layer}.attn.hook_pattern"


def _working(pattern: Tensor) -> Tensor:
    """The pattern in float32 at least (float64 stays float64): half precision would lose the
    small terms of the entropy."""
    return pattern if pattern.dtype in (torch.float32, torch.float64) else pattern.float()


def head_sums(
    pattern: Float[Tensor, "batch head query key"],
    queries: Bool[Tensor, "batch query"],
    keys: Bool[Tensor, "batch key"],
    first: int,
) -> dict[str, Float[Tensor, " head"]]:
    """Per-head sums over the kept queries (float64): the mass on key 0 (``mass0``), on keys
    ``0..first−1`` (``mass_first``) and the entropy ``−Σ_k p ln p`` in nats (``entropy``),
    computed in the pattern's dtype (float32 at least) and summed in float64.

    Keys outside ``keys`` (pads) add nothing to either mass; a pad never receives attention from
    a real query of a right-padded causal batch, so this only guards left padding.
    """
    p = _working(pattern)
    if not bool(keys.all()):
        p = p * keys[:, None, None, :].to(p.dtype)
    per_query = {
        "mass0": p[..., 0],
        "mass_first": p[..., :first].sum(-1),
        "entropy": torch.special.entr(p).sum(-1),
    }
    # Boolean indexing (not multiplying by the mask): a NaN in a pad row cannot leak in.
    return {key: value.transpose(1, 2)[queries].double().sum(0) for key, value in per_query.items()}


def key_mass(
    pattern: Float[Tensor, "batch head query key"],
    queries: Bool[Tensor, "batch query"],
) -> Float[Tensor, "batch key"]:
    """Attention each key position receives, summed over heads and kept queries (float64)."""
    p = _working(pattern)
    weight = queries.to(p.dtype)
    return torch.einsum("bhqk,bq->bk", p, weight).double()


def uniform_mass(queries: Bool[Tensor, "batch query"]) -> Float[Tensor, "batch key"]:
    """What :func:`key_mass` would be, per head, if every kept query spread its attention evenly
    over the keys it sees (``1/(q+1)`` on each key ``≤ q``; causal, right-padded rows)."""
    width = queries.shape[1]
    pos = torch.arange(width, device=queries.device)
    weight = queries.double() / (pos + 1.0)  # [batch, query]
    # key k receives Σ_{q ≥ k} weight[q]: a reversed cumulative sum.
    return weight.flip(1).cumsum(1).flip(1)


def remove_sink(
    pattern: Float[Tensor, "batch head query key"],
    first: int,
    heads: Sequence[int] | None = None,
) -> Float[Tensor, "batch head query key"]:
    """The pattern with keys ``0..first−1`` masked for every query ``q ≥ first`` and the rest of
    each row renormalised (the softmax over the remaining keys).

    Queries ``0..first−1`` see no other key; they are left as they are. A row whose remaining
    mass is exactly 0 (all its attention on the sink, to the last bit) is left as it is too.
    ``first == 0`` masks nothing and returns ``pattern`` itself. ``heads``: only these heads
    (default all).
    """
    if first <= 0:
        return pattern
    out = pattern.clone()
    select = slice(None) if heads is None else list(heads)
    part = out[:, select, first:, :]
    rest = part[..., first:].sum(-1, keepdim=True)
    masked = torch.zeros_like(part)
    masked[..., first:] = part[..., first:] / rest.clamp_min(torch.finfo(rest.dtype).tiny)
    out[:, select, first:, :] = torch.where(rest > 0, masked, part)
    return out


def final_with(
    resumer: Resumer,
    tokens: Int[Tensor, "batch pos"],
    start: int,
    resid: Float[Tensor, "batch pos d_model"],
    hooks: Sequence[Hook] = (),
) -> Float[Tensor, "batch pos d_model"]:
    """The final residual ``h_L`` of a pass resumed at block ``start`` from ``resid`` with
    ``hooks`` on (blocks ``start..L−1`` run; the edit lives in the hooks)."""
    if start == resumer.n_layers:  # no block left to run: the edited state is the final one
        return resid
    last = f"blocks.{resumer.n_layers - 1}.hook_resid_post"
    final: dict[str, Tensor] = {}

    def keep(tensor: Tensor, *, hook: Any) -> Tensor:
        final["h"] = tensor
        return tensor

    resumer.run(tokens, start, resid, [*hooks, (last, keep)], logits=False)
    return final["h"].to(tokens.device)
