"""Statistics of read-out rows from their logits: the log-partition, entropy, KL against a
reference, cross-entropy, ranks and the top-k (:func:`row_stats`, :func:`top_k`), and every lens
statistic of a batch's states through a lens and the final readout (:func:`lens_statistics`).

The readout's precision and cost policy (:mod:`lensdiv.ops.readout`) holds: logits in the
readout dtype, one log-partition per row, no log-probability tensor over the vocabulary,
full-vocabulary passes into the :class:`~lensdiv.ops.readout.Workspace`'s buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.bridge import Bridge
from lensdiv.core.numerics import exp, exp_
from lensdiv.ops.fused import fuse, fused_sums
from lensdiv.ops.readout import (
    BLOCK_ELEMENTS,
    LENS_MIN_ROWS,
    FinalReadout,
    Workspace,
    block_rows,
)
from lensdiv.ops.translators import LOGIT, Lens

# -- statistics from logits --------------------------------------------------------------------------


@dataclass
class RowStats:
    """What one block of logits ``z`` says per row (float64, on the logits' device).

    Args:
        lse: ``log Σ exp z`` (the log-partition).
        expect: ``E_p[z]`` with ``p = softmax z`` (entropy = ``lse − expect``), if asked.
        shift: ``E_p[z − z_ref]`` against a reference block, if given.
        target: ``z[target]``, if targets were given.
        rank: Tokens with a strictly larger logit than the target, if targets were given.
        top: Indices of the ``k`` largest logits ``[n, k]``, if ``k > 0``.
    """

    lse: Tensor
    expect: Tensor | None = None
    shift: Tensor | None = None
    target: Tensor | None = None
    rank: Tensor | None = None
    top: Tensor | None = None


# Logits whose statistics are taken together (at least 32 rows): a few rows' logits and buffers
# stay in the cores' caches across the passes of :func:`row_stats` (on SmolLM2's 49k vocabulary
# with 2 threads, 32 rows take 0.82x the time of one 512-row block; 8 rows pay for their many
# small calls, as would rows of a small vocabulary cut 32 at a time).
STATS_ELEMENTS = 1 << 21
STATS_ROWS = 32

# ``exp(z)`` without subtracting the row's largest logit first (one full-vocabulary pass fewer)
# when every row's largest logit lies in this range: ``Σ exp z`` cannot overflow float32 on any
# vocabulary below 2^24 tokens (``e^60 · 2^24 < 10^33``), and the logits below float32's normal
# range, raised to ``−87`` (:func:`lensdiv.core.numerics.exp`), are below
# ``e^(−87+40) · 2^24 < 10^−13`` of the sum.
_DIRECT_EXP = (-40.0, 60.0)


def row_stats(
    z: Float[Tensor, "n d_vocab"],
    scratch: Float[Tensor, "n d_vocab"],
    *,
    targets: Int[Tensor, " n"] | None = None,
    k: int = 0,
    expect: bool = False,
    rank: bool = True,
    reference: Float[Tensor, "n d_vocab"] | None = None,
    product: Float[Tensor, "n d_vocab"] | None = None,
) -> RowStats:
    """Statistics of ``p = softmax(z)`` from the logits alone, one log-partition per row.

    Every full-vocabulary pass writes into ``scratch`` (or ``z`` itself, or ``product``), never
    into a new tensor: top-k, the target's logit and rank, ``e = exp(z − c)`` (``c`` the row's
    largest logit, or 0 when no row's is far from 0) and its sum, then the expectations
    ``E_p[x] = Σ e·x / Σ e``. ``E_p[z − z_ref]`` is summed from the elementwise differences, so
    a small KL is not the difference of two large expectations. The rows are taken
    :data:`STATS_ELEMENTS` logits (and at least :data:`STATS_ROWS` rows) at a time, so that their
    passes run in cache; once a process has read
    enough logits, every sum after the top-k comes from one fused pass instead
    (:mod:`lensdiv.ops.fused`).

    Args:
        z: Logits (readout dtype). Overwritten when ``reference`` is given, or when ``expect``
            is asked without a ``product`` buffer (after every statistic that needs it).
        scratch: A buffer of ``z``'s shape; overwritten.
        targets: Per-row token ids for :attr:`RowStats.target` and :attr:`RowStats.rank`.
        rank: With ``targets``, also count the target's rank (a full-vocabulary pass).
        k: Report the top-``k`` indices.
        expect: Report ``E_p[z]`` (for the entropy).
        reference: Logits of the distribution to compare with: report ``E_p[z − z_ref]``, so
            ``KL(p ‖ p_ref) = E_p[z − z_ref] − lse + lse_ref``.
        product: A buffer for ``e·z`` that keeps ``z`` intact (without ``reference``).
    """
    n = z.shape[0]
    fused = fuse(z.numel())
    step = max(STATS_ROWS, STATS_ELEMENTS // max(1, z.shape[1]))
    if n <= step or fused:
        return _row_stats(z, scratch, targets, k, expect, rank, reference, product, fused)
    parts = [
        _row_stats(
            z[lo : lo + step],
            scratch[lo : lo + step],
            None if targets is None else targets[lo : lo + step],
            k,
            expect,
            rank,
            None if reference is None else reference[lo : lo + step],
            None if product is None else product[lo : lo + step],
            False,
        )
        for lo in range(0, n, step)
    ]

    def cat(name: str) -> Tensor | None:
        values = [getattr(part, name) for part in parts]
        return None if values[0] is None else torch.cat(values)

    lse = cat("lse")
    assert lse is not None
    return RowStats(
        lse=lse,
        expect=cat("expect"),
        shift=cat("shift"),
        target=cat("target"),
        rank=cat("rank"),
        top=cat("top"),
    )


def _row_stats(
    z: Float[Tensor, "n d_vocab"],
    scratch: Float[Tensor, "n d_vocab"],
    targets: Int[Tensor, " n"] | None,
    k: int,
    expect: bool,
    rank: bool,
    reference: Float[Tensor, "n d_vocab"] | None,
    product: Float[Tensor, "n d_vocab"] | None,
    fused: bool,
) -> RowStats:
    """:func:`row_stats` of one block of rows (by :mod:`lensdiv.ops.fused`'s kernel if
    ``fused``)."""
    top = None
    if k > 0:
        values, top = top_k(z, k)
        peak = values[:, :1]
    else:
        peak = z.amax(-1, keepdim=True)
    target = ranks = None
    target_logit = None
    if targets is not None:
        target_logit = z.gather(-1, targets.view(-1, 1).to(z.device))
        target = target_logit[:, 0].double()
    sums = fused_sums(z, peak, target_logit if rank else None, reference) if fused else None
    if sums is not None:  # one pass over the logits, nothing written
        norm, ey, count, shift_sum = sums
        offset = peak[:, 0].double()
        expected = offset + ey / norm if expect else None
        shift = None if shift_sum is None else shift_sum / norm
        ranks = None if count is None else count.double()
        return RowStats(
            lse=offset + norm.log(),
            expect=expected,
            shift=shift,
            target=target,
            rank=ranks,
            top=top,
        )
    if target_logit is not None and rank:
        torch.gt(z, target_logit, out=scratch)  # 0/1 in the logits' dtype: exact, and fast
        ranks = scratch.sum(-1).double()
    low, high = _DIRECT_EXP
    direct = z.dtype == torch.float32 and z.device.type == "cpu"  # no device sync for it
    if direct and low < float(peak.min()) and float(peak.max()) < high:
        exp(z, out=scratch)
        offset = torch.zeros_like(peak[:, 0], dtype=torch.float64)
    else:
        exp_(torch.sub(z, peak, out=scratch))
        offset = peak[:, 0].double()
    norm = scratch.sum(-1).double()
    lse = offset + norm.log()
    shift = expected = None
    if reference is not None:
        z.sub_(reference).mul_(scratch)
        shift = z.sum(-1).double() / norm
        if expect:
            torch.mul(scratch, reference, out=z)
            expected = shift + z.sum(-1).double() / norm
    elif expect:
        if product is None:
            product = z.mul_(scratch)
        else:
            torch.mul(scratch, z, out=product)
        expected = product.sum(-1).double() / norm
    return RowStats(lse=lse, expect=expected, shift=shift, target=target, rank=ranks, top=top)


# Logits per chunk when :func:`top_k` looks for the largest among the chunks' maxima.
TOPK_CHUNK = 64


def top_k(
    z: Float[Tensor, "n d_vocab"], k: int, chunk: int = TOPK_CHUNK
) -> tuple[Float[Tensor, "n k"], Int[Tensor, "n k"]]:
    """``z.topk(k, dim=-1)`` (values sorted, largest first, and their indices), from one
    vectorised pass over the logits.

    ``torch.topk`` over a row of 50k logits costs a CPU several times an elementwise pass (it
    was an eighth of a lens's statistics). The ``k`` largest logits of a row lie in the ``k``
    chunks (of ``chunk`` consecutive logits) with the largest maxima, so the row's chunk maxima
    are taken in one pass, and ``topk`` looks only at those ``k`` chunks and the row's last,
    incomplete chunk. The values are ``torch.topk``'s; among equal logits the indices may be
    others (``torch.topk`` leaves the order of ties unspecified too).
    """
    n, V = z.shape
    whole = V - V % chunk
    if z.stride(-1) != 1 or whole < 4 * k * chunk:  # a narrow vocabulary: topk is cheap
        values, indices = z.topk(k, dim=-1)
        return values, indices
    chunks = z.as_strided((n, whole // chunk, chunk), (z.stride(0), chunk, 1))
    best = chunks.amax(-1).topk(k, dim=-1).indices
    within = torch.arange(chunk, device=z.device)
    cols = (best.unsqueeze(-1) * chunk + within).reshape(n, k * chunk)
    if whole < V:
        cols = torch.cat([cols, torch.arange(whole, V, device=z.device).expand(n, -1)], dim=1)
    values, picked = z.gather(1, cols).topk(k, dim=-1)
    return values, cols.gather(1, picked)


@dataclass
class LensRows:
    """Logit-lens statistics of every state and row (float64, ``[state, row]``).

    Args:
        kl: ``KL(p_l ‖ p_ref)``.
        entropy: ``H(p_l)``.
        overlap: ``|top_k(p_l) ∩ top_k(p_ref)| / k``.
        target_logp: ``log p_l(target)``.
        rank: Tokens more probable than the target under ``p_l``.
    """

    kl: Tensor
    entropy: Tensor
    overlap: Tensor
    target_logp: Tensor
    rank: Tensor


def lens_statistics(
    readout: FinalReadout,
    states: Sequence[Float[Tensor, "... d_model"]],
    rows: Int[Tensor, " n"],
    targets: Int[Tensor, " n"],
    *,
    k: int,
    reference: int = -1,
    workspace: Workspace | None = None,
    block_elements: int | None = None,
    translator: Lens | None = None,
    model: Bridge | None = None,
    tokens: Int[Tensor, "batch pos"] | None = None,
) -> LensRows:
    """The lens of every state at the given rows, against the reference state's output.

    Blocks of rows; in each block the reference state is read first and its logits stay in a
    buffer while every other state is read against them: one large unembedding matmul per state
    and block, then the statistics of :func:`row_stats` in the block's buffers.

    Args:
        readout: The model's :func:`final_readout`.
        states: Residual states of the same batch (any leading shape, flattened to rows; each
            may live on its own device).
        rows: Flat row indices to read (into ``state.reshape(-1, d_model)``).
        targets: Next-token id per row (any valid id where a row has none; mask it later).
        k: Size of the top-k sets.
        reference: Index into ``states`` of the output state (default the last).
        workspace: Scratch buffers (a fresh one when omitted).
        block_elements: Logits per buffer (rows per block = this / d_vocab); by default
            :data:`~lensdiv.ops.readout.BLOCK_ELEMENTS`, but at least
            :data:`~lensdiv.ops.readout.LENS_MIN_ROWS` rows.
        translator: The lens (:class:`~lensdiv.ops.translators.Lens`; ``None``: the logit
            lens), indexed like ``states``: its reader gives the state the final norm reads
            (an affine translator applied in the readout dtype; a lens that runs blocks, in
            the model's).
        model, tokens: The model and the batch's tokens, for a lens that runs model blocks.

    Returns:
        :class:`LensRows` on the device of ``rows``.
    """
    ws = workspace or Workspace()
    n_states, n = len(states), int(rows.numel())
    V, dtype, device = readout.d_vocab, readout.dtype, readout.device
    k = max(1, min(k, V))
    reference = reference % n_states
    out = {
        key: torch.zeros(n_states, n, dtype=torch.float64, device=device)
        for key in ("kl", "entropy", "overlap", "target_logp", "rank")
    }
    flat = [s.reshape(-1, s.shape[-1]) for s in states]
    targets = targets.to(device)
    step = (
        block_rows(V, block_elements)
        if block_elements is not None
        else max(block_rows(V), LENS_MIN_ROWS)
    )
    others = [i for i in range(n_states) if i != reference]
    read = (translator or LOGIT).reader(model, tokens, dtype=dtype, device=device)
    for lo in range(0, n, step):
        idx = rows[lo : lo + step]
        r, t, block = int(idx.numel()), targets[lo : lo + step], slice(lo, lo + step)
        z_ref = ws.get("lens.reference", (r, V), dtype, device)
        scratch = ws.get("lens.scratch", (r, V), dtype, device)
        ref = row_stats(
            readout.logits(read(flat, reference, idx), out=z_ref),
            scratch,
            targets=t,
            k=k,
            expect=True,
            product=ws.get("lens.logits", (r, V), dtype, device),
        )
        _put(out, [reference], block, ref, ref, k, torch.zeros_like(ref.lse))
        # a block of few rows (a small vocabulary) reads several states in one call: fewer,
        # larger products and passes, the same numbers row by row
        per_call = max(1, step // r)
        for first in range(0, len(others), per_call):
            group = others[first : first + per_call]
            g = len(group)
            h = (
                torch.cat([read(flat, i, idx) for i in group])
                if g > 1
                else read(flat, group[0], idx)
            )
            s = row_stats(
                readout.logits(h, out=ws.get("lens.logits", (g * r, V), dtype, device)),
                ws.get("lens.scratch", (g * r, V), dtype, device),  # the reference's is done
                targets=t if g == 1 else t.repeat(g),
                k=k,
                expect=True,
                reference=z_ref if g == 1 else z_ref.repeat(g, 1),
            )
            assert s.shift is not None
            kl = (s.shift.view(g, r) - s.lse.view(g, r) + ref.lse).clamp_min(0.0)
            _put(out, group, block, s, ref, k, kl)
    return LensRows(**{key: value.to(rows.device) for key, value in out.items()})


def _put(
    out: dict[str, Tensor],
    states: list[int],
    block: slice,
    s: RowStats,
    ref: RowStats,
    k: int,
    kl: Tensor,
) -> None:
    """Write the statistics ``s`` of ``states`` (their rows one after another) at ``block``."""
    assert s.expect is not None and s.target is not None and s.rank is not None
    assert s.top is not None and ref.top is not None
    g = len(states)
    top = s.top.view(g, -1, s.top.shape[-1])
    same = (top.unsqueeze(-1) == ref.top.unsqueeze(-2)).any(-1)
    at = torch.tensor(states, device=kl.device)
    out["kl"][at, block] = kl.view(g, -1)
    out["entropy"][at, block] = (s.lse - s.expect).view(g, -1)
    out["overlap"][at, block] = same.sum(-1).double() / k
    out["target_logp"][at, block] = (s.target - s.lse).view(g, -1)
    out["rank"][at, block] = s.rank.double().view(g, -1)


def cross_entropy(
    readout: FinalReadout,
    h: Float[Tensor, "n d_model"],
    targets: Int[Tensor, " n"],
    *,
    workspace: Workspace | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> Float[Tensor, " n"]:
    """Next-token cross-entropy ``lse(z) − z[target]`` of residual vectors (float64, per row,
    on ``h``'s device)."""
    ws = workspace or Workspace()
    V, dtype, device = readout.d_vocab, readout.dtype, readout.device
    n = h.shape[0]
    out = torch.zeros(n, dtype=torch.float64, device=device)
    t_all = targets.to(device)
    step = block_rows(V, block_elements)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        z = readout.logits(h[lo:hi], out=ws.get("ce.logits", (hi - lo, V), dtype, device))
        scratch = ws.get("ce.scratch", (hi - lo, V), dtype, device)
        s = row_stats(z, scratch, targets=t_all[lo:hi], rank=False)
        assert s.target is not None
        out[lo:hi] = s.lse - s.target
    return out.to(h.device)


def log_partition(z: Float[Tensor, "*batch d_vocab"]) -> Float[Tensor, "*batch"]:
    """``log Σ exp z`` along the last axis in float64 (from readout-dtype logits, one exp pass)."""
    peak = z.amax(-1, keepdim=True)
    total = exp_(z - peak).sum(-1)
    return peak[..., 0].double() + total.double().log()
