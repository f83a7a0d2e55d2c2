"""Benchmark: the peak memory of a run does not grow with the number of tokens.

Runs ``--plugins`` (``lens,bias`` by default; ``prune,reorder`` for issue 30) on ``--tokens N`` and on ``10·N`` tokens of the built-in corpus, each in a
fresh process (the peak resident set size of a process only grows), on a random TL-native model
with GPT-2's 50257-token vocabulary (``--layers 6 --d-model 512`` by default: the readout
buffers, the float32 unembedding and the per-batch activations are what could grow; depth only
scales the model). Target (issue 15): peak RSS at 10·N ≤ 1.05 × peak RSS at N.

    python bench/bench_memory.py [--tokens 512 --json bench/memory_cpu.json]
    python bench/bench_memory.py --plugins prune,reorder --tokens 1024 --layers 4 --d-model 128 \
        --vocab 8192 --json bench/memory_surgery_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from common import build, describe, model_parser, report

from lensdiv import DataSpec, analyze


def child(args: argparse.Namespace) -> None:
    """One run in this process; print its peak RSS (MiB) and seconds as JSON."""
    torch.set_grad_enabled(False)
    model = build(args.layers, args.d_model, args.vocab)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)
    t0 = time.perf_counter()
    run = analyze(model, data=spec, plugins=args.plugins, progress=False)
    assert run.ok, run.errors
    # this process's own high-water mark: ru_maxrss starts at the spawning parent's peak
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024
    tokens = run.manifest["timings"]["tokens"]
    print(
        json.dumps(
            {
                "peak_rss_mib": round(peak, 1),
                "tokens": tokens,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        )
    )


def main() -> None:
    parser = model_parser(__doc__, tokens=512, batch_size=4, repeats=1)
    parser.set_defaults(layers=6, d_model=512)
    parser.add_argument("--plugins", default="lens,bias", help="the analyzers run (default lens,bias)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sizes = {"N": args.tokens, "10N": 10 * args.tokens}
    runs = {}
    for name, tokens in sizes.items():
        command = [
            sys.executable,
            __file__,
            "--child",
            "--tokens",
            str(tokens),
            "--layers",
            str(args.layers),
            "--d-model",
            str(args.d_model),
            "--vocab",
            str(args.vocab),
            "--seq-len",
            str(args.seq_len),
            "--batch-size",
            str(args.batch_size),
            "--plugins",
            args.plugins,
        ]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs[name] = json.loads(out.strip().splitlines()[-1])
    report(
        {
            **describe(args),
            "batch_size": args.batch_size,
            "plugins": args.plugins,
            "runs": runs,
            "peak_rss_10N_over_N": round(
                runs["10N"]["peak_rss_mib"] / runs["N"]["peak_rss_mib"], 4
            ),
        },
        args.json,
    )


if __name__ == "__main__":
    main()
