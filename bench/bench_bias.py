"""Benchmark: what does the ``bias`` decomposition add to a ``lens`` run on the same tokens?

The random 24-layer, d_model=1024 TL-native model of ``bench_fused.py`` (GPT-2 medium shape,
50257-token vocabulary). Times on the same tokens ``lens`` alone, ``bias`` alone and the fused
``lens,bias`` run (one forward pass per batch feeds both), interleaved, best of ``--repeats``.
Acceptance (issue: layer diversity): fused ≤ 1.3 × lens alone.

``bias`` costs, per position, one ``d_model × d_model`` Gram product per member for the
squared-error form over the full vocabulary (49 members here), and every ``every``-th position
the 49 members' full-vocabulary softmaxes for the cross-entropy form.

    python bench/bench_bias.py [--tokens 1024 --ce-every 16 --json bench/bias_cpu.json]
"""

from __future__ import annotations

import argparse

from common import lens_plus_main

from lensdiv.analyzers.bias import BiasDiversity


def members(args: argparse.Namespace) -> dict[str, int]:
    """The ensemble's size: the embedding and every block's attention and MLP output."""
    return {"members": 2 * args.layers + 1}


def main() -> None:
    lens_plus_main(__doc__, BiasDiversity, "every", tokens=1024, figures=members)


if __name__ == "__main__":
    main()
