"""Benchmark: fitted lenses — the Jacobian lens' fit (lensdiv vs TransformerLens, exact vs sketch),
the tuned lens' training throughput, and the lens' readout cost with a translator.

A random TL-native model of GPT-2 shape (``--layers``, ``--d-model``, ``--vocab``; the byte
tokenizer packs the built-in corpus). In one process, interleaved, best of ``--repeats``:

- **Jacobian lens, exact**: ``JacobianLens.fit`` (TransformerLens 4.3, on the prompts' text) and
  lensdiv's ``fit-jacobian`` (``exact``: TransformerLens' own per-prompt step, through
  ``lensdiv.analyze``) on the same ``--prompts`` rows of ``--seq-len`` tokens; the ratio is
  lensdiv's overhead (target ≤ 1.05), the maximum relative difference their agreement.
- **Jacobian lens, sketch**: ``estimator=sketch`` with ``probes`` = d/4, d/8, d/16, d/32 (its
  first batch of ``--batch-size`` prompts fitted exactly: the control variate): seconds, backward
  rows per prompt, and per layer the cosine and relative Frobenius error of ``J_l`` against the
  exact fit on the same prompts (target: ≥ 0.99 mean cosine at ≥ 4× less time).
- **Tuned lens**: training tokens/s (``--tuned-steps`` steps of ``--tuned-tokens``) against the
  model's plain forward tokens/s on the same batches.
- **Readout with a translator**: the ``lens`` analyzer through the logit lens and through a
  (random) tuned lens, and the floor of each: one caching forward, then per state [translator
  matmul,] final norm, unembedding, one log-softmax.

    python bench/bench_lenses.py [--layers 6 --d-model 256 --vocab 8192 --prompts 32]
    python bench/bench_lenses.py --only jacobian --device cuda --prompts 64   # on a GPU
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import build, describe, model_device, model_parser, place, report, sync

from lensdiv import DataSpec, analyze
from lensdiv.core.analyzer import ModelInfo
from lensdiv.data.corpus import builtin_documents
from lensdiv.data.sources import token_batches
from lensdiv.lenses.jacobian import JacobianFit, cosine
from lensdiv.lenses.tuned import TunedRecipe, train_tuned
from lensdiv.ops.capture import capture
from lensdiv.ops.lens_files import JACOBIAN_FILE, save_tuned
from lensdiv.ops.lens_specs import read_jacobian, read_tuned


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def jacobian_figures(model: Any, args: Any) -> dict[str, Any]:
    """TL's fit vs lensdiv's (exact), then the sketch at several probe counts."""
    from transformer_lens.tools.analysis import JacobianLens

    info = ModelInfo.from_model(model)
    d = info.d_model
    # Documents of the built-in corpus long enough for a full row; TL tokenises the text (with
    # BOS) and cuts it at max_seq_len, and lensdiv reads exactly those token rows.
    texts, text = [], ""
    for doc in builtin_documents(seed=1):  # documents joined until a prompt fills a row
        text = f"{text} {doc}".strip()
        if model.to_tokens(text).shape[1] >= args.seq_len:
            texts.append(text)
            text = ""
        if len(texts) == args.prompts:
            break
    tl_rows = torch.cat([model.to_tokens(t)[:, : args.seq_len] for t in texts]).cpu()  # data
    folder = Path(tempfile.mkdtemp(prefix="bench_lenses_"))

    def ours(**options: Any) -> Any:
        def run() -> Any:
            out = folder / f"run-{time.monotonic_ns()}"
            done = analyze(model, data=tl_rows, plugins=[JacobianFit(**options)], out=out,
                           progress=False, max_tokens=10**9, batch_size=args.batch_size)
            assert done.ok, done.errors
            return read_jacobian(out / "fit-jacobian" / JACOBIAN_FILE)

        return run

    def theirs() -> Any:
        return JacobianLens.fit(model, texts, corpus="bench", max_seq_len=args.seq_len,
                                show_progress=False)

    best: dict[str, float] = {}
    lenses: dict[str, Any] = {}
    cases: dict[str, Callable[[], Any]] = {"transformer_lens_fit": theirs, "lensdiv_exact": ours()}
    probes = [p for p in (d // 4, d // 8, d // 16, d // 32) if p >= 1]
    for k in probes:
        cases[f"sketch_{k}"] = ours(estimator="sketch", probes=k)
    for _ in range(args.repeats):
        for name, fn in cases.items():
            seconds, lens = timed(fn)
            best[name] = min(best.get(name, float("inf")), seconds)
            lenses[name] = lens
    exact, reference = lenses["lensdiv_exact"], lenses["transformer_lens_fit"]
    agreement = max(
        float((exact.maps[k + 1].weight - reference.jacobians[k]).norm()
              / reference.jacobians[k].norm())
        for k in reference.jacobians
    )
    sketch = {}
    for k in probes:
        lens = lenses[f"sketch_{k}"]
        cos = [cosine(lens.maps[i].weight, exact.maps[i].weight) for i in exact.maps]
        err = [float((lens.maps[i].weight - exact.maps[i].weight).norm()
                     / exact.maps[i].weight.norm()) for i in exact.maps]
        sketch[str(k)] = {
            "seconds": round(best[f"sketch_{k}"], 3),
            "speedup_over_exact": round(best["lensdiv_exact"] / best[f"sketch_{k}"], 2),
            "backward_rows_per_prompt": k,
            "mean_cosine": round(sum(cos) / len(cos), 5),
            "min_cosine": round(min(cos), 5),
            "mean_relative_frobenius_error": round(sum(err) / len(err), 4),
        }
    return {
        "prompts": args.prompts,
        "seq_len": args.seq_len,
        "exact": {
            "transformer_lens_fit_s": round(best["transformer_lens_fit"], 3),
            "lensdiv_exact_s": round(best["lensdiv_exact"], 3),
            "lensdiv_over_transformer_lens": round(
                best["lensdiv_exact"] / best["transformer_lens_fit"], 3),
            "backward_passes_per_prompt": -(-d // 8),
            "backward_rows_per_prompt": d,
            "max_relative_difference": agreement,
        },
        "sketch": sketch,
    }


def tuned_figures(model: Any, args: Any) -> dict[str, Any]:
    """Training tokens/s against the plain forward's, on the same batches."""
    info = ModelInfo.from_model(model)
    spec = DataSpec(max_tokens=args.tuned_steps * args.tuned_tokens, seq_len=args.seq_len,
                    batch_size=8)
    batches = list(token_batches(spec, model.tokenizer))
    recipe = TunedRecipe(steps=args.tuned_steps, tokens_per_step=args.tuned_tokens)
    tokens = sum(b.n_tokens for b in batches)
    device = model_device(model)

    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                model(batch.tokens.to(device))

    def train() -> Any:
        return train_tuned(model, info, lambda: iter(batches), recipe)[1]

    best = {"forward": float("inf"), "train": float("inf")}
    progress = None
    for _ in range(args.repeats):
        best["forward"] = min(best["forward"], timed(forward)[0])
        seconds, progress = timed(train)
        best["train"] = min(best["train"], seconds)
    assert progress is not None
    return {
        "steps": progress.steps,
        "tokens": tokens,
        "forward_tokens_per_s": round(tokens / best["forward"], 1),
        "train_tokens_per_s": round(tokens / best["train"], 1),
        "train_over_forward": round(best["train"] / best["forward"], 2),
        "final_kl_per_layer": [round(x, 4) for x in progress.loss or []],
    }


def readout_figures(model: Any, args: Any) -> dict[str, Any]:
    """``lens`` through the logit lens and a tuned lens, against each one's floor."""
    info = ModelInfo.from_model(model)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=8)
    device = model_device(model)
    rows = [b.tokens.to(device) for b in token_batches(spec, model.tokenizer)]
    folder = Path(tempfile.mkdtemp(prefix="bench_lenses_tuned_"))
    gen = torch.Generator().manual_seed(0)
    d = info.d_model
    save_tuned(folder, {i: torch.randn(d, d, generator=gen) * 0.02 for i in range(info.n_layers)},
               {i: torch.zeros(d) for i in range(info.n_layers)}, d_model=d,
               n_layers=info.n_layers, model_name="bench")
    tuned = read_tuned(folder)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]

    def floor(translate: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                for tokens in rows:
                    _, cache = capture(model, tokens, names, need_logits=False)
                    for index, name in enumerate(names):
                        h = cache[name]
                        if translate and index < info.n_layers:
                            found = tuned.maps[index]
                            weight, bias = found.weight.to(h), found.bias.to(h)
                            h = h + h @ weight.T + bias
                        torch.log_softmax(model.ln_final(h) @ model.W_U + model.b_U, dim=-1)

        return run

    def lens(how: Any) -> Callable[[], None]:
        def run() -> None:
            done = analyze(model, data=spec, plugins="lens", lens=how, progress=False)
            assert done.ok, done.errors

        return run

    cases = {"floor": floor(False), "lens": lens("logit"), "floor_translated": floor(True),
             "lens_tuned": lens(tuned)}
    for fn in cases.values():
        fn()  # warm-up
    best = {name: float("inf") for name in cases}
    for _ in range(args.repeats):
        for name, fn in cases.items():
            best[name] = min(best[name], timed(fn)[0])
    return {
        "seconds": {k: round(v, 3) for k, v in best.items()},
        "lens_over_floor": round(best["lens"] / best["floor"], 3),
        "lens_tuned_over_floor_translated": round(best["lens_tuned"] / best["floor_translated"], 3),
        "lens_tuned_over_lens": round(best["lens_tuned"] / best["lens"], 3),
    }


def main() -> None:
    parser = model_parser(__doc__, tokens=2048, batch_size=4, repeats=2, devices=True)
    parser.set_defaults(layers=6, d_model=256, vocab=8192, seq_len=64)
    # The sketch fits its first batch exactly (the control variate): 64 prompts in batches of 4
    # leave 60 sketched.
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tuned-steps", type=int, default=8)
    parser.add_argument("--tuned-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=["jacobian", "tuned", "readout"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = place(build(args.layers, args.d_model, args.vocab), args)
    figures: dict[str, Any] = {**describe(args), "threads": args.threads}
    parts = {"jacobian": jacobian_figures, "tuned": tuned_figures, "readout": readout_figures}
    for name, part in parts.items():
        if args.only in (None, name):
            figures[name] = part(model, args)
    report(figures, args.json)


if __name__ == "__main__":
    main()
