"""Benchmark: the patchscope's continuations on the real models, one start at a time against
sweeps (``Inspection.run_each``), on the work of nnterp's ``patchscope_lens``: the last position
of 16 pydoc prompts of 64 tokens, every layer, 2 threads.

Times :meth:`~lensdiv.ops.blocklens.PatchscopeLens.read_all` with ``SWEEP_ROWS = 0`` (every
start alone, as before sweeps) and at its default, best of ``--repeats``, in ``--rounds``
interleaved rounds, and the largest relative difference between the two ways' final states.

    python bench/bench_patchscope_real.py [--models smollm2-135m,gemma3-270m]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
from bench_patchscope import best, states_of

from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.models.load import load_model
from lensdiv.ops import inspection as inspection_module
from lensdiv.ops.blocklens import PatchscopeLens


def measure(name: str, prompts: int, seq_len: int, repeats: int, rounds: int) -> dict[str, Any]:
    model = load_model(name, progress=False)
    spec = DataSpec(source="pydoc", max_tokens=prompts * seq_len, seq_len=seq_len,
                    batch_size=prompts)
    tokens = torch.cat([b.tokens for b in token_batches(spec, model.tokenizer)])[:prompts]
    L = int(model.cfg.n_layers)
    states = [s.reshape(prompts, seq_len, -1)[:, -1] for s in states_of(model, tokens)]
    found = inspection_module.inspection(model, PatchscopeLens().prompt, -1)
    rows = torch.arange(prompts)
    default = inspection_module.SWEEP_ROWS

    def read(limit: int) -> dict[int, torch.Tensor]:
        inspection_module.SWEEP_ROWS = limit
        with torch.no_grad():
            return PatchscopeLens().read_all(found, states, rows)

    apart, swept = read(0), read(default)
    error = max(float((apart[i] - swept[i]).abs().max() / apart[i].abs().max()) for i in range(L))
    t_apart = t_swept = float("inf")
    for _ in range(rounds):
        t_apart = min(t_apart, best(lambda: read(0), repeats))
        t_swept = min(t_swept, best(lambda: read(default), repeats))
    inspection_module.SWEEP_ROWS = default
    return {"layers": L, "states": L * prompts, "continuations": found.layers,
            "one_start_at_a_time_s": t_apart, "sweeps_s": t_swept,
            "speedup": t_apart / t_swept, "max_relative_difference": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,gemma3-270m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/patchscope_real_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    figures: dict[str, Any] = {"threads": args.threads, "prompts": args.prompts,
                               "seq_len": args.seq_len,
                               "load_average": [round(x, 2) for x in os.getloadavg()]}
    for name in args.models.split(","):
        figures[name] = measure(name, args.prompts, args.seq_len, args.repeats, args.rounds)
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=1)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
