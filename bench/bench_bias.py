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

import torch
from common import best_of, build, describe, model_parser, report


def main() -> None:
    parser = model_parser(__doc__, tokens=1024, batch_size=4, repeats=2)
    parser.add_argument("--ce-every", type=int, default=None, help="default: the option's")
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
    in_run = [float("inf")]

    def without_bias(name: str, _: object) -> None:
        if name == "lens,bias":
            # The same run without bias's own seconds: immune to load drifting between runs.
            fused = timings[name]
            in_run[0] = min(in_run[0], fused["total_s"] / (fused["total_s"] - fused["bias_s"]))

    best = best_of(cases, args.repeats, without_bias)
    report(
        {
            **describe(args),
            "members": 2 * args.layers + 1,
            "ce_every": bias.ce_every,
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "fused_over_lens": round(best["lens,bias"] / best["lens"], 3),
            "fused_over_fused_without_bias": round(in_run[0], 3),
            "last_run_timings": timings,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
