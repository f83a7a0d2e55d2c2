"""The readout's row sums in one pass over the logits: a kernel fused by ``torch.compile``.

What a lens reports of a row of logits ``z`` — the log-partition, ``E_p[z]`` (the entropy),
``E_p[z − z_ref]`` (the KL) and the target's rank — are sums over the vocabulary of
``e = exp(z − max z)`` times something. Run as separate PyTorch operations they are eight to ten
passes over a ``[rows, vocabulary]`` block, each reading (and most writing) it from memory: about
as long as the unembedding product itself, on a CPU. Fused, they are one pass that reads ``z``
(and ``z_ref``) once and writes nothing: on Gemma 3's 262k vocabulary with 2 threads, 1.6 ns a
logit instead of about 5 with float64 accumulation, 0.56 ns with the logits' own float32.

**Precision.** On a CPU the sums accumulate in the logits' dtype (float64 elsewhere, where a row
is read whole). A CPU reads a large vocabulary in tiles of
at most :data:`~lensdiv.ops.readout.TILE_COLUMNS` columns (merged in float64 across tiles by
:func:`~lensdiv.ops.rowstats.merge_stats`), so a float32 sum adds at most that many terms, in
vectorised lanes of about a thousand each. Measured on 64 random rows of 262,144 logits (scale
3, the reference 0.1 away) read in such tiles: the log-partition within 8.7e-7 of float64's, the
entropy within 3.0e-6 nats and a KL of 0.005 nats within 2.1e-7 (the eager passes, whose float32
sums ATen takes pairwise: 3.9e-8, 9.0e-7, 6.8e-8) — the rounding of float32 logits of this size
(an ulp of 10 is 9.5e-7). One float32 sum over a whole 262k row would be 20x worse; float64
accumulation costs 2.8x the time.

**Tiering, as a JIT does.** Compiling costs seconds (a C++ compiler on CPU, Triton on GPU; tens
of seconds the first time on a machine, a few once PyTorch's cache holds it), more than a small
run saves. So a process reads out eagerly until it has read :data:`AFTER_LOGITS` logits (about
fifteen seconds of eager statistics on a CPU), and only then compiles: tests, the explorer and
small runs never compile; a long run pays once. ``LENSDIV_FUSED=1`` fuses from the first logit
(what ``bench/`` measures), ``0`` never. A compiler that fails (none installed, an unsupported
device) is said once (:class:`~lensdiv.ops.kvcache.FallbackWarning`) and the eager path runs.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch import Tensor

from lensdiv.core.numerics import EXP_FLOOR
from lensdiv.ops.kvcache import warn_fallback

#: Logits a process reads out eagerly before it compiles the fused kernel (2^32: about 15 s of
#: eager statistics on 2 CPU threads, what a cold compile costs).
AFTER_LOGITS = 1 << 32

ENV = "LENSDIV_FUSED"


def _sums(
    z: Tensor,
    peak: Tensor,
    target: Tensor | None,
    reference: Tensor | None,
    floor: float,
    acc: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``Σ e``, ``Σ e·(z − peak)``, the count of ``z > target`` and ``Σ e·(z − z_ref)`` per row,
    ``e = exp(max(z − peak, floor))``, accumulated in ``acc``."""
    y = (z - peak).clamp_min(floor)
    e = y.exp()
    norm = e.sum(-1, dtype=acc)
    expect = (e * y).sum(-1, dtype=acc)
    rank = None if target is None else (z > target).sum(-1)
    shift = None if reference is None else (e * (z - reference)).sum(-1, dtype=acc)
    return norm, expect, rank, shift


def accumulation(z: Tensor) -> torch.dtype:
    """What :func:`_sums` adds ``z``'s terms in: its own dtype on a CPU (which reads a large
    vocabulary in tiles), float64 elsewhere (whole rows in one sum)."""
    return z.dtype if z.device.type == "cpu" else torch.float64


class _Tier:
    """When to fuse: the logits read so far, the compiled kernel, a failure seen."""

    def __init__(self) -> None:
        self.read = 0
        self.kernel: Any = None
        self.failed = False
        self.lock = threading.Lock()

    def wanted(self, logits: int) -> bool:
        """Whether a block of ``logits`` logits takes the fused kernel (and count them)."""
        mode = os.environ.get(ENV, "auto").strip().lower()
        if self.failed or mode in ("0", "false", "no", "off"):
            return False
        with self.lock:
            self.read += logits
            return mode in ("1", "true", "yes", "on") or self.read > AFTER_LOGITS

    def compiled(self) -> Any:
        with self.lock:
            if self.kernel is None:
                self.kernel = torch.compile(_sums, dynamic=True)
            return self.kernel


_TIER = _Tier()


def fuse(logits: int) -> bool:
    """Whether a block of ``logits`` logits is read by the fused kernel (it is counted)."""
    return _TIER.wanted(logits)


def fused_sums(
    z: Tensor, peak: Tensor, target: Tensor | None, reference: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
    """:func:`_sums` by the fused kernel, or ``None`` where the eager path must run instead
    (a dtype it does not cover, or the compiler failed: said once)."""
    floor = EXP_FLOOR.get(z.dtype)
    if floor is None or _TIER.failed:
        return None
    try:
        sums: tuple[Tensor, Tensor, Tensor | None, Tensor | None]
        sums = _TIER.compiled()(z, peak, target, reference, floor, accumulation(z))
    except Exception as err:  # no compiler, an unsupported device: the exact eager path
        _TIER.failed = True
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        warn_fallback("the readout's fused statistics", reason, "about 3x the statistics' time")
        return None
    return sums
