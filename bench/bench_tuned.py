"""Time to quality of a tuned lens (issue 32): held-out KL per layer against the fit's wall time,
for the published recipe (identity start, SGD with Nesterov momentum, linear decay) and the fast
path (one closed-form pass, the affine lens, then a few SGD steps: ``affine_passes=1``).

Every fit reads the same data from its start; the held-out KL is measured on ``--eval-tokens``
tokens after everything any fit read (``evaluate_lens``), so every fit is judged on the same
positions. The wall time is the fit alone (the model loaded before the clock starts; the
closed-form pass counted). Fits run interleaved, ``--repeats`` rounds; the median time is kept.

    python bench/bench_tuned.py --model toy --preset toy --fast-steps 4,8,16 --json bench/tuned_cpu.json

The figure from the recorded JSON, without fitting anything:

    python bench/bench_tuned.py --plot-only --json bench/tuned_cpu.json --plot bench/tuned_cpu.png \
        --plot-keys "toy:d8 cpu,toy:d4-w128 cpu"
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lensdiv.lenses.fit import evaluate_lens, fit_lens
from lensdiv.lenses.tuned import PRESETS
from lensdiv.models.load import load_model


def fit_once(model: Any, preset: str, options: dict[str, Any], folder: Path) -> tuple[float, Any]:
    """One fit's wall time and its lens folder."""
    started = time.perf_counter()
    fit = fit_lens(model, "tuned", out=folder, preset=preset, options=options, eval_tokens=0,
                   progress=False, overwrite=True)
    return time.perf_counter() - started, fit.lens


def held_out_kl(model: Any, lens: Path, skip: int, tokens: int) -> list[float]:
    """KL(p_L ‖ p_l) per residual state on held-out tokens, through the fitted lens."""
    table = evaluate_lens(model, f"tuned:{lens}", skip_tokens=skip, max_tokens=tokens,
                          progress=False)
    return [float(v) for v in table["kl_tuned"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--preset", default="toy", choices=sorted(PRESETS))
    parser.add_argument("--fast-steps", default="4,8,16",
                        help="passes of the fast path (1 closed-form + the rest SGD at the -fast "
                        "preset's lr), comma-separated")
    parser.add_argument("--baseline-steps", default="",
                        help="extra (shorter) baseline runs for the curve, comma-separated")
    parser.add_argument("--eval-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None,
                        help="the baseline's steps (default: the preset's)")
    parser.add_argument("--tokens-per-step", type=int, default=None,
                        help="every run's tokens a step (default: the preset's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", help="the model's dtype (readouts: float32)")
    parser.add_argument("--json", type=Path, help="merge the figures into this file")
    parser.add_argument("--plot", type=Path, help="draw every model's figures of --json here")
    parser.add_argument("--plot-only", action="store_true",
                        help="draw --json's figures only (no fit: the recorded figures)")
    parser.add_argument("--plot-keys", default="",
                        help="the entries of --json to draw (comma-separated, e.g. 'toy:d8 cpu,"
                        "toy:d4-w128 cpu'); default: all")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.plot_only:
        plot(chosen(json.loads(args.json.read_text()), args.plot_keys), args.plot)
        return
    sizes = {} if args.tokens_per_step is None else {"tokens_per_step": args.tokens_per_step}
    recipe = dataclasses.replace(PRESETS[args.preset], **sizes)
    recipe = dataclasses.replace(recipe, steps=args.steps or recipe.steps)
    fast = PRESETS.get(f"{args.preset}-fast", PRESETS["cpu-fast"])  # its step size
    model = load_model(args.model, device=args.device, dtype=args.dtype, progress=False)
    runs: dict[str, dict[str, Any]] = {
        "baseline": {"steps": recipe.steps, "affine_passes": 0, **sizes}
    }
    for steps in filter(None, args.baseline_steps.split(",")):
        runs[f"baseline-{steps}"] = {"steps": int(steps), "affine_passes": 0, **sizes}
    for steps in filter(None, args.fast_steps.split(",")):
        runs[f"fast-{steps}"] = {"steps": int(steps), "affine_passes": 1, "lr": fast.lr, **sizes}
    step_tokens = -(-recipe.tokens_per_step // (8 * 128)) * 8 * 128  # whole batches (8 × 128)
    skip = recipe.steps * step_tokens
    times: dict[str, list[float]] = {name: [] for name in runs}
    lenses: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):  # interleaved rounds
            for name, options in runs.items():
                seconds, lens = fit_once(model, args.preset, options, Path(tmp, name))
                times[name].append(seconds)
                print(f"{name}: {seconds:.2f} s", file=sys.stderr, flush=True)
                lenses[name] = lens
        kl = {name: held_out_kl(model, lenses[name], skip, args.eval_tokens) for name in runs}
    base_kl, base_s = kl["baseline"], statistics.median(times["baseline"])
    rows = {}
    for name, options in runs.items():
        seconds = statistics.median(times[name])
        ratios = [k / b if b > 0 else 1.0 for k, b in zip(kl[name], base_kl, strict=True)]
        rows[name] = {
            **options,
            "seconds": seconds,
            "seconds_all": times[name],
            "time_vs_baseline": seconds / base_s,
            "kl": kl[name],
            "kl_vs_baseline": ratios,
            "within_2pct": all(r <= 1.02 for r in ratios[:-1]),
        }
    report = {
        "model": args.model,
        "preset": args.preset,
        "recipe": dataclasses.asdict(recipe),
        "tokens_per_step": step_tokens,
        "eval_tokens": args.eval_tokens,
        "held_out_from_token": skip,
        "threads": args.threads,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "repeats": args.repeats,
        "runs": rows,
    }
    print(json.dumps(report, indent=1))
    if args.json:  # merged with the other models' and presets' figures in the file
        merged = json.loads(args.json.read_text()) if args.json.exists() else {}
        merged[f"{args.model} {args.preset}"] = report
        args.json.write_text(json.dumps(merged, indent=1) + "\n")
    if args.plot:
        reports = json.loads(args.json.read_text()) if args.json else {"": report}
        plot(chosen(reports, args.plot_keys), args.plot)


def chosen(reports: dict[str, Any], keys: str) -> dict[str, Any]:
    """The entries named in ``keys`` (comma-separated; empty: all), in that order."""
    names = [k.strip() for k in keys.split(",") if k.strip()]
    missing = [k for k in names if k not in reports]
    if missing:
        sys.exit(f"bench_tuned.py: no entry {missing[0]!r} in the JSON (it has: "
                 f"{', '.join(reports)})")
    return {k: reports[k] for k in names} if names else reports


def groups(n_states: int) -> dict[str, list[int]]:
    """The residual states read by a lens, in two groups: the first half and the rest (the
    output state, where every lens is exact, left out)."""
    half = max(1, (n_states - 1) // 2)
    spans = [range(half), range(half, n_states - 1)]
    return {(f"h{r[0]}" if len(r) == 1 else f"h{r[0]}–h{r[-1]}"): list(r) for r in spans if r}


def plot(reports: dict[str, Any], path: Path) -> None:
    """Held-out KL (summed over a layer group) against the fit's wall time, per model and group:
    the published recipe's runs (its full run and shorter ones) and the fast path's."""
    import matplotlib.pyplot as plt  # plotting only when asked

    panels = [(key, name, states) for key, report in reports.items()
              for name, states in groups(len(report["runs"]["baseline"]["kl"])).items()]
    rows = len(reports)
    fig, axes = plt.subplots(rows, 2, figsize=(7.6, 2.9 * rows), squeeze=False)
    for ax, (key, name, states) in zip(axes.flat, panels, strict=True):
        runs = reports[key]["runs"]
        for kind, style in (("baseline", "o-"), ("fast", "s-")):
            chosen = sorted((r["seconds"], sum(r["kl"][i] for i in states))
                            for n, r in runs.items() if n.split("-")[0] == kind)
            label = "published recipe" if kind == "baseline" else "fast path (affine start)"
            ax.plot(*zip(*chosen, strict=True), style, label=label)
        full = runs["baseline"]
        ax.axhline(sum(full["kl"][i] for i in states) * 1.02, color="grey", lw=0.8, ls=":")
        ax.axvline(full["seconds"] / 4, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{key} preset: {name}", fontsize=9)
        ax.set_xlabel("fit wall time (s)", fontsize=8)
        ax.set_ylabel("held-out Σ KL (nats)", fontsize=8)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Tuned lens: held-out KL(p_L ‖ p_l) against fit wall time\n(dotted: the "
                 "recipe's KL + 2 %; dashed: ¼ of its time)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
