"""Depth surgery (docs/science.md E1, E2): ``prune`` removes ranges of blocks, ``reorder`` swaps,
reverses, shuffles, repeats, loops or parallelises them; both read what the model then outputs.

The interventions are :mod:`lensdiv.ops.surgery`; ``prune`` is in :mod:`.prune` (the numbers of
a run in :mod:`.numbers`, the result in :mod:`.present`), ``reorder`` in :mod:`.reorder`; what
both share (options, hooks, the task accuracy) in :mod:`.base`.
"""

from lensdiv.analyzers.surgery.prune import Prune
from lensdiv.analyzers.surgery.reorder import Reorder

__all__ = ["Prune", "Reorder"]
