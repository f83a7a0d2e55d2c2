"""Benchmark: what does a layer-skip sweep over every block cost, in forward passes?

Builds the random 24-layer, d_model=1024 TL-native model of ``bench_fused.py`` (GPT-2 medium
shape, 50257-token vocabulary) and times on the same tokens: a plain forward pass, the ``skip``
sweep resumed from the cached clean residual (future mode with one split point per sequence, and
current mode), and the same sweep with every block re-run (``resume=false``, the naive way:
``L + 1`` forwards). Cost = seconds / plain forward seconds. Acceptance (issue 4): ≤ 0.6·L.

    python bench/bench_skip.py [--layers 24 --d-model 1024 --vocab 50257 --tokens 512]
"""

from __future__ import annotations

from common import best_of, describe, model_and_data, model_parser, plain_forward, report

from lensdiv import analyze
from lensdiv.analyzers.skip import LayerSkip


def main() -> None:
    parser = model_parser(__doc__, tokens=512, batch_size=4, repeats=1)
    parser.add_argument("--skip-naive", action="store_true", help="do not time the re-run sweep")
    args = parser.parse_args()
    model, spec = model_and_data(args)
    plain = plain_forward(model, spec)

    def sweep(**options: object) -> dict:
        run = analyze(model, data=spec, plugins=[LayerSkip(**options)], progress=False)
        return run["skip"].meta

    cases = {
        "forward": plain,
        "skip_future": lambda: sweep(mode="future", splits=1),
        "skip_current": lambda: sweep(mode="current"),
    }
    if not args.skip_naive:
        cases["rerun_future"] = lambda: sweep(mode="future", splits=1, resume=False)
    plain()  # warm-up
    meta: dict[str, dict] = {}

    def keep(name: str, out: object) -> None:
        if isinstance(out, dict):
            meta[name] = {k: out[k] for k in ("resume", "block_runs_per_prompt", "prompts")}

    best = best_of(cases, args.repeats, keep)
    L = args.layers
    cost = {k: round(v / best["forward"], 2) for k, v in best.items()}
    report(
        {
            **describe(args),
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "forward_equivalents": cost,
            "over_L": {k: round(v / L, 3) for k, v in cost.items() if k != "forward"},
            "acceptance": f"skip_future <= {0.6 * L:.1f} forwards (0.6 L); naive is L + 1 = {L + 1}",
            "runs": meta,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
