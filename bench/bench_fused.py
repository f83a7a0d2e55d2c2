"""Benchmark: does fusing analyzers into one pass cost (almost) nothing over the lens alone?

Builds a random 24-layer, d_model=1024 TL-native model (GPT-2 medium shape, 50257-token vocab),
then times on the same tokens: a plain forward pass, ``lens`` alone, ``contrib`` alone and the
fused ``lens,contrib`` run. Runs are interleaved and the best of ``--repeats`` is kept, so a noisy
neighbour does not decide the ratio. Acceptance (issue 2): fused ≤ 1.2 × lens alone.

    python bench/bench_fused.py [--layers 24 --d-model 1024 --vocab 50257 --tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def build(layers: int, d_model: int, vocab: int) -> object:
    from transformer_lens import TransformerBridge
    from transformer_lens.config import TransformerBridgeConfig

    from lensdiv.tokenizer import byte_tokenizer

    cfg = TransformerBridgeConfig(
        d_model=d_model, d_head=64, n_heads=d_model // 64, n_layers=layers, n_ctx=1024,
        d_mlp=4 * d_model, d_vocab=vocab, act_fn="gelu", normalization_type="LN", seed=0,
    )
    # The byte tokenizer only packs the built-in corpus; its ids all lie below any vocab used here.
    return TransformerBridge.boot_native(cfg, tokenizer=byte_tokenizer()).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    from lensdiv import DataSpec, analyze
    from lensdiv.data import token_batches

    torch.set_grad_enabled(False)
    model = build(args.layers, args.d_model, args.vocab)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    batches = list(token_batches(spec, model.tokenizer))

    def plain() -> None:
        for batch in batches:
            model(batch.tokens)

    def run(plugins: str) -> None:
        analyze(model, data=spec, plugins=plugins, progress=False)

    cases = {"forward": plain, "lens": lambda: run("lens"), "contrib": lambda: run("contrib"),
             "lens,contrib": lambda: run("lens,contrib")}
    run("lens,contrib")  # warm-up: first-call allocations and lazy imports
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    figures = {
        "model": f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab} (random)",
        "tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "fused_over_lens": round(best["lens,contrib"] / best["lens"], 3),
        "contrib_over_forward": round(best["contrib"] / best["forward"], 3),
        "lens_over_forward": round(best["lens"] / best["forward"], 3),
    }
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
