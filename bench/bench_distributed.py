"""Benchmark: tokens/s of one process against two gloo processes (one thread each), same job.

Each configuration starts fresh processes (``multiprocessing`` spawn; the two-process one joins a
real gloo process group, as ``torchrun`` would), builds the random GPT-2-shaped model of
``common.py``, meets at a barrier, then times ``lensdiv.analyze`` over the same tokens; the
world's tokens/s is the tokens over the slowest rank's seconds. Configurations are interleaved
and the best of ``--repeats`` kept, so a noisy neighbour does not decide the ratio. Scaling
efficiency = (tokens/s with 2) / (2 × tokens/s with 1). On a shared machine the wall clock
depends on what else runs, so the CPU seconds each configuration spends per token are reported
too: their ratio (``cpu_efficiency``) is the efficiency two free cores would show, and 1 - it is
what the splitting and the collectives cost. The results of both must agree.

    python bench/bench_distributed.py [--layers 6 --d-model 512 --vocab 16384 --tokens 16384]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from common import data_spec, describe, model_parser, report


def rank_main(
    rank: int, world: int, args: argparse.Namespace, store: str, out: str, plugins: str
) -> None:
    """One process: build the model, wait for the others, time the run, write the figures."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    import torch.distributed as dist
    from common import build

    from lensdiv import analyze

    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(minutes=30),
        )
    model, spec = build(args.layers, args.d_model, args.vocab), data_spec(args)
    if world > 1:
        dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    run = analyze(model, data=spec, plugins=plugins, progress=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    if world > 1:
        dist.destroy_process_group()
    figures = {"seconds": seconds, "cpu_s": cpu, "tokens": run.manifest["timings"].get("tokens", 0)}
    if rank == 0:
        figures["tables"] = {
            name: {key: table.columns for key, table in result.tables.items()}
            for name, result in run.results.items()
        }
        figures["ranks"] = run.manifest.get("distributed", {}).get("ranks")
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures, default=float))


def one_run(world: int, args: argparse.Namespace, plugins: str) -> dict[str, Any]:
    """Run the job with ``world`` processes; the world's seconds and tokens, rank 0's tables."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lensdiv-bench-") as tmp:
        procs = [
            ctx.Process(target=rank_main, args=(r, world, args, f"{tmp}/store", tmp, plugins))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    seconds = max(r["seconds"] for r in ranks)
    cpu = sum(r["cpu_s"] for r in ranks)
    return {
        **ranks[0],
        "seconds": seconds,
        "cpu_s": cpu,
        "tokens_per_s": ranks[0]["tokens"] / seconds,
        "tokens_per_cpu_s": ranks[0]["tokens"] / cpu,
    }


def max_relative_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest relative difference between two runs' numeric table columns."""
    import numpy as np

    worst = 0.0
    for name, tables in a.items():
        for key, columns in tables.items():
            for col, values in columns.items():
                x = np.asarray(values)
                if x.dtype.kind != "f":
                    continue
                y = np.asarray(b[name][key][col])
                scale = np.maximum(np.abs(y), 1e-12)
                diff = np.abs(x - y) / scale
                worst = max(worst, float(np.nanmax(diff, initial=0.0)))
    return worst


def main() -> None:
    parser = model_parser(__doc__, tokens=16384, batch_size=8, repeats=2)
    parser.add_argument("--plugins", default="lens,contrib")
    parser.set_defaults(layers=6, d_model=512, vocab=16384)
    args = parser.parse_args()
    best: dict[Any, dict[str, Any]] = {}
    for _ in range(args.repeats):  # interleaved: 1, 2, 1, 2, ...
        for world in (1, 2):
            run = one_run(world, args, args.plugins)
            if world not in best or run["seconds"] < best[world]["seconds"]:
                best[world] = run
            # CPU seconds per token do not depend on how busy the machine's other cores are.
            key = f"cpu_{world}"
            if key not in best or run["cpu_s"] < best[key]["cpu_s"]:
                best[key] = run
    one, two = best[1], best[2]
    figures = {
        **describe(args),
        "threads": 1,
        "plugins": args.plugins,
        "batches": -(-args.tokens // (args.batch_size * args.seq_len)),
        "seconds": {"1 process": round(one["seconds"], 3), "2 processes": round(two["seconds"], 3)},
        "tokens_per_s": {
            "1 process": round(one["tokens_per_s"], 1),
            "2 processes": round(two["tokens_per_s"], 1),
        },
        "speedup": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
        "scaling_efficiency": round(two["tokens_per_s"] / (2 * one["tokens_per_s"]), 3),
        "tokens_per_cpu_s": {
            "1 process": round(best["cpu_1"]["tokens_per_cpu_s"], 1),
            "2 processes": round(best["cpu_2"]["tokens_per_cpu_s"], 1),
        },
        "cpu_efficiency": round(
            best["cpu_2"]["tokens_per_cpu_s"] / best["cpu_1"]["tokens_per_cpu_s"], 3
        ),
        "ranks_of_best_2_process_run": two["ranks"],
        "max_relative_difference_of_results": max_relative_difference(two["tables"], one["tables"]),
        "cpu_count": os.cpu_count(),
    }
    report(figures, args.json)


if __name__ == "__main__":
    main()
