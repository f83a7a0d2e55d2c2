"""Benchmark: what do ``sinks`` and ``massive`` cost against their floors?

A random TL-native model of GPT-2 shape (``--layers --d-model --vocab``; default 12 × 512, 8
heads, vocabulary 8192) on the built-in corpus, interleaved rounds, best of ``--repeats`` after
a warm-up. Times, on the same tokens:

- ``forward``: a plain forward pass (TransformerLens' attention bridges compute the attention
  weights explicitly in every pass: this is already the eager attention);
- ``forward_patterns``: the same pass caching every layer's ``hook_pattern`` (what the
  statistics need: the floor of ``sinks``' statistics);
- ``sinks_stats``: ``lensdiv.analyze`` with ``sinks`` (``truth=false``): the analyzer's
  statistics, data path and result included; ``sinks_over_floor`` = this / ``forward_patterns``
  (target ≤ 1.5);
- ``sinks``: with the truth (one pass resumed at every layer: about ``L/2`` forward passes more);
- ``lens,contrib``, ``lens,contrib,massive`` (truth off and on) and ``massive`` alone:
  ``massive_fused_overhead`` = fused / ``lens,contrib``.

A random model has no massive activation, so the truth would never run: block 1's MLP output
bias gets ``+1e4`` in dimension 0 (``--plant 0`` leaves the model as it is), which makes one
massive dimension at every position from ``h_2`` on, as in Sun et al.'s models.

    python bench/bench_sinks.py [--layers 12 --d-model 512 --vocab 8192 --tokens 2048
                                 --json bench/sinks_cpu.json]
"""

from __future__ import annotations

from typing import Any

from common import best_of, describe, model_and_data, model_parser, plain_forward, report

from lensdiv import analyze
from lensdiv.analyzers.contrib import Contribution
from lensdiv.analyzers.lens import LogitLens
from lensdiv.analyzers.massive import Massive
from lensdiv.analyzers.sinks import Sinks
from lensdiv.data.sources import token_batches
from lensdiv.ops.attention import pattern_hook
from lensdiv.ops.capture import capture


def main() -> None:
    parser = model_parser(__doc__, tokens=2048, batch_size=4, repeats=2)
    parser.set_defaults(layers=12, d_model=512, vocab=8192, seq_len=256)
    parser.add_argument("--plant", type=float, default=1e4, help="bias planted (0: none)")
    args = parser.parse_args()
    model, spec = model_and_data(args)
    mlp = model.blocks[1].original_component.mlp.original_component
    mlp.fc_out.original_component.bias[0] += args.plant
    batches = [b.tokens for b in token_batches(spec, model.tokenizer)]
    patterns = [pattern_hook(layer) for layer in range(args.layers)]

    def forward_patterns() -> None:
        for tokens in batches:
            capture(model, tokens, patterns, need_logits=False)

    def run(*analyzers: Any) -> Any:
        def go() -> None:
            result = analyze(model, data=spec, plugins=list(analyzers), progress=False)
            assert result.ok, result.errors

        return go

    lens, contrib = LogitLens(), Contribution()
    cases = {
        "forward": plain_forward(model, spec),
        "forward_patterns": forward_patterns,
        "sinks_stats": run(Sinks(truth=False)),
        "sinks": run(Sinks()),
        "lens,contrib": run(lens, contrib),
        "massive_stats": run(Massive(truth=False)),
        "lens,contrib,massive_stats": run(lens, contrib, Massive(truth=False)),
        "lens,contrib,massive": run(lens, contrib, Massive()),
    }
    for fn in cases.values():  # warm-up: first-call allocations, lazy imports, per-model checks
        fn()
    best = best_of(cases, args.repeats)
    figures = {
        **describe(args),
        "seq_len": args.seq_len,
        "planted_bias": args.plant,
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "sinks_over_floor": round(best["sinks_stats"] / best["forward_patterns"], 3),
        "sinks_over_forward": round(best["sinks_stats"] / best["forward"], 3),
        "sinks_truth_over_forward": round(best["sinks"] / best["forward"], 3),
        "massive_fused_overhead": round(
            best["lens,contrib,massive_stats"] / best["lens,contrib"], 3
        ),
        "massive_truth_fused_overhead": round(
            best["lens,contrib,massive"] / best["lens,contrib"], 3
        ),
    }
    report(figures, args.json)


if __name__ == "__main__":
    main()
