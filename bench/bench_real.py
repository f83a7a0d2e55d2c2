"""Benchmark: each analyzer on a real model against the floor of its work.

A real pretrained model of lensdiv's catalog (``smollm2-135m``: Llama, 30 layers, vocabulary
49152; ``gemma3-270m``: Gemma 3, 18 layers, vocabulary 262144; dequantized from GGUF), on the
same rows of Python's documentation (``pydoc_data``), one process, interleaved rounds, best of
``--repeats`` after a warm-up. The floor of each analyzer is built from pieces measured here
with Hugging Face's own modules, nothing of lensdiv's:

- ``stack``: the model's decoder stack on the rows (``model.model(ids)``: embedding and every
  block, no unembedding), the unit every pass pays; ``stack_attn``: the same returning every
  layer's attention weights (eager attention: what ``sinks`` reads);
- ``readout``: one state of every row read out — the final norm, the unembedding product (with
  the ``[d_model, vocab]`` matrix made contiguous once) into a preallocated buffer and one
  log-partition per row, in place —, and ``readout_kl``: the same
  plus the KL to the clean output's distribution (one dot product per row more); each timed in
  row blocks of 64, 256 and 512, and in row blocks of 256 and 512 with the vocabulary in tiles
  of ``TILE_ELEMENTS / rows`` columns (each tile's logits read back from the cache, its
  log-partition merged across tiles by ``logaddexp``: what lensdiv's readout does on a CPU);
  the fastest taken.

lensdiv runs with ``LENSDIV_FUSED=1`` (unless the environment says otherwise): its readout's
row sums from the first logit by the fused kernel, as a long run has them after its first
2^32 logits (``lensdiv/ops/fused.py``); the kernel is compiled in the warm-up round.

Floors (``L`` blocks; a block costs ``stack / L``, so a pass resumed at block ``ℓ`` costs
``(L − ℓ) · stack / L``):

- ``lens``: ``stack + (L + 1) · readout``;
- ``contrib``: ``stack``;
- ``sinks`` (truth on, the default): ``stack_attn + Σ_{ℓ<L} (L − ℓ) · stack / L + readout +
  L · readout_kl`` (the sink of each layer removed and the pass resumed from that layer; the
  clean output read once, the reference of every KL);
- ``massive`` (truth on): ``2 · stack + 2 · (L − a) · stack / L + readout + 2 · readout_kl``
  with ``a`` the residual state where the massive entries appear (a pass for the statistics and
  the data's means, a second for the zero and mean edits; the clean output read once);
- ``skip`` and ``prune`` are reported as seconds with their planned work, not as ratios.

    python bench/bench_real.py smollm2-135m [--tokens 1024 --seq-len 256 --threads 2
                                              --json bench/real_smollm2_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch
from common import best_of, report

from lensdiv import analyze
from lensdiv.models.load import load_model
from lensdiv.ops.readout import TILE_ELEMENTS


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="smollm2-135m or gemma3-270m (or any model spec)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--plugins", default="lens,contrib,sinks,massive", help="analyzers timed one by one"
    )
    parser.add_argument("--extra", default="skip,prune", help="timed once, no floor ratio")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def pydoc_rows(tokenizer: Any, tokens: int, seq_len: int) -> torch.Tensor:
    """Rows of ``seq_len`` tokens (BOS first) of the Python documentation, ``tokens`` in all."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    per_row = seq_len - 1
    rows = max(1, tokens // seq_len)
    bos = tokenizer.bos_token_id
    body = torch.tensor(ids[: rows * per_row]).view(rows, per_row)
    return torch.cat([torch.full((rows, 1), bos), body], 1)


#: Row blockings of the floor's readout, whole rows and in vocabulary tiles; the floor takes the
#: fastest.
READOUT_BLOCKS = (64, 256, 512)
TILED_BLOCKS = (256, 512)


def pieces(hf: Any, rows: torch.Tensor, batch: int) -> dict[str, Any]:
    """The floor's pieces, measured with the Hugging Face modules alone."""
    base = hf.model
    norm, head = base.norm, hf.get_output_embeddings()
    W = head.weight
    batches = rows.split(batch)

    def stack() -> None:
        for b in batches:
            base(b)

    def stack_attn() -> None:
        for b in batches:
            base(b, output_attentions=True)

    hidden = [base(b).last_hidden_state for b in batches]
    # the clean output's probabilities, made once (a run has them from its clean pass)
    p = [torch.softmax(norm(h) @ W.T, -1).reshape(-1, W.shape[0]) for h in hidden]

    V = W.shape[0]
    # The unembedding also as a contiguous [d_model, vocab] matrix (TransformerLens' W_U layout):
    # the product with it, not with the transposed view, is what a readout can do at best.
    WT = W.T.contiguous()

    def readout(kl: bool, block: int) -> Any:
        """Per row: logits, their log-partition and, for the KL to the clean output,
        ``Σ p log p`` (once per row, not counted) minus ``Σ p · logits`` plus the partition —
        in blocks of ``block`` rows written into one preallocated buffer, the log-partition in
        place (no vocabulary-wide temporary beyond the buffer and, for the KL, the product's).
        ``exp`` takes its fast path (arguments raised to −87 first), as lensdiv's does."""
        buffer = torch.empty(block, V, dtype=W.dtype)
        product = torch.empty(block, V, dtype=W.dtype) if kl else buffer

        def run() -> None:
            for h, ref in zip(hidden, p, strict=True):
                flat = h.reshape(-1, h.shape[-1])
                for i in range(0, flat.shape[0], block):
                    x = norm(flat[i : i + block])
                    logits = buffer[: x.shape[0]]
                    torch.mm(x, WT, out=logits)
                    if kl:  # Σ p · logits, one dot product per row
                        torch.mul(ref[i : i + block], logits, out=product[: x.shape[0]]).sum(-1)
                    top = logits.amax(-1, keepdim=True)
                    # exp's fast path: arguments below −87 (results under float32's normal range)
                    # cost x86 45x more, and their terms are 0 to float32 beside the row's e^0
                    logits.sub_(top).clamp_min_(-87.0).exp_().sum(-1).log_().add_(top[:, 0])

        return run

    def tiled(kl: bool, block: int) -> Any:
        """:func:`readout` with the vocabulary in tiles of ``TILE_ELEMENTS / block`` columns
        (each tile's logits read back from the cache, as lensdiv's readout reads them): per
        tile the product into one buffer, its part of ``Σ p · logits`` and of the
        log-partition (its own maximum, merged across tiles by ``logaddexp``)."""
        width = max(64, TILE_ELEMENTS // block)
        buffer = torch.empty(block, width, dtype=W.dtype)
        product = torch.empty(block, width, dtype=W.dtype)

        def run() -> None:
            for h, ref in zip(hidden, p, strict=True):
                flat = h.reshape(-1, h.shape[-1])
                for i in range(0, flat.shape[0], block):
                    x = norm(flat[i : i + block])
                    lse = None
                    for c in range(0, V, width):
                        logits = buffer[: x.shape[0], : min(width, V - c)]
                        torch.mm(x, WT[:, c : c + width], out=logits)
                        if kl:
                            part = ref[i : i + block, c : c + width]
                            torch.mul(part, logits, out=product[: x.shape[0], : part.shape[1]])
                            product[: x.shape[0], : part.shape[1]].sum(-1)
                        top = logits.amax(-1, keepdim=True)
                        z = logits.sub_(top).clamp_min_(-87.0).exp_().sum(-1).log_().add_(top[:, 0])
                        lse = z if lse is None else torch.logaddexp(lse, z)

        return run

    # The floor's readout is the fastest of these blockings (what the machine's caches like).
    return {
        "stack": stack,
        "stack_attn": stack_attn,
        **{f"readout_{b}": readout(False, b) for b in READOUT_BLOCKS},
        **{f"readout_kl_{b}": readout(True, b) for b in READOUT_BLOCKS},
        **{f"readout_tiled_{b}": tiled(False, b) for b in TILED_BLOCKS},
        **{f"readout_kl_tiled_{b}": tiled(True, b) for b in TILED_BLOCKS},
    }


def _appears(layers: Any) -> float:
    """The mean residual state at which ``massive``'s truth intervened (batches counted), or 0
    when it did not run (the floor then counts every block: the largest it can be)."""
    if layers is None:
        return 0.0
    counts = torch.as_tensor(layers, dtype=torch.float64)
    total = float(counts.sum())
    return float((counts * torch.arange(len(counts))).sum() / total) if total else 0.0


def main() -> None:
    args = parse()
    os.environ.setdefault("LENSDIV_FUSED", "1")  # what a long run reads with (see above)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    model = load_model(args.model, progress=False)
    hf = model.original_model
    if getattr(hf.config, "_attn_implementation", None) != "eager":
        hf.config._attn_implementation = "eager"  # what TransformerLens runs: weights explicit
    rows = pydoc_rows(model.tokenizer, args.tokens, args.seq_len)
    L = model.cfg.n_layers
    floor_cases = pieces(hf, rows, batch=4)
    seen: dict[str, dict[str, Any]] = {}

    def run(plugin: str) -> Any:
        def go() -> None:
            result = analyze(model, data=rows, plugins=[plugin], progress=False)
            seen[plugin] = {
                "ok": result.ok,
                "errors": {k: str(v) for k, v in result.errors.items()},
            }
            seen[plugin]["manifest"] = result.manifest.get("timings", {})
            if plugin == "massive" and "massive" in result.results:
                layers = result.results["massive"].meta.get("truth_layers")
                seen[plugin]["at"] = layers

        return go

    plugins = [p for p in args.plugins.split(",") if p]
    cases = {**floor_cases, **{p: run(p) for p in plugins}}
    for case in cases.values():  # warm-up
        case()
    best = best_of(cases, args.repeats)
    stack = best["stack"]
    readout = min(best[key] for key in best if key.startswith("readout_") and "_kl" not in key)
    readout_kl = min(best[key] for key in best if key.startswith("readout_kl_"))
    per_block = stack / L
    resumed = sum(L - layer for layer in range(L)) * per_block
    at = _appears(seen.get("massive", {}).get("at"))
    floors = {
        "lens": stack + (L + 1) * readout,
        "contrib": stack,
        "sinks": best["stack_attn"] + resumed + readout + L * readout_kl,
        "massive": 2 * stack + 2 * (L - at) * per_block + readout + 2 * readout_kl,
    }
    extra = {}
    for plugin in [p for p in args.extra.split(",") if p]:
        t0 = time.perf_counter()
        run(plugin)()
        extra[plugin] = round(time.perf_counter() - t0, 2)
    figures = {
        "model": args.model,
        "layers": L,
        "d_vocab": model.cfg.d_vocab,
        "tokens": int(rows.numel()),
        "seq_len": args.seq_len,
        "threads": torch.get_num_threads(),
        "lensdiv_fused": os.environ["LENSDIV_FUSED"],
        "load_average": os.getloadavg(),
        "pieces_s": {k: round(best[k], 3) for k in floor_cases},
        "seconds": {p: round(best[p], 3) for p in plugins},
        "floor_s": {p: round(floors[p], 3) for p in plugins if p in floors},
        "ratio": {p: round(best[p] / floors[p], 3) for p in plugins if p in floors},
        "massive_appears_at": round(at, 2),
        "extra_seconds": extra,
        "status": {p: {k: v for k, v in s.items() if k != "manifest"} for p, s in seen.items()},
    }
    report(figures, args.json)


if __name__ == "__main__":
    main()
