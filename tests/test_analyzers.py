"""Analyzers on tiny random models of every architecture (and a TL-native one).

A contract test runs every registered analyzer end to end; then the identities of SCIENCE.md A1
and A2 are checked against independent computations: a naive logit lens built from
``ln_final``/``W_U``/``b_U``, TransformerLens' own ``logit_lens``, the model's own cross-entropy,
and a per-token Python loop over ``run_with_cache`` activations. Streaming (merged shards) and
padding (pads never enter a statistic) are checked on the analyzers' own state.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console

from lensdiv.analyzers.contrib import Contribution
from lensdiv.analyzers.lens import LogitLens
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.registry import PluginEntry, list_plugins
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze, load_run
from lensdiv.testing.models import ARCHITECTURES, boot_native_tiny, boot_tiny
from tests.test_core import assert_results_equal

ARCHS = [*ARCHITECTURES, "native"]
PARALLEL = {"neox"}  # architectures built with a parallel residual (lensdiv/testing/models.py)


def fresh_model(arch: str, request: pytest.FixtureRequest) -> Any:
    """A private bridge, for runs that change the model (folded numerics)."""
    if arch == "native":
        return boot_native_tiny()
    return boot_tiny(arch, request.getfixturevalue("tiny_dirs")[arch])


# -- helpers -------------------------------------------------------------------------------------


def batches_of(model: Any, spec: DataSpec) -> list[Batch]:
    return list(token_batches(spec, model.tokenizer))


def run_state(analyzer: Analyzer, model: Any, batches: Iterable[Batch]) -> Stats:
    """Drive ``init``/``update`` directly, one ``capture`` per batch, like the runner does."""
    info = ModelInfo.from_model(model)
    state = analyzer.init(info)
    names = analyzer.hooks(info)
    for batch in batches:
        logits, cache = capture(model, batch.tokens, names, need_logits=analyzer.needs_logits)
        analyzer.update(state, Step(batch=batch, cache=cache, logits=logits, model=model,
                                    info=info))
    return state


def assert_tables_close(a: Result, b: Result, *, rtol: float, atol: float) -> None:
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        ta, tb = a.tables[name], b.tables[name]
        assert list(ta.columns) == list(tb.columns)
        for col in ta.columns:
            x, y = ta[col], tb[col]
            if x.dtype.kind in "fiu":
                np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"{name}.{col}")
            else:
                assert x.tolist() == y.tolist(), f"{name}.{col}"


def resid_names(model: Any) -> list[str]:
    n = model.cfg.n_layers
    return [f"blocks.{i}.hook_resid_pre" for i in range(n)] + [f"blocks.{n - 1}.hook_resid_post"]


def sublayer_names(model: Any) -> list[str]:
    names = []
    for i in range(model.cfg.n_layers):
        names += [f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_attn_out",
                  f"blocks.{i}.hook_mlp_out", f"blocks.{i}.hook_resid_post"]
    return names


# -- contract over every registered analyzer -----------------------------------------------------


def _plugin_params() -> list[Any]:
    params = []
    for entry in list_plugins():
        marks = []
        if entry.cls is None and entry.provider.split()[0] != "lensdiv":
            marks = [pytest.mark.skip(reason=f"third-party plugin failed to load: {entry.error}")]
        params.append(pytest.param(entry, id=entry.name, marks=marks))
    return params


@pytest.mark.parametrize("entry", _plugin_params())
def test_contract(entry: PluginEntry, model: Any, arch: str,
                  request: pytest.FixtureRequest) -> None:
    assert entry.cls is not None, f"lensdiv's own plugin {entry.name!r} failed: {entry.error}"
    cls = entry.cls
    analyzer = cls.from_options({})
    assert analyzer.name == entry.name and cls.description
    info = ModelInfo.from_model(model)
    hooks = analyzer.hooks(info)
    missing = [h for h in hooks if h not in model.hook_dict]
    assert not missing, f"{entry.name} declares hooks {arch} lacks: {missing}"

    target = fresh_model(arch, request) if cls.numerics == "folded" else model
    spec = DataSpec(max_tokens=256, seq_len=32, batch_size=4)
    run = analyze(target, data=spec, plugins=[entry.name], progress=False, seed=3)
    assert run.ok, run.errors
    result = run[entry.name]
    assert result.analyzer == entry.name

    text = result.to_json()
    back = Result.from_json(text)
    assert_results_equal(back, result)
    assert back.to_json() == text

    console = Console(file=io.StringIO(), width=100)
    console.print(result)
    rendered = console.file.getvalue()
    assert entry.name in rendered
    assert max(len(line) for line in rendered.splitlines()) <= 100

    meta = result.meta
    options = json.loads(json.dumps({k: list(v) if isinstance(v, tuple) else v
                                     for k, v in analyzer.options().items()}))
    assert meta["options"] == options
    assert meta["seed"] == 3
    for dist in ("lensdiv", "torch", "transformer-lens"):
        assert meta["versions"][dist] not in ("", "not installed"), dist
    assert meta["model"]["n_layers"] == model.cfg.n_layers
    assert meta["model"]["d_model"] == model.cfg.d_model
    if meta["data"] == "own examples":  # task analyzers measure on their own examples
        info = ModelInfo.from_model(model)
        own = analyzer.examples(model, info)
        assert meta["tokens"] == sum(b.n_tokens for b in own)
    else:
        assert meta["tokens"] == sum(b.n_tokens for b in batches_of(model, spec))


def test_run_saves_and_loads(native_model: Any, tmp_path: Path) -> None:
    spec = DataSpec(max_tokens=64, seq_len=16, batch_size=2)
    run = analyze(native_model, data=spec, plugins="lens,contrib", out=tmp_path, progress=False)
    assert run.ok
    loaded = load_run(tmp_path)
    assert loaded.ok and set(loaded.results) == {"lens", "contrib"}
    for name, result in run.results.items():
        assert_results_equal(loaded.results[name], result)


# -- residual identity ---------------------------------------------------------------------------


def test_residual_identity(model: Any) -> None:
    spec = DataSpec(max_tokens=48, seq_len=16, batch_size=3)
    (batch,) = batches_of(model, spec)
    _, cache = capture(model, batch.tokens, sublayer_names(model), need_logits=False)
    n = model.cfg.n_layers
    total = cache["blocks.0.hook_resid_pre"].clone()
    for i in range(n):
        total += cache[f"blocks.{i}.hook_attn_out"] + cache[f"blocks.{i}.hook_mlp_out"]
    h_last = cache[f"blocks.{n - 1}.hook_resid_post"]
    assert h_last.abs().max() > 1e-3  # not trivially zero
    torch.testing.assert_close(h_last, total, atol=1e-5, rtol=0)


# -- logit lens (A2) ----------------------------------------------------------------------------

LENS_SPEC = DataSpec(seq_len=16, max_tokens=16 * 6, batch_size=4)


def _naive_lens(model: Any, tokens: torch.Tensor, keep: torch.Tensor, k: int) -> dict[str, Any]:
    """Every lens statistic from ``ln_final``, ``W_U`` and ``b_U`` applied by hand."""
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=resid_names(model))
        out = torch.log_softmax(logits.double(), -1)[keep]
        has_target = keep.clone()
        has_target[:, -1] = False
        target = tokens[:, 1:][has_target[:, :-1]]
        stats: dict[str, list[float]] = {key: [] for key in
                                         ("kl", "overlap", "entropy", "ce", "target_prob",
                                          "top1_acc", "mean_rank")}
        top_out = out.topk(k, -1).indices
        for name in resid_names(model):
            h = cache[name]
            lp_all = torch.log_softmax((model.ln_final(h) @ model.W_U + model.b_U).double(), -1)
            lp = lp_all[keep]
            stats["kl"].append(float((lp.exp() * (lp - out)).sum(-1).mean()))
            top = lp.topk(k, -1).indices
            stats["overlap"].append(np.mean([len(set(a.tolist()) & set(b.tolist())) / k
                                             for a, b in zip(top, top_out, strict=True)]))
            stats["entropy"].append(float(-(lp.exp() * lp).sum(-1).mean()))
            lpt = lp_all[:, :-1][has_target[:, :-1]]
            t_lp = lpt.gather(-1, target[:, None])[:, 0]
            stats["ce"].append(float(-t_lp.mean()))
            stats["target_prob"].append(float(t_lp.exp().mean()))
            rank = (lpt > t_lp[:, None]).sum(-1).double()
            stats["mean_rank"].append(float(rank.mean()))
            stats["top1_acc"].append(float((rank == 0).double().mean()))
    return {"logits": logits, **stats}


@pytest.mark.parametrize("exclude_bos", [False, True])
def test_lens_matches_naive_and_transformer_lens(model: Any, exclude_bos: bool) -> None:
    from transformer_lens.tools.analysis.logit_lens import logit_lens

    batches = batches_of(model, LENS_SPEC)
    assert all(bool(b.mask.all()) for b in batches)  # full rows: no pads in this test
    tokens = torch.cat([b.tokens for b in batches])
    keep = torch.ones_like(tokens, dtype=torch.bool)
    keep[:, 0] = not exclude_bos
    lens = LogitLens(exclude_bos=exclude_bos)
    run = analyze(model, data=LENS_SPEC, plugins=[lens], progress=False)
    assert run.ok, run.errors
    result = run["lens"]
    table = result.table()
    n_states = model.cfg.n_layers + 1
    assert table["layer"].tolist() == list(range(n_states))
    assert result.meta["positions"] == int(keep.sum())

    # Identities at h_L.
    assert abs(table["kl"][-1]) <= 1e-6
    assert table[f"top{lens.top_k}_overlap"][-1] == 1.0

    naive = _naive_lens(model, tokens, keep, lens.top_k)
    assert naive["kl"][-1] < 1e-5  # the naive readout of h_L is the model's output
    for col, key in [("kl", "kl"), ("entropy", "entropy"), ("ce", "ce"),
                     ("target_prob", "target_prob"), (f"top{lens.top_k}_overlap", "overlap"),
                     ("top1_acc", "top1_acc"), ("mean_rank", "mean_rank")]:
        np.testing.assert_allclose(table[col], naive[key], rtol=1e-4, atol=1e-5, err_msg=col)

    # The final state's CE is the model's own next-token loss over the same positions.
    logits = naive["logits"][:, :-1]
    targets = tokens[:, 1:]
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1),
                             reduction="none").view_as(targets)
    model_ce = float(losses[keep[:, :-1]].mean())
    assert abs(table["ce"][-1] - model_ce) <= 1e-4

    # TransformerLens' own logit lens over every position.
    with torch.no_grad():
        tl = logit_lens(model, tokens, positions=None, return_type="log_probs")
    assert len(tl.labels) == n_states
    lp = tl.values.double()  # [state, batch, pos, vocab]
    out = torch.log_softmax(naive["logits"].double(), -1)
    tl_kl = [float((lp[i].exp() * (lp[i] - out)).sum(-1)[keep].mean()) for i in range(n_states)]
    np.testing.assert_allclose(table["kl"], tl_kl, rtol=1e-4, atol=1e-5)


def test_lens_exclude_bos_drops_one_position_per_row(model: Any) -> None:
    counts = {}
    for exclude in (False, True):
        run = analyze(model, data=LENS_SPEC, plugins=[LogitLens(exclude_bos=exclude)],
                      progress=False)
        counts[exclude] = run["lens"].meta["positions"]
    n_rows = sum(b.tokens.shape[0] for b in batches_of(model, LENS_SPEC))
    assert counts[False] - counts[True] == n_rows
    assert counts[False] == sum(b.n_tokens for b in batches_of(model, LENS_SPEC))


# -- sublayer contributions (A1) -----------------------------------------------------------------


def _naive_contrib(cache: Any, mask: torch.Tensor, n_layers: int, parallel: bool,
                   exclude_bos: bool) -> dict[str, list[float]]:
    """Per-token Python loop over the cached activations, in float64."""
    eps = 1e-6

    def cos(x: torch.Tensor, y: torch.Tensor) -> float:
        return float(torch.dot(x, y)) / max(float(x.norm()) * float(y.norm()), eps)

    out: dict[str, list[float]] = {}
    for layer in range(n_layers):
        vals: dict[str, list[float]] = {}
        for b in range(mask.shape[0]):
            for t in range(mask.shape[1]):
                if not mask[b, t] or (exclude_bos and t == 0):
                    continue
                h = cache[f"blocks.{layer}.hook_resid_pre"][b, t].double()
                a = cache[f"blocks.{layer}.hook_attn_out"][b, t].double()
                m = cache[f"blocks.{layer}.hook_mlp_out"][b, t].double()
                h_next = cache[f"blocks.{layer}.hook_resid_post"][b, t].double()
                mlp_in = h if parallel else h + a
                row = {
                    "r_attn": float(a.norm()) / max(float(h.norm()), eps),
                    "r_mlp": float(m.norm()) / max(float(mlp_in.norm()), eps),
                    "r_block": float((a + m).norm()) / max(float(h.norm()), eps),
                    "cos_attn": cos(a, h),
                    "cos_mlp": cos(m, mlp_in),
                    "cos_update": cos(h_next - h, h),
                    "cos_next": cos(h_next, h),
                    "resid": float(h.norm()),
                    "attn": float(a.norm()),
                    "mlp": float(m.norm()),
                }
                for key, value in row.items():
                    vals.setdefault(key, []).append(value)
        for key, series in vals.items():
            if key in ("resid", "attn", "mlp"):
                out.setdefault(f"norm_{key}_mean", []).append(float(np.mean(series)))
                out.setdefault(f"norm_{key}_max", []).append(float(np.max(series)))
            else:
                out.setdefault(key, []).append(float(np.mean(series)))
    return out


@pytest.mark.parametrize("exclude_bos", [True, False])
def test_contrib_matches_naive_loop(model: Any, arch: str, exclude_bos: bool) -> None:
    spec = DataSpec(seq_len=12, max_tokens=30, batch_size=3)  # 3 rows, the last one padded
    (batch,) = batches_of(model, spec)
    assert not batch.mask.all()
    run = analyze(model, data=spec, plugins=[Contribution(exclude_bos=exclude_bos)],
                  progress=False)
    assert run.ok, run.errors
    result = run["contrib"]
    table = result.table()
    parallel = arch in PARALLEL
    assert result.meta["mlp_reference"] == ("h_l" if parallel else "h_l + a_l")
    with torch.no_grad():
        _, cache = model.run_with_cache(batch.tokens, names_filter=sublayer_names(model))
    naive = _naive_contrib(cache, batch.mask, model.cfg.n_layers, parallel, exclude_bos)
    assert table["layer"].tolist() == list(range(model.cfg.n_layers))
    assert set(naive) <= set(table.columns)
    for key, expected in naive.items():
        np.testing.assert_allclose(table[key], expected, rtol=1e-5, atol=1e-5, err_msg=key)
    for key in ("cos_attn", "cos_mlp", "cos_update", "cos_next"):
        assert np.all(np.abs(table[key]) <= 1 + 1e-6), key
    for key in ("resid", "attn", "mlp"):
        assert np.all(table[f"norm_{key}_max"] >= table[f"norm_{key}_mean"] - 1e-6), key
    assert result.meta["positions"] == int(batch.mask.sum()) - exclude_bos * batch.tokens.shape[0]


# -- streaming and padding -----------------------------------------------------------------------

ANALYZERS = {"lens": LogitLens, "contrib": Contribution}


@pytest.mark.parametrize("name", list(ANALYZERS))
def test_merged_halves_equal_one_pass(model: Any, name: str) -> None:
    analyzer = ANALYZERS[name]()
    spec = DataSpec(seq_len=16, max_tokens=16 * 7 + 5, batch_size=2)
    batches = batches_of(model, spec)
    assert len(batches) == 4 and not batches[-1].mask.all()
    info = ModelInfo.from_model(model)
    whole = run_state(analyzer, model, batches)
    merged = run_state(analyzer, model, batches[:2]).merge(run_state(analyzer, model, batches[2:]))
    assert float(merged["n"]) == float(whole["n"])
    one_pass, two_halves = analyzer.finalize(whole, info), analyzer.finalize(merged, info)
    assert_tables_close(two_halves, one_pass, rtol=1e-9, atol=1e-12)
    # The runner streams the same way.
    run = analyze(model, data=spec, plugins=[analyzer], progress=False)
    assert_tables_close(run[name], one_pass, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("pad_fill", ["pad", "random"])
@pytest.mark.parametrize("name", list(ANALYZERS))
def test_pads_never_enter_a_statistic(model: Any, name: str, pad_fill: str) -> None:
    analyzer = ANALYZERS[name]()
    (full,) = batches_of(model, DataSpec(seq_len=16, max_tokens=48, batch_size=3))
    tokens, half = full.tokens.clone(), 8
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, half:] = False
    if pad_fill == "pad":
        tokens[-1, half:] = model.tokenizer.pad_token_id
    else:  # whatever sits at a pad position must not matter
        gen = torch.Generator().manual_seed(11)
        tokens[-1, half:] = torch.randint(4, model.cfg.d_vocab, (tokens.shape[1] - half,),
                                          generator=gen)
    padded = Batch(tokens=tokens, mask=mask)
    pieces = [Batch(tokens=tokens[:-1], mask=mask[:-1]),
              Batch(tokens=tokens[-1:, :half], mask=mask[-1:, :half], index=1)]
    info = ModelInfo.from_model(model)
    with_pads = run_state(analyzer, model, [padded])
    without = run_state(analyzer, model, pieces[:1]).merge(run_state(analyzer, model, pieces[1:]))
    assert float(with_pads["n"]) == float(without["n"])
    assert_tables_close(analyzer.finalize(with_pads, info), analyzer.finalize(without, info),
                        rtol=1e-5, atol=1e-6)
