"""Benchmark: a run's fixed cost and the data path's share, part by part; lens / floor with a
data spec and with the same batches as token ids — here, or against an older checkout.

The random GPT-2-shaped model of ``bench_floor.py`` (a Hugging Face GPT-2 booted through
TransformerLens, a warm token cache) with a GPT-2-sized tokenizer (``--tokenizer bpe``: a
byte-level BPE of 50257 tokens built here; ``byte``: ``bench_floor.py``'s byte tokenizer). Each tree (this one and, with
``--before DIR``, the checkout in ``DIR``) is measured by a worker process that imports
``lensdiv`` from that tree, builds the model once and warms up; the parent then asks the workers
for one round at a time, alternately (before, after, before, after, ...), so that both see the
same load, and keeps each figure's best round. A round times:

- the parts of a run's fixed cost, each on its own (as the second run on a model pays them):
  ``probe`` (the validation's forward pass over a few tokens, ``run.validate.check_runs``),
  ``probe forward`` (that forward pass itself, whether a run pays it or not), ``versions`` (the
  manifest's package versions), ``tokenizer copy`` (the reader thread's private copy),
  ``cache key`` (the token cache's identity of the tokenizer and its entry's key);
- the data path at each ``--tokens``: ``data cached`` (``token_batches`` from the warm cache,
  in the caller's thread) and ``data read ahead`` (``ready_batches``, what a run iterates);
- ``run fixed``: ``analyze(model, data=spec, plugins="lens")`` over 32 tokens (a run whose work
  is nearly nothing: what any run pays besides its tokens);
- at each ``--tokens``: ``floor`` (one caching forward; per state final norm, unembedding, one
  log-softmax), ``lens, spec`` (``analyze(model, data=spec)``) and ``lens, ids`` (``analyze``
  of the same batches as a token tensor), wall clock and process CPU time; each run's own split
  (``total_s - forward_s - lens_s``: what the run spent outside the model and the analyzer).

    python bench/bench_fixed.py --layers 12 --d-model 768 --threads 2 --tokens 512 4096 \\
        --before /path/to/older/checkout --json bench/fixed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--tokenizer",
        default="bpe",
        choices=["bpe", "byte"],
        help="bpe (default): a GPT-2-sized byte-level BPE of --vocab tokens built here; byte: "
        "lensdiv's byte tokenizer (bench_floor.py's)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds per tree")
    parser.add_argument("--parts-repeats", type=int, default=5, help="best of, per part, a round")
    parser.add_argument("--before", help="an older checkout (its root) to measure alongside")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the tree a worker measures
    return parser.parse_args()


# -- the worker: one tree, one model, a round at a time ---------------------------------------


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _best(fn: Callable[[], Any], n: int) -> float:
    return min(_timed(fn)[0] for _ in range(n))


def _optional(module: str, name: str) -> Any:
    """``module.name`` in the tree measured, or ``None`` where that tree has no such thing."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def bpe_tokenizer(vocab: int) -> Any:
    """A fast byte-level BPE of ``vocab`` tokens with no download: GPT-2's pre-tokenizer and byte
    alphabet, then merges of two bytes in a fixed order, and ``<|endoftext|>`` last (BOS, EOS
    and pad, as GPT-2's) — what copying and hashing a GPT-2 tokenizer costs, not its merges."""
    import itertools

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    ids = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a, b in itertools.product(alphabet, alphabet):
        if len(ids) >= vocab - 1:
            break
        ids[a + b] = len(ids)
        merges.append((a, b))
    ids["<|endoftext|>"] = len(ids)
    core = Tokenizer(models.BPE(vocab=ids, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    end = "<|endoftext|>"
    folder = tempfile.mkdtemp(prefix="bench_fixed_bpe_")  # loaded from a folder, as a hub one is
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token=end, eos_token=end).save_pretrained(
        folder
    )
    return PreTrainedTokenizerFast.from_pretrained(folder)


def worker(args: argparse.Namespace) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from bench_floor import build_gpt2, floor

    from lensdiv import DataSpec, analyze
    from lensdiv.core.analyzer import ModelInfo
    from lensdiv.data.sources import token_batches
    from lensdiv.ops.capture import capture

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = build_gpt2(args.layers, args.d_model, args.vocab).eval()
    if args.tokenizer == "bpe":
        model.tokenizer = bpe_tokenizer(args.vocab)
    tokenizer = model.tokenizer
    info = ModelInfo.from_model(model)
    specs = {
        n: DataSpec(max_tokens=n, seq_len=args.seq_len, batch_size=args.batch_size)
        for n in args.tokens
    }
    batches = {n: list(token_batches(spec, tokenizer)) for n, spec in specs.items()}
    ids = {n: torch.cat([b.tokens for b in bs]) for n, bs in batches.items()}
    tiny = DataSpec(max_tokens=32, seq_len=16, batch_size=2)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]

    check_runs = _optional("lensdiv.run.validate", "check_runs")
    versions = _optional("lensdiv.core.provenance", "versions")
    private_copy = _optional("lensdiv.data.prefetch", "_private_copy")
    tokenizer_identity = _optional("lensdiv.data.cache", "tokenizer_identity")
    entry_key = _optional("lensdiv.data.cache", "entry_key")
    ready_batches = _optional("lensdiv.data.prefetch", "ready_batches")

    def cache_key() -> None:
        identity = tokenizer_identity(tokenizer)
        if entry_key is not None and identity is not None:
            entry_key({"kind": "builtin", "seed": 0}, identity)

    parts: dict[str, Callable[[], Any] | None] = {
        "probe": None if check_runs is None else lambda: check_runs(model, info),
        "probe forward": lambda: capture(model, torch.arange(8)[None], names, need_logits=True),
        "versions": versions,
        "tokenizer copy": None if private_copy is None else lambda: private_copy(tokenizer),
        "cache key": None if tokenizer_identity is None else cache_key,
    }
    for n, spec in specs.items():
        parts[f"data cached, {n}"] = lambda spec=spec: list(token_batches(spec, tokenizer))
        parts[f"data read ahead, {n}"] = (
            None
            if ready_batches is None
            else lambda spec=spec: list(ready_batches(spec, tokenizer))
        )
    splits: dict[str, dict[str, float]] = {}

    def run(name: str, data: Any, max_tokens: int) -> Callable[[], None]:
        def go() -> None:
            kwargs = {} if isinstance(data, DataSpec) else {"max_tokens": max_tokens}
            result = analyze(model, data=data, plugins="lens", progress=False, **kwargs)
            assert result.ok, result.errors
            t = result.manifest["timings"]
            outside = t["total_s"] - t.get("forward_s", 0.0) - t.get("lens_s", 0.0)
            splits[name] = {**t, "outside_s": round(outside, 4)}

        return go

    cases: dict[str, Callable[[], None]] = {"run fixed": run("run fixed", tiny, 32)}
    for n in args.tokens:
        cases[f"floor, {n}"] = floor(model, batches[n])
        cases[f"lens, spec, {n}"] = run(f"lens, spec, {n}", specs[n], n)
        cases[f"lens, ids, {n}"] = run(f"lens, ids, {n}", ids[n], n)
    for fn in [*(p for p in parts.values() if p is not None), *cases.values()]:
        fn()  # warm-up: the token cache, lazy imports, first-call allocations, per-model checks
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        out: dict[str, Any] = {"parts_s": {}, "wall_s": {}, "cpu_s": {}}
        for name, fn in parts.items():
            out["parts_s"][name] = None if fn is None else _best(fn, args.parts_repeats)
        for name, fn in cases.items():
            out["wall_s"][name], out["cpu_s"][name] = _timed(fn)
        out["splits"] = dict(splits)
        out["load_average"] = [round(x, 2) for x in os.getloadavg()]
        print(json.dumps(out), flush=True)


# -- the parent: workers for each tree, rounds interleaved -------------------------------------


def _commit(tree: Path) -> str:
    """The commit a tree holds (``+changes`` if its files differ from it), not its path."""
    try:
        head = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+changes" if dirty else "")


def _start(tree: Path, args: argparse.Namespace, cache: str) -> subprocess.Popen[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree)]
    for flag in ("layers", "d_model", "vocab", "seq_len", "batch_size", "threads", "tokenizer"):
        argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    argv += ["--parts-repeats", str(args.parts_repeats), "--tokens", *map(str, args.tokens)]
    env = {**os.environ, "PYTHONPATH": str(tree), "LENSDIV_TOKEN_CACHE": cache}
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    return proc


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"a worker stopped (exit {proc.wait()})")
    return json.loads(line)


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The best of each figure over the rounds; ratios from the best; the best run's splits."""
    out: dict[str, Any] = {}
    for key in ("parts_s", "wall_s", "cpu_s"):
        out[key] = {
            name: None
            if rounds[0][key][name] is None
            else round(min(r[key][name] for r in rounds), 4)
            for name in rounds[0][key]
        }
    best_round = {
        name: min(rounds, key=lambda r, name=name: r["wall_s"][name])
        for name in rounds[0]["splits"]
    }
    out["splits"] = {name: r["splits"][name] for name, r in best_round.items()}
    out["load_average"] = [r["load_average"] for r in rounds]
    return out


def _ratios(figures: dict[str, Any], tokens: list[int]) -> dict[str, float]:
    out = {}
    for n in tokens:
        for clock in ("wall", "cpu"):
            seconds = figures[f"{clock}_s"]
            for data in ("spec", "ids"):
                out[f"{clock}: lens, {data} / floor, {n}"] = round(
                    seconds[f"lens, {data}, {n}"] / seconds[f"floor, {n}"], 3
                )
    return out


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    trees = {"after": HERE.parent}
    if args.before:
        trees = {"before": Path(args.before).resolve(), **trees}
    cache = tempfile.mkdtemp(prefix="bench_fixed_tokens_")  # the same warm cache for both trees
    procs = {name: _start(tree, args, cache) for name, tree in trees.items()}
    try:
        for proc in procs.values():
            _read(proc)  # built and warmed up
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in procs}
        for _ in range(args.repeats):
            for name, proc in procs.items():  # one round each, in turn
                assert proc.stdin is not None
                proc.stdin.write("round\n")
                proc.stdin.flush()
                rounds[name].append(_read(proc))
    finally:
        for proc in procs.values():
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait()
    import torch

    figures: dict[str, Any] = {
        "model": f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab} "
        "(random Hugging Face GPT-2)",
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "threads": args.threads,
        "tokenizer": args.tokenizer,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "trees": {name: _commit(tree) for name, tree in trees.items()},
    }
    for name in procs:
        merged = _merge(rounds[name])
        figures[name] = {"ratios": _ratios(merged, args.tokens), **merged}
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
