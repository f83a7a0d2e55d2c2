"""Skipping a block (docs/science.md A3): the intervened passes and the effects they measure.

Skipping block ``s`` sets ``h_{s+1} := h_s`` (part ``block``) or zeroes only its attention or MLP
write (parts ``attn``, ``mlp``) at the skipped positions. For every later layer ``l`` the effect is

    E[s, l] = max_{t' measured} ||Δ_l(t') − Δ̃_l(t')|| / max(||Δ_l(t')||, 1e-6)
    O[s]    = max_{t' measured} ||softmax z(t') − softmax z̃(t')||₂        (0 ≤ O ≤ √2)

Blocks ``0..s`` are unchanged by skipping ``s``, so each intervened pass resumes from the clean
residual (:class:`~lensdiv.ops.resume.Resumer`) and runs only the blocks after ``s``; the output
effect is read out (final norm + unembedding) at the measured positions only. Used by the
``skip`` and ``depth-score`` analyzers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Step
from lensdiv.core.numerics import exp
from lensdiv.ops.readout import FinalReadout, final_readout
from lensdiv.ops.resume import Resumer

EPS = 1e-6
Mode = Literal["future", "current", "local"]
Part = Literal["block", "attn", "mlp"]

# Positions read out through the unembedding at once (bounds the [rows, vocab] block).
_READOUT_ROWS = 512


@dataclass(frozen=True)
class Intervals:
    """Which positions are skipped and which are measured, per intervened row.

    Args:
        rows: Row of the batch each intervened sequence copies.
        skip: True where block ``s`` is skipped.
        measure: True where effects are measured (real tokens only).
    """

    rows: Int[Tensor, " pair"]
    skip: Bool[Tensor, "pair pos"]
    measure: Bool[Tensor, "pair pos"]


def split_intervals(
    mask: Bool[Tensor, "batch pos"],
    *,
    mode: Mode,
    splits: int,
    stride: int,
    generator: torch.Generator,
    skip_bos: bool = False,
) -> Intervals:
    """The source's intervals: ``current`` skips ``τ ≥ 1`` and measures everything; ``future`` and
    ``local`` draw up to ``splits`` split points ``t ∈ range(stride, n − 4, stride)`` per row of
    real length ``n`` and skip ``1 ≤ τ < t``, measure ``t' ≥ t``. Rows too short get none.
    ``skip_bos`` skips the first position too (``τ ≥ 0``): ``current`` then removes the block at
    every position, as ``prune`` does."""
    n_rows, width = mask.shape
    first = 0 if skip_bos else 1
    pos = torch.arange(width, device=mask.device)
    lengths = mask.sum(1).tolist()
    rows, starts = [], []
    for row, n in enumerate(lengths):
        if mode == "current":
            if n > first:
                rows.append(row)
                starts.append(0)
            continue
        candidates = list(range(stride, n - 4, stride))
        if not candidates:
            continue
        order = torch.randperm(len(candidates), generator=generator)[:splits].tolist()
        for i in sorted(order):
            rows.append(row)
            starts.append(candidates[i])
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    t = torch.tensor(starts, dtype=torch.long, device=mask.device)[:, None]
    real = mask[index]
    if mode == "current":
        skip = (pos >= first) & real
        measure = real.clone()
    else:
        skip = (pos >= first) & (pos < t) & real
        measure = (pos >= t) & real
    return Intervals(rows=index, skip=skip, measure=measure)


def skip_effects(
    step: Step,
    intervals: Intervals,
    *,
    part: Part = "block",
    local: bool = False,
    resumer: Resumer | None = None,
    chunk: int = 0,
    layers: list[int] | None = None,
    kl: Float[Tensor, "pair skipped"] | None = None,
) -> tuple[Float[Tensor, "pair skipped layer"], Float[Tensor, "pair skipped"]]:
    """``E`` and ``O`` for every intervened row and skipped block, from one clean step.

    Args:
        step: The clean pass; its cache must hold every residual ``h_0..h_L`` (and, for a local
            ``attn``/``mlp`` skip, the sublayer outputs).
        intervals: Rows, skipped and measured positions (see :func:`split_intervals`).
        part: ``block``, ``attn`` or ``mlp``.
        local: Remove only the direct residual write of ``s`` at skipped positions.
        resumer: Reused across calls (it checks itself once per model).
        chunk: Intervened rows per forward pass (``0``: as many as the batch has rows).
        layers: Blocks to skip (default all).
        kl: Where given (float64, ``[pair, L]``, zeros), each entry is filled with the sum over
            the pair's measured positions of ``KL(p̃ ‖ p)``, the skipped output's KL to the
            clean one (``lens``'s and ``prune``'s direction).

    Returns:
        ``E[pair, s, l]`` (0 where ``s`` is not in ``layers``) and ``O[pair, s]``, in float64.
    """
    info, model = step.info, step.model
    L = info.n_layers
    resumer = resumer or Resumer(model)
    layers = list(range(L)) if layers is None else layers
    n_pairs = int(intervals.rows.numel())
    device = step.batch.tokens.device
    effect = torch.zeros(n_pairs, L, L, dtype=torch.float64, device=device)
    output = torch.zeros(n_pairs, L, dtype=torch.float64, device=device)
    if n_pairs == 0:
        return effect, output
    resumer.prepare(step.batch.tokens)
    # Every residual on the batch's device (the layers of a split model live on several).
    h = [step.resid(layer).to(device) for layer in range(L + 1)]
    chunk = chunk or step.batch.tokens.shape[0]
    for lo in range(0, n_pairs, chunk):
        sel = slice(lo, lo + chunk)
        rows = intervals.rows[sel]
        skip = intervals.skip[sel]
        measure = intervals.measure[sel]
        tokens = step.batch.tokens[rows]
        clean_h = [x[rows] for x in h]
        clean_p = _probs(final_readout(model), clean_h[L][measure], log=kl is not None)
        for s in layers:
            e, o, k = _one_skip(
                resumer,
                step,
                tokens,
                clean_h,
                clean_p,
                rows,
                skip,
                measure,
                s,
                part,
                local,
                with_kl=kl is not None,
            )
            effect[sel, s] = e
            output[sel, s] = o
            if kl is not None:
                kl[sel, s] = k.to(kl.device)
    return effect, output


def _probs(
    readout: FinalReadout, final: Float[Tensor, "n d_model"], *, log: bool = False
) -> Float[Tensor, "n d_vocab"]:
    """Output distributions of final residual vectors (readout dtype, on the readout's device),
    a block of rows at a time; with ``log``, their log-probabilities."""
    blocks = [
        _log_probs(readout, final[lo : lo + _READOUT_ROWS])
        if log
        else readout.probabilities(final[lo : lo + _READOUT_ROWS])
        for lo in range(0, final.shape[0], _READOUT_ROWS)
    ]
    if not blocks:
        return torch.zeros(0, readout.d_vocab, dtype=readout.dtype, device=readout.device)
    return torch.cat(blocks)


def _one_skip(
    resumer: Resumer,
    step: Step,
    tokens: Int[Tensor, "pair pos"],
    h: list[Tensor],
    clean_p: Float[Tensor, "n d_vocab"],
    rows: Int[Tensor, " pair"],
    skip: Bool[Tensor, "pair pos"],
    measure: Bool[Tensor, "pair pos"],
    s: int,
    part: Part,
    local: bool,
    *,
    with_kl: bool = False,
) -> tuple[Float[Tensor, "pair layer"], Float[Tensor, " pair"], Tensor]:
    """Skip block ``s`` on every row of the chunk; return ``E[:, s, :]``, ``O[:, s]`` and, with
    ``with_kl`` (then ``clean_p`` holds log-probabilities), ``Σ KL(p̃ ‖ p)`` over each pair's
    measured positions (else an empty tensor)."""
    info = step.info
    L = info.n_layers
    n_pairs = tokens.shape[0]
    sk = skip[..., None]
    hooks: list[tuple[str, Callable[..., Any]]] = []
    if local:
        if part == "block":
            write = h[s + 1] - h[s]
        else:
            write = step.cache[f"blocks.{s}.hook_{part}_out"].to(tokens.device)[rows]
        start, resid = s + 1, torch.where(sk, h[s + 1] - write, h[s + 1])
        for layer in range(s + 2, L):

            def pin(tensor: Tensor, *, hook: Any, layer: int = layer) -> Tensor:
                # Interventions happen where the hooked module runs.
                return torch.where(sk.to(tensor.device), (h[layer] - write).to(tensor), tensor)

            hooks.append((f"blocks.{layer}.hook_resid_pre", pin))
    elif part == "block":
        start, resid = s + 1, torch.where(sk, h[s], h[s + 1])
    else:
        start, resid = s, h[s]

        def zero(tensor: Tensor, *, hook: Any) -> Tensor:
            return tensor.masked_fill(sk.to(tensor.device), 0.0)

        hooks.append((f"blocks.{s}.hook_{part}_out", zero))

    # Effects on later updates, computed as each block finishes (nothing is stored).
    effect = torch.zeros(n_pairs, L, dtype=torch.float64, device=tokens.device)
    previous = {"h": resid}
    final: dict[str, Tensor] = {}

    def measure_update(layer: int, new: Tensor, old: Tensor) -> None:
        new, old = new.to(tokens.device), old.to(tokens.device)
        # In float64 before any difference: the updates of a half-precision model are small
        # against the states they are taken from.
        clean = h[layer + 1].double() - h[layer].double()
        diff = (clean - (new.double() - old.double())).norm(dim=-1)
        ratio = diff / clean.norm(dim=-1).clamp_min(EPS)
        effect[:, layer] = ratio.masked_fill(~measure, 0.0).amax(dim=1)

    if start == s + 1:
        measure_update(s, resid, h[s])
    for layer in range(start, L):

        def watch(tensor: Tensor, *, hook: Any, layer: int = layer) -> Tensor:
            # With an attn/mlp part the skipped block itself runs, and its update is measured.
            measure_update(layer, tensor, previous["h"])
            previous["h"] = tensor
            if layer == L - 1:
                final["h"] = tensor
            return tensor

        hooks.append((f"blocks.{layer}.hook_resid_post", watch))
    resumer.run(tokens, start, resid, hooks, logits=False)
    last = final.get("h", resid).to(tokens.device)

    # Output effect: read out only the measured positions, in the readout dtype (L2 of
    # probability vectors: float32 is exact enough, the entries are at most 1).
    readout = final_readout(step.model)
    vectors = last[measure]
    dist = torch.empty(vectors.shape[0], dtype=torch.float64, device=tokens.device)
    kls = torch.empty(vectors.shape[0] if with_kl else 0, dtype=torch.float64, device=dist.device)
    for lo in range(0, vectors.shape[0], _READOUT_ROWS):
        hi = lo + _READOUT_ROWS
        if with_kl:
            log_q, log_p = _log_probs(readout, vectors[lo:hi]), clean_p[lo:hi]
            probs, clean = exp(log_q), exp(log_p)
            kls[lo:hi] = (probs * (log_q - log_p)).sum(-1).double().to(dist.device)
        else:
            probs, clean = readout.probabilities(vectors[lo:hi]), clean_p[lo:hi]
        dist[lo:hi] = (clean - probs).norm(dim=-1).double().to(dist.device)
    per_pos = torch.zeros(measure.shape, dtype=torch.float64, device=tokens.device)
    per_pos[measure] = dist
    kl = torch.zeros(0, dtype=torch.float64, device=tokens.device)
    if with_kl:
        per_kl = torch.zeros(measure.shape, dtype=torch.float64, device=tokens.device)
        per_kl[measure] = kls.to(tokens.device)
        kl = per_kl.sum(dim=1)
    return effect, per_pos.amax(dim=1), kl


def _log_probs(readout: FinalReadout, final: Float[Tensor, "n d_model"]) -> Tensor:
    """Next-token log-probabilities of final residual vectors, in the readout dtype."""
    return torch.log_softmax(readout.logits(final), dim=-1)


def later_effect(effect: Float[Tensor, "skipped layer"]) -> Float[Tensor, " skipped"]:
    """``e_s = Σ_{l>s} E[s, l] / max(L − 1 − s, 1)`` (docs/science.md A5)."""
    L = effect.shape[0]
    later = torch.triu(torch.ones(L, L, dtype=torch.bool, device=effect.device), diagonal=1)
    counts = torch.clamp(torch.arange(L - 1, -1, -1, device=effect.device), min=1)
    return (effect * later).sum(1) / counts
