"""Throughput of a tuned-lens training step (issue 32): lensdiv's (``kl_gradients`` + its
``NesterovSGD``), in float32 and in its bf16 mode (``TunedRecipe.bf16``), against tuned-lens's own
``TunedLens`` module driven as its ``train_loop`` does (per layer: the lens' logits, ``Σ p_L (log
p_L − log_softmax)`` mean, ``backward``; then ``clip_grad_norm_``, ``SGD(nesterov)``,
``LambdaLR``), in float32 and under bf16 autocast (as its trainer runs), on the same hidden
states of a random GPT-2-shaped model. Every variant runs in each round, one after the other
(rounds interleaved, the median reported), so the ratios are of one machine state.

With ``--levers`` (the default) lensdiv's step is also timed as it was before the fused step
(each layer's readout by autograd through the log-softmax: :func:`unfused_kl_gradients`) and with
one readout block per layer (``rows_per_block = tokens``: the fused KL without the stacked
product), so each lever is measured on its own: fused KL (before → per layer), stacked product
(per layer → default), bf16 products (float32 → bf16).

tuned-lens is not a dependency: pass the folder of its unpacked wheel (``pip download --no-deps
tuned-lens`` and unzip) as ``--tuned-lens-src``. Its ``TunedLens`` is used unchanged; the one stub
is its ``Unembed`` (which wraps a Hugging Face model): a module with the same ``unembedding``,
``unembedding_hash`` and ``forward`` (final LayerNorm, then the unembedding) holding this
model's weights. lensdiv's step also reads ``log p_L`` out (tuned-lens gets it from the model's
forward, outside its step): one readout more.

    python bench/bench_tuned_step.py --tuned-lens-src /tmp/tl/src --json bench/tuned_step_cpu.json
    python bench/bench_tuned_step.py --tuned-lens-src /tmp/tl/src --layers 12 --d-model 768 \
        --vocab 50257 --tokens 512 --threads 2 --steps 1 --json bench/tuned_step_gpt2_cpu.json
"""


from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import build
from lensdiv.lenses.tuned import NesterovSGD, TunedRecipe, kl_gradients
from lensdiv.ops.readout import Workspace, final_readout


class StubUnembed(nn.Module):
    """tuned-lens's ``Unembed`` interface over this model's final LayerNorm and unembedding."""

    def __init__(self, readout: Any) -> None:
        super().__init__()
        d, vocab = readout.W_U.shape
        self.final_norm = nn.LayerNorm(d, eps=readout.eps)
        self.unembedding = nn.Linear(d, vocab)
        with torch.no_grad():
            self.final_norm.weight.copy_(readout.weight)
            self.final_norm.bias.copy_(readout.bias)
            self.unembedding.weight.copy_(readout.W_U.T)
            self.unembedding.bias.copy_(readout.b_U)
        self.requires_grad_(False)

    def unembedding_hash(self) -> str:
        return "stub"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.unembedding(self.final_norm(h))


def unfused_kl_gradients(
    readout: Any, states: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lensdiv's step before issue 32 (the reference of the fused KL lever): each layer's logits
    and log-softmax ``[n, d_vocab]`` in float32, the KL against ``log p_L``, autograd back."""
    with torch.no_grad():
        target = readout.logits(states[-1]).log_softmax(-1)
        p_target = target.exp()
    grads = []
    for layer in range(len(states) - 1):
        w = weight[layer].detach().requires_grad_(True)
        b = bias[layer].detach().requires_grad_(True)
        with torch.enable_grad():
            h = states[layer]
            logq = readout.logits(h + h @ w.T + b).log_softmax(-1)
            kl = (p_target * (target - logq)).sum()
            gw, gb = torch.autograd.grad(kl, (w, b))
        grads.append((gw, gb, kl.detach()))
    gw, gb, kl = (torch.stack([g[i] for g in grads]) for i in range(3))
    return gw, gb, kl


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings of a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuned-lens-src", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bench/gpu.sh)")
    parser.add_argument("--levers", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the step before the fused KL and with a block per layer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(args.tuned_lens_src))
    from tuned_lens.nn.lenses import TunedLens, TunedLensConfig  # the optional comparison

    device = torch.device(args.device)
    model = build(args.layers, args.d_model, args.vocab).to(device)
    readout = final_readout(model)
    gen = torch.Generator().manual_seed(0)
    states = [torch.randn(args.tokens, args.d_model, generator=gen).to(device)
              for _ in range(args.layers + 1)]
    recipe = TunedRecipe(steps=10**6, tokens_per_step=args.tokens)  # the step size barely decays

    lens = TunedLens(StubUnembed(readout), TunedLensConfig("stub", args.d_model, args.layers))
    lens = lens.to(device)
    opt = torch.optim.SGD(lens.parameters(), lr=recipe.lr * (1 - recipe.momentum),
                          momentum=recipe.momentum, nesterov=True,
                          weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1 - t / recipe.steps)
    with torch.no_grad():
        labels = readout.logits(states[-1]).log_softmax(-1)

    def tuned_lens_step(bf16: bool) -> None:
        for i, h in enumerate(states[:-1]):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                logits = lens(h, idx=i)
                loss = torch.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean()
            loss.backward()
        nn.utils.clip_grad_norm_(lens.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        sched.step()

    params = {"weight": torch.zeros(args.layers, args.d_model, args.d_model, device=device),
              "bias": torch.zeros(args.layers, args.d_model, device=device)}
    slots: dict[str, torch.Tensor] = {}
    done = [0]
    sgd = NesterovSGD(recipe)

    ws = Workspace()

    def lensdiv_step(kl_grads: Any, **options: Any) -> None:
        nonlocal params, slots
        gw, gb, _ = kl_grads(readout, states, params["weight"], params["bias"], **options)
        grads = {"weight": gw / args.tokens, "bias": gb / args.tokens}
        params, slots = sgd.step(params, grads, slots, done[0])
        done[0] += 1

    runs = {"lensdiv float32": lambda: lensdiv_step(kl_gradients, workspace=ws),
            "lensdiv bf16": lambda: lensdiv_step(kl_gradients, bf16=True, workspace=ws),
            "tuned-lens float32": lambda: tuned_lens_step(False),
            "tuned-lens bf16 autocast": lambda: tuned_lens_step(True)}
    if args.levers:
        per_layer = {"rows_per_block": args.tokens, "workspace": ws}
        runs |= {
            "lensdiv float32 before (unfused, autograd per layer)":
                lambda: lensdiv_step(unfused_kl_gradients),
            "lensdiv float32 fused, a block per layer":
                lambda: lensdiv_step(kl_gradients, **per_layer),
            "lensdiv bf16 fused, a block per layer":
                lambda: lensdiv_step(kl_gradients, bf16=True, **per_layer),
        }
    # The gradients agree: bf16 and the step before against float32 (relative Frobenius norm).
    check = {"weight": 0.02 * torch.randn(args.layers, args.d_model, args.d_model, generator=gen),
             "bias": 0.1 * torch.randn(args.layers, args.d_model, generator=gen)}
    check = {name: value.to(device) for name, value in check.items()}
    exact = kl_gradients(readout, states, check["weight"], check["bias"], workspace=ws)
    agreement = {}
    for name, grads in (
        ("bf16", kl_gradients(readout, states, check["weight"], check["bias"], bf16=True,
                              workspace=ws)),
        ("before", unfused_kl_gradients(readout, states, check["weight"], check["bias"])),
    ):
        agreement[name] = {part: float((g.double() - e.double()).norm() / e.double().norm())
                           for part, g, e in zip(("grad_A", "grad_b", "kl"), grads, exact,
                                                 strict=True)}
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):  # interleaved
        for name, run in runs.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(args.steps):
                run()
            sync(device)
            times[name].append((time.perf_counter() - started) / args.steps)
    base = statistics.median(times["tuned-lens float32"])
    base_bf16 = statistics.median(times["tuned-lens bf16 autocast"])
    report = {
        "model": f"random GPT-2 shape, {args.layers} layers, d_model {args.d_model}, "
                 f"vocab {args.vocab}",
        "tokens_per_step": args.tokens,
        "threads": args.threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "steps_per_round": args.steps,
        "repeats": args.repeats,
        "relative_difference_vs_lensdiv_float32": agreement,
        "runs": {name: {"step_s": statistics.median(t), "step_s_all": t,
                        "tokens_per_s": args.tokens / statistics.median(t),
                        "speed_vs_tuned_lens_float32": base / statistics.median(t),
                        "speed_vs_tuned_lens_bf16": base_bf16 / statistics.median(t)}
                 for name, t in times.items()},
    }
    print(json.dumps(report, indent=1))
    width = max(map(len, times))
    for name, run in report["runs"].items():
        print(f"{name:<{width}}  {run['step_s']:8.3f} s  {run['speed_vs_tuned_lens_float32']:5.2f} x "
              f"tuned-lens float32  {run['speed_vs_tuned_lens_bf16']:5.2f} x tuned-lens bf16")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
