"""Benchmark: ``similarity`` and ``spectrum`` against the forward that caches the same states plus
the floor of their own matrix work.

The random TL-native model of ``common.build`` (default here: 12 layers, d_model 768, GPT-2's
vocabulary). On the same tokens, interleaved, best of ``--repeats``:

- ``cache``: the forward that caches the residual states ``h_0 … h_L`` (lensdiv's ``capture``,
  as the runner calls it), batch by batch;
- ``floor_similarity``: the float64 cross-products of every pair of states (one
  ``(L+1)d × (L+1)d`` ``addmm`` per batch, on the cached states) — linear CKA's streamed work;
- ``floor_spectrum``: the float64 ``d × d`` moments of every state (one batched product) and
  each row's Gram eigenvalues per state — the spectra's streamed work;
- ``similarity``, ``spectrum``, ``similarity,spectrum``: ``analyze`` runs (reading the corpus,
  checks, manifest, finalize) — each also reported against ``cache`` plus its floor(s).

The acceptance (issue 44): each run ≤ 1.3 × (cache + its floor). The finalize (the kernel forms
on the capped sample, the spectra, the jackknife), with the plots and files, is ``rest_s``: a
run's total less its forward and its analyzers' updates.

    python bench/bench_geometry.py [--tokens 1024 --json bench/geometry_cpu.json]
"""

from __future__ import annotations

from typing import Any

import torch
from common import best_of, describe, model_and_data, model_device, model_parser, report

from lensdiv import analyze
from lensdiv.analyzers.similarity import Similarity
from lensdiv.analyzers.spectrum import Spectrum
from lensdiv.core.analyzer import ModelInfo
from lensdiv.data.sources import token_batches
from lensdiv.ops.capture import capture
from lensdiv.ops.geometry import gram_eigenvalues


def main() -> None:
    parser = model_parser(__doc__, tokens=1024, batch_size=4, repeats=2)
    parser.set_defaults(layers=12, d_model=768)
    args = parser.parse_args()
    model, spec = model_and_data(args)
    info = ModelInfo.from_model(model)
    hooks = [info.resid(layer) for layer in range(info.n_layers + 1)]
    device = model_device(model)
    batches = [b.tokens.to(device) for b in token_batches(spec, model.tokenizer)]
    cached: list[list[torch.Tensor]] = []

    def cache() -> None:
        cached.clear()
        for tokens in batches:
            _, states = capture(model, tokens, hooks, need_logits=False)
            cached.append([states[name] for name in hooks])

    cache()

    def floor_similarity() -> None:
        D = len(hooks) * info.d_model
        m = torch.zeros(D, D, dtype=torch.float64, device=device)
        for h in cached:
            rows = torch.cat([x.reshape(-1, x.shape[-1]).double() for x in h], 1)
            m.addmm_(rows.T, rows)

    def floor_spectrum() -> None:
        L1, d = len(hooks), info.d_model
        m = torch.zeros(L1, d, d, dtype=torch.float64, device=device)
        for h in cached:
            x = torch.stack(h).double()
            flat = x.reshape(L1, -1, d)
            m.baddbmm_(flat.transpose(1, 2), flat)
            for row in range(x.shape[1]):
                for layer in range(L1):
                    gram_eigenvalues(x[layer, row])

    timings: dict[str, dict[str, float]] = {}

    def run(*analyzers: Any) -> None:
        result = analyze(model, data=spec, plugins=list(analyzers), progress=False)
        assert result.ok, result.errors
        timings[",".join(a.name for a in analyzers)] = dict(result.manifest["timings"])

    similarity, spectrum = Similarity(), Spectrum()
    cases = {
        "cache": cache,
        "floor_similarity": floor_similarity,
        "floor_spectrum": floor_spectrum,
        "similarity": lambda: run(similarity),
        "spectrum": lambda: run(spectrum),
        "similarity,spectrum": lambda: run(similarity, spectrum),
    }
    run(similarity, spectrum)  # warm-up
    best = best_of(cases, args.repeats)
    base = best["cache"]
    floors = {
        "similarity": base + best["floor_similarity"],
        "spectrum": base + best["floor_spectrum"],
        "similarity,spectrum": base + best["floor_similarity"] + best["floor_spectrum"],
    }
    report(
        {
            **describe(args),
            "state_gib": {
                a.name: round(a.state_bytes(info) / 2**30, 3) for a in (similarity, spectrum)
            },
            "seconds": {k: round(v, 3) for k, v in best.items()},
            "over_cache_plus_floor": {k: round(best[k] / v, 3) for k, v in floors.items()},
            "over_cache": {k: round(best[k] / base, 3) for k in floors},
            # Outside the forward and the analyzers' updates: finalize, plots, files.
            "rest_s": {
                k: round(v["total_s"] - v["forward_s"] - sum(v[f"{a}_s"] for a in k.split(",")), 3)
                for k, v in timings.items()
            },
            "last_run_timings": timings,
        },
        args.json,
    )


if __name__ == "__main__":
    main()
