"""Benchmark: what does the ``bias`` decomposition add to a ``lens`` run on the same tokens?

The random 24-layer, d_model=1024 TL-native model of ``bench_fused.py`` (GPT-2 medium shape,
50257-token vocabulary). Times on the same tokens ``lens`` alone, ``bias`` alone and the fused
``lens,bias`` run (one forward pass per batch feeds both), interleaved, best of ``--repeats``.
Acceptance (issue: layer diversity): fused ≤ 1.3 × lens alone. On a shared machine the load
can drift between runs, so the fused run's own split is reported too: its total over its total
less the seconds spent in ``bias`` (same tokens, same minute).

``bias`` costs, per position, one ``d_model × d_model`` Gram product per member for the
squared-error form over the full vocabulary (49 members here), and every ``ce_every``-th position
the 49 members' full-vocabulary softmaxes for the cross-entropy form.

    python bench/bench_bias.py [--tokens 1024 --ce-every 16 --json bench/bias_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_fused import build  # noqa: E402 - the script's folder must be importable first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--ce-every", type=int, default=None, help="default: the option's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from lensdiv import DataSpec, analyze
    from lensdiv.analyzers.bias import BiasDiversity
    from lensdiv.analyzers.lens import LogitLens

    torch.set_grad_enabled(False)
    model = build(args.layers, args.d_model, args.vocab)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    bias = BiasDiversity() if args.ce_every is None else BiasDiversity(ce_every=args.ce_every)
    timings: dict[str, dict[str, float]] = {}

    def run(*analyzers: object) -> None:
        result = analyze(model, data=spec, plugins=list(analyzers), progress=False)
        assert result.ok, result.errors
        name = ",".join(a.name for a in analyzers)  # type: ignore[attr-defined]
        timings[name] = dict(result.manifest["timings"])

    cases = {
        "lens": lambda: run(LogitLens()),
        "bias": lambda: run(bias),
        "lens,bias": lambda: run(LogitLens(), bias),
    }
    run(LogitLens(), bias)  # warm-up: first-call allocations, lazy imports, the Gram matrix
    best = {name: float("inf") for name in cases}
    in_run = float("inf")
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            if name == "lens,bias":
                # The same run without bias's own seconds: immune to load drifting between runs.
                fused = timings[name]
                in_run = min(in_run, fused["total_s"] / (fused["total_s"] - fused["bias_s"]))
    figures = {
        "model": f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab} (random)",
        "tokens": args.tokens,
        "members": 2 * args.layers + 1,
        "ce_every": bias.ce_every,
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "fused_over_lens": round(best["lens,bias"] / best["lens"], 3),
        "fused_over_fused_without_bias": round(in_run, 3),
        "last_run_timings": timings,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
