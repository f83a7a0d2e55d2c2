"""Benchmark: what does ``dynamics`` add to a ``lens`` run on the same tokens?

The random 24-layer, d_model=1024 TL-native model of ``bench_fused.py`` (GPT-2 medium shape,
50257-token vocabulary). Times on the same tokens ``lens`` alone, ``dynamics`` alone and the
fused ``lens,dynamics`` run (one forward pass per batch feeds both), interleaved, best of
``--repeats``. Acceptance (issue: inverse depth scaling): fused ≤ 1.3 × lens alone.

``dynamics`` costs, per batch, elementwise work on the cached residuals (angles, norms, progress,
histograms, the angle-profile moments), one pass of the final block over each of the ``L − 1``
earlier residual states (about one forward pass of blocks) and, at every ``every``-th
position, ``L`` full-vocabulary readouts for the last-block lens.

    python bench/bench_dynamics.py [--tokens 512 --every 8 --json bench/dynamics_cpu.json]
"""

from __future__ import annotations

from common import lens_plus_main

from lensdiv.analyzers.dynamics import Dynamics


def main() -> None:
    lens_plus_main(__doc__, Dynamics, "every", tokens=512)


if __name__ == "__main__":
    main()
