"""Benchmark: what does a study cost beyond the runs it is made of?

The toy zoo's depth family (``zoo:depth``: depths 1, 2, 3, 4, 6, 8 at width 64; toys that are
not cached are trained first, outside the timing) with ``lens,contrib,skip,dynamics``. Times, in one process and
one torch thread, interleaved over ``--repeats`` rounds: the study (``lensdiv.run_study`` into a
fresh folder, dataset, summary and page included) and the same six ``lensdiv.analyze`` runs one
after the other. Wall and CPU seconds of each; the study's overhead over the sum of its runs
(target ≤ 5 %); inside the study, its own time beside its runs' (the time outside ``analyze``:
model lists, records, freeing memory, the dataset, the figures, the page); and the gathering
alone (``report_study`` on the finished folder: the dataset, the figures and the page again).

    python bench/bench_study.py [--tokens 16384 --repeats 2 --json bench/study_cpu.json]
    python bench/bench_study.py --device cuda --tokens 65536 --json bench/study_gpu.json
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import add_device, device_name, report

import lensdiv
from lensdiv.models.toy import cached_log, parse_toy
from lensdiv.studies.crossmodel import FAMILIES, report_study

PLUGINS = "lens,contrib,skip,dynamics"


def cpu_seconds() -> float:
    """User plus system CPU seconds of this process so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="zoo:depth")
    parser.add_argument("--plugins", default=PLUGINS)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures to this file")
    add_device(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = list(FAMILIES.get(args.family, args.family.split(",")))
    for model in models:  # the toys are trained (once, then cached) before any timing
        if model.startswith("toy") and cached_log(parse_toy(model)) is None:
            print(f"training {model} (not cached; about a minute)", file=sys.stderr)
            lensdiv.load_model(model, progress=False)
    settings = {
        "max_tokens": args.tokens,
        "progress": False,
        "device": args.device,
        "dtype": args.dtype,
    }
    root = Path(tempfile.mkdtemp(prefix="lensdiv-bench-study-"))
    lensdiv.analyze(models[0], plugins=args.plugins, out=root / "warm", **settings)  # imports
    rounds: list[dict[str, Any]] = []
    load = [os.getloadavg()[0]]
    try:
        for r in range(args.repeats):
            wall, cpu = time.perf_counter(), cpu_seconds()
            study = lensdiv.run_study(models, plugins=args.plugins, out=root / f"s{r}", **settings)
            study_wall, study_cpu = time.perf_counter() - wall, cpu_seconds() - cpu
            assert study.ok, study.notes()
            wall = time.perf_counter()
            report_study(root / f"s{r}", progress=False)
            gathering = time.perf_counter() - wall
            runs_wall, runs_cpu, each = 0.0, 0.0, {}
            for model in models:
                wall, cpu = time.perf_counter(), cpu_seconds()
                lensdiv.analyze(model, plugins=args.plugins, out=root / f"r{r}" / model, **settings)
                each[model] = time.perf_counter() - wall
                runs_wall += each[model]
                runs_cpu += cpu_seconds() - cpu
            inside = sum(m.seconds or 0.0 for m in study.models)
            rounds.append(
                {
                    "study_wall_s": round(study_wall, 2),
                    "study_cpu_s": round(study_cpu, 2),
                    "runs_wall_s": round(runs_wall, 2),
                    "runs_cpu_s": round(runs_cpu, 2),
                    "overhead_wall": round(study_wall / runs_wall - 1, 4),
                    "overhead_cpu": round(study_cpu / runs_cpu - 1, 4),
                    "study_runs_s": round(inside, 2),
                    "study_own_s": round(study_wall - inside, 2),
                    "study_own_share": round((study_wall - inside) / study_wall, 4),
                    "gathering_s": round(gathering, 2),
                    "run_wall_s": {m: round(s, 2) for m, s in each.items()},
                    "study_model_s": {m.model: round(m.seconds or 0.0, 2) for m in study.models},
                }
            )
            load.append(os.getloadavg()[0])
            shutil.rmtree(root / f"r{r}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = min(rounds, key=lambda r: r["overhead_cpu"])
    report(
        {
            "family": args.family,
            "models": models,
            "plugins": args.plugins,
            "tokens": args.tokens,
            "threads": torch.get_num_threads(),
            "device": device_name(args.device),
            "dtype": args.dtype,
            "cpu_count": os.cpu_count(),
            "load_average": [round(x, 2) for x in load],
            "rounds": rounds,
            "best_round_by_cpu_overhead": best,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
