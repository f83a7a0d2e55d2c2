"""The GPU section of bench/README.md, written from the ``*_gpu.json`` files of ``bench/gpu.sh``.

Reads every figure file ``bench/gpu.sh`` writes (those present; a missing one is named as
missing) and replaces what stands between the two marker lines of the README (``<!--
gpu-figures:start -->`` and ``<!-- gpu-figures:end -->``) with a table per script: the ratios each
benchmark exists for, and the absolute times beside them. Nothing is measured here.

    python bench/gpu_report.py                                  # bench/*_gpu.json -> bench/README.md
    python bench/gpu_report.py --folder /tmp/smoke --readme /tmp/smoke/README.md   # gpu.sh --smoke
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

START = "<!-- gpu-figures:start -->"
END = "<!-- gpu-figures:end -->"
HERE = Path(__file__).resolve().parent


def _num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "—" if value is None else str(value)
    return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_num(v) if not isinstance(v, str) else v for v in row) + " |"
              for row in rows]
    return lines


def floor(d: dict[str, Any]) -> list[str]:
    """``bench_floor.py``: the lens and the fused analyzers against their floor."""
    tps = d.get("tokens_per_s", {})
    return [
        f"`bench_floor.py` — {d.get('arch', '')}, {d.get('model')}, {d.get('dtype')}, "
        f"{d.get('tokens')} tokens, batch {d.get('batch_size')} (target: lens ≤ 1.2 × floor, "
        "fused ≤ 1.5 × floor):",
        "",
        *_table(["case", "seconds", "tokens/s", "/ floor"], [
            [name, sec, tps.get(name), sec / d["seconds"]["floor"] if d["seconds"].get("floor")
             else None] for name, sec in d.get("seconds", {}).items()]),
    ]


def fused(d: dict[str, Any]) -> list[str]:
    """``bench_fused.py``: ``lens,contrib`` fused against ``lens`` alone."""
    return [
        f"`bench_fused.py` — {d.get('model')}, {d.get('dtype')}, {d.get('tokens')} tokens "
        "(target: fused ≤ 1.2 × lens): lens,contrib / lens "
        f"**{_num(d.get('fused_over_lens'))}**, lens / forward {_num(d.get('lens_over_forward'))}, "
        f"contrib / forward {_num(d.get('contrib_over_forward'))}; seconds: "
        + ", ".join(f"{k} {_num(v)}" for k, v in d.get("seconds", {}).items()) + ".",
    ]


def tuned_step(d: dict[str, Any]) -> list[str]:
    """``bench_tuned_step.py``: lensdiv's training step against tuned-lens's."""
    return [
        f"`bench_tuned_step.py` — {d.get('model')}, {d.get('tokens_per_step')} tokens a step"
        + (f" ({d['device']})" if d.get("device") else "") + ":",
        "",
        *_table(["step", "seconds", "tokens/s", "speed / tuned-lens float32"], [
            [name, r.get("step_s"), r.get("tokens_per_s"), r.get("speed_vs_tuned_lens_float32")]
            for name, r in d.get("runs", {}).items()]),
    ]


def lenses(d: dict[str, Any]) -> list[str]:
    """``bench_lenses.py --only jacobian``: the Jacobian fit against TransformerLens' ``fit``."""
    exact = d.get("jacobian", {}).get("exact", {})
    sketch = d.get("jacobian", {}).get("sketch", {})
    rows = [["TransformerLens `JacobianLens.fit`", exact.get("transformer_lens_fit_s"), 1.0, "—"],
            ["lensdiv `fit-jacobian` (exact)", exact.get("lensdiv_exact_s"),
             exact.get("lensdiv_over_transformer_lens"),
             f"max relative difference {_num(exact.get('max_relative_difference'))}"]]
    rows += [[f"lensdiv sketch, {k} probes", s.get("seconds"),
              (s.get("seconds") / exact["transformer_lens_fit_s"]
               if exact.get("transformer_lens_fit_s") else None),
              f"mean cosine {_num(s.get('mean_cosine'), 5)}"] for k, s in sketch.items()]
    return [
        f"`bench_lenses.py --only jacobian` — {d.get('model')}, {d.get('dtype')}, "
        f"{d.get('jacobian', {}).get('prompts')} prompts of {d.get('jacobian', {}).get('seq_len')} "
        "tokens (target: lensdiv exact ≤ 1.05 × TransformerLens):",
        "",
        *_table(["fit", "seconds", "/ TransformerLens", "agreement"], rows),
    ]


def study(d: dict[str, Any]) -> list[str]:
    """``bench_study.py``: a study's cost beyond its runs."""
    best = d.get("best_round_by_cpu_overhead", {})
    return [
        f"`bench_study.py` — {d.get('family')} ({len(d.get('models', []))} models), "
        f"{d.get('plugins')}, {d.get('tokens')} tokens a model, {d.get('dtype')} (target: "
        f"overhead ≤ 5 %): study {_num(best.get('study_wall_s'))} s against its runs "
        f"{_num(best.get('runs_wall_s'))} s one by one: overhead **{_num(best.get('overhead_wall'))}** "
        f"(CPU time {_num(best.get('overhead_cpu'))}); the study's own share "
        f"{_num(best.get('study_own_share'))}, the gathering {_num(best.get('gathering_s'))} s.",
    ]


def data(d: dict[str, Any]) -> list[str]:
    """``bench_data.py``: the data path alone, and its overlap with the model on the GPU."""
    rows = [[name, t.get("M_tokens_per_s", {}).get("before"),
             t.get("M_tokens_per_s", {}).get("after"),
             t.get("M_tokens_per_s", {}).get("after, read ahead"),
             t.get("M_tokens_per_s", {}).get("after, cached")]
            for name, t in d.get("data_path", {}).items()]
    o = d.get("overlap", {})
    return [
        "`bench_data.py` — the data path alone (CPU; million tokens/s):",
        "",
        *_table(["tokenizer", "before", "after", "after, read ahead", "after, cached"], rows),
        "",
        f"Overlap on {o.get('device', '')} ({o.get('model')}, {o.get('tokens')} tokens, a "
        "tokenizer slowed to the model's time): overlapped run / max(data, compute) "
        f"**{_num(o.get('overlapped_over_max'))}** (1 = full overlap), serial / overlapped "
        f"{_num(o.get('serial_over_overlapped'))}.",
    ]


def tuned(d: dict[str, Any]) -> list[str]:
    """``bench_tuned.py``: time to quality, the published recipe against the fast path."""
    rows = []
    for key, report in d.items():
        for name, r in report.get("runs", {}).items():
            ratios = r.get("kl_vs_baseline", [])[:-1]
            rows.append([f"`{key}`", name, r.get("seconds"), r.get("time_vs_baseline"),
                         max(ratios) if ratios else None,
                         "**yes**" if r.get("within_2pct") and name != "baseline" else
                         ("—" if name == "baseline" else "no")])
    return [
        "`bench_tuned.py` — tuned lens, time to quality (held-out KL per layer / the recipe's; "
        "target: every layer ≤ 1.02 in ≤ ¼ of the recipe's time):",
        "",
        *_table(["model (preset)", "run", "fit (s)", "time / recipe", "worst layer's KL / recipe's",
                 "every layer ≤ 1.02"], rows),
    ]


#: The files of bench/gpu.sh, in its order, and how each becomes Markdown.
FILES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "floor_gpu.json": floor,
    "fused_gpu.json": fused,
    "tuned_step_gpu.json": tuned_step,
    "lenses_gpu.json": lenses,
    "study_gpu.json": study,
    "data_gpu.json": data,
    "tuned_gpu.json": tuned,
}


def section(folder: Path) -> str:
    """The Markdown between the markers, from the files in ``folder``."""
    device = next((json.loads((folder / n).read_text()).get("device") for n in
                   ("floor_gpu.json", "fused_gpu.json") if (folder / n).is_file()), None)
    written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(max(
        (folder / n).stat().st_mtime for n in FILES if (folder / n).is_file())))
    lines = [START, "", f"**GPU figures** of `bench/gpu.sh` ({device or 'device unknown'}, "
             f"{written}; written by `bench/gpu_report.py` from `bench/*_gpu.json`):", ""]
    missing = []
    for name, render in FILES.items():
        path = folder / name
        if not path.is_file():
            missing.append(name)
            continue
        rendered = render(json.loads(path.read_text()))
        lines += ["- " + rendered[0], *rendered[1:], ""]
    if missing:
        lines += [f"Not written by this run (skipped or over its time limit; see gpu.sh's "
                  f"output): {', '.join(missing)}.", ""]
    lines.append(END)
    return "\n".join(lines)


def replace_section(text: str, new: str) -> str:
    """``text`` with its marked section replaced by ``new``."""
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"gpu_report.py: no {START} … {END} section in the README")
    return pattern.sub(lambda _: new, text, count=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=HERE, help="where the *_gpu.json are")
    parser.add_argument("--readme", type=Path, default=HERE / "README.md")
    args = parser.parse_args()
    if not any((args.folder / name).is_file() for name in FILES):
        sys.exit(f"gpu_report.py: no *_gpu.json in {args.folder}: the README is left as it is")
    args.readme.write_text(replace_section(args.readme.read_text(), section(args.folder)))
    print(f"gpu_report.py: wrote the GPU section of {args.readme}")


if __name__ == "__main__":
    main()
