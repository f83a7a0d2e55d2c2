"""Benchmark: ``lens`` through ``analyze`` against its two floors, in one command (issue 36).

The model: a random Hugging Face GPT-2 of 12 layers, d_model 768, 12 heads, vocabulary 50257,
built here from a config (seed 0, nothing downloaded) and booted through TransformerLens with a
GPT-2-sized byte-level BPE tokenizer (``bench_fixed.bpe_tokenizer``). Two sections, each
timed in interleaved rounds (every case once per round, in turn, so that all see the same load),
best of ``--rounds``, by the wall clock and by the process's CPU time:

- **TransformerLens floor, 2 threads**, at 512 and 4096 tokens of the built-in corpus
  (``DataSpec(max_tokens=N)``: rows of 128 tokens, batches of 8): ``floor`` is
  ``run_with_cache`` of the ``L + 1`` residual states on the same batches tokenised beforehand,
  then per state the bridge's ``ln_final``, ``@ W_U + b_U`` and one ``log_softmax``;
  ``lens`` is ``analyze(model, data=DataSpec(max_tokens=N), plugins="lens")``, everything a
  user's call pays (reading the corpus, checks, the manifest; no output folder).
- **Hugging Face floor, 1 thread**, 1024 tokens (8 × 128): ``floor`` is the plain Hugging Face
  model (a second copy with the same weights: booting a bridge replaces the first one's modules)
  called with ``output_hidden_states=True``, then per state ``ln_f``, ``lm_head`` and one
  ``log_softmax`` (the last hidden state is already ``ln_f``'s output, so it only goes through
  ``lm_head``); ``lens`` as above on ``DataSpec(max_tokens=1024, seq_len=128, batch_size=8)``.

Each floor's own split (forward vs. readout) and each lens run's manifest timings (forward,
analyzer, total) come with the figures, so the difference can be placed; ``--profile`` adds
torch profiler tables (self CPU time by operator) of one lens run and one floor run at 512
tokens. The load average is recorded before and after each section.

    python bench/bench_lens_floor.py --json bench/lens_floor_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fixed import bpe_tokenizer  # noqa: E402
from common import gpt2_config  # noqa: E402

import lensdiv  # noqa: E402
from lensdiv import DataSpec, analyze  # noqa: E402
from lensdiv.data.sources import token_batches  # noqa: E402

LAYERS, D_MODEL, VOCAB = 12, 768, 50257


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tl-tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--tl-threads", type=int, default=2)
    parser.add_argument("--hf-tokens", type=int, default=1024)
    parser.add_argument("--hf-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (best of)")
    parser.add_argument(
        "--large-rounds",
        type=int,
        default=2,
        help="rounds at 2048 tokens and more (they dominate the script's time)",
    )
    parser.add_argument("--sections", default="tl,hf", help="tl, hf or both (default)")
    parser.add_argument("--profile", action="store_true", help="operator tables at 512 tokens")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args()


# -- the cases ----------------------------------------------------------------------------------


class Split:
    """Seconds a floor spends in its forward pass and in its readout (the last run's)."""

    def __init__(self) -> None:
        self.forward = self.readout = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"forward_s": round(self.forward, 3), "readout_s": round(self.readout, 3)}


def tl_floor(model: Any, batches: list[Any], split: Split) -> Callable[[], None]:
    """``run_with_cache`` of the residual states; per state ``ln_final``, ``W_U``, log-softmax."""
    names = [f"blocks.{i}.hook_resid_pre" for i in range(model.cfg.n_layers)]
    names.append(f"blocks.{model.cfg.n_layers - 1}.hook_resid_post")

    def run() -> None:
        split.forward = split.readout = 0.0
        for tokens in batches:
            t0 = time.perf_counter()
            _, cache = model.run_with_cache(tokens, names_filter=names)
            t1 = time.perf_counter()
            for name in names:
                logits = model.ln_final(cache[name]) @ model.W_U + model.b_U
                torch.log_softmax(logits, dim=-1)
            split.forward += t1 - t0
            split.readout += time.perf_counter() - t1

    return run


def hf_floor(hf: Any, batches: list[Any], split: Split) -> Callable[[], None]:
    """Hugging Face's ``output_hidden_states``; per state ``ln_f``, ``lm_head``, log-softmax."""

    def run() -> None:
        split.forward = split.readout = 0.0
        for tokens in batches:
            t0 = time.perf_counter()
            states = hf.transformer(tokens, output_hidden_states=True).hidden_states
            t1 = time.perf_counter()
            for i, h in enumerate(states):
                x = h if i == len(states) - 1 else hf.transformer.ln_f(h)  # the last is ln_f's
                torch.log_softmax(hf.lm_head(x), dim=-1)
            split.forward += t1 - t0
            split.readout += time.perf_counter() - t1

    return run


def lens(model: Any, spec: DataSpec, timings: list[dict[str, float]]) -> Callable[[], None]:
    """``analyze(model, data=spec, plugins="lens")``; its manifest's timings are kept."""

    def run() -> None:
        result = analyze(model, data=spec, plugins="lens", progress=False)
        assert result.ok, result.errors
        timings.append(dict(result.manifest["timings"]))

    return run


# -- timing ---------------------------------------------------------------------------------------


def interleaved(cases: dict[str, Callable[[], None]], rounds: int) -> dict[str, Any]:
    """Best wall and CPU seconds of each case over ``rounds`` rounds, each case once a round."""
    wall = {name: float("inf") for name in cases}
    cpu = {name: float("inf") for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[name] = min(wall[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
    return {
        "wall_s": {k: round(v, 3) for k, v in wall.items()},
        "cpu_s": {k: round(v, 3) for k, v in cpu.items()},
    }


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def ratios(figures: dict[str, Any], pairs: dict[str, tuple[str, str]]) -> dict[str, float]:
    out = {}
    for label, (num, den) in pairs.items():
        for clock in ("wall", "cpu"):
            seconds = figures[f"{clock}_s"]
            out[f"{clock}: {label}"] = round(seconds[num] / seconds[den], 3)
    return out


def pretokenised(spec: DataSpec, tokenizer: Any) -> list[Any]:
    return [batch.tokens for batch in token_batches(spec, tokenizer)]


# -- the sections ---------------------------------------------------------------------------------


def tl_section(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.tl_threads)
    figures: dict[str, Any] = {"threads": args.tl_threads, "load_before": load()}
    for n in args.tl_tokens:
        spec = DataSpec(max_tokens=n)
        split, timings = Split(), []  # type: ignore[var-annotated]
        cases = {
            "floor": tl_floor(model, pretokenised(spec, model.tokenizer), split),
            "lens": lens(model, spec, timings),
        }
        rounds = args.large_rounds if n >= 2048 else args.rounds
        measured = interleaved(cases, rounds)
        figures[str(n)] = {
            "data_spec": repr(spec),
            "rounds": rounds,
            **measured,
            "ratios": ratios(measured, {"lens / floor": ("lens", "floor")}),
            "floor_split_last_run": split.as_dict(),
            "lens_timings_best": min(timings, key=lambda t: t["total_s"]),
            "load": load(),
        }
        print(json.dumps({n: figures[str(n)]["ratios"]}), flush=True)
    return figures


def hf_section(model: Any, hf: Any, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.hf_threads)
    spec = DataSpec(max_tokens=args.hf_tokens, seq_len=128, batch_size=8)
    batches = pretokenised(spec, model.tokenizer)
    split, tl_split, timings = Split(), Split(), []  # type: ignore[var-annotated]
    cases = {
        "hf floor": hf_floor(hf, batches, split),
        "tl floor": tl_floor(model, batches, tl_split),
        "lens": lens(model, spec, timings),
    }
    figures: dict[str, Any] = {
        "threads": args.hf_threads,
        "data_spec": repr(spec),
        "batches": [list(b.shape) for b in batches],
        "rounds": args.rounds,
        "load_before": load(),
    }
    measured = interleaved(cases, args.rounds)
    figures.update(measured)
    figures["ratios"] = ratios(
        measured,
        {
            "lens / hf floor": ("lens", "hf floor"),
            "lens / tl floor": ("lens", "tl floor"),
            "tl floor / hf floor": ("tl floor", "hf floor"),
        },
    )
    figures["hf_floor_split_last_run"] = split.as_dict()
    figures["tl_floor_split_last_run"] = tl_split.as_dict()
    figures["lens_timings_best"] = min(timings, key=lambda t: t["total_s"])
    figures["load"] = load()
    print(json.dumps({"hf": figures["ratios"]}), flush=True)
    return figures


def profile(model: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Self CPU seconds by operator of one lens run and one floor run at 512 tokens."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.set_num_threads(args.tl_threads)
    spec = DataSpec(max_tokens=512)
    cases = {
        "floor": tl_floor(model, pretokenised(spec, model.tokenizer), Split()),
        "lens": lens(model, spec, []),
    }
    out = {}
    for name, fn in cases.items():
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        out[name] = {e.key: round(e.self_cpu_time_total / 1e6, 3) for e in rows}
        out[name]["(total)"] = round(
            sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e6, 3
        )
    return out


def build() -> tuple[Any, Any]:
    """The bridge of :func:`bench_floor.build_gpt2` and a plain copy of its Hugging Face model
    (booting replaces the wrapped model's modules with the bridge's)."""
    import copy
    import tempfile

    from transformer_lens import TransformerBridge
    from transformers import GPT2LMHeadModel

    from lensdiv.data.tokenizer import byte_tokenizer

    config = gpt2_config(LAYERS, D_MODEL, VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = GPT2LMHeadModel(config).eval()
    plain = copy.deepcopy(hf)
    folder = tempfile.mkdtemp(prefix="bench_lens_floor_")
    config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    model = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=byte_tokenizer())
    model.tokenizer = bpe_tokenizer(VOCAB)
    return model.eval(), plain


def main() -> None:
    args = parse()
    started = time.perf_counter()
    torch.set_grad_enabled(False)
    model, hf = build()
    probe = torch.arange(2, 34).reshape(2, 16)
    torch.testing.assert_close(hf(probe).logits, model(probe), rtol=1e-4, atol=1e-4)
    sections = set(args.sections.split(","))
    torch.set_num_threads(args.tl_threads)
    warm = DataSpec(max_tokens=32, seq_len=16, batch_size=2)
    analyze(model, data=warm, plugins="lens", progress=False)  # per-model checks, lazy imports
    tree = Path(lensdiv.__file__).resolve().parent.parent
    figures: dict[str, Any] = {
        "model": f"{LAYERS} layers, d_model {D_MODEL}, vocab {VOCAB} (random Hugging Face "
        "GPT-2 booted through TransformerLens; a GPT-2-sized byte-level BPE)",
        "lensdiv": lensdiv.__version__,
        "commit": _commit(tree),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if "tl" in sections:
        figures["tl"] = tl_section(model, args)
    if "hf" in sections:
        figures["hf"] = hf_section(model, hf, args)
    if args.profile:
        figures["profile_512"] = profile(model, args)
    figures["script_s"] = round(time.perf_counter() - started, 1)
    summary = {}
    for n in args.tl_tokens if "tl" in figures else []:
        for k, v in figures["tl"][str(n)]["ratios"].items():
            summary[f"{k}, {n} tokens, {args.tl_threads} threads"] = v
    for k, v in figures.get("hf", {}).get("ratios", {}).items():
        summary[f"{k}, {args.hf_tokens} tokens, {args.hf_threads} thread(s)"] = v
    print(json.dumps(figures, indent=1))
    print(json.dumps({"summary": summary, "script_s": figures["script_s"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


def _commit(tree: Path) -> str:
    import subprocess

    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--", "lensdiv"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


if __name__ == "__main__":
    main()
