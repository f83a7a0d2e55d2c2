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
    TILE_ELEMENTS,
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
        top_values: Their logits (readout dtype), largest first.
    """

    lse: Tensor
    expect: Tensor | None = None
    shift: Tensor | None = None
    target: Tensor | None = None
    rank: Tensor | None = None
    top: Tensor | None = None
    top_values: Tensor | None = None


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
    reference: Float[Tensor, "r d_vocab"] | None = None,
    product: Float[Tensor, "n d_vocab"] | None = None,
    threshold: Float[Tensor, "n 1"] | None = None,
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
            ``KL(p ‖ p_ref) = E_p[z − z_ref] − lse + lse_ref``. Its rows may be fewer than
            ``z``'s: then ``z`` is several states' rows stacked, each against the same rows.
        product: A buffer for ``e·z`` that keeps ``z`` intact (without ``reference``).
        threshold: Without ``targets``, count per row the logits above this one instead (a
            part of the vocabulary that may not hold the target: :func:`merge_stats`).
    """
    n = z.shape[0]
    fused = fuse(z.numel())
    step = max(STATS_ROWS, STATS_ELEMENTS // max(1, z.shape[1]))
    if reference is not None and reference.shape[0] != n and (fused or n > step):
        reference = reference.repeat(n // reference.shape[0], 1)  # row by row from here
    if n <= step or fused:
        return _row_stats(
            z, scratch, targets, k, expect, rank, reference, product, threshold, fused
        )
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
            None if threshold is None else threshold[lo : lo + step],
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
        top_values=cat("top_values"),
    )


def _row_stats(
    z: Float[Tensor, "n d_vocab"],
    scratch: Float[Tensor, "n d_vocab"],
    targets: Int[Tensor, " n"] | None,
    k: int,
    expect: bool,
    rank: bool,
    reference: Float[Tensor, "r d_vocab"] | None,
    product: Float[Tensor, "n d_vocab"] | None,
    threshold: Float[Tensor, "n 1"] | None,
    fused: bool,
) -> RowStats:
    """:func:`row_stats` of one block of rows (by :mod:`lensdiv.ops.fused`'s kernel if
    ``fused``)."""
    top = values = None
    if k > 0:
        values, top = top_k(z, k)
        peak = values[:, :1]
    else:
        peak = z.amax(-1, keepdim=True)
    target = ranks = None
    target_logit = threshold
    if targets is not None:
        target_logit = z.gather(-1, targets.view(-1, 1).to(z.device))
        target = target_logit[:, 0].double()
    sums = fused_sums(z, peak, target_logit if rank else None, reference) if fused else None
    if sums is not None:  # one pass over the logits, nothing written
        norm, ey, count, shift_sum = (None if x is None else x.double() for x in sums)
        assert norm is not None and ey is not None
        offset = peak[:, 0].double()
        expected = offset + ey / norm if expect else None
        shift = None if shift_sum is None else shift_sum / norm
        ranks = count
        return RowStats(
            lse=offset + norm.log(),
            expect=expected,
            shift=shift,
            target=target,
            rank=ranks,
            top=top,
            top_values=values,
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
        _grouped(z, reference).sub_(reference)
        shift = z.mul_(scratch).sum(-1).double() / norm
        if expect:
            torch.mul(_grouped(scratch, reference), reference, out=_grouped(z, reference))
            expected = shift + z.sum(-1).double() / norm
    elif expect:
        if product is None:
            product = z.mul_(scratch)
        else:
            torch.mul(scratch, z, out=product)
        expected = product.sum(-1).double() / norm
    return RowStats(
        lse=lse, expect=expected, shift=shift, target=target, rank=ranks, top=top, top_values=values
    )


def _grouped(x: Tensor, reference: Tensor) -> Tensor:
    """``x`` ``[g · r, V]`` as ``[g, r, V]`` against a ``reference`` of ``r`` rows (the same
    reference for each of ``g`` states: broadcast, not copied), else ``x`` itself."""
    return x if x.shape[0] == reference.shape[0] else x.view(-1, *reference.shape)


def merge_stats(a: RowStats | None, b: RowStats, offset: int = 0) -> RowStats:
    """The statistics of a row's logits from those of two disjoint parts of its vocabulary:
    ``a`` (``None``: nothing yet) and ``b``, whose columns start at ``offset``. The
    log-partitions add (``logaddexp``), the expectations are averaged with the parts' shares
    of the mass, ranks counted against the same threshold add, and the top-k is the largest
    ``k`` of both parts'. A target's logit comes from the part that holds it (kept from ``a``
    when it has one)."""
    top = None if b.top is None else b.top + offset
    if a is None:
        return RowStats(b.lse, b.expect, b.shift, b.target, b.rank, top, b.top_values)
    lse = torch.logaddexp(a.lse, b.lse)
    wa, wb = (a.lse - lse).exp(), (b.lse - lse).exp()

    def mean(x: Tensor | None, y: Tensor | None) -> Tensor | None:
        return None if x is None or y is None else wa * x + wb * y

    values = a.top_values
    if a.top is not None and top is not None and a.top_values is not None:
        assert b.top_values is not None
        k = a.top.shape[-1]
        values, pick = torch.cat([a.top_values, b.top_values], -1).topk(k, dim=-1)
        top = torch.cat([a.top, top], -1).gather(-1, pick)
    return RowStats(
        lse=lse,
        expect=mean(a.expect, b.expect),
        shift=mean(a.shift, b.shift),
        target=a.target if a.target is not None else b.target,
        rank=None if a.rank is None or b.rank is None else a.rank + b.rank,
        top=top,
        top_values=values,
    )


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
    tile_elements: int = TILE_ELEMENTS,
    translator: Lens | None = None,
    model: Bridge | None = None,
    tokens: Int[Tensor, "batch pos"] | None = None,
) -> LensRows:
    """The lens of every state at the given rows, against the reference state's output.

    Blocks of rows; in each block the vocabulary is read a tile at a time
    (:meth:`~lensdiv.ops.readout.FinalReadout.tile_columns`: the whole vocabulary but on a CPU
    with a large one): the reference state's logits of the tile first, kept in a buffer, then
    every other state's against them, one unembedding product per state and tile and the
    statistics of :func:`row_stats` in the tile's buffers, merged across tiles
    (:func:`merge_stats`). On a small vocabulary several states are read in one call.

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
        tile_elements: Logits per vocabulary tile on a CPU
            (:data:`~lensdiv.ops.readout.TILE_ELEMENTS`).
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
        r, block = int(idx.numel()), slice(lo, lo + step)
        width = readout.tile_columns(r, tile_elements)
        sweep = _Sweep(readout, ws, targets[lo : lo + step], k, width)
        x_ref = readout.normalize(read(flat, reference, idx))
        held = max(1, HELD_ELEMENTS // max(1, r * x_ref.shape[-1]))
        # a small vocabulary reads several states in one call (fewer, larger products and
        # passes, the same numbers row by row); a tiled one holds the normalised rows of up to
        # ``held`` states while it walks the tiles (the reference's logits made once a tile)
        per_call = max(1, step // r) if width == V else 1
        ref: RowStats | None = None
        for first in range(0, max(1, len(others)), held):
            group = others[first : first + held]
            calls = [group[i : i + per_call] for i in range(0, len(group), per_call)]
            units = [
                torch.cat([readout.normalize(read(flat, i, idx)) for i in call]) for call in calls
            ]
            ref, found = sweep.run(x_ref, units, ref)
            for call, s in zip(calls, found, strict=True):
                g = len(call)
                assert s.shift is not None
                kl = (s.shift.view(g, r) - s.lse.view(g, r) + ref.lse).clamp_min(0.0)
                _put(out, call, block, s, ref, k, kl)
        assert ref is not None
        _put(out, [reference], block, ref, ref, k, torch.zeros_like(ref.lse))
    return LensRows(**{key: value.to(rows.device) for key, value in out.items()})


def _rows(t: Tensor, g: int) -> Tensor:
    """``t`` repeated for ``g`` states' rows stacked (``t`` itself for one)."""
    return t if g == 1 else t.repeat(g)


# Normalised rows a tiled lens holds at once (float32: 256 MiB), states times rows times d_model.
HELD_ELEMENTS = 1 << 26


class _Sweep:
    """One block of rows read through the vocabulary's tiles (:func:`lens_statistics`)."""

    def __init__(
        self, readout: FinalReadout, ws: Workspace, targets: Tensor, k: int, width: int
    ) -> None:
        self.readout, self.ws, self.targets, self.k = readout, ws, targets, k
        V = readout.d_vocab
        self.tiles = [slice(c, min(c + width, V)) for c in range(0, V, width)]

    def run(
        self, x_ref: Tensor, units: list[Tensor], ref: RowStats | None
    ) -> tuple[RowStats, list[RowStats]]:
        """The statistics of each unit (the normalised rows of one or more states, stacked),
        and of the reference rows unless ``ref`` already has them."""
        readout, ws, t = self.readout, self.ws, self.targets
        dtype, device = readout.dtype, readout.device
        r, whole = x_ref.shape[0], len(self.tiles) == 1
        # a target's logit cannot be taken from a tile that may not hold it: ranks are counted
        # against each row's own target logit, and each row's logit is taken from its tile
        columns = None if whole else readout.target_columns(t)  # once for every state
        limits: list[Tensor | None] = [
            None if columns is None else readout.target_logits(x, columns)[:, None]
            for x in [x_ref, *units]
        ]
        need_ref = ref is None
        acc: list[RowStats | None] = [None] * (len(units) + 1)
        for cols in self.tiles:
            w = cols.stop - cols.start
            z_ref = readout.unembed(
                x_ref, None if whole else cols, out=ws.get("lens.reference", (r, w), dtype, device)
            )
            if need_ref:
                acc[0] = self._add(acc[0], z_ref, cols, limits[0], product=True)
            for u, x in enumerate(units, start=1):
                g = x.shape[0] // r
                z = readout.unembed(
                    x, None if whole else cols, out=ws.get("lens.logits", (g * r, w), dtype, device)
                )
                acc[u] = self._add(acc[u], z, cols, limits[u], against=z_ref)
        if need_ref:
            ref = acc[0]
        assert ref is not None and all(a is not None for a in acc[1:])
        return ref, [a for a in acc[1:] if a is not None]

    def _add(
        self,
        acc: RowStats | None,
        z: Tensor,
        cols: slice,
        limit: Tensor | None,
        *,
        product: bool = False,
        against: Tensor | None = None,
    ) -> RowStats:
        """``acc`` with the statistics of the tile ``z`` of columns ``cols`` merged in
        (``limit``: the rows' own target logits, for a vocabulary in several tiles)."""
        ws, dtype, device = self.ws, self.readout.dtype, self.readout.device
        n, w = z.shape
        t = _rows(self.targets, n // self.targets.shape[0])
        scratch = ws.get("lens.scratch", (n, w), dtype, device)
        # the reference's e·z, its logits kept for the others (whose own are made afterwards)
        keep = ws.get("lens.logits", (n, w), dtype, device) if product else None
        if limit is None:  # the whole vocabulary: the target's logit read from it
            return row_stats(
                z, scratch, targets=t, k=self.k, expect=True, reference=against, product=keep
            )
        inside = (t >= cols.start) & (t < cols.stop)
        at = (t - cols.start).clamp(0, w - 1)[:, None]
        own = z.gather(-1, at)[:, 0]  # before the statistics overwrite z
        part = row_stats(
            z, scratch, k=self.k, expect=True, reference=against, product=keep, threshold=limit
        )
        merged = merge_stats(acc, part, cols.start)
        assert merged.rank is not None
        # the row's own logit (the product's, not the dot product's) where this tile holds it;
        # a rounding above the limit counted the target itself, which is not above itself
        base = merged.target if merged.target is not None else torch.zeros_like(merged.lse)
        merged.target = torch.where(inside, own.double(), base)
        merged.rank = merged.rank - (inside & (own > limit[:, 0])).to(merged.rank.dtype)
        return merged


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
