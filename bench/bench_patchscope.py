"""Benchmark: the ``lens`` analyzer through the patchscope lens against its floor, and against
the peers' way of computing Patchscopes.

Builds a random Hugging Face GPT-2 from a config (``--layers --d-model``; the byte tokenizer's
vocabulary) and times, on the same batches (``--tokens`` in rows of ``--seq-len``):

- ``lens_patchscope``: ``analyze(model, data, plugins="lens", lens="patchscope")`` — the clean
  pass, every state ``h_0..h_{L-1}`` of every position patched into the token-identity prompt
  at ``ℓ* = ℓ`` and run on against the prompt's cached prefix, the readout and statistics of
  ``L + 1`` states per token, the result;
- the *floor*, from its own pieces: the clean pass (the ``L + 1`` states captured); the block
  floor ``Σ_ℓ Σ_{k ≥ ℓ} u_k(T)`` — ``u_k(T)``: block ``k``'s operations and no others
  (:func:`floor_block`, written here from Hugging Face's weights: the norms, the four weight
  products, the attention against the prefix held once — checked against the exact
  continuation), on ``T`` one-token rows in a tight loop, best of
  ``--tight`` calls and of the rounds; and the readout floor: final norm, unembedding and a
  float32 log-softmax of every one of the ``(L + 1) · T`` rows, in the blocks of rows the
  readout uses. ``floor_ratio`` = ``lens_patchscope`` over the floor (target ≤ 1.3); the lens
  and each piece of the floor measured in turn, ``--rounds`` times, the best of each kept.
  The block floor is the fastest of two ways per block (:func:`blocks_floor`): ``k + 1``
  calls of ``T`` rows, or one call of all ``(k + 1) · T`` (a sweep, as the lens runs few rows);
- ``nnterp_work`` (:func:`prompts_work`): the work issue 45 names — nnterp's
  ``patchscope_lens`` on ``--prompts`` 16 source prompts, the last position, every layer, one
  thread, GPT-2 small's blocks (12 layers, d_model 768) — against its floor: the source
  passes, the block floor and the readout floor;
- ``peers``: the way Patchscopes are computed elsewhere (nnterp's ``patchscope_lens``, the
  TransformerLens demo): one forward pass of the whole inspection prompt per layer and per
  source position, a hook writing the state at the patch position, then the same readout;
  against ``ours`` (:meth:`~lensdiv.ops.blocklens.PatchscopeLens.read_all` and the same readout)
  for the last position of 16 prompts at every layer, and for every (layer, position) of one
  ``--sequence``-token sequence;
- ``memory``: peak RSS of the ``lens_patchscope`` run in a fresh process at ``--tokens`` and at
  4× as many (memory flat in tokens: their ratio).

    python bench/bench_patchscope.py [--layers 6 --d-model 256 --tokens 512 --sequence 256]
        [--prompts 16 --prompt-layers 12 --prompt-d-model 768 --prompt-threads 1 | --skip-prompts]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lensdiv import analyze
from lensdiv.core.analyzer import ModelInfo
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.blocklens import PatchscopeLens
from lensdiv.ops.capture import capture
from lensdiv.ops.inspection import Inspection, inspection
from lensdiv.ops.readout import block_rows, final_readout
from lensdiv.testing.models import boot_tiny, tiny_config


def build(layers: int, d_model: int, n_ctx: int = 512) -> Any:
    """A random GPT-2 of this shape (the byte tokenizer), ``n_ctx`` positions."""
    from transformers import AutoModelForCausalLM

    from lensdiv.data.tokenizer import byte_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="bench-patchscope-")) / "gpt2"
    config = tiny_config("gpt2", n_layers=layers, d_model=d_model)
    config.n_positions = n_ctx
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    model = boot_tiny("gpt2", folder)
    _FOLDERS[id(model)] = folder
    return model


_FOLDERS: dict[int, Path] = {}


def hf_layers(model: Any) -> list[Any]:
    """The layers of the same weights loaded by Hugging Face alone (no TransformerLens inside:
    the floor's blocks are the model's own modules as Hugging Face runs them)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(_FOLDERS[id(model)], attn_implementation="eager")
    return list(hf.eval().transformer.h)


def batches(model: Any, tokens: int, seq_len: int) -> list[torch.Tensor]:
    spec = DataSpec(max_tokens=tokens, seq_len=seq_len, batch_size=8)
    return [b.tokens for b in token_batches(spec, model.tokenizer)]


def best(fn: Any, repeats: int) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - start)
    return out


def states_of(model: Any, tokens: torch.Tensor) -> list[torch.Tensor]:
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    with torch.no_grad():
        _, cache = capture(model, tokens, names, need_logits=False)
    return [cache[name].reshape(-1, info.d_model) for name in names]


def readout_rows(model: Any, h: torch.Tensor) -> None:
    readout = final_readout(model)
    step = block_rows(readout.d_vocab)
    for lo in range(0, h.shape[0], step):
        torch.log_softmax(readout.logits(h[lo : lo + step]), -1)


def floor_block(layer: Any, x: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor) -> torch.Tensor:
    """A GPT-2 block (Hugging Face's weights) on ``T`` one-token rows ``x`` ``[T, d]`` against
    the prefix's keys and values ``[1, heads, j, d_head]`` held once: its operations and no
    others — the norms, the four products with the weights, each head's scores against the
    prefix and its weighted values as one product over all rows, the row's own key and value
    as a dot product."""
    attn, mlp = layer.attn, layer.mlp
    T, d = x.shape
    heads = attn.num_heads
    a = F.layer_norm(x, (d,), layer.ln_1.weight, layer.ln_1.bias, layer.ln_1.eps)
    q, k, v = (t.view(T, heads, -1).transpose(0, 1)
               for t in torch.addmm(attn.c_attn.bias, a, attn.c_attn.weight).split(d, dim=1))
    s = torch.cat([torch.bmm(q, keys[0].transpose(1, 2)), (q * k).sum(-1, keepdim=True)], -1)
    p = torch.softmax(s * q.shape[-1] ** -0.5, -1)
    o = torch.bmm(p[..., :-1], values[0]) + p[..., -1:] * v
    x = x + torch.addmm(attn.c_proj.bias, o.transpose(0, 1).reshape(T, d), attn.c_proj.weight)
    m = F.layer_norm(x, (d,), layer.ln_2.weight, layer.ln_2.bias, layer.ln_2.eps)
    hidden = mlp.act(torch.addmm(mlp.c_fc.bias, m, mlp.c_fc.weight))
    return x + torch.addmm(mlp.c_proj.bias, hidden, mlp.c_proj.weight)


def block_units(model: Any, rows: list[int], repeats: int) -> list[float]:
    """``u_k(rows[k])``: block ``k``'s floor (:func:`floor_block`) on ``rows[k]`` one-token
    rows, first checked against the exact continuation (the whole prompt re-run per state)."""
    found = inspection(model, PatchscopeLens().prompt, -1)
    layers = hf_layers(model)
    exact = Inspection(model, PatchscopeLens().prompt, -1, fast=False)
    h = found.clean[1][:8]  # states the prompt's last position has not seen
    with torch.no_grad():
        x = h
        for k in range(1, len(layers)):
            x = floor_block(layers[k], x, *found.prefix[k])
        want = exact.run(1, h)
    error = float((x - want).abs().max() / want.abs().max())
    # float32 rounding of another order of operations, through up to 11 random blocks
    assert error < 1e-3, f"the floor's block is not the model's: {error:.2g} relative"
    units = []
    for k, layer in enumerate(layers):
        x = found.clean[0][-1].expand(rows[k], -1).clone()

        def call(layer: Any = layer, k: int = k, x: torch.Tensor = x) -> None:
            with torch.no_grad():
                floor_block(layer, x, *found.prefix[k])

        units.append(best(call, repeats))
    return units


def blocks_floor(model: Any, rows: int, repeats: int) -> float:
    """The floor of the continuations' block evaluations for ``rows`` states of each
    ``h_ℓ`` (``ℓ < L``): block ``k`` evaluates ``(k + 1) · rows`` one-token rows, timed the
    fastest of two ways: ``k + 1`` calls of ``rows`` (one start at a time) or one call of
    all of them (a sweep)."""
    L = int(model.cfg.n_layers)
    apart = block_units(model, [rows] * L, repeats)
    swept = block_units(model, [(k + 1) * rows for k in range(L)], repeats)
    return sum(min((k + 1) * a, b) for k, (a, b) in enumerate(zip(apart, swept, strict=True)))


def peers(model: Any, found: Any, sources: list[tuple[int, torch.Tensor]]) -> None:
    """One forward of the whole inspection prompt per (layer, state), then the readout."""
    L = found.n_layers
    finals = []
    for layer, h in sources:
        kept: dict[str, torch.Tensor] = {}

        def patch(t: torch.Tensor, hook: Any, h: torch.Tensor = h) -> torch.Tensor:
            t[:, found.position] = h.to(t)
            return t

        def keep(t: torch.Tensor, hook: Any, kept: dict = kept) -> torch.Tensor:
            kept["h"] = t[0, -1]
            return t

        hooks = [(f"blocks.{layer}.hook_resid_pre", patch),
                 (f"blocks.{L - 1}.hook_resid_post", keep)]
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            model(found.tokens)
        finals.append(kept["h"])
    readout_rows(model, torch.stack(finals))


def ours(model: Any, found: Any, states: list[torch.Tensor], rows: torch.Tensor) -> None:
    with torch.no_grad():
        out = PatchscopeLens().read_all(found, states, rows)
        readout_rows(model, torch.cat(list(out.values())))


def compare(model: Any, states: list[torch.Tensor], rows: torch.Tensor, repeats: int) -> dict:
    found = inspection(model, PatchscopeLens().prompt, -1)
    L = found.n_layers
    sources = [(layer, states[layer][r]) for layer in range(L) for r in rows.tolist()]
    t_peers = best(lambda: peers(model, found, sources), max(1, repeats // 2))
    t_ours = best(lambda: ours(model, found, states, rows), repeats)
    return {"states": len(sources), "peers_s": t_peers, "ours_s": t_ours,
            "speedup": t_peers / t_ours}


def prompts_work(args: argparse.Namespace) -> dict[str, Any]:
    """The work of nnterp's ``patchscope_lens`` as issue 45 states it: ``--prompts`` source
    prompts of ``--seq-len`` tokens, the last position, every layer, on a random GPT-2 of
    ``--prompt-layers`` layers and width ``--prompt-d-model`` (12 and 768: GPT-2 small's
    blocks; the byte tokenizer's vocabulary), ``--prompt-threads`` threads. The lens: the
    source passes, :meth:`PatchscopeLens.read_all` and the readout of every state; its floor:
    the same source passes, :func:`blocks_floor` and the readout floor. Each round measures
    the lens and then its floor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.prompt_threads)
    try:
        model = build(args.prompt_layers, args.prompt_d_model)
        L, n = int(model.cfg.n_layers), args.prompts
        prompts = torch.cat(batches(model, n * args.seq_len, args.seq_len))[:n]
        found = inspection(model, PatchscopeLens().prompt, -1)
        rows = torch.arange(n)

        def lens() -> None:
            states = [s.reshape(n, args.seq_len, -1)[:, -1] for s in states_of(model, prompts)]
            ours(model, found, states, rows)

        rounds = []
        for _ in range(args.rounds):
            lens_s = best(lens, args.repeats)
            clean = best(lambda: states_of(model, prompts), args.repeats)
            blocks = blocks_floor(model, n, args.tight)
            h = torch.randn(L * n, int(model.cfg.d_model))
            readout = best(lambda h=h: readout_rows(model, h), args.repeats)
            floor = clean + blocks + readout
            rounds.append({"lens_s": lens_s, "floor_s": floor, "ratio": lens_s / floor,
                           "pieces_s": {"source_passes": clean, "blocks": blocks,
                                        "readout": readout}})
    finally:
        torch.set_num_threads(threads)
    ratios = sorted(r["ratio"] for r in rounds)
    return {
        "model": f"GPT-2 (Hugging Face, random), {L} layers, d_model {args.prompt_d_model}, "
        f"vocab {model.cfg.d_vocab}",
        "prompts": n, "seq_len": args.seq_len, "threads": args.prompt_threads,
        "states": L * n, "layers": found.layers,
        "rounds": rounds,
        "round_ratios": [round(r, 3) for r in ratios],
        "median_round_ratio": ratios[len(ratios) // 2],
    }


def peak_rss(args: argparse.Namespace, tokens: int) -> float:
    """Peak RSS (MiB) of the lens_patchscope run in a fresh process: its own memory's high-water
    mark (``VmHWM``). Not ``ru_maxrss``: Linux starts a spawned child's at its parent's peak (the
    exec takes over the parent's high-water mark), which here is the benchmark's own."""
    code = (
        "import sys, torch; sys.path.insert(0, 'bench');"
        "from bench_patchscope import build; from lensdiv import analyze;"
        "from lensdiv.data.sources import DataSpec;"
        f"torch.manual_seed(0); m = build({args.layers}, {args.d_model});"
        f"analyze(m, data=DataSpec(max_tokens={tokens}, seq_len={args.seq_len}, batch_size=8),"
        "plugins='lens', lens='patchscope', progress=False);"
        "print(next(int(line.split()[1]) for line in open('/proc/self/status')"
        " if line.startswith('VmHWM')) / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tight", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-layers", type=int, default=12)
    parser.add_argument("--prompt-d-model", type=int, default=768)
    parser.add_argument("--prompt-threads", type=int, default=1)
    parser.add_argument("--skip-prompts", action="store_true",
                        help="leave out the prompts' work (nnterp's) at GPT-2 small's size")
    parser.add_argument("--out", default="bench/patchscope_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build(args.layers, args.d_model)
    L = int(model.cfg.n_layers)
    spec = DataSpec(max_tokens=args.tokens, seq_len=args.seq_len, batch_size=8)
    found = inspection(model, PatchscopeLens().prompt, -1)
    t_lens = t_logit = floor_clean = floor_blocks = floor_readout = float("inf")
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):  # the lens and its floor side by side, round by round
        lens_s = best(lambda: analyze(model, data=spec, plugins="lens", lens="patchscope",
                                      progress=False), args.repeats)
        logit_s = best(lambda: analyze(model, data=spec, plugins="lens", progress=False),
                       args.repeats)
        clean = blocks = readout = 0.0
        for tokens in batches(model, args.tokens, args.seq_len):
            T = tokens.numel()
            clean += best(lambda tokens=tokens: states_of(model, tokens), args.repeats)
            blocks += blocks_floor(model, T, args.tight)
            h = torch.randn((L + 1) * T, model.cfg.d_model)
            readout += best(lambda h=h: readout_rows(model, h), args.repeats)
        rounds.append({"lens_s": lens_s, "floor_s": clean + blocks + readout,
                       "ratio": lens_s / (clean + blocks + readout)})
        t_lens, t_logit = min(t_lens, lens_s), min(t_logit, logit_s)
        floor_clean, floor_blocks = min(floor_clean, clean), min(floor_blocks, blocks)
        floor_readout = min(floor_readout, readout)
    floor = floor_clean + floor_blocks + floor_readout
    ratios = sorted(r["ratio"] for r in rounds)
    prompts = batches(model, 16 * args.seq_len, args.seq_len)
    last = torch.cat(prompts)[:16]
    last_states = [s.reshape(16, args.seq_len, -1)[:, -1] for s in states_of(model, last)]
    seq = batches(model, args.sequence, args.sequence)[0][:1]
    def save() -> None:
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=1)

    figures: dict[str, Any] = {
        "model": f"GPT-2 (Hugging Face, random), {L} layers, d_model {args.d_model}, "
        f"vocab {model.cfg.d_vocab}",
        "tokens": args.tokens,
        "threads": args.threads,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "inspection_prompt_tokens": int(found.tokens.shape[1]),
        "mode": found.mode,
        "layers": found.layers,
        "rounds": args.rounds,
        "lens_patchscope_s": t_lens,
        "lens_logit_s": t_logit,
        "floor_s": floor,
        "floor_pieces_s": {"clean_pass": floor_clean, "blocks": floor_blocks,
                           "readout": floor_readout},
        "floor_ratio": t_lens / floor,
        # each round's lens over the floor measured right after it: on a shared host the
        # median of these is steadier than the best of each side from different moments
        "round_ratios": [round(r, 3) for r in ratios],
        "median_round_ratio": ratios[len(ratios) // 2],
        "lensdiv_fused": os.environ.get("LENSDIV_FUSED", "auto"),
    }
    save()
    if not args.skip_prompts:
        figures["nnterp_work"] = prompts_work(args)
        save()
    figures["peers_last_position_16_prompts"] = compare(model, last_states, torch.arange(16),
                                                        args.repeats)
    save()
    figures["peers_every_position_one_sequence"] = compare(
        model, states_of(model, seq), torch.arange(seq.shape[1]), 1
    )
    save()
    small, large = peak_rss(args, args.tokens), peak_rss(args, 4 * args.tokens)
    figures["memory_mib"] = {str(args.tokens): small, str(4 * args.tokens): large,
                             "ratio": large / small}
    save()
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
