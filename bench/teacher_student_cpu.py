"""The search for a CPU-sized teacher–student configuration (``--preset cpu``): every trial run.

Each trial is a :class:`~lensdiv.studies.teacher_student.TeacherStudentConfig` (overrides of
the ``fast`` preset) run through the public API on one thread. For each one this records the
settings, the inputs seen, ``α_ℓ`` per teacher with its 95 % interval, the test loss per depth,
how much the training loss still fell over the last quarter, the wall and CPU seconds and the
load average before and after (the machine is shared: CPU seconds are the comparable cost).

    python bench/teacher_student_cpu.py                  # list the trials and what is recorded
    python bench/teacher_student_cpu.py T1 T4 --json bench/teacher_student_cpu.json
    python bench/teacher_student_cpu.py --markdown bench/teacher_student_cpu.json

Results are merged into the JSON file by trial name, so trials can run one at a time (or in two
processes at once on two cores). ``bench/README.md`` has the table and what was learnt.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from common import trials_main

#: name -> (what the trial tests, overrides of the fast preset). Append; never rewrite a trial
#: that has been run (its figures in the JSON file would no longer match its settings).
TRIALS: dict[str, tuple[str, dict[str, Any]]] = {
    "T0": ("the fast preset, as shipped", {}),
    "T1": (
        "source depths, 3.3x the fast preset's inputs at batch 256",
        {"steps": 3000, "batch_size": 256},
    ),
    "T2": (
        "shallower students (2-16): about 3x cheaper per input, so more inputs",
        {"steps": 5000, "batch_size": 256, "depths": (2, 4, 6, 8, 12, 16)},
    ),
    # T3-T5 (2.3-3.1 M inputs, about 1000 CPU s each) were interrupted by a machine restart
    # before they finished and dropped: over the preset's budget of about 300 CPU s.
    "T6": (
        "T1 with the learning rate scaled by 2/sqrt(depth) (peak 3e-3): the same Adam step moves "
        "a deep student's function less",
        {"steps": 3000, "batch_size": 256, "lr": 3e-3, "depth_scaled_lr": True},
    ),
    "T7": (
        "T6 at batch 128: twice the steps of the decaying schedule on the same inputs",
        {"steps": 6000, "batch_size": 128, "lr": 3e-3, "depth_scaled_lr": True},
    ),
    "T8": (
        "T1 at batch 128 (twice the steps on the same inputs, as T7 against T6) and peak 3e-3 "
        "for every depth (T6, T7: a lower rate leaves the deep students behind)",
        {"steps": 6000, "batch_size": 128, "lr": 3e-3},
    ),
    # The budget is about 15 minutes of wall time on 2 cores, not 300 CPU seconds: one trial
    # alone on a quiet machine runs at about one CPU second per second, so ~700 CPU s fit.
    "T9": (
        "students 4-24 with 3.1 M inputs (the dropped T4): deeper range than T2, converged further",
        {"steps": 12000, "batch_size": 256, "depths": (4, 6, 8, 12, 16, 24)},
    ),
    "T10": (
        "as T9 at batch 128, 22000 steps (the dropped T5): more, smaller steps",
        {"steps": 22000, "batch_size": 128, "depths": (4, 6, 8, 12, 16, 24)},
    ),
}


def run_trial(name: str) -> dict[str, Any]:
    """Run one trial on one thread; return its record."""
    import torch

    from lensdiv.studies.teacher_student import TeacherStudentConfig, run_teacher_student

    torch.set_num_threads(1)
    what, overrides = TRIALS[name]
    config = TeacherStudentConfig.preset("fast", **overrides)
    load_before = os.getloadavg()
    wall, cpu = time.perf_counter(), time.process_time()
    result = run_teacher_student(config, progress=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    alpha, losses = result.table("alpha"), result.table("losses")
    return {
        "trial": name,
        "what": what,
        "overrides": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()},
        "config": dataclasses.asdict(config),
        "inputs": config.steps * config.batch_size,
        "alpha": {
            label: {k: round(float(alpha[k][i]), 4) for k in ("alpha", "ci_low", "ci_high", "r2")}
            for i, label in enumerate(alpha["teacher"])
        },
        "test_loss": {
            label: {
                int(d): float(v)
                for t, d, v in zip(
                    losses["teacher"], losses["depth"], losses["test_loss"], strict=True
                )
                if t == label
            }
            for label in alpha["teacher"]
        },
        "late_drop_max": round(float(losses["late_drop"].max()), 4),
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def markdown(records: dict[str, dict[str, Any]]) -> str:
    """The exploration tables of ``bench/README.md``: α_ℓ per trial, then the test loss of every
    student (what the slopes are fitted to)."""
    order = sorted(records.items(), key=lambda kv: int(kv[0][1:]))
    lines = [
        "| trial | what changed | students | inputs | α_ℓ ρ=0 (95 % CI) | α_ℓ ρ=1 (95 % CI) | "
        "late drop | CPU s | wall s (load) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in order:
        fits = list(r["alpha"].values())
        cells = [f"{f['alpha']:.2f} ({f['ci_low']:.2f} to {f['ci_high']:.2f})" for f in fits[:2]]
        cells += [""] * (2 - len(cells))
        load = (r["load_average_before"][0] + r["load_average_after"][0]) / 2
        depths = r["config"]["depths"]
        lines.append(
            f"| {name} | {r['what']} | {depths[0]}–{depths[-1]} | {r['inputs'] / 1e6:.2f} M | "
            f"{cells[0]} | {cells[1]} | {r['late_drop_max']:.0%} | {r['cpu_seconds']:.0f} | "
            f"{r['wall_seconds']:.0f} ({load:.1f}) |"
        )
    depths = sorted({int(d) for _, r in order for row in r["test_loss"].values() for d in row})
    lines += [
        "",
        "Test KL × 10⁴ per student depth:",
        "",
        "| trial | teacher | " + " | ".join(f"ℓ={d}" for d in depths) + " |",
        "|---|---|" + "---|" * len(depths),
    ]
    for name, r in order:
        for teacher, row in r["test_loss"].items():
            cells = [f"{row[str(d)] * 1e4:.2f}" if str(d) in row else "" for d in depths]
            lines.append(f"| {name} | {teacher} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    trials_main(__doc__ or "", TRIALS, run_trial, markdown)


if __name__ == "__main__":
    main()
