"""Benchmark: what does ``prune``'s (ℓ, n ≤ N) grid cost against its floor and against full passes?

Builds the random TL-native model of ``bench_fused.py`` (``--layers --d-model --vocab``) and, on
the same batches, times:

- ``blocks``: block 0 removed, i.e. one pass resumed at block 1 through the same code path as
  the grid (the cost of a block evaluation, ``blocks / (L − 1)``);
- ``grid_blocks``: the grid's interventions alone (:func:`lensdiv.ops.surgery.removed_finals`,
  every removal resumed after its range and stacked along the batch), whose floor is
  ``Σ_{ℓ,n} (L − ℓ − n)`` block evaluations per sequence: ``floor_ratio`` = its time over the
  floor's (target ≤ 1.3);
- ``prune``: the whole analyzer's grid (``curves=false``: the grid, its readouts and the signals);
- ``prune_full_passes``: the same analyzer with every removal run as a full forward pass
  (``resume=false``: every block of every intervened pass, the way a one-off script runs each
  removal), the same readouts; ``speedup_over_full_passes`` = its time over ``prune``'s;
- ``forward``: a plain forward pass, for scale.

    python bench/bench_surgery.py [--layers 12 --d-model 256 --vocab 8192 --tokens 128 --max-n 6]
"""

from __future__ import annotations

import torch
from common import best_of, describe, model_and_data, model_parser, plain_forward, report

from lensdiv import analyze
from lensdiv.analyzers.surgery import Prune
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.data.sources import token_batches
from lensdiv.ops.capture import capture
from lensdiv.ops.resume import Resumer
from lensdiv.ops.surgery import grid_cells, range_mask, removed_finals


def main() -> None:
    parser = model_parser(__doc__, tokens=128, batch_size=4, repeats=2)
    parser.add_argument("--max-n", type=int, default=0, help="longest range (0: L // 2)")
    parser.set_defaults(layers=12, d_model=256, vocab=8192, seq_len=64)
    args = parser.parse_args()
    model, spec = model_and_data(args)
    info = ModelInfo.from_model(model)
    L = info.n_layers
    N = args.max_n or L // 2
    names = [info.resid(layer) for layer in range(L + 1)]
    steps = []
    for batch in token_batches(spec, model.tokenizer):
        logits, cache = capture(model, batch.tokens, names, need_logits=False)
        steps.append(Step(Batch(batch.tokens, batch.mask), cache, logits, model, info))
    resumer = Resumer(model)
    resumer.prepare(steps[0].batch.tokens)
    cells = grid_cells(L, N)
    masks = [range_mask(L, s, n) for s, n in cells]
    floor = sum(L - s - n for s, n in cells)

    def blocks() -> None:
        for step in steps:
            for _ in removed_finals(step, [range_mask(L, 0, 1)], resumer):
                pass

    def grid_blocks() -> None:
        for step in steps:
            for _ in removed_finals(step, masks, resumer):
                pass

    def prune(resume: bool = True) -> dict:
        analyzer = Prune(max_n=N, curves=False, resume=resume)
        return dict(analyze(model, data=spec, plugins=[analyzer], progress=False)["prune"].meta)

    cases = {"forward": plain_forward(model, spec), "blocks": blocks, "grid_blocks": grid_blocks,
             "prune": prune, "prune_full_passes": lambda: prune(resume=False)}
    blocks()  # warm-up
    counted: dict[str, float] = {}

    def keep(name: str, meta: object) -> None:
        if isinstance(meta, dict):
            counted[name] = meta["block_runs_per_row"] / meta["block_runs_floor_per_row"]

    best = best_of(cases, args.repeats, keep)
    per_block = best["blocks"] / (L - 1)
    report(
        {
            **describe(args),
            "max_n": N,
            "cells": len(cells),
            "floor_block_evaluations_per_sequence": floor,
            "seconds": {k: round(v, 4) for k, v in best.items()},
            "floor_seconds": round(floor * per_block, 4),
            "floor_ratio": round(best["grid_blocks"] / (floor * per_block), 3),
            "block_evaluations_over_floor": counted,
            "speedup_over_full_passes": round(best["prune_full_passes"] / best["prune"], 2),
            "acceptance": "floor_ratio <= 1.3",
            "threads": torch.get_num_threads(),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
