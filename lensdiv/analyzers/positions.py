"""Which positions an analyzer's statistics count, declared once for the analyzers that intervene
on whole blocks and compare their outputs (``skip``, ``prune``, ``reorder``), so that one
``exclude_bos`` means the same in each and their identities can be checked from the command line
(``-O skip.skip_bos=true -O prune.exclude_bos=false``)."""

from __future__ import annotations

from dataclasses import dataclass

from lensdiv.core.analyzer import Analyzer


@dataclass(frozen=True)
class FirstPosition(Analyzer):
    """An analyzer whose statistics may leave the first position out.

    Args:
        exclude_bos: Leave the first (BOS) position out of every statistic (an intervention
            acts there all the same, where it acts there at all).
    """

    exclude_bos: bool = False
