"""Benchmark: what does the logit lens cost against the arithmetic it cannot avoid (its floor)?

A randomly initialised Hugging Face GPT-2 built from a config of GPT-2 medium's shape (24 layers,
d_model 1024, 16 heads, 50257-token vocabulary), booted through TransformerLens like a hub model
(``--arch native``: the TL-native model of ``bench_fused.py`` instead). On the same tokens, in one
process, interleaved, best of ``--repeats`` after a warm-up:

- ``forward``: a plain forward pass (``model(tokens)``);
- ``floor``: the floor of a full-vocabulary logit lens as issue 15 defines it: one forward pass
  that caches the ``L + 1`` residual states, then for each state the model's final norm, the
  unembedding matmul and one log-softmax (nothing else: no statistic is computed);
- ``lens``: ``lensdiv``'s ``lens`` analyzer through ``analyze()`` (every statistic it reports);
- ``fused``: ``lens,contrib,dynamics,bias`` in one run (their defaults).

Targets (issue 15): lens ≤ 1.2 × floor and fused ≤ 1.5 × floor. Each case is timed by the wall
clock and by the process's CPU time (``time.process_time``, every thread); on a machine shared
with other work the CPU-time ratios are the steadier ones, best with ``--threads 1`` (no
threads waiting on each other). ``--dtype bfloat16 --device
cuda`` runs the same on a GPU (the floor then reads out in the model's dtype, as the issue's
floor does; lensdiv reads out in float32) and reports tokens/s.

    python bench/bench_floor.py [--tokens 1024 --repeats 2 --json bench/floor_cpu.json]
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from common import build as build_native
from common import describe, gpt2_config, model_parser, place, report
from transformer_lens import TransformerBridge
from transformers import GPT2LMHeadModel

from lensdiv import DataSpec, analyze
from lensdiv.core.analyzer import ModelInfo
from lensdiv.data.sources import token_batches
from lensdiv.data.tokenizer import byte_tokenizer
from lensdiv.ops.capture import capture


def build(args: Any) -> Any:
    """The random model of ``--arch``, moved to ``--device`` and ``--dtype``."""
    if args.arch == "native":
        model = build_native(args.layers, args.d_model, args.vocab)
    else:
        model = build_gpt2(args.layers, args.d_model, args.vocab)
    return place(model, args)


def build_gpt2(layers: int, d_model: int, vocab: int) -> Any:
    """A random Hugging Face ``GPT2LMHeadModel`` of this shape (seed 0, no dropout), booted
    through TransformerLens with the byte tokenizer (its config is saved to a temporary folder,
    the weights stay in memory)."""
    config = gpt2_config(layers, d_model, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf_model = GPT2LMHeadModel(config).eval()
    folder = tempfile.mkdtemp(prefix="bench_floor_")
    config.save_pretrained(folder)
    tokenizer = byte_tokenizer()
    tokenizer.save_pretrained(folder)
    return TransformerBridge.boot_transformers(folder, hf_model=hf_model, tokenizer=tokenizer)


def floor(model: Any, batches: list[Any]) -> Callable[[], None]:
    """One caching forward, then per state: final norm, unembedding, one log-softmax."""
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]

    def run() -> None:
        for batch in batches:
            _, cache = capture(model, batch.tokens, names, need_logits=False)
            for name in names:
                logits = model.ln_final(cache[name]) @ model.W_U + model.b_U
                torch.log_softmax(logits, dim=-1)

    return run


def main() -> None:
    parser = model_parser(__doc__, tokens=1024, batch_size=8, repeats=2, devices=True)
    parser.add_argument("--arch", default="gpt2", choices=["gpt2", "native"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = build(args)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    batches = list(token_batches(spec, model.tokenizer))
    for batch in batches:
        batch.tokens, batch.mask = batch.tokens.to(args.device), batch.mask.to(args.device)
    tokens = sum(b.n_tokens for b in batches)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    timings: dict[str, dict[str, float]] = {}

    def forward() -> None:
        for batch in batches:
            model(batch.tokens)

    def run(plugins: str) -> Callable[[], None]:
        def go() -> None:
            result = analyze(model, data=spec, plugins=plugins, progress=False)
            assert result.ok, result.errors
            timings[plugins] = dict(result.manifest["timings"])

        return go

    fused = "lens,contrib,dynamics,bias"
    cases = {
        "forward": forward,
        "floor": floor(model, batches),
        "lens": run("lens"),
        "fused": run(fused),
    }
    for fn in cases.values():  # warm-up: lazy imports, first-call allocations, per-model checks
        fn()
    best = {name: float("inf") for name in cases}
    cpu = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    report(
        {
            **describe(args),
            "arch": "Hugging Face GPT-2 (random)" if args.arch == "gpt2" else "TL-native (random)",
            "device": device,
            "dtype": args.dtype,
            "batch_size": args.batch_size,
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "tokens_per_s": {k: round(tokens / v, 1) for k, v in best.items()},
            "floor_over_forward": round(best["floor"] / best["forward"], 3),
            "lens_over_floor": round(best["lens"] / best["floor"], 3),
            "fused_over_floor": round(best["fused"] / best["floor"], 3),
            "cpu_seconds": {k: round(v, 3) for k, v in cpu.items()},
            "cpu_lens_over_floor": round(cpu["lens"] / cpu["floor"], 3),
            "cpu_fused_over_floor": round(cpu["fused"] / cpu["floor"], 3),
            "cpu_floor_over_forward": round(cpu["floor"] / cpu["forward"], 3),
            "last_run_timings": timings,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
