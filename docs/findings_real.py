"""Regenerate ``docs/findings_real.md``: the findings of ``docs/findings.md`` on two real models.

    make findings-real                               # = python docs/findings_real.py
    python docs/findings_real.py --only smollm2-135m:one --reuse   # one run again, the rest as recorded

The models are lensdiv's catalog models ``smollm2-135m`` (SmolLM2-135M-Instruct, Llama, 30
blocks) and ``gemma3-270m`` (Gemma 3 270M, 18 blocks). Their weights are **4-bit GGUF
quantizations (Q4_1 and Q4_K_M), dequantized to float32** by lensdiv: not the original bf16
weights. To see what quantization does, SmolLM2 is measured a second time from a copy of its
GGUF file whose tensors are quantized again to Q4_0 (``bench/requantize_gguf.py``; written to
``$LENSDIV_CACHE/requantized/``, never committed). The text is Python's documentation
(``--data pydoc``, lensdiv's default for real models). The verdict rules and helpers are those of
``docs/findings.py`` (imported, not copied); every number here is measured by this script, and
``findings_real.json`` holds the measured values (``runs``: what each run returned).

The budgets are small (hundreds of tokens) because the work was done on 2 shared CPU cores: the
numbers carry the noise of a few hundred tokens of one kind of text, and the standard errors are
given where the analyzers give them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import findings as F  # noqa: E402  (docs/findings.py: the rules, verdict helpers and figures)
import findings_geometry as G  # noqa: E402  (the geometry rows' rules, shared with the toys)

SMOL, GEMMA, REQ = "smollm2-135m", "gemma3-270m", "smollm2-135m@Q4_0"
LABELS = {
    SMOL: "SmolLM2-135M (Q4_1)",
    GEMMA: "Gemma-3-270M (Q4_K_M)",
    REQ: "SmolLM2-135M re-quantized Q4_0",
}
SOURCE_GGUF = "gguf-files/SmolLM2-135M-Instruct.Q4_1.gguf"
REQ_FILE = "requantized/SmolLM2-135M-Instruct.Q4_0-of-Q4_1.gguf"

ONE = "lens,contrib,dynamics,sinks,massive,bias"
#: patch on the built-in capital-city pairs: activation patching of the residual stream only
#: (the question of the row), no erasure, integrated gradients with few steps.
PATCH_OPTIONS = {"sites": ("resid_pre",), "erasure": False, "ig_steps": 8}
#: (model, group) -> (plugins, tokens, options): every run the document reads.
RUNS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    f"{SMOL}:one": (SMOL, ONE, 256, {"bias": {"ce_depth": True}}),
    f"{GEMMA}:one": (GEMMA, ONE, 128, {"bias": {"ce_depth": True}}),
    f"{REQ}:one": (REQ, ONE, 256, {"bias": {"ce_depth": True}}),
    f"{SMOL}:skip": (SMOL, "skip", 128, {}),
    f"{SMOL}:surgery": (SMOL, "prune,reorder", 128, {"prune": {"curves": False}}),
    f"{GEMMA}:surgery": (GEMMA, "prune,reorder", 128, {"prune": {"curves": False}}),
    f"{REQ}:surgery": (REQ, "prune,reorder", 128, {"prune": {"curves": False}}),
    f"{GEMMA}:skip": (GEMMA, "skip", 128, {}),
    f"{SMOL}:submod": (SMOL, "submod", 128, {}),
    f"{GEMMA}:submod": (GEMMA, "submod", 128, {}),
    f"{SMOL}:patchscope": (SMOL, "patchscope-lens", 128, {}),
    f"{GEMMA}:patchscope": (GEMMA, "patchscope-lens", 128, {}),
    # the built-in clean/corrupt pairs of real tokenizers: capital cities
    f"{SMOL}:patch": (SMOL, "patch", 4096, {"patch": PATCH_OPTIONS}),
    f"{GEMMA}:patch": (GEMMA, "patch", 4096, {"patch": PATCH_OPTIONS}),
    # the representation's geometry (issue 44)
    # SmolLM2's exact moments take 4.8 GiB (2 (L+1)² d², L = 30, d = 576): over the default cap
    f"{SMOL}:geometry": (SMOL, "similarity,spectrum", 256, {"similarity": {"max_state_gb": 6}}),
    f"{GEMMA}:geometry": (GEMMA, "similarity,spectrum", 256, {}),
    f"{REQ}:geometry": (REQ, "similarity,spectrum", 256, {"similarity": {"max_state_gb": 6}}),
    # massive alone: its mean edit takes the data's mean in a second pass over the same tokens
    f"{SMOL}:massive": (SMOL, "massive", 256, {}),
    f"{GEMMA}:massive": (GEMMA, "massive", 128, {}),
    f"{REQ}:massive": (REQ, "massive", 256, {}),
    # each model's own loss on the held-out part of pydoc (every tenth topic), more tokens
    f"{SMOL}:ce": (SMOL, "lens", 512, {"_data": "pydoc:heldout"}),
    f"{REQ}:ce": (REQ, "lens", 512, {"_data": "pydoc:heldout"}),
    f"{GEMMA}:ce": (GEMMA, "lens", 256, {"_data": "pydoc:heldout"}),
}


def cache() -> Path:
    return Path(os.environ.get("LENSDIV_CACHE", Path.home() / ".cache" / "lensdiv"))


def model_spec(model: str) -> str:
    """The spec lensdiv loads: the catalog name, or the re-quantized file (made if missing)."""
    if model != REQ:
        return model
    path = cache() / REQ_FILE
    if not path.is_file():
        sys.path.insert(0, str(F.ROOT / "bench"))
        from requantize_gguf import requantize

        from lensdiv.models.load import load_model

        src = cache() / SOURCE_GGUF
        if not src.is_file():
            load_model(SMOL)  # fetches the GGUF file into the cache
        path.parent.mkdir(parents=True, exist_ok=True)
        requantize(src, path, "Q4_0")
    return str(path)


def _cols(table: Any, *names: str) -> dict[str, list[Any]]:
    have = table.columns if hasattr(table, "columns") else table
    return {n: [_num(v) for v in table[n]] for n in names if n in have}


def _num(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def measure(key: str) -> dict[str, Any]:
    """Run ``RUNS[key]`` and keep what the rows read, as plain lists."""
    model, plugins, tokens, options = RUNS[key]
    t0 = time.time()
    if plugins == "patchscope-lens":
        from lensdiv.lenses.fit import evaluate_lens

        table = evaluate_lens(model_spec(model), "patchscope", max_tokens=tokens, progress=False)
        values = {"patchscope": _cols(table, "kl_logit", "kl_patchscope")}
        return {"values": values, "seconds": time.time() - t0, "tokens": tokens}
    options = dict(options)
    data = options.pop("_data", None)
    if data is None:
        run = F._analyze(model_spec(model), plugins, tokens, **options)
    else:
        import lensdiv

        run = lensdiv.analyze(model_spec(model), data=data, plugins=plugins, max_tokens=tokens,
                              options=options or None, progress=False)
    raw = {}
    for name in plugins.split(","):
        try:
            result = run[name]
        except Exception as err:  # noqa: BLE001  (recorded, the other analyzers kept)
            raw[name] = {"error": repr(err)}
            continue
        raw[name] = {"tables": {t: dict(table.columns) for t, table in result.tables.items()},
                     "meta": {k: v for k, v in result.meta.items()
                              if k not in ("model", "data", "versions")},
                     "main": result.table().name}
        if name == "similarity":  # the matrices the geometry rows read ((L+1)² each)
            raw[name]["arrays"] = {k: np.asarray(result.arrays[k]).tolist() for k in
                                   ("linear_all", "linear_no_sink", "linear_outlier_change")}
    return {"raw": raw, "seconds": time.time() - t0, "tokens": tokens, "plugins": plugins}


class _Result:
    """A recorded result read back: ``table(name)``, ``tables``, ``meta``."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.meta = raw["meta"]
        self.arrays = raw.get("arrays", {})
        self.tables = {t: _Table(c) for t, c in raw["tables"].items()}
        self._main = raw["main"]

    def table(self, name: str | None = None) -> _Table:
        return self.tables[name or self._main]


class _Table(dict):
    @property
    def column_names(self) -> list[str]:
        return list(self)


def extract(record: dict[str, Any]) -> dict[str, Any]:
    """What the rows read from one recorded run."""
    if "values" in record:
        return record["values"]
    run = {n: _Result(r) for n, r in record["raw"].items() if "error" not in r}
    values: dict[str, Any] = {}
    names = list(run)
    if "lens" in names:
        lens = run["lens"].table()
        values["lens"] = _cols(lens, "layer", "kl", "kl_sem", "ce", "entropy")
        values["lens"]["positions"] = run["lens"].meta.get("positions_with_target")
    if "contrib" in names:
        values["contrib"] = _cols(run["contrib"].table(), "layer", "r_block", "r_attn", "r_mlp")
    if "dynamics" in names:
        d = run["dynamics"]
        values["dynamics"] = {
            **_cols(d.table("updates"), "block", "theta", "theta_update", "rel_update"),
            "middle_blocks": list(d.meta["middle_blocks"]),
        }
    if "sinks" in names:
        s = run["sinks"]
        tok = s.tables["sink_tokens"]
        values["sinks"] = {**_cols(s.table(), "mass0", "sink_share", "kl"),
                           "top_token": str(tok["text"][0]), "top_share": float(tok["share"][0])}
    if "massive" in names:
        m = run["massive"]
        truth = m.tables.get("massive_truth")
        values["massive"] = {
            **_cols(m.table(), "max_abs", "median", "log10_ratio"),
            "appear": m.meta.get("appear"), "vanish": m.meta.get("vanish"),
            "writer": m.meta.get("writer"),
            "dce": {} if truth is None else {str(e): float(v) for e, v in
                                             zip(truth["edit"], truth["dce"], strict=True)},
        }
    if "bias" in names:
        depth = run["bias"].table("depth")
        values["bias"] = _cols(depth, "layer", "members", "ce_bias", "ce_diversity", "ce_loss")
    if "skip" in names:
        values["skip"] = _cols(run["skip"].table(), "skipped", "later_mean", "output_mean")
    if "prune" in names:
        b = run["prune"].table("blocks")
        values["prune"] = {**_cols(b, "block", "kl_remove"),
                           "spearman": run["prune"].meta.get("spearman_overall")}
    if "reorder" in names:
        r = run["reorder"]
        sw, var = r.table("swaps"), r.table("variants")
        values["reorder"] = {**_cols(sw, "block", "kl_swap", "kl_remove"),
                             "variants": _cols(var, "variant", "kl"),
                             "middle": r.meta.get("middle")}
    if "similarity" in names and "spectrum" in names:
        values["geometry"] = G.numbers(run["similarity"], run["spectrum"])
    if "patch" in names:
        t = run["patch"].table("patching")
        values["patch"] = {**_cols(t, "site", "layer", "pos", "score", "stderr"),
                           "pairs": len(run["patch"].table("pairs")["line"])}
    if "submod" in names:
        blocks = run["submod"].table("blocks")
        fit = run["submod"].table("fit")
        values["submod"] = {**_cols(blocks, "k", "F", "diminishing"),
                            "fit": dict(zip(map(str, fit["statistic"]),
                                            map(_num, fit["value"]), strict=True))}
    return values


# -- rows ---------------------------------------------------------------------------------------
class Row(dict):  # key, title, cells {model: text}, command, verdict, why, figure, rule
    pass


def _get(runs: dict[str, Any], key: str, part: str) -> Any:
    run = runs.get(key)
    return None if run is None else extract(run).get(part)


def _models(runs: dict[str, Any], group: str, part: str) -> dict[str, Any]:
    return {m: v for m in (SMOL, GEMMA, REQ) if (v := _get(runs, f"{m}:{group}", part)) is not None}


def _verdict(verdicts: dict[str, str]) -> str:
    """Over the two models (the re-quantized copy aside): as :func:`findings.combined_verdict`."""
    got = [verdicts[m] for m in (SMOL, GEMMA) if m in verdicts]
    return F.combined_verdict(got) if got else "not run"


def _tok(runs: dict[str, Any], m: str, group: str) -> str:
    return f"{runs[f'{m}:{group}']['tokens']} tokens"


def row_contribution(runs: dict[str, Any], out: Path) -> Row:
    contrib, lens = _models(runs, "one", "contrib"), _models(runs, "one", "lens")
    fig, (ax1, ax2) = F._figure(2)
    cells, verdicts, vals = {}, {}, {}
    for m, c in contrib.items():
        r = np.asarray(c["r_block"], float)
        L = len(r)
        verdict, ratios = F.halves_verdict(r)
        ln = lens[m]
        kl, sem = np.asarray(ln["kl"]), np.asarray(ln["kl_sem"])
        # the first state where the logit lens is within 1 nat of the output
        within = next(i for i, v in enumerate(kl) if v < 1.0)
        verdicts[m], vals[m] = verdict, {**ratios, "r_block": r.tolist(), "first_within_1nat": within}
        cells[m] = (f"{_tok(runs, m, 'one')}: ‖a+m‖/‖h‖ second half / first half "
                    f"{ratios['ratio']:.2f} ({ratios['ratio_without_block0']:.2f} without block 0;"
                    f" block 0 {r[0]:.2f}, last block {r[-1]:.2f}); logit-lens KL "
                    f"h0 {kl[0]:.1f}±{sem[0]:.1f}, h{L // 2} {kl[L // 2]:.1f}±{sem[L // 2]:.1f},"
                    f" h{L - 1} {kl[L - 1]:.2f}±{sem[L - 1]:.2f} nats; within 1 nat of the "
                    f"output from h{within} of h{L} → **{verdict}**")
        style = "--" if m == REQ else "-"
        ax1.plot((np.arange(L) + 0.5) / L, r, "o" + style, ms=3, label=LABELS[m])
        ax2.errorbar(np.arange(L + 1) / L, kl, yerr=sem, fmt="o" + style, ms=3, label=LABELS[m])
    ax1.set(yscale="log", xlabel="relative depth of the block", ylabel="‖a+m‖ / ‖h‖",
            title="contribution of each block")
    ax2.set(xlabel="relative depth of h_l", ylabel="KL(p_l ‖ p_out), nats (± SEM)",
            title="logit lens")
    for ax in (ax1, ax2):
        ax.axvline(0.5, color="grey", lw=0.8, ls=":")
        ax.legend(fontsize=7)
    return Row(key="contribution", title="Second-half layers contribute less; the logit lens "
               "converges late", cells=cells,
               command=f"lensdiv analyze {SMOL} --plugins contrib,lens --max-tokens 256",
               verdict=_verdict(verdicts),
               rule=F.RULES["contribution"] + "; over the two models (the re-quantized copy "
               "aside): reproduced on both, not on neither, partly otherwise",
               figure=F._save(fig, out, "real_contribution.png"), values=vals)


def row_skip(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, s in _models(runs, "skip", "skip").items():
        later = s["later_mean"]
        verdict, ratios = F.halves_verdict(later, skip_last=True)
        verdicts[m], vals[m] = verdict, {**ratios, "later_mean": later}
        cells[m] = (f"{_tok(runs, m, 'skip')} (one prompt, 4 split points): effect on later "
                    f"layers, second half / first half {ratios['ratio']:.2f} "
                    f"({ratios['ratio_without_block0']:.2f} without block 0) → **{verdict}**")
        ax.plot(s["skipped"], later, "o-", label=LABELS[m])
    ax.set(xlabel="skipped block s", ylabel="mean over l > s of E[s, l]", yscale="log",
           title="effect of skipping a block on later layers")
    ax.legend(fontsize=7)
    return Row(key="skip", title="Skipping a second-half layer barely changes later computation",
               cells=cells, command=f"lensdiv analyze {SMOL} --plugins skip --max-tokens 128",
               verdict=_verdict(verdicts),
               rule=F.RULES["skip"], figure=F._save(fig, out, "real_skip.png"), values=vals)


def row_bias(runs: dict[str, Any], out: Path) -> Row:
    from scipy.stats import spearmanr

    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, d in _models(runs, "one", "bias").items():
        keep = [i for i, k in enumerate(d["members"]) if k > 0]
        b, dv, loss = (np.asarray(d[c], float)[keep] for c in ("ce_bias", "ce_diversity",
                                                                  "ce_loss"))
        rho = float(spearmanr(b, dv).statistic)
        falls = bool(loss[-1] < loss[0])
        verdicts[m] = F.count_verdict(int(falls) + int(rho > 0.5), 2)
        vals[m] = {"ce_bias": b.tolist(), "ce_diversity": dv.tolist(), "ce_loss": loss.tolist(),
                   "spearman": rho}
        cells[m] = (f"{_tok(runs, m, 'one')} (CE at every 16th position): ensemble CE "
                    f"{loss[0]:.2f} → {loss[-1]:.2f}, bias {b[0]:.2f} → {b[-1]:.2f}, diversity "
                    f"{dv[0]:.2f} → {dv[-1]:.2f} nats; rank correlation {rho:.2f} → "
                    f"**{verdicts[m]}**")
        ax.plot(np.asarray(d["layer"])[keep], loss, "o-", ms=3, label=f"{LABELS[m]}: ensemble CE")
        ax.plot(np.asarray(d["layer"])[keep], dv, "s:", ms=3, label=f"{LABELS[m]}: diversity")
    ax.set(xlabel="prefix ensemble up to h_l", ylabel="nats", yscale="log")
    ax.legend(fontsize=6)
    return Row(key="bias", title="Layers help when accurate and diverse", cells=cells,
               command=f"lensdiv analyze {SMOL} --plugins bias -O bias.ce_depth=true "
               "--max-tokens 256",
               verdict=_verdict(verdicts),
               rule=F.RULES["bias"], figure=F._save(fig, out, "real_bias.png"), values=vals)


def row_submod(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, s in _models(runs, "submod", "submod").items():
        dim = np.asarray([x for x in s["diminishing"] if x is not None], float)
        dim = dim[~np.isnan(dim)]
        share = float(dim.mean()) if len(dim) else math.nan
        k, Fk = np.asarray(s["k"], float), np.asarray(s["F"], float)
        ok = k >= 1
        slope, icpt = np.polyfit(np.log(k[ok]), Fk[ok], 1)
        pred = icpt + slope * np.log(k[ok])
        r2 = float(1 - ((Fk[ok] - pred) ** 2).sum() / ((Fk[ok] - Fk[ok].mean()) ** 2).sum())
        verdicts[m] = F.submod_verdict(share, r2)
        vals[m] = {"F": Fk.tolist(), "diminishing_share": share, "log_fit": [icpt, slope, r2],
                   "fit": s["fit"]}
        cells[m] = (f"{_tok(runs, m, 'submod')}: whole-block gains diminish at {share:.0%} of "
                    f"the steps; F(k) ≈ {icpt:.2f} + {slope:.2f} log k, R² {r2:.2f} → "
                    f"**{verdicts[m]}**")
        ax.plot(k, Fk, "o-", ms=3, label=LABELS[m])
        ax.plot(k[ok], pred, "k:", label=f"log fit, R² {r2:.2f}")
    ax.set(xlabel="k (embedding, then blocks 0 … k−2)", ylabel="−CE, nats",
           title="performance of the first k blocks")
    ax.legend(fontsize=7)
    return Row(key="submod", title="The gain from adding layers is submodular", cells=cells,
               command=f"lensdiv analyze {SMOL} --plugins submod --max-tokens 128",
               verdict=_verdict(verdicts),
               rule=F.RULES["submod"], figure=F._save(fig, out, "real_submod.png"), values=vals)


def row_dynamics(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, d in _models(runs, "one", "dynamics").items():
        a, b = d["middle_blocks"]
        theta = np.degrees(np.asarray(d["theta"], float))
        angle = np.degrees(np.asarray(d["theta_update"], float))
        mid = theta[a:b]
        cv = float(mid.std() / mid.mean())
        mid_angle = float(np.nanmean(angle[a:b]))
        checks = {"uniform rotations": cv <= 0.25, "uncorrelated updates": 80 <= mid_angle <= 100}
        verdicts[m] = F.count_verdict(sum(checks.values()), len(checks))
        vals[m] = {"middle_theta_deg": mid.tolist(), "cv": cv, "middle_update_angle": mid_angle,
                   "checks": checks}
        cells[m] = (f"{_tok(runs, m, 'one')}: middle blocks {a}–{b - 1} rotate h by "
                    f"{mid.min():.0f}–{mid.max():.0f}° (coefficient of variation {cv:.2f}); "
                    f"neighbouring updates {mid_angle:.0f}° apart → **{verdicts[m]}** (2 checks; "
                    "the 1/depth check needs a depth family)")
        ax.plot(d["block"], theta, "o-", ms=3, label=f"{LABELS[m]}: θ_l")
        ax.plot(d["block"], angle, "s:", ms=3, label=f"{LABELS[m]}: θΔ_l")
    ax.axhline(90, color="grey", ls=":", lw=1)
    ax.set(xlabel="block l", ylabel="degrees", title="rotation and angle between updates")
    ax.legend(fontsize=6)
    return Row(key="dynamics", title="Middle layers make small, similar, uncorrelated updates",
               cells=cells, command=f"lensdiv analyze {SMOL} --plugins dynamics --max-tokens 256",
               verdict=_verdict(verdicts),
               rule="the first two checks of: " + F.RULES["dynamics"] + " (the third, the "
               "1/depth slope, needs models of several depths: not testable on two models of "
               "different families)",
               figure=F._save(fig, out, "real_dynamics.png"), values=vals)


def row_prune(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, p in _models(runs, "surgery", "prune").items():
        kl = np.asarray(p["kl_remove"], float)
        verdict, ratios = F.halves_verdict(kl)
        first, last = F.ends_checks(kl)
        rank_last = int((kl > kl[-1]).sum()) + 1
        sp = p.get("spearman") or {}
        verdicts[m] = verdict
        vals[m] = {**ratios, "kl_remove": kl.tolist(), "first_most": first,
                   "last_above_middle": last, "spearman": sp}
        proxies = ", ".join(f"{k} {v:.2f}" for k, v in sp.items()) if isinstance(sp, dict) else sp
        cells[m] = (f"{_tok(runs, m, 'surgery')}: removing one block, KL second half / first "
                    f"half {ratios['ratio']:.2f} ({ratios['ratio_without_block0']:.2f} without "
                    f"block 0) → **{verdict}**; block 0 costs the most: {first}; the last block "
                    f"ranks {rank_last} of {len(kl)}; proxies' rank correlation with the true KL: "
                    f"{proxies}")
        L = len(kl)
        ax.plot((np.arange(L) + 0.5) / L, kl, "o-" if m != REQ else "o--", ms=3, label=LABELS[m])
    ax.set(xlabel="relative depth of the removed block", ylabel="KL(p ‖ p_out), nats",
           yscale="log", title="removing one block")
    ax.legend(fontsize=7)
    return Row(key="prune_depth", title="Deeper blocks are more removable; proxies vs truth",
               cells=cells, command=f"lensdiv analyze {SMOL} --plugins prune -O "
               "prune.curves=false --max-tokens 128",
               verdict=_verdict(verdicts),
               rule=F.RULES["prune_depth"], figure=F._save(fig, out, "real_prune.png"),
               values=vals)


def row_reorder(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    for m, r in _models(runs, "surgery", "reorder").items():
        pairs = F.middle_pairs(len(r["kl_swap"]))
        cheaper = [r["kl_swap"][s] < r["kl_remove"][s] for s in pairs]
        shuf = [k for v, k in zip(r["variants"]["variant"], r["variants"]["kl"], strict=True)
                if str(v).startswith("shuffle")]
        verdicts[m] = F.count_verdict(sum(cheaper), len(cheaper))
        vals[m] = {"swap_cheaper": cheaper, "shuffle_kl": shuf, "middle": r["middle"]}
        cells[m] = (f"{_tok(runs, m, 'surgery')}: swapping ℓ, ℓ+1 costs less KL than removing ℓ "
                    f"for {sum(cheaper)} of {len(cheaper)} middle pairs → **{verdicts[m]}**; "
                    f"shuffling the middle half {r['middle']}: KL "
                    + ", ".join(f"{k:.2f}" for k in shuf) + " nats")
    return Row(key="reorder_swap", title="Swapping adjacent middle blocks hurts less than "
               "removing one", cells=cells,
               command=f"lensdiv analyze {SMOL} --plugins reorder --max-tokens 128",
               verdict=_verdict(verdicts),
               rule=F.RULES["reorder_swap"], figure="findings/real_prune.png", values=vals)


def row_patchscope(runs: dict[str, Any], out: Path) -> Row:
    cells, vals = {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, p in _models(runs, "patchscope", "patchscope").items():
        lo, pa = np.asarray(p["kl_logit"]), np.asarray(p["kl_patchscope"])
        L = len(lo) - 1
        closer = [i for i in range(L) if pa[i] < lo[i]]
        vals[m] = {"kl_logit": lo.tolist(), "kl_patchscope": pa.tolist(), "closer": closer}
        cells[m] = (f"{_tok(runs, m, 'patchscope')} of pydoc:heldout: the patchscope reads "
                    f"{len(closer)} of {L} states closer to the output than the logit lens; h{L // 2}"
                    f" {pa[L // 2]:.2f} vs {lo[L // 2]:.2f}, h{3 * L // 4} {pa[3 * L // 4]:.2f} vs "
                    f"{lo[3 * L // 4]:.2f} nats (patchscope vs logit)")
        ax.plot(range(L + 1), lo, "o-", ms=3, label=f"{LABELS[m]}: logit lens")
        ax.plot(range(L + 1), pa, "s-", ms=3, label=f"{LABELS[m]}: patchscope")
    ax.set(xlabel="residual state h_l", ylabel="KL(p_l ‖ p_out), nats", yscale="log",
           title="held-out tokens")
    ax.legend(fontsize=7)
    return Row(key="patchscope_lens", title="The patchscope lens against the logit lens",
               cells=cells, command=f"lensdiv lenses evaluate {SMOL} --lens patchscope "
               "--max-tokens 128",
               verdict=F.COMPARED,
               rule="a comparison (verdict: compared): the token-identity Patchscope's KL to "
               "the output by residual state against the logit lens' on the same held-out tokens "
               "(no tuned or Jacobian lens was fitted to the real models, so the paper's claim "
               "against the tuned lens is not tested here)",
               figure=F._save(fig, out, "real_patchscope.png"), values=vals)


def row_sinks(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax1, ax2) = F._figure(2)
    for m, s in _models(runs, "one", "sinks").items():
        mass, share, kl = (np.asarray(s[c], float) for c in ("mass0", "sink_share", "kl"))
        verdicts[m] = F.sinks_verdict(share[0], float(share[1:].mean()))
        big = int(np.argmax(kl))
        vals[m] = {"mass0": mass.tolist(), "sink_share": share.tolist(), "kl": kl.tolist()}
        cells[m] = (f"{_tok(runs, m, 'one')}: attention on position 0 layer 0 {mass[0]:.2f}, "
                    f"layers 1+ mean {mass[1:].mean():.2f} (max {mass.max():.2f}); sink heads "
                    f"{share[0]:.0%} in layer 0, {share[1:].mean():.0%} after; removing one "
                    f"layer's sink costs KL up to {kl[big]:.2f} nats (layer {big}), median "
                    f"{np.median(kl):.3f}; most attended token {s['top_token']!r} "
                    f"({s['top_share']:.0%}) → **{verdicts[m]}**")
        L = len(mass)
        st = "o--" if m == REQ else "o-"
        ax1.plot((np.arange(L) + 0.5) / L, mass, st, ms=3, label=LABELS[m])
        ax2.plot((np.arange(L) + 0.5) / L, np.maximum(kl, 1e-4), st, ms=3, label=LABELS[m])
    ax1.set(xlabel="relative depth of the layer", ylabel="mean attention on position 0",
            ylim=(0, 1), title="attention on the first token")
    ax1.axhline(0.3, color="grey", lw=0.8, ls=":")
    ax2.set(xlabel="relative depth of the layer", ylabel="KL(p_removed ‖ p_out), nats",
            yscale="log", title="one layer's sink removed (floored at 1e-4)")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
    return Row(key="sinks_form", title="Attention sinks form after the first layers; removing "
               "them", cells=cells, command=f"lensdiv analyze {SMOL} --plugins sinks "
               "--max-tokens 256",
               verdict=_verdict(verdicts),
               rule=F.RULES["sinks_form"], figure=F._save(fig, out, "real_sinks.png"),
               values=vals)


def row_massive(runs: dict[str, Any], out: Path) -> Row:
    cells, vals, verdicts = {}, {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, s in _models(runs, "massive", "massive").items():
        ratio = 10 ** np.asarray(s["log10_ratio"], float)
        dce = s["dce"]
        verdicts[m] = F.massive_verdict(s["appear"], dce.get("zero", 0.0), dce.get("mean", 0.0))
        vals[m] = {k: s[k] for k in ("max_abs", "appear", "vanish", "writer", "dce")}
        where = ("none" if s["appear"] is None else
                 f"from h_{s['appear']} to h_{s['vanish']} (written by the {s['writer']})")
        cells[m] = (f"{_tok(runs, m, 'massive')}: largest |x| {max(s['max_abs']):.0f}, "
                    f"{ratio.max():.0f}× the median; massive {where}; Δ cross-entropy set to "
                    f"zero {dce.get('zero', math.nan):+.2f} vs to the mean "
                    f"{dce.get('mean', math.nan):+.3f} nats → **{verdicts[m]}**")
        L = len(ratio) - 1
        ax.plot(np.arange(L + 1) / L, ratio, "o--" if m == REQ else "o-", ms=3, label=LABELS[m])
    ax.axhline(1000, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="relative depth of h_l", ylabel="max |x| / median |x|", yscale="log",
           title="largest activation over the median")
    ax.legend(fontsize=7)
    return Row(key="massive_bias", title="Massive activations act as biases (zero vs mean)",
               cells=cells, command=f"lensdiv analyze {SMOL} --plugins massive --max-tokens 256",
               verdict=_verdict(verdicts),
               rule=F.RULES["massive_bias"], figure=F._save(fig, out, "real_massive.png"),
               values=vals)


def _geometry_row(key: str, runs: dict[str, Any], out: Path) -> Row:
    found = _models(runs, "geometry", "geometry")
    cells, vals, verdicts = {}, {}, {}
    for m, numbers in found.items():
        verdict, info = G.verdicts(numbers)[key]
        verdicts[m], vals[m] = verdict, info
        cells[m] = f"{_tok(runs, m, 'geometry')}: " + G.cell(key, numbers, verdict, info)
    name = "real_geometry.png"
    if found and key == "block_structure":  # one figure for the three rows
        short = {SMOL: "SmolLM2 (Q4_1)", GEMMA: "Gemma 3 (Q4_K_M)", REQ: "SmolLM2 (Q4_0)"}
        styles = {short[m]: "o--" if m == REQ else "o-" for m in found}
        F._save(G.figure({short[m]: v for m, v in found.items()}, styles), out, name)
    combined = G.combined([verdicts[m] for m in (SMOL, GEMMA) if m in verdicts])
    return Row(key=key, title=G.TITLES[key], cells=cells,
               command=f"lensdiv analyze {SMOL} --plugins similarity,spectrum --max-tokens 256 "
               "-O similarity.max_state_gb=6",
               verdict=combined if verdicts else "not run", rule=G.RULES[key],
               figure=f"findings/{name}", values=vals)


def row_block_structure(runs: dict[str, Any], out: Path) -> Row:
    return _geometry_row("block_structure", runs, out)


def row_entropy_dip(runs: dict[str, Any], out: Path) -> Row:
    return _geometry_row("entropy_dip", runs, out)


def row_cka_outliers(runs: dict[str, Any], out: Path) -> Row:
    return _geometry_row("cka_outliers", runs, out)


def patch_handoff(p: dict[str, Any]) -> dict[str, Any]:
    """Where patching the clean residual stream restores the clean answer: per layer, the score
    at the answer position (offset 0) and the best earlier position."""
    layers = sorted(set(p["layer"]))
    last, best, where = [], [], []
    for layer in layers:
        rows = [i for i, (lay, site) in enumerate(zip(p["layer"], p["site"], strict=True))
                if lay == layer and site == "resid_pre"]
        at = {p["pos"][i]: p["score"][i] for i in rows}
        earlier = {k: v for k, v in at.items() if k < 0 and v == v}
        last.append(at.get(0, math.nan))
        w = max(earlier, key=earlier.get) if earlier else 0
        where.append(w)
        best.append(earlier.get(w, math.nan))
    first = next((i for i, v in enumerate(last) if v >= 0.5), None)
    return {"last": last, "earlier_best": best, "earlier_pos": where, "answer_from": first}


def row_patch(runs: dict[str, Any], out: Path) -> Row:
    cells, vals = {}, {}
    fig, (ax,) = F._figure(1, 6)
    for m, p in _models(runs, "patch", "patch").items():
        h = patch_handoff(p)
        L = len(h["last"])
        vals[m] = h
        frm = h["answer_from"]
        early = max(range(L), key=lambda i: h["earlier_best"][i])
        cells[m] = (f"{p['pairs']} capital-city pairs (`The capital of France is` → ` Paris`): "
                    f"patching h_l at the answer position restores ≥ half of the clean logit "
                    f"difference from h_{frm} (ℓ/L {frm / L:.2f}) on" if frm is not None else
                    f"{p['pairs']} capital-city pairs: patching h_l at the answer position "
                    "never restores half of the clean logit difference")
        cells[m] += (f"; an earlier position restores most at h_{early} (offset "
                     f"{h['earlier_pos'][early]}, score {h['earlier_best'][early]:.2f})")
        depth = np.arange(L) / L
        ax.plot(depth, h["last"], "o-", ms=3, label=f"{LABELS[m]}: answer position")
        ax.plot(depth, h["earlier_best"], "s:", ms=3, label=f"{LABELS[m]}: best earlier position")
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set(xlabel="relative depth ℓ/L of the patched h_l", ylabel="share of the clean logit "
           "difference restored", ylim=(-0.2, 1.2), title="activation patching, clean → corrupt")
    ax.legend(fontsize=6)
    return Row(key="patch_handoff", title="Patching: where the answer moves to the last position",
               cells=cells, command=f"lensdiv analyze {SMOL} --plugins patch "
               "-O patch.erasure=false -O patch.ig_steps=8",
               verdict=F.COMPARED,
               rule="a comparison (verdict: compared), as causal tracing reads it (Meng et al. "
               "2022): the residual stream of the clean prompt patched into the corrupt run one "
               "(layer, position) at a time; per layer, the share of the clean logit difference "
               "restored at the answer position and at the best earlier position (the subject)",
               figure=F._save(fig, out, "real_patch.png"), values=vals)


ROWS = [row_contribution, row_skip, row_bias, row_submod, row_dynamics, row_prune, row_reorder,
        row_patch, row_patchscope, row_sinks, row_massive, row_block_structure, row_entropy_dip,
        row_cka_outliers]


def quantization(runs: dict[str, Any]) -> dict[str, Any]:
    """Each model's own next-token CE (the logit lens at h_L) and what the re-quantization
    changes."""
    ce = {m: v["ce"][-1] for m, v in _models(runs, "one", "lens").items()}
    held = {m: {"ce": v["ce"][-1], "positions": v["positions"]}
            for m, v in _models(runs, "ce", "lens").items()}
    return {"ce_final": ce, "ce_heldout": held}


def robust(rows: list[Row]) -> dict[str, str]:
    """Per row: whether the re-quantized copy's verdict is SmolLM2's."""
    out = {}
    for r in rows:
        a, b = r["cells"].get(SMOL, ""), r["cells"].get(REQ, "")
        if not a or not b:
            continue
        va, vb = a.rsplit("**", 2)[-2], b.rsplit("**", 2)[-2]
        out[r["key"]] = "same verdict" if va == vb else f"{va} → {vb}"
    return out


def render(rows: list[Row], runs: dict[str, Any], q: dict[str, Any], run: dict[str, Any]) -> str:
    ce = q["ce_final"]
    lines = [
        "# The findings on real models",
        "",
        "<!-- Generated by docs/findings_real.py (`make findings-real`); edit the script, not "
        "this file. -->",
        "",
        "The rows of [findings.md](findings.md) measured on two small real language models: "
        "**SmolLM2-135M-Instruct** (Llama architecture, 30 blocks) and **Gemma-3-270M** (18 "
        "blocks, a 262 144-token vocabulary), lensdiv's catalog models `smollm2-135m` and "
        "`gemma3-270m`. **Their weights are 4-bit GGUF quantizations (Q4_1 and Q4_K_M) that "
        "lensdiv dequantizes to float32, not the published bf16 weights.** To see what a "
        "quantization changes, SmolLM2 was measured a second time from a copy of its GGUF file "
        "whose tensors were quantized again to Q4_0 ([`bench/requantize_gguf.py`]"
        "(../bench/requantize_gguf.py)): its weights are the Q4_1 weights with a second, "
        "coarser 4-bit rounding on top. The text is Python's documentation (`--data pydoc`, "
        "the default for real models; the patchscope row reads `pydoc:heldout`). Verdict rules "
        "and helpers are those of [`docs/findings.py`](findings.py), imported by "
        "[`docs/findings_real.py`](findings_real.py), which measured every number and drew "
        "every figure here; [`findings_real.json`](findings_real.json) holds the values.",
        "",
        f"**This run:** {run['date']}, {run['machine']}; budgets of 128–256 tokens per run "
        "(2 shared CPU cores), so every figure carries the noise of a few hundred tokens of one "
        "kind of text; SEMs are given where the analyzer gives them (the logit lens' KL). Time "
        "per run: " + ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in runs.items()) + ".",
        "",
        "**Quantization.** Next-token cross-entropy on the pydoc tokens of the `one` run (the "
        "logit lens at h_L is the model itself): "
        + ", ".join(f"{LABELS[m]} {v:.3f} nats/token" for m, v in ce.items())
        + (". On the held-out part of pydoc (every tenth topic): " + ", ".join(
            f"{LABELS[m]} {v['ce']:.3f} nats/token ({v['positions']} positions)"
            for m, v in q["ce_heldout"].items()) if q["ce_heldout"] else "")
        + " (no standard error: the lens analyzer sums the loss without its square; neither "
        "model was trained on lensdiv's split, but their pretraining may have seen Python's "
        "documentation). Verdicts of the re-quantized copy against SmolLM2's: "
        + (", ".join(f"{k}: {v}" for k, v in run["robust"].items()) or "—") + ".",
        "",
        "| finding | " + " | ".join(LABELS[m] for m in (SMOL, GEMMA, REQ))
        + " | command | verdict (SmolLM2, Gemma) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = " | ".join(F._cell(r["cells"].get(m, "not run")) for m in (SMOL, GEMMA, REQ))
        lines.append(f"| [{F._cell(r['title'])}](#{r['key'].replace('_', '-')}) | {cells} | "
                     f"`{F._cell(r['command'])}` | **{r['verdict']}** |")
    for r in rows:
        lines += ["", f'<a id="{r["key"].replace("_", "-")}"></a>', f"## {r['title']}", ""]
        lines += [f"- **{LABELS[m]}:** {r['cells'][m]}." for m in (SMOL, GEMMA, REQ)
                  if m in r["cells"]]
        lines += [f"- **Command:** `{r['command']}`",
                  f"- **Verdict: {r['verdict']}**. Rule: {r['rule']}.", "",
                  f"![{r['title']}]({r['figure']})"]
    lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--only", help="comma-separated run keys (default: every run)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs recorded in findings_real.json that are not measured")
    parser.add_argument("--render", action="store_true", help="measure nothing: render only")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    path = args.out / "findings_real.json"
    runs: dict[str, Any] = {}
    if (args.reuse or args.render) and path.is_file():
        runs = json.loads(path.read_text())["runs"]
    keys = [] if args.render else (args.only.split(",") if args.only else list(RUNS))
    for key in keys:
        print(f"measuring {key} ...", file=sys.stderr, flush=True)
        runs[key] = measure(key)
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"runs": runs}, indent=1, default=F._plain) + "\n")
    runs = {k: runs[k] for k in RUNS if k in runs}
    rows = [row(runs, args.out) for row in ROWS]
    q = quantization(runs)
    run = {"date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()} CPU cores (shared), one torch thread",
           "versions": F._versions(), "robust": robust(rows)}
    (args.out / "findings_real.md").write_text(render(rows, runs, q, run))
    record = {"run": run, "runs": runs, "quantization": q,
              "rows": [{k: v for k, v in r.items()} for r in rows]}
    path.write_text(json.dumps(record, indent=1, default=F._plain) + "\n")


if __name__ == "__main__":
    main()
