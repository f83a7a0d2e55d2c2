"""Benchmark: what does ``prune``'s (ℓ, n ≤ N) grid cost against its floor and against full passes?

Builds the random TL-native model of ``bench_fused.py`` (``--layers --d-model --vocab``) and, on
the same batches, times:

- ``grid_blocks``: the grid's interventions alone (:func:`lensdiv.ops.surgery.removed_finals`:
  every removal resumed after its range, the removals that resume at one block stacked along
  the batch, ``k`` of them at block ``r``);
- ``prune``: the whole analyzer (``curves=false``: the clean pass, the grid, its readouts, the
  signals, the linearity moments, the result);
- ``prune_full_passes``: the same analyzer with every removal run as a full forward pass
  (``resume=false``: every block of every intervened pass, the way a one-off script runs each
  removal), the same readouts; ``speedup_over_full_passes`` = its time over ``prune``'s;
- ``forward``: a plain forward pass, for scale.

The floors are timed from their own pieces, at the shapes the analyzer runs them:

- the *block unit* ``u(rows)``: one block evaluation on a stacked ``[rows, pos, d_model]``
  input — each block's own module (``blocks[j].original_component``) applied in a tight loop to
  the inputs it received in a forward pass of ``rows`` rows (no hooks, no resume, no stacking),
  its best time over ``--tight`` calls per round and over the rounds, averaged over the blocks —
  for every stack size ``rows = k · batch`` the grid runs, measured in the same interleaved
  rounds as the cases;
- the *block floor*: ``Σ_r (L − r) · u(k_r · batch)`` per batch — the grid's
  ``Σ_{ℓ,n} (L − ℓ − n)`` block evaluations per sequence, each at its stack's size;
  ``floor_ratio`` = ``grid_blocks`` over it (target ≤ 1.3);
- the *readout floor*: the final norm, unembedding and float32 log-softmax of every row read
  (each intervened row, and the clean output's once), timed the same way on rows of the size
  :func:`~lensdiv.ops.rowstats.lens_statistics` reads at once; ``analyzer_ratio`` = ``prune``
  over block floor + the clean pass's ``L · u(batch)`` + readout floor.

    python bench/bench_surgery.py [--layers 12 --d-model 512 --vocab 8192 --tokens 256 --max-n 6]
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from math import inf
from typing import Any

import torch
from common import best_of, describe, model_and_data, model_parser, plain_forward, report

from lensdiv import analyze
from lensdiv.analyzers.surgery import Prune
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.data.sources import token_batches
from lensdiv.ops.capture import capture
from lensdiv.ops.readout import block_rows, final_readout
from lensdiv.ops.resume import Resumer
from lensdiv.ops.surgery import grid_cells, range_mask, removed_finals


def block_inputs(model: Any, tokens: torch.Tensor) -> list[tuple[Any, tuple, dict]]:
    """Each block's own module with the arguments it receives in a forward pass of ``tokens``."""
    seen: list[tuple[Any, tuple, dict]] = []
    handles = []
    for block in model.blocks:
        layer = block.original_component

        def record(module: Any, args: tuple, kwargs: dict, layer: Any = layer) -> None:
            seen.append((layer, args, dict(kwargs)))

        handles.append(layer.register_forward_pre_hook(record, with_kwargs=True))
    try:
        model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def tight(fn: Callable[[], Any], repeats: int) -> float:
    """Best time of ``fn`` over ``repeats`` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def block_times(inputs: list[tuple[Any, tuple, dict]], repeats: int) -> list[float]:
    """Seconds of each block's module on its recorded inputs (:func:`block_inputs`), the best of
    ``repeats`` calls in a row (after one warm-up call)."""
    return [tight(partial(layer, *args, **kwargs), repeats) for layer, args, kwargs in inputs]


def readout_unit(model: Any, h: torch.Tensor, repeats: int) -> float:
    """Seconds per row of the final norm, unembedding and float32 log-softmax, on blocks of the
    rows ``lens_statistics`` reads at once (or all of ``h``'s rows, if fewer)."""
    readout = final_readout(model)
    flat = h.reshape(-1, h.shape[-1])
    rows = flat[: block_rows(readout.d_vocab)]

    def read() -> None:
        torch.log_softmax(readout.logits(rows), dim=-1)

    return tight(read, repeats) / rows.shape[0]


def main() -> None:
    parser = model_parser(__doc__, tokens=256, batch_size=4, repeats=3)
    parser.add_argument("--max-n", type=int, default=0, help="longest range (0: L // 2)")
    parser.add_argument("--tight", type=int, default=3, help="tight-loop calls per unit and round")
    parser.set_defaults(layers=12, d_model=512, vocab=8192, seq_len=64)
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
    per_resume = Counter(s + n for s, n in cells)  # k_r: removals resuming at block r

    def grid_blocks() -> None:
        for step in steps:
            for _ in removed_finals(step, masks, resumer):
                pass

    def prune(resume: bool = True) -> dict:
        analyzer = Prune(max_n=N, curves=False, resume=resume)
        return dict(analyze(model, data=spec, plugins=[analyzer], progress=False)["prune"].meta)

    # The floors' units at every stack size the grid runs, measured inside the same interleaved
    # rounds as the cases (best over rounds and over ``--tight`` calls in each): a load that
    # comes and goes does not land on the units alone.
    sizes = sorted({(i, k) for i, _ in enumerate(steps) for k in {1, *per_resume.values()}})
    inputs = {(i, k): block_inputs(model, steps[i].batch.tokens.repeat(k, 1)) for i, k in sizes}
    times: dict[tuple[int, int], list[float]] = {}
    reads: dict[int, float] = {}

    def floors() -> None:
        for i, k in sizes:
            now = block_times(inputs[i, k], args.tight)
            times[i, k] = [min(a, b) for a, b in zip(times.get((i, k), now), now, strict=True)]
        for i, step in enumerate(steps):
            reads[i] = min(reads.get(i, inf), readout_unit(model, step.resid(L), args.tight))

    cases = {"forward": plain_forward(model, spec), "grid_blocks": grid_blocks,
             "prune": prune, "prune_full_passes": lambda: prune(resume=False), "floors": floors}
    grid_blocks()  # warm-up
    counted: dict[str, float] = {}

    def keep(name: str, meta: object) -> None:
        if name.startswith("prune") and isinstance(meta, dict):
            counted[name] = meta["block_runs_per_row"] / meta["block_runs_floor_per_row"]

    best = best_of(cases, args.repeats, keep)
    del best["floors"]
    # The unit: the mean over blocks of each block's best time (a load spike on one call of one
    # block does not count).
    units = {key: sum(values) / len(values) for key, values in times.items()}
    block_floor = clean_pass = readout_floor = 0.0
    for i, step in enumerate(steps):
        block_floor += sum((L - r) * units[i, k] for r, k in per_resume.items() if r < L)
        clean_pass += L * units[i, 1]
        readout_floor += (len(cells) + 1) * int(step.batch.mask.sum()) * reads[i]
    analyzer_floor = block_floor + clean_pass + readout_floor
    report(
        {
            **describe(args),
            "max_n": N,
            "cells": len(cells),
            "floor_block_evaluations_per_sequence": sum(L - s - n for s, n in cells),
            "seconds": {k: round(v, 4) for k, v in best.items()},
            "block_unit_ms_by_rows": {
                str(k * steps[i].batch.tokens.shape[0]): round(v * 1e3, 3)
                for (i, k), v in units.items()
            },
            "readout_unit_us_per_row": {i: round(v * 1e6, 2) for i, v in reads.items()},
            "floor_seconds": {
                "grid_blocks": round(block_floor, 4),
                "clean_pass": round(clean_pass, 4),
                "readouts": round(readout_floor, 4),
                "analyzer": round(analyzer_floor, 4),
            },
            "floor_ratio": round(best["grid_blocks"] / block_floor, 3),
            "analyzer_ratio": round(best["prune"] / analyzer_floor, 3),
            "block_evaluations_over_floor": counted,
            "speedup_over_full_passes": round(best["prune_full_passes"] / best["prune"], 2),
            "acceptance": "floor_ratio <= 1.3",
        },
        args.json,
    )


if __name__ == "__main__":
    main()
