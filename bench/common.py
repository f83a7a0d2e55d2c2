"""What every benchmark here shares: the random model and data, the command line, timing, output.

Scripts run as ``python bench/NAME.py`` (this folder is then importable). Besides the pieces,
:func:`lens_plus_main` is the whole of a benchmark of ``lens`` fused with one more analyzer.
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
from transformer_lens import TransformerBridge
from transformer_lens.config import TransformerBridgeConfig

from lensdiv import Analyzer, DataSpec, analyze
from lensdiv.analyzers.lens import LogitLens
from lensdiv.data.sources import token_batches
from lensdiv.data.tokenizer import byte_tokenizer


def build(layers: int, d_model: int, vocab: int) -> Any:
    """A random TL-native model of GPT-2 shape (d_head 64, d_mlp 4·d_model, LayerNorm)."""
    cfg = TransformerBridgeConfig(
        d_model=d_model,
        d_head=64,
        n_heads=d_model // 64,
        n_layers=layers,
        n_ctx=1024,
        d_mlp=4 * d_model,
        d_vocab=vocab,
        act_fn="gelu",
        normalization_type="LN",
        seed=0,
    )
    # The byte tokenizer only packs the built-in corpus; its ids all lie below any vocab used here.
    return TransformerBridge.boot_native(cfg, tokenizer=byte_tokenizer()).eval()


def gpt2_config(layers: int, d_model: int, vocab: int) -> Any:
    """A Hugging Face GPT-2 config of this shape (d_head 64, no dropout, the byte tokenizer's
    special ids), for random models built from it."""
    from transformers import GPT2Config

    from lensdiv.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

    return GPT2Config(
        vocab_size=vocab,
        n_positions=1024,
        n_embd=d_model,
        n_layer=layers,
        n_head=d_model // 64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def model_parser(
    doc: str, *, tokens: int, batch_size: int, repeats: int, devices: bool = False
) -> argparse.ArgumentParser:
    """``--layers --d-model --vocab`` (24 × 1024, GPT-2's 50257), data sizes, ``--repeats``,
    ``--json``; with ``devices``, ``--device`` and ``--dtype`` (:func:`add_device`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if devices:
        add_device(parser)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--json", help="also write the figures to this file")
    return parser


def data_spec(args: argparse.Namespace) -> DataSpec:
    """The built-in corpus at the sizes of ``--tokens --seq-len --batch-size``."""
    return DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=args.batch_size)


def add_device(parser: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """``--device`` (where the model runs) and ``--dtype`` (its dtype; lensdiv's readouts stay
    float32 whatever it is)."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default: cpu)")
    parser.add_argument(
        "--dtype", default=dtype, help=f"the model's dtype: float32, bfloat16, float16 ({dtype})"
    )


def place(model: Any, args: argparse.Namespace) -> Any:
    """``model`` on ``--device`` in ``--dtype`` (as it is where the script has neither)."""
    device = getattr(args, "device", None)
    dtype = getattr(args, "dtype", None)
    if device is None and dtype is None:
        return model
    return model.to(device=device, dtype=getattr(torch, dtype) if dtype else None).eval()


def sync() -> None:
    """Wait for the GPU's queued work (timings on a GPU end there); nothing on a CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def device_name(device: Any) -> str:
    """The GPU's name on a CUDA device, else ``cpu``."""
    return torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "cpu"


def model_and_data(args: argparse.Namespace) -> tuple[Any, DataSpec]:
    """Gradients off; the random model of ``--layers --d-model --vocab`` (on ``--device`` in
    ``--dtype`` where the script has them) and :func:`data_spec`."""
    torch.set_grad_enabled(False)
    return place(build(args.layers, args.d_model, args.vocab), args), data_spec(args)


def model_device(model: Any) -> torch.device:
    """Where the model's weights are."""
    return next(model.parameters()).device


def plain_forward(model: Any, spec: DataSpec) -> Callable[[], None]:
    """A plain forward pass over the data (tokenised once, here, and moved to the model's
    device): the unit of cost."""
    device = model_device(model)
    batches = [b.tokens.to(device) for b in token_batches(spec, model.tokenizer)]

    def forward() -> None:
        for tokens in batches:
            model(tokens)

    return forward


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every figure file starts with (the device and dtype where the script has
    them)."""
    figures = {
        "model": f"{args.layers} layers, d_model {args.d_model}, vocab {args.vocab} (random)",
        "tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if hasattr(args, "device"):
        figures["device"] = device_name(args.device)
        figures["dtype"] = args.dtype
    return figures


def best_of(
    cases: dict[str, Callable[[], Any]],
    repeats: int,
    after: Callable[[str, Any], None] | None = None,
) -> dict[str, float]:
    """Best wall time of each case over ``repeats`` interleaved rounds (so a noisy neighbour
    does not decide a ratio); ``after(name, returned)`` sees every run's return value."""
    best = {name: float("inf") for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - t0)
            if after is not None:
                after(name, out)
    return best


def report(figures: dict[str, Any], path: str | None) -> None:
    """Print the figures as JSON, and write them to ``path`` if given."""
    print(json.dumps(figures, indent=1))
    if path:
        with open(path, "w") as fh:
            json.dump(figures, fh, indent=1)


def fused_overhead(model: Any, spec: Any, base: Any, extra: Any, repeats: int) -> dict[str, Any]:
    """Time ``base`` alone, ``extra`` alone and both fused (one forward pass per batch feeds
    both) on the same tokens, interleaved, best of ``repeats`` after a warm-up.

    Besides ``fused / base``, reports the fused run's own split, its total over its total less
    the seconds spent in ``extra`` (same tokens, same minute): immune to load drifting between
    runs on a shared machine.
    """
    timings: dict[str, dict[str, float]] = {}

    def run(*analyzers: Any) -> None:
        result = analyze(model, data=spec, plugins=list(analyzers), progress=False)
        assert result.ok, result.errors
        timings[",".join(a.name for a in analyzers)] = dict(result.manifest["timings"])

    fused = f"{base.name},{extra.name}"
    cases = {
        base.name: lambda: run(base),
        extra.name: lambda: run(extra),
        fused: lambda: run(base, extra),
    }
    run(base, extra)  # warm-up: first-call allocations, lazy imports, per-model checks
    in_run = [float("inf")]

    def split(name: str, _: object) -> None:
        if name == fused:
            total, own = timings[name]["total_s"], timings[name][f"{extra.name}_s"]
            in_run[0] = min(in_run[0], total / (total - own))

    best = best_of(cases, repeats, split)
    return {
        "seconds": {k: round(v, 3) for k, v in best.items()},
        f"fused_over_{base.name}": round(best[fused] / best[base.name], 3),
        f"fused_over_fused_without_{extra.name}": round(in_run[0], 3),
        "last_run_timings": timings,
    }


def lens_plus_main(
    doc: str,
    analyzer: type[Analyzer],
    option: str,
    *,
    tokens: int,
    figures: Callable[[argparse.Namespace], dict[str, Any]] = lambda args: {},
) -> None:
    """Time ``lens`` alone, ``analyzer`` alone and both fused (:func:`fused_overhead`); report.

    Args:
        doc: The script's docstring (its first line describes the command).
        analyzer: The analyzer class, built with its defaults but for ``option``.
        option: An integer option of the analyzer, set with ``--OPTION`` (hyphens for
            underscores) and reported with the figures.
        tokens: Default of ``--tokens``.
        figures: Figures of the script's own, reported after the settings.
    """
    parser = model_parser(doc, tokens=tokens, batch_size=4, repeats=2)
    flag = "--" + option.replace("_", "-")
    parser.add_argument(flag, type=int, default=None, help="default: the option's")
    args = parser.parse_args()
    model, spec = model_and_data(args)
    value = getattr(args, option)
    extra = analyzer() if value is None else analyzer(**{option: value})
    timings = fused_overhead(model, spec, LogitLens(), extra, args.repeats)
    report(
        {**describe(args), **figures(args), option: getattr(extra, option), **timings}, args.json
    )


def trials_main(
    doc: str,
    trials: dict[str, tuple[Any, ...]],
    run_trial: Callable[[str], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
) -> None:
    """The command line of a recorded search (``teacher_student_cpu.py``, ``toy_kb_search.py``):
    list the trials, run some (each record merged into ``--json`` by trial name), or print the
    table of a records file (``--markdown``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("trials", nargs="*", help="trial names (none: list them)")
    parser.add_argument("--json", help="merge the records into this file")
    parser.add_argument("--markdown", help="print the table of the records in this file")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(json.loads(Path(args.markdown).read_text())))
        return
    if not args.trials:
        for name, (what, *settings) in trials.items():
            print(f"{name}: {what}  {' '.join(map(str, settings))}")
        return
    for name in args.trials:
        if name not in trials:
            sys.exit(f"unknown trial {name!r}; known: {', '.join(trials)}")
        record = run_trial(name)
        print(json.dumps(record), flush=True)
        if args.json:
            _merge_record(Path(args.json), name, record)


def _merge_record(path: Path, name: str, record: dict[str, Any]) -> None:
    """Put ``record`` under ``name`` in the JSON file (locked: two trials may end together)."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        records = json.loads(path.read_text()) if path.exists() else {}
        records[name] = record
        path.write_text(json.dumps(records, indent=1) + "\n")
