"""The KL of read-out states against a target distribution and its gradient, fused and chunked:
the tuned lens' training step (:mod:`lensdiv.lenses.tuned`) without autograd over the vocabulary.

For normed states ``x`` (``k`` groups of ``n`` rows: the layers of a tuned lens, each read
against the same target ``p`` of the ``n`` positions) the logits are ``z = x W_U + b_U``,
``log q = log_softmax(z)`` and the loss is ``Σ_rows KL(p ‖ q)``; its gradient with respect to the
logits is ``q − p`` per row, so the gradient with respect to ``x`` is ``(q − p) W_Uᵀ``. Both are
computed block by block of rows (:func:`~lensdiv.ops.readout.block_rows`: about
:data:`~lensdiv.ops.readout.BLOCK_ELEMENTS` logits; a block crosses from one group to the next,
so the layers' readouts are one stacked product) in one reused ``[rows, d_vocab]`` buffer (a
:class:`~lensdiv.ops.readout.Workspace`): nothing over the vocabulary is kept for a backward
pass, and the log-softmax, the KL and ``q − p`` are computed in place.

**Precision.** The softmax, the KL and the gradient are in the readout dtype (float32), the KL's
sums per row, then in float64. With ``bf16`` the unembedding's products (``x W_U`` and
``(q − p) W_Uᵀ``) take bfloat16 operands and accumulate in float32 (torch's CPU kernels with
AVX-512 BF16/AMX; tensor cores): the logits and ``q − p`` carry bfloat16's rounding (relative
2⁻⁹) into and out of the float32 softmax, as under tuned-lens's bf16 autocast, which rounds the
logits the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.numerics import exp, exp_
from lensdiv.ops.derived import derived
from lensdiv.ops.readout import Workspace, block_rows


def unembedding(readout: Any, bf16: bool = False) -> tuple[Tensor, Tensor]:
    """``(W_U, b_U)`` of ``readout`` (a :class:`~lensdiv.ops.readout.FinalReadout`) as the
    products take them: the readout's own, or bfloat16 copies (:func:`~lensdiv.ops.derived.derived`:
    made once, made again when the weights change)."""
    if not bf16:
        return readout.W_U, readout.b_U
    W_U, b_U = readout.W_U, readout.b_U
    return derived(
        readout,
        "kl_grad.bf16",
        (W_U, b_U),
        lambda: (W_U.to(torch.bfloat16), b_U.to(torch.bfloat16)),
    )


class _Logits:
    """Blocks of logits ``x W_U + b_U`` in the readout dtype, into reused buffers, and the
    backward product of a block."""

    def __init__(self, readout: Any, bf16: bool, rows: int, ws: Workspace) -> None:
        self.readout = readout
        self.w, self.b = unembedding(readout, bf16)
        vocab, device = readout.d_vocab, readout.device
        self.buffer = ws.get("kl_grad/logits", (rows, vocab), readout.dtype, device)
        self.low = ws.get("kl_grad/bf16", (rows, vocab), torch.bfloat16, device) if bf16 else None
        self.scratch = ws.get("kl_grad/product", (rows, vocab), readout.dtype, device)
        self.raw: Tensor | None = None
        self.capped: Tensor | None = None

    def centered(self, x: Tensor) -> Tensor:
        """``z − max z`` per row of the logits of rows ``x`` (a view of the buffer, valid until
        the next call). Elementwise passes stay within one dtype: torch's kernels that cast as
        they go run several times slower than a copy and a pass."""
        z = self.buffer[: x.shape[0]]
        if self.low is None:
            torch.addmm(self.b, x, self.w, out=z)
        else:
            low = self.low[: x.shape[0]]
            z.copy_(torch.addmm(self.b, x.to(torch.bfloat16), self.w, out=low))
        if self.readout.transform is not None:  # a softcap, say: its derivative by autograd
            self.raw = z.clone().requires_grad_(True)
            with torch.enable_grad():
                self.capped = self.readout.transform(self.raw)
            z.copy_(self.capped.detach())
        return z.sub_(z.amax(-1, keepdim=True))

    def backward(self, minus_dz: Tensor, out: Tensor) -> None:
        """``out = dz W_Uᵀ`` for ``−dz`` the negated gradient with respect to the last block's
        logits (in the logits' buffer)."""
        if self.raw is not None and self.capped is not None:
            with torch.enable_grad():
                (minus_dz,) = torch.autograd.grad(self.capped, self.raw, minus_dz)
        if self.low is None:
            torch.mm(minus_dz, self.w.T, out=out).neg_()
        else:
            low = self.low[: out.shape[0]].copy_(minus_dz)
            out.copy_(torch.mm(low, self.w.T)).neg_()


def _dot_sum(a: Tensor, b: Tensor, scratch: Tensor) -> Tensor:
    """``Σ a ⊙ b`` over rows ``[r, v]`` in float64: the product into ``scratch`` (a buffer of at
    least ``r·v`` elements), summed per row in the readout dtype (torch's cascade sum), then in
    float64. A BLAS dot accumulates one long chain (a relative 1e-3 lost over 8M terms; 1e-5
    over 4 rows of 50k) and many small dots cost a thread synchronisation each; this costs one
    elementwise pass more and is exact to 1e-8."""
    product = scratch.reshape(-1)[: a.numel()].view(a.shape)
    return torch.mul(a, b, out=product).sum(-1).sum(dtype=torch.float64)


def target_probabilities(
    readout: Any,
    h: Float[Tensor, "n d_model"],
    *,
    bf16: bool = False,
    workspace: Workspace | None = None,
) -> tuple[Float[Tensor, "n d_vocab"], Tensor]:
    """``p`` of residual states ``h`` (the target: the model's output) in the readout dtype, and
    ``Σ_rows Σ_v p log p`` (minus the summed entropy) in float64; the logits' product in
    bfloat16 with ``bf16``.

    ``p`` is the workspace's buffer ``kl_grad/target`` (valid until its next use)."""
    ws = workspace or Workspace()
    n, vocab = h.shape[0], readout.d_vocab
    rows = block_rows(vocab)
    logits = _Logits(readout, bf16, min(rows, n), ws)
    p = ws.get("kl_grad/target", (n, vocab), readout.dtype, readout.device)
    neg_entropy = torch.zeros((), dtype=torch.float64, device=readout.device)
    x = readout.normalize(h)
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        z = logits.centered(x[start:stop])
        block = exp(z, out=p[start:stop])
        total = block.sum(-1, keepdim=True)
        block.div_(total)  # Σ p log p = Σ p (z − max) − log Σ exp(z − max)
        neg_entropy += _dot_sum(block, z, logits.scratch) - total.log().sum(dtype=torch.float64)
    return p, neg_entropy


def fused_kl(
    readout: Any,
    x: Float[Tensor, "rows d_model"],
    p: Float[Tensor, "n d_vocab"],
    neg_entropy: Tensor,
    *,
    bf16: bool = False,
    rows_per_block: int | None = None,
    workspace: Workspace | None = None,
) -> tuple[Float[Tensor, "rows d_model"], Float[Tensor, " k"]]:
    """The gradient of ``Σ_rows KL(p ‖ softmax(x W_U + b_U))`` with respect to ``x``, and the
    KL summed per group of ``n`` rows.

    Args:
        readout: The model's :class:`~lensdiv.ops.readout.FinalReadout`.
        x: Final-normed states, ``k·n`` rows: group ``g`` is rows ``g·n .. g·n + n − 1``, row
            ``g·n + i`` read against ``p[i]``. No gradient is tracked through it here.
        p: The target distribution of the ``n`` positions (:func:`target_probabilities`).
        neg_entropy: ``Σ_rows Σ_v p log p`` of the ``n`` positions.
        bf16: The products in bfloat16 with float32 accumulation.
        rows_per_block: Rows a block (default: :func:`~lensdiv.ops.readout.block_rows`).
        workspace: Where the buffers live between calls (a fresh one otherwise).

    Returns:
        ``(∂/∂x, KL)``: ``[rows, d_model]`` in the readout dtype and ``[k]`` in float64.
    """
    ws = workspace or Workspace()
    n = p.shape[0]
    rows = x.shape[0]
    block = max(1, min(rows, rows_per_block or block_rows(readout.d_vocab)))
    logits = _Logits(readout, bf16, block, ws)
    grad = torch.empty(rows, x.shape[1], dtype=p.dtype, device=p.device)
    kl = torch.zeros(rows // n, dtype=torch.float64, device=p.device)
    with torch.no_grad():
        x = x.detach()
        for start in range(0, rows, block):
            stop = min(rows, start + block)
            z = logits.centered(x[start:stop])  # log q = z − max − log Σ exp(z − max)
            segments = _segments(start, stop, n)
            cross = [
                _dot_sum(z[lo - start : hi - start], p[a:b], logits.scratch)
                for _, lo, hi, a, b in segments
            ]
            total = exp_(z).sum(-1, keepdim=True)
            log_total = total.log().squeeze(-1)
            for (group, lo, hi, a, b), dot in zip(segments, cross, strict=True):
                here = slice(lo - start, hi - start)  # p − q in place: q and − p in one pass
                torch.addcdiv(p[a:b], z[here], total[here], value=-1, out=z[here])
                kl[group] += log_total[here].sum(dtype=torch.float64) - dot
            logits.backward(z, grad[start:stop])
    return grad, kl + neg_entropy  # every group reads all n positions once


def _segments(start: int, stop: int, n: int) -> list[tuple[int, int, int, int, int]]:
    """Rows ``start .. stop − 1`` cut where a group of ``n`` ends: ``(group, lo, hi, a, b)``,
    rows ``lo .. hi − 1`` being the group's positions ``a .. b − 1``."""
    out = []
    lo = start
    while lo < stop:
        group = lo // n
        hi = min(stop, (group + 1) * n)
        out.append((group, lo, hi, lo - group * n, hi - group * n))
        lo = hi
    return out
