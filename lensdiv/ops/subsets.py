"""``F(S)`` for many subsets ``S`` of a model's units on one batch (docs/science.md B4).

Two ways to use only the units in ``S``:

- by direct-path sums of the ensemble members' logit contributions (B1, :mod:`lensdiv.ops.members`):
  one clean forward pass, then a sum of member logits and a softmax per subset and position;
- by truly removing the blocks not in ``S`` (``h_{l+1} := h_l``): a forward pass per subset that
  resumes from the clean residual at the first removed block (:class:`~lensdiv.ops.resume.Resumer`),
  several subsets stacked along the batch.

Both return, per subset, the SUM over the kept positions of a per-position score (negative
cross-entropy or top-1 hit), so the caller's statistics stay sums that merge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Step
from lensdiv.ops.members import iter_member_logits, member_readout
from lensdiv.ops.resume import Resumer

Metric = Literal["neg_ce", "accuracy"]
ConstantMode = Literal["full", "shared"]

# Logits alive at once (member logits, or subset logits), ~128 MB in float32.
_BLOCK_ELEMENTS = 1 << 25
# Rows (subsets × sequences) per removal forward pass when ``chunk`` is automatic.
_REMOVAL_ROWS = 64


def _scores(
    logits: Float[Tensor, "subset n d_vocab"], targets: Int[Tensor, " n"], metric: Metric
) -> Float[Tensor, "subset n"]:
    """Per-position score: log-probability of the target (negative CE) or top-1 hit (a hit when
    no logit is strictly larger than the target's, the logit lens's rank-0 rule)."""
    index = targets.view(1, -1, 1).expand(logits.shape[0], -1, 1)
    target = logits.gather(-1, index)
    if metric == "neg_ce":
        return (target - logits.logsumexp(-1, keepdim=True))[..., 0]
    return ((logits > target).sum(-1) == 0).to(logits.dtype)


def _subset_matrix(masks: Sequence[int], n_units: int, device: Any) -> Float[Tensor, "subset unit"]:
    rows = [[float(m >> u & 1) for u in range(n_units)] for m in masks]
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(len(masks), n_units)


def direct_scores(
    step: Step,
    masks: Sequence[int],
    keep: Bool[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    *,
    metric: Metric = "neg_ce",
    constant: ConstantMode = "full",
    max_elements: int = _BLOCK_ELEMENTS,
) -> Float[Tensor, " subset"]:
    """Sum over kept positions of each subset's score, predicting with its members' logits.

    Args:
        step: The clean pass; its cache must hold :func:`lensdiv.ops.members.member_hooks`.
        masks: Subsets of the ``2L + 1`` members (bit ``i`` = member ``i`` of
            :func:`lensdiv.ops.members.member_names`).
        keep: Positions scored (each must have a next token).
        targets: Next tokens.
        metric: ``neg_ce`` or ``accuracy``.
        constant: ``full`` (the whole constant for every subset) or ``shared`` (``|S|/M`` of it).
        max_elements: Logits alive at once.

    Returns:
        ``[len(masks)]`` float64 sums.
    """
    info = step.info
    n_members = 2 * info.n_layers + 1
    device = keep.device
    out = torch.zeros(len(masks), dtype=torch.float64, device=device)
    if not masks or not keep.any():
        return out
    weights = _subset_matrix(masks, n_members, device)
    const = member_readout(step.model).const
    share = weights.sum(1, keepdim=True) / n_members if constant == "shared" else None
    flat_targets = targets[keep]
    chunks = iter_member_logits(
        step.model, step.cache, info, keep, constant="separate", max_elements=max_elements
    )
    for rows, z in chunks:
        n_rows, d_vocab = z.shape[1], z.shape[2]
        per = max(1, max_elements // max(n_rows * d_vocab, 1))
        flat = z.reshape(n_members, -1)
        for lo in range(0, len(masks), per):
            w = weights[lo : lo + per].to(flat.dtype)  # float64 member logits: float64 sums
            logits = (w @ flat).view(w.shape[0], n_rows, d_vocab)
            if share is None:
                logits = logits + const
            else:
                logits = logits + share[lo : lo + per, :, None] * const
            out[lo : lo + per] += _scores(logits, flat_targets[rows], metric).double().sum(1)
    return out


def _first_removed(mask: int, n_layers: int) -> int:
    """The first block not in ``mask`` (``n_layers`` when all are kept)."""
    for layer in range(n_layers):
        if not mask >> layer & 1:
            return layer
    return n_layers


def _next_kept(mask: int, start: int, n_layers: int) -> int:
    """The first block in ``mask`` at or after ``start`` (``n_layers`` when none)."""
    for layer in range(start, n_layers):
        if mask >> layer & 1:
            return layer
    return n_layers


def removal_finals(
    step: Step, masks: Sequence[int], resumer: Resumer, *, chunk: int = 0
) -> Iterator[tuple[list[int], Float[Tensor, "subset batch pos d_model"]]]:
    """Final residuals ``h_L`` with only the blocks of each mask kept (``h_{l+1} := h_l`` for
    the others), as ``(indices into masks, residuals)`` chunks.

    A subset whose first skipped block is ``s0`` and whose next kept block is ``s1`` has
    ``h_{s1} = h_{s0}`` of the clean pass; the subsets of a chunk (sorted by ``s1``) resume
    together from the smallest ``s1``, skipped blocks are overwritten row by row, and subsets with
    no kept block after ``s0`` need no forward pass at all.
    """
    info = step.info
    L = info.n_layers
    h = [step.resid(layer) for layer in range(L + 1)]
    batch = step.batch.tokens.shape[0]
    plans = []
    for index, mask in enumerate(masks):
        s0 = _first_removed(mask, L)
        plans.append((_next_kept(mask, s0, L), s0, index))
    still = [p for p in plans if p[0] == L]
    if still:
        yield [i for _, _, i in still], torch.stack([h[s0] for _, s0, _ in still])
    running = sorted(p for p in plans if p[0] < L)
    per = chunk or max(1, _REMOVAL_ROWS // batch)
    for lo in range(0, len(running), per):
        group = running[lo : lo + per]
        start = group[0][0]
        n = len(group)
        resid = torch.cat([h[min(start, s0)] for _, s0, _ in group])
        tokens = step.batch.tokens.repeat(n, 1)
        kept = torch.tensor(
            [[masks[i] >> layer & 1 for layer in range(L)] for _, _, i in group],
            dtype=torch.bool,
            device=resid.device,
        ).repeat_interleave(batch, dim=0)
        hooks, current = _skip_hooks(resid, ~kept, start)
        resumer.run(tokens, start, resid, hooks, logits=False)
        out = current["h"].view(n, batch, *current["h"].shape[1:])
        yield [i for _, _, i in group], out


def _skip_hooks(
    resid: Float[Tensor, "row pos d_model"], skip: Bool[Tensor, "row layer"], start: int
) -> tuple[list[tuple[str, Callable[..., Any]]], dict[str, Tensor]]:
    """Hooks on ``blocks.{l}.hook_resid_post`` (``l ≥ start``) that replace the output of every
    skipped block by its input, row by row; the returned dict ends up holding ``h_L``."""
    current = {"h": resid}  # the input of the next block to run
    hooks = []
    for layer in range(start, skip.shape[1]):
        rows = skip[:, layer, None, None]
        any_skip = bool(rows.any())

        def overwrite(
            tensor: Tensor, *, hook: Any, rows: Tensor = rows, any_skip: bool = any_skip
        ) -> Tensor:
            out = torch.where(rows, current["h"], tensor) if any_skip else tensor
            current["h"] = out
            return out

        hooks.append((f"blocks.{layer}.hook_resid_post", overwrite))
    return hooks, current


def removal_scores(
    step: Step,
    masks: Sequence[int],
    keep: Bool[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    resumer: Resumer,
    *,
    metric: Metric = "neg_ce",
    chunk: int = 0,
    max_elements: int = _BLOCK_ELEMENTS,
) -> Float[Tensor, " subset"]:
    """Sum over kept positions of each block subset's score, by true removal of the other
    blocks (see :func:`removal_finals`); read out through the model's final norm and
    unembedding in the readout dtype (:meth:`~lensdiv.ops.resume.Resumer.readout`)."""
    out = torch.zeros(len(masks), dtype=torch.float64, device=keep.device)
    if not masks or not keep.any():
        return out
    resumer.prepare(step.batch.tokens)
    flat_targets = targets[keep]
    d_vocab = step.info.d_vocab
    rows_per = max(1, max_elements // d_vocab)
    for indices, finals in removal_finals(step, masks, resumer, chunk=chunk):
        vectors = finals[:, keep]  # [subset, n, d_model]
        n = vectors.shape[1]
        flat = vectors.reshape(-1, vectors.shape[-1])  # subset-major rows
        which = torch.tensor(indices, device=out.device).repeat_interleave(n)
        goal = flat_targets.repeat(len(indices))
        for lo in range(0, flat.shape[0], rows_per):
            logits = resumer.readout(flat[lo : lo + rows_per])  # float32 (float64 model: 64)
            scores = _scores(logits[None], goal[lo : lo + rows_per], metric)[0]
            out.index_add_(0, which[lo : lo + rows_per], scores.double())
    return out
