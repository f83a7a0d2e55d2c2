"""The prompt view's cells from residual states, read out in blocks of rows.

For every state (a row of the grid) and position: the top-k tokens with their log-probabilities,
the KL divergence to a reference output, the entropy, and the log-probability and rank of the
token that comes next — from the logits and one log-partition per row
(:mod:`lensdiv.ops.readout`'s method): no log-probability tensor over the grid is ever formed.
Several states share one unembedding product (a block of rows); the statistics then run over
sub-blocks of a few rows, whose full-vocabulary buffers stay in the CPU's cache between the passes
(a :class:`~lensdiv.ops.readout.Workspace`, kept between calls by the explore server); the
reference output's logits stay in a buffer while the states are read against them.

**Products** (:data:`PRODUCTS`, the one declaration of the setting; :func:`products_of` reads
it):

- ``"float32"``: every logit in the readout dtype (float32; float64 for a float64 model), the
  precision policy of :mod:`lensdiv.ops.readout`. Exact; what reports and ``lensdiv lens MODEL
  TEXT`` use.
- ``"bf16"``: the vocabulary-wide product of the grid's rows in bfloat16 (float32 accumulation,
  bfloat16 output; the unembedding centred over the vocabulary first, which changes no
  probability and keeps the logits small, so their bfloat16 rounding is small too), and every
  number that is shown recomputed in float32 from the float32 normalised states: the logits of
  the top-k candidates (the ``k + SPARE`` largest bfloat16 logits, re-ranked by their float32
  logits) and of the next token; the reference output row (the model's output, the top row) is
  read entirely in float32. What still carries bfloat16 rounding: the rest of the vocabulary's
  share of the normaliser, of the entropy and of the KL (the candidates' own terms are float32),
  the next token's rank (counted against the bfloat16 logits) and the choice of the candidates.
  ``tests/test_cells.py`` bounds the difference to ``"float32"`` on a GPT-2-shaped
  unembedding (the shown probabilities within 1e-3).
  Memory: a bfloat16 copy of the unembedding, centred, and a float32 copy laid out by token
  (unless the model's already is), kept while the model's readout lives (231 MB for GPT-2
  small).
- ``"auto"``: ``"bf16"`` where it pays and is sound — the CPU has bfloat16 instructions
  (``avx512_bf16`` or ``amx_bf16``) or the GPU supports bfloat16, the unembedding has at least
  :data:`BF16_MIN_WEIGHTS` weights, and the readout is float32 with no non-linear logit transform;
  else ``"float32"``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.errors import OptionError
from lensdiv.core.numerics import exp
from lensdiv.ops.derived import derived
from lensdiv.ops.readout import BLOCK_ELEMENTS, FinalReadout, Workspace, block_rows

PRODUCTS = ("auto", "float32", "bf16")
# The unembedding size from which "auto" takes bf16 products (GPT-2 small's is 38.6 M): below it
# the float32 product is already cheap and every number stays exact.
BF16_MIN_WEIGHTS = 1 << 24
# Candidates re-read in float32 beyond the k shown (bf16 products).
SPARE = 8
# Logits per sub-block of the statistics: its few full-vocabulary buffers stay in the cache
# between the passes (4 MiB each in float32).
STAT_ELEMENTS = 1 << 20


@dataclass
class _Grid:
    """The cells' statistics (float64 unless said otherwise).

    Args:
        top: ``[row, pos, k]`` token ids, most likely first (int64).
        top_logp: ``[row, pos, k]`` their log-probabilities.
        kl: ``[row, pos]`` ``KL(p_cell ‖ p_reference)`` in nats (≥ 0).
        entropy: ``[row, pos]`` the cell's entropy in nats.
        next_logp: ``[row, pos]`` log-probability of the next token (``following``).
        next_rank: ``[row, pos]`` tokens with a larger logit than the next one (int64).
    """

    top: Tensor
    top_logp: Tensor
    kl: Tensor
    entropy: Tensor
    next_logp: Tensor
    next_rank: Tensor


@dataclass
class Cells(_Grid):
    """Every cell of a ``[row, position]`` grid: the statistics of :class:`_Grid` (``top``,
    ``top_logp``, ``kl``, ``entropy``, ``next_logp``, ``next_rank``), and ``products``, the
    products used: ``"float32"`` or ``"bf16"``."""

    products: str


def products_of(products: str, readout: FinalReadout) -> str:
    """``"float32"`` or ``"bf16"``: the setting ``products`` (one of :data:`PRODUCTS`) for this
    readout.

    Raises:
        OptionError: An unknown setting, or ``"bf16"`` where it is unsound (a readout that is not
            float32, or a non-linear transform of the logits).
    """
    if products not in PRODUCTS:
        raise OptionError(
            f"unknown products {products!r}", hint=f"use one of {', '.join(PRODUCTS)}"
        )
    sound = readout.dtype == torch.float32 and readout.transform is None
    if products == "bf16" and not sound:
        raise OptionError(
            "bf16 products need a float32 readout without a non-linear logit transform",
            hint="use products float32 (or auto) with this model",
        )
    if products == "auto":
        big = readout.W_U.numel() >= BF16_MIN_WEIGHTS
        return "bf16" if sound and big and fast_bf16(readout.device) else "float32"
    return products


def describe(products: str) -> str:
    """What the products mean for the numbers, for a view's ``meta``."""
    if products == "bf16":
        return (
            "bf16 products (float32 accumulation) for the vocabulary-wide normaliser, entropy, "
            f"KL and rank; the top-k (chosen among the k + {SPARE} largest), the next token and "
            "the output row re-read in float32"
        )
    return "float32 products"


def fast_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively (a CUDA GPU that supports
    bfloat16, or a CPU with ``avx512_bf16`` / ``amx_bf16``)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    return device.type == "cpu" and _cpu_bf16()


@functools.cache
def _cpu_bf16() -> bool:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flag to read, so no claim
        return False
    flags = set(next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


# -- bf16 weights ----------------------------------------------------------------------------------


@dataclass(eq=False)
class _Bf16Weights:
    """The unembedding for bf16 products: ``W_T`` float32 ``[d_vocab, d_model]`` (rows gathered
    for the candidates), ``centred`` bfloat16 ``[d_vocab, d_model]`` (``W_T`` minus its mean over
    the vocabulary, ``mean``)."""

    W_T: Tensor
    centred: Tensor
    mean: Tensor
    has_bias: bool


def _bf16_weights(readout: FinalReadout) -> _Bf16Weights:
    """The readout's :class:`_Bf16Weights` (:func:`~lensdiv.ops.derived.derived`: made once,
    made again when ``W_U`` or ``b_U`` change)."""
    W_U, b_U = readout.W_U, readout.b_U

    def make() -> _Bf16Weights:
        W_T = W_U.t().contiguous()
        mean = W_T.mean(0)
        return _Bf16Weights(W_T, (W_T - mean).to(torch.bfloat16), mean, bool(b_U.any()))

    return derived(readout, "cells.bf16", (W_U, b_U), make)


# -- the grid ------------------------------------------------------------------------------------


def cells(
    readout: FinalReadout,
    states: Sequence[Float[Tensor, "pos d_model"]],
    reference: Float[Tensor, "pos d_model"],
    following: Int[Tensor, " pos"],
    *,
    k: int,
    products: str = "float32",
    workspace: Workspace | None = None,
    block_elements: int = BLOCK_ELEMENTS // 2,
    stat_elements: int = STAT_ELEMENTS,
) -> Cells:
    """Every cell of the grid whose rows are ``states`` read out through ``readout``.

    Args:
        readout: The model's :func:`~lensdiv.ops.readout.final_readout`.
        states: One ``[pos, d_model]`` tensor per row of the grid (a lens already applied).
        reference: The states whose distributions the KL compares with (the model's output);
            a row equal to it is read once, with KL 0.
        following: The next token at each position (any valid id where there is none).
        k: Tokens kept per cell.
        products: One of :data:`PRODUCTS` (see the module docstring).
        workspace: Scratch buffers, kept between calls (a fresh one when omitted).
        block_elements: Logits per product (rows per product = this / d_vocab).
        stat_elements: Logits per sub-block of the statistics.

    Returns:
        :class:`Cells` on the readout's device.
    """
    ws = workspace or Workspace()
    mode = products_of(products, readout)
    V, dtype, device = readout.d_vocab, readout.dtype, readout.device
    n_rows, n_pos, k = len(states), int(reference.shape[0]), max(1, min(k, readout.d_vocab))
    kq = min(V, k + SPARE) if mode == "bf16" else k
    shape = (n_rows, n_pos)
    out = _Out(
        top=torch.zeros(*shape, k, dtype=torch.long, device=device),
        top_logp=torch.zeros(*shape, k, dtype=torch.float64, device=device),
        kl=torch.zeros(shape, dtype=torch.float64, device=device),
        entropy=torch.zeros(shape, dtype=torch.float64, device=device),
        next_logp=torch.zeros(shape, dtype=torch.float64, device=device),
        next_rank=torch.zeros(shape, dtype=torch.long, device=device),
    )
    same = [i for i, h in enumerate(states) if _equal(h, reference)]
    others = [i for i in range(n_rows) if i not in same]
    following = following.to(device)
    cap = block_rows(V, block_elements)
    sub = block_rows(V, stat_elements)
    step = min(n_pos, cap)
    for lo in range(0, n_pos, step):
        n = min(lo + step, n_pos) - lo
        nxt = following[lo : lo + n]
        parts = [(a, min(a + sub, n)) for a in range(0, n, sub)]
        # The reference first, in the readout dtype: its rows' cells, then y_ref = z_ref - max
        # stays in its buffer while the states are read against it.
        z_ref = ws.get("cells.ref", (n, V), dtype, device)
        readout.logits(reference[lo : lo + n], out=z_ref)
        ref_log_norm = torch.empty(n, dtype=torch.float64, device=device)
        for a, b in parts:
            e, prod = _scratch(ws, b - a, V, dtype, device)
            s = _stats(z_ref[a:b], e, prod, None, None, nxt[a:b], k, None)
            ref_log_norm[a:b] = s.log_norm
            for i in same:
                out.put(i, slice(lo + a, lo + b), s, zero_kl=True)
        per = max(1, cap // n)  # states per product
        for g in range(0, len(others), per):
            group = others[g : g + per]
            h = torch.cat([states[i][lo : lo + n].to(device) for i in group])
            z = ws.get("cells.z", (len(group) * n, V), dtype, device)
            exact = None
            if mode == "bf16":
                exact = _Exact.of(readout, h, z, ws, nxt.repeat(len(group)))
            else:
                readout.logits(h, out=z)
            for j, i in enumerate(group):
                for a, b in parts:  # the statistics in sub-blocks that stay in the cache
                    r = slice(j * n + a, j * n + b)
                    e, prod = _scratch(ws, b - a, V, dtype, device)
                    rows = None if exact is None else exact.rows(r)
                    s = _stats(z[r], e, prod, z_ref[a:b], ref_log_norm[a:b], nxt[a:b], kq, rows)
                    out.put(i, slice(lo + a, lo + b), s)
    return Cells(**out.__dict__, products=mode)


def _scratch(
    ws: Workspace, rows: int, V: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    return ws.get("cells.e", (rows, V), dtype, device), ws.get("cells.p", (rows, V), dtype, device)


def _equal(h: Tensor, reference: Tensor) -> bool:
    return h is reference or (
        h.shape == reference.shape and h.device == reference.device and torch.equal(h, reference)
    )


@dataclass
class _Block(_Grid):
    """One sub-block's cells (a ``[rows]`` slice of each statistic), and its log-partition
    (``log Σ exp(z − max z)``, float64)."""

    log_norm: Tensor


@dataclass
class _Out(_Grid):
    """The grid being filled, sub-block by sub-block."""

    def put(self, row: int, pos: slice, s: _Block, zero_kl: bool = False) -> None:
        k = self.top.shape[-1]
        self.top[row, pos] = s.top[:, :k]
        self.top_logp[row, pos] = s.top_logp[:, :k]
        self.kl[row, pos] = 0.0 if zero_kl else s.kl
        self.entropy[row, pos] = s.entropy
        self.next_logp[row, pos] = s.next_logp
        self.next_rank[row, pos] = s.next_rank


@dataclass
class _Exact:
    """Rows whose logits ``z`` come from the bf16 product (float32, minus the per-row constant
    ``offset`` = ``x · mean``), and the float32 logits of chosen tokens in the same frame."""

    w: _Bf16Weights
    b: Tensor  # the unembedding's bias
    x: Tensor  # the normalised states, float32
    offset: Tensor
    next: Tensor  # the next token's float32 logit, in z's frame

    @classmethod
    def of(
        cls, readout: FinalReadout, h: Tensor, z: Tensor, ws: Workspace, following: Tensor
    ) -> _Exact:
        """The bf16 product of the states ``h`` into ``z``."""
        w = _bf16_weights(readout)
        x = readout.normalize(h)
        low = ws.get("cells.bf16", tuple(z.shape), torch.bfloat16, z.device)
        torch.mm(x.to(torch.bfloat16), w.centred.t(), out=low)
        z.copy_(low)
        if w.has_bias:
            z.add_(readout.b_U)
        exact = cls(w, readout.b_U, x, x @ w.mean, torch.empty(0))
        exact.next = exact.logits(following[:, None])[:, 0]
        return exact

    def rows(self, r: slice) -> _Exact:
        return _Exact(self.w, self.b, self.x[r], self.offset[r], self.next[r])

    def logits(self, ids: Int[Tensor, "rows c"]) -> Float[Tensor, "rows c"]:
        """Float32 logits of ``ids`` per row, minus the row's offset (``z``'s frame)."""
        cols = self.w.W_T.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)
        z = torch.bmm(cols, self.x[:, :, None])[..., 0] + self.b[ids]
        return z - self.offset[:, None]


def _stats(
    z: Tensor,
    e: Tensor,
    prod: Tensor,
    ref_y: Tensor | None,
    ref_log_norm: Tensor | None,
    following: Tensor,
    kq: int,
    exact: _Exact | None,
) -> _Block:
    """The cells of rows of logits ``z`` (shifted in place to ``y = z − max z``), with buffers
    ``e`` and ``prod`` of its shape, against the reference's shifted logits ``ref_y`` and its
    log-partitions, row by row (none for the reference itself).

    Passes over the vocabulary: top-k, the next token's rank, ``y`` in place, ``e = exp y`` and
    its sum, ``Σ e·y`` (entropy) and ``Σ e·(y − y_ref)`` (KL, summed from the elementwise
    differences so that a small KL is not the difference of two large sums). With ``exact`` the
    candidates' and the next token's terms are replaced by their float32 values.
    """
    vals, top = z.topk(kq, dim=-1)
    peak = vals[:, :1]
    t = z.gather(1, following[:, None]) if exact is None else exact.next[:, None].to(z.dtype)
    rank = torch.gt(z, t, out=e).sum(-1).long()
    y = z.sub_(peak)
    exp(y, out=e)
    norm = e.sum(-1).double()
    ey = torch.mul(e, y, out=prod).sum(-1).double()
    ed = None if ref_y is None else torch.sub(y, ref_y, out=prod).mul_(e).sum(-1).double()
    shift = peak[:, 0].double()
    if exact is None:
        top_y = (vals - peak).double()
        next_y = (t[:, 0] - peak[:, 0]).double()
    else:  # the candidates' terms, from their float32 logits instead of the bf16 ones
        approx = (vals - peak).double()
        real = exact.logits(top).double() - shift[:, None]
        a, r = approx.exp(), real.exp()
        norm = norm + (r - a).sum(-1)
        ey = ey + (r * real - a * approx).sum(-1)
        if ed is not None and ref_y is not None:
            y_ref = ref_y.gather(1, top).double()
            ed = ed + (r * (real - y_ref) - a * (approx - y_ref)).sum(-1)
        order = real.argsort(dim=-1, descending=True)
        top, top_y = top.gather(1, order), real.gather(1, order)
        next_y = exact.next.double() - shift
    log_norm = norm.log()
    kl = torch.zeros_like(log_norm)
    if ed is not None and ref_log_norm is not None:
        kl = (ed / norm - log_norm + ref_log_norm).clamp_min(0.0)
    return _Block(
        top=top,
        top_logp=top_y - log_norm[:, None],
        kl=kl,
        entropy=log_norm - ey / norm,
        next_logp=next_y - log_norm,
        next_rank=rank,
        log_norm=log_norm,
    )


__all__ = ["BF16_MIN_WEIGHTS", "PRODUCTS", "SPARE", "Cells", "cells", "describe", "products_of"]
