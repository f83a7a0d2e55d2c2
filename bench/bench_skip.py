"""Benchmark: what does a layer-skip sweep over every block cost, in forward passes?

Builds the random 24-layer, d_model=1024 TL-native model of ``bench_fused.py`` (GPT-2 medium
shape, 50257-token vocabulary) and times on the same tokens: a plain forward pass, the ``skip``
sweep resumed from the cached clean residual (future mode with one split point per sequence, and
current mode), and the same sweep with every block re-run (``resume=false``, the naive way:
``L + 1`` forwards). Cost = seconds / plain forward seconds. Acceptance (issue 4): ≤ 0.6·L.

    python bench/bench_skip.py [--layers 24 --d-model 1024 --vocab 50257 --tokens 512]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_fused import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip-naive", action="store_true", help="do not time the re-run sweep")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from lensdiv import DataSpec, analyze
    from lensdiv.analyzers.skip import LayerSkip
    from lensdiv.data import token_batches

    torch.set_grad_enabled(False)
    model = build(args.layers, args.d_model, args.vocab)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    batches = list(token_batches(spec, model.tokenizer))

    def plain() -> None:
        for batch in batches:
            model(batch.tokens)

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
    best = {name: float("inf") for name in cases}
    meta = {}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            out = fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            if isinstance(out, dict):
                meta[name] = {k: out[k] for k in ("resume", "block_runs_per_prompt", "prompts")}
    L = args.layers
    cost = {k: round(v / best["forward"], 2) for k, v in best.items()}
    figures = {
        "model": f"{L} layers, d_model {args.d_model}, vocab {args.vocab} (random)",
        "tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "forward_equivalents": cost,
        "over_L": {k: round(v / L, 3) for k, v in cost.items() if k != "forward"},
        "acceptance": f"skip_future <= {0.6 * L:.1f} forwards (0.6 L); naive is L + 1 = {L + 1}",
        "runs": meta,
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
