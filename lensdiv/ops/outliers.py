"""Activation outliers (docs/science.md F2): a mergeable log-magnitude histogram, the median it
gives to a stated precision, and the entries of a batch that are massive.

The median of ``|x|`` over a stream cannot be kept exactly in flat memory; each site keeps a
histogram of ``log10 |x|`` in fixed bins of width ``1/bins_per_decade`` over ``[10^LO, 10^HI)``
(plus one bin for smaller values, zeros included, and one for larger), merged by sum. Its median
is the geometric centre of the bin that holds the lower median order statistic: within a factor
``10^(1/(2·bins_per_decade))`` of it (1.16 % at the default 100 bins per decade), unless that
statistic falls outside ``[10^LO, 10^HI)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

LO, HI = -10, 8  # decades the histogram resolves


def n_bins(bins_per_decade: int) -> int:
    """Bins of the histogram: the resolved decades, one below and one above."""
    return (HI - LO) * bins_per_decade + 2


def log_histogram(values: Float[Tensor, ...], bins_per_decade: int) -> Float[Tensor, " bins"]:
    """Counts of ``log10 |values|`` per bin, over every entry (float64, on ``values``' device)."""
    magnitude = values.abs().float().reshape(-1)
    scaled = (magnitude.log10() - LO) * bins_per_decade
    inner = (HI - LO) * bins_per_decade
    index = torch.where(
        magnitude > 0, scaled.floor().clamp(-1, inner).long() + 1, torch.zeros_like(scaled).long()
    )
    return torch.bincount(index, minlength=n_bins(bins_per_decade)).double()


def histogram_median(counts: Float[Tensor, " bins"], bins_per_decade: int) -> float:
    """The median ``|x|`` a histogram gives: the geometric centre of the bin holding the lower
    median order statistic (``0.0`` below the range, ``inf`` above it, NaN when empty)."""
    total = float(counts.sum())
    if total == 0:
        return math.nan
    rank = math.ceil(total / 2)  # the lower median: the ⌈n/2⌉-th smallest value
    index = int(torch.searchsorted(counts.cumsum(0), torch.tensor(float(rank), dtype=counts.dtype)))
    if index == 0:
        return 0.0
    if index == counts.numel() - 1:
        return math.inf
    return float(10 ** (LO + (index - 1 + 0.5) / bins_per_decade))


def lower_median(values: Float[Tensor, ...]) -> float:
    """The exact lower median of ``|values|`` (the ⌈n/2⌉-th smallest): the reference the
    histogram's median is tested against."""
    magnitude = values.abs().float().reshape(-1)
    return float(magnitude.kthvalue((magnitude.numel() + 1) // 2).values)


def massive_entries(
    x: Float[Tensor, "batch pos d"],
    keep: Bool[Tensor, "batch pos"],
    absolute: float,
    ratio: float,
    bins_per_decade: int,
) -> tuple[Bool[Tensor, "batch pos d"], Float[Tensor, " bins"], float, float]:
    """Where ``|x| > max(absolute, ratio · median)``, the median being that of ``|x|`` over the
    kept positions of this batch as its log histogram gives it (within a factor
    ``10^(1/(2·bins_per_decade))`` of the exact lower median; a histogram costs a fraction of an
    exact selection, and the stream's histogram needs it anyway); with that histogram, the
    median and the threshold."""
    hist = log_histogram(x[keep], bins_per_decade)
    median = histogram_median(hist, bins_per_decade)
    threshold = max(absolute, ratio * median)
    return (x.abs() > threshold) & keep[..., None], hist, median, threshold


def massive_counts(
    states: Sequence[Tensor] | Float[Tensor, "states batch pos d"],
    keep: Bool[Tensor, "batch pos"],
    absolute: float,
    ratio: float,
    bins_per_decade: int,
) -> tuple[Float[Tensor, "states d"], Bool[Tensor, " d"]]:
    """Per residual state of one batch, how many of its kept positions are massive in each
    dimension (:func:`massive_entries`; float64, a sum that merges), and which dimensions are
    massive in any state (what an analysis leaves out to be outlier-aware)."""
    counts, dims = [], None
    for x in states:
        massive, *_ = massive_entries(x, keep, absolute, ratio, bins_per_decade)
        counts.append(massive.sum((0, 1)).double())
        found = massive.any(0).any(0)
        dims = found if dims is None else dims | found
    assert dims is not None, "no states"
    return torch.stack(counts), dims
