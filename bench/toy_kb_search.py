"""The search for the multi-hop toy's recipe (``toy:kb``): every trial run.

Each trial trains one toy (architecture and recipe below) with ``lensdiv.models.toy.train_toy``,
nothing cached, and records its training log: held-out loss and multi-hop accuracy per hop count
at every evaluation point, on held-out chains and on chains of the training split (beside each
hop count's prior baseline: the accuracy of always giving the most common end of the query's
relation chain), CPU and wall seconds, and the load average.

    python bench/toy_kb_search.py                       # list the trials
    python bench/toy_kb_search.py K1 --json bench/toy_kb_search.json
    python bench/toy_kb_search.py --markdown bench/toy_kb_search.json

``bench/README.md`` has the table and what was learnt. K1–K3 were run (and K2, K3 stopped by a
machine restart) by a scratch script with the same training loop before this script existed;
``toy_kb_search.json`` says so in each record's ``source``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from common import trials_main

#: name -> (what the trial tests, ToySpec fields, TrainRecipe fields). Append only.
TRIALS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "K1": (
        "the zoo's default toy on knowledge-base documents only, 6x the steps",
        {"depth": 4, "width": 64},
        {"steps": 3000, "kb_fraction": 1.0, "eval_every": 500, "hop_queries": 100},
    ),
    "K2": (
        "6 blocks, weight decay 0.1",
        {"depth": 6, "width": 64},
        {
            "steps": 6000,
            "kb_fraction": 1.0,
            "weight_decay": 0.1,
            "eval_every": 1000,
            "hop_queries": 100,
        },
    ),
    "K3": (
        "4 blocks, weight decay 0.1, documents rich in 2-hop queries",
        {"depth": 4, "width": 64},
        {
            "steps": 10000,
            "kb_fraction": 1.0,
            "weight_decay": 0.1,
            "kb_hops": (1, 2, 2, 2, 3),
            "eval_every": 1000,
            "hop_queries": 100,
        },
    ),
    "K4": (
        "toy:kb as shipped: 6 blocks, weight decay 0.1, 3000-step schedule",
        {"depth": 6, "width": 64, "task": "kb"},
        {"steps": 3000, "kb_fraction": 1.0, "weight_decay": 0.1, "eval_every": 500},
    ),
}


def run_trial(name: str) -> dict[str, Any]:
    """Train the trial's toy on one thread (nothing cached); return its record."""
    import torch

    from lensdiv.models.toy import ToySpec, TrainRecipe, train_toy

    torch.set_num_threads(1)
    what, spec_fields, recipe_fields = TRIALS[name]
    spec, recipe = ToySpec(**spec_fields), TrainRecipe(**recipe_fields)
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    _, log = train_toy(spec, recipe, progress=False, save=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {
        "trial": name,
        "what": what,
        "spec": dataclasses.asdict(spec),
        "recipe": dataclasses.asdict(recipe),
        "eval": log["eval"],
        "multihop": log["multihop"],
        "multihop_seen": log["multihop_seen"],
        "train_seconds": log["train_seconds"],
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def markdown(records: dict[str, dict[str, Any]]) -> str:
    """The exploration table of ``bench/README.md``: accuracy per hop at each evaluation, on
    chains of the training split (seen) and on held-out chains (unseen)."""
    lines = [
        "| trial | what changed | step | 1-hop | 2-hop seen | 3-hop seen | 4-hop seen | "
        "2-hop unseen | 3-hop unseen | 4-hop unseen | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in sorted(records.items(), key=lambda kv: int(kv[0][1:])):
        for i, point in enumerate(r["eval"]):
            hop, seen = point["multihop"], point.get("multihop_seen", {})
            first = i == 0
            lines.append(
                f"| {name if first else ''} | {r['what'] if first else ''} | {point['step']} | "
                f"{hop['1']:.0%} | "
                + " | ".join(f"{seen[h]:.0%}" if h in seen else "–" for h in "234")
                + " | "
                + " | ".join(f"{hop[h]:.0%}" for h in "234")
                + (f" | {r['cpu_seconds']:.0f} |" if first else " | |")
            )
    return "\n".join(lines)


def main() -> None:
    trials_main(__doc__ or "", TRIALS, run_trial, markdown)


if __name__ == "__main__":
    main()
