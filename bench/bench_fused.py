"""Benchmark: does fusing analyzers into one pass cost (almost) nothing over the lens alone?

Builds a random 24-layer, d_model=1024 TL-native model (GPT-2 medium shape, 50257-token vocab),
then times on the same tokens: a plain forward pass, ``lens`` alone, ``contrib`` alone and the
fused ``lens,contrib`` run. Runs are interleaved and the best of ``--repeats`` is kept, so a noisy
neighbour does not decide the ratio. Acceptance (issue 2): fused ≤ 1.2 × lens alone.

    python bench/bench_fused.py [--layers 24 --d-model 1024 --vocab 50257 --tokens 1024]
    python bench/bench_fused.py --device cuda --dtype bfloat16 --tokens 16384   # a GPU, bf16
"""

from __future__ import annotations

from common import best_of, describe, model_and_data, model_parser, plain_forward, report

from lensdiv import analyze


def main() -> None:
    args = model_parser(__doc__, tokens=1024, batch_size=4, repeats=2, devices=True).parse_args()
    model, spec = model_and_data(args)
    plain = plain_forward(model, spec)

    def run(plugins: str) -> None:
        analyze(model, data=spec, plugins=plugins, progress=False)

    cases = {
        "forward": plain,
        "lens": lambda: run("lens"),
        "contrib": lambda: run("contrib"),
        "lens,contrib": lambda: run("lens,contrib"),
    }
    run("lens,contrib")  # warm-up: first-call allocations and lazy imports
    best = best_of(cases, args.repeats)
    report(
        {
            **describe(args),
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "fused_over_lens": round(best["lens,contrib"] / best["lens"], 3),
            "contrib_over_forward": round(best["contrib"] / best["forward"], 3),
            "lens_over_forward": round(best["lens"] / best["forward"], 3),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
