"""Benchmark: does fitting every cross-model linear map cost less than collecting the activations?

Builds two random GPT-2-architecture Hugging Face models with the same (byte) tokenizer — by
default a 12-layer d_model=512 source and a 24-layer d_model=768 target — saves them locally and
drives the ``linmap`` analyzer the way the runner does, timing each stage separately:

- *collect* (pass 0): the source's forward pass (``capture``) and ``update``, which runs the
  target's forward pass and accumulates the float64 moments of all (s, j) pairs;
- *fit*: ``start_pass`` — one ridge solve per source state for all target states at once;
- *evaluate* (pass 1): both forward passes again and the held-out scores.

The target's forward pass is also timed on its own, to split *collect* into forwards and moment
accumulation. Acceptance (issue 4): fit ≤ collect.

    python bench/bench_linmap.py [--src-layers 12 --src-width 512 --tgt-layers 24 --tgt-width 768]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import data_spec, gpt2_config, report
from transformers import AutoModelForCausalLM

from lensdiv.analyzers.linmap import LinearMaps, moment_gb
from lensdiv.core.analyzer import ModelInfo, RunContext, Step
from lensdiv.data.sources import token_batches
from lensdiv.data.tokenizer import VOCAB_SIZE, byte_tokenizer
from lensdiv.models.load import load_model
from lensdiv.ops.capture import capture


def save_model(directory: Path, layers: int, width: int, seed: int) -> Path:
    """A random GPT-2-config model (fp32, no dropout) plus the byte tokenizer, saved locally."""
    config = gpt2_config(layers, width, VOCAB_SIZE)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src-layers", type=int, default=12)
    parser.add_argument("--src-width", type=int, default=512)
    parser.add_argument("--tgt-layers", type=int, default=24)
    parser.add_argument("--tgt-width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    root = Path(tempfile.mkdtemp(prefix="bench-linmap-"))
    src_dir = save_model(root / "src", args.src_layers, args.src_width, seed=0)
    tgt_dir = save_model(root / "tgt", args.tgt_layers, args.tgt_width, seed=1)
    source = load_model(str(src_dir), device="cpu")
    info = ModelInfo.from_model(source, name="source")
    analyzer = LinearMaps(target=str(tgt_dir))
    resource = analyzer.setup(source, info)  # loads the target, checks the tokenizers
    context = RunContext(source, info, {analyzer.name: resource})
    target = load_model(str(tgt_dir), device="cpu")  # a copy, for timing its forward alone
    batches = list(token_batches(data_spec(args), source.tokenizer))
    hooks = analyzer.hooks(info)
    capture(source, batches[0].tokens, hooks, need_logits=False)  # warm-up
    seconds = {"source_forward": 0.0, "update_pass0": 0.0, "fit": 0.0, "evaluate": 0.0}

    state = analyzer.init(info)
    for index in (0, 1):
        context.pass_index = index
        if index == 1:
            state.freeze()  # what the runner does at a pass boundary
            seconds["fit"] = timed(lambda: analyzer.start_pass(state, info, 1))
        for batch in batches:
            t0 = time.perf_counter()
            _, cache = capture(source, batch.tokens, hooks, need_logits=False)
            t1 = time.perf_counter()
            context.pass_index = index
            step = Step(batch, cache, None, context=context)
            analyzer.update(state, step)
            t2 = time.perf_counter()
            if index == 0:
                seconds["source_forward"] += t1 - t0
                seconds["update_pass0"] += t2 - t1
            else:
                seconds["evaluate"] += t2 - t0
    seconds["finalize"] = timed(lambda: analyzer.finalize(state, info))
    tgt_info = ModelInfo.from_model(target)
    names = [tgt_info.resid(j) for j in range(tgt_info.n_layers + 1)]
    seconds["target_forward"] = sum(
        timed(lambda b=b: capture(target, b.tokens, names, need_logits=False)) for b in batches
    )
    collect = seconds["source_forward"] + seconds["update_pass0"]
    seconds["collect"] = collect
    seconds["moments"] = seconds["update_pass0"] - seconds["target_forward"]
    n_tokens = sum(b.n_tokens for b in batches)
    result = analyzer.finalize(state, info)
    figures = {
        "source": f"{args.src_layers} layers, d_model {args.src_width} (random GPT-2 config)",
        "target": f"{args.tgt_layers} layers, d_model {args.tgt_width} (random GPT-2 config)",
        "tokens": n_tokens,
        "train_positions": result.meta["train_positions"],
        "eval_positions": result.meta["eval_positions"],
        "pairs": (args.src_layers + 1) * (args.tgt_layers + 1),
        "moment_gb": round(
            moment_gb(args.src_layers + 1, args.src_width, args.tgt_layers + 1, args.tgt_width), 3
        ),
        "threads": torch.get_num_threads(),
        "seconds": {k: round(v, 3) for k, v in seconds.items()},
        "fit_over_collect": round(seconds["fit"] / collect, 3),
        "collect_ms_per_token": round(1000 * collect / n_tokens, 3),
        "break_even_tokens": round(seconds["fit"] / (collect / n_tokens)),
    }
    shutil.rmtree(root, ignore_errors=True)  # the saved models (hundreds of MB)
    report(figures, args.json)


if __name__ == "__main__":
    main()
