"""The precision policy (issue 15): residual states are read out in float32 whatever the model's
dtype, and statistics accumulate in float64, so the only error left is the model's own.

On tiny models in bfloat16 and float16, every analyzer's numbers equal a float64 reference
computed from the *same* low-precision activations (captured by hooks; the low-precision forward
is deterministic, which the tests check where it matters) to 1e-5 relative: the logit lens, the
sublayer contributions, the hidden-state dynamics and last-block lens, the bias–diversity
decomposition, submodularity scores (direct and removal), layer skipping (whose effects the
``depth-score`` analyzer aggregates in float64), patching readouts and the linear maps. The
references are independent: the final norm applied by hand from the module's parameters, float64
log-softmaxes, per-position loops. The bf16-vs-fp32 *model* difference (the model's own error) is
measured and stated, not asserted tight. Every analyzer also runs on a float64 model and agrees
with float32. The readout is device-safe: a model whose ``lm_head`` and final norm accelerate
offloaded to disk reads out like the same model in memory.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lensdiv.analyzers.bias import BiasDiversity, direct_decomposition
from lensdiv.analyzers.contrib import Contribution
from lensdiv.analyzers.dynamics import Dynamics
from lensdiv.analyzers.lens import LogitLens
from lensdiv.analyzers.linmap import LinearMaps, heldout_mask
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.core.registry import list_plugins, make_analyzers
from lensdiv.data.sources import DataSpec
from lensdiv.ops.capture import capture
from lensdiv.ops.members import member_hooks
from lensdiv.ops.patching import integrated_gradients, run_variants
from lensdiv.ops.readout import Workspace, final_readout, readout_dtype
from lensdiv.ops.resume import Resumer
from lensdiv.ops.rowstats import lens_statistics
from lensdiv.ops.skipping import skip_effects, split_intervals
from lensdiv.ops.subsets import direct_scores, removal_scores
from lensdiv.run.runner import analyze
from tests.helpers import batches_of
from tests.test_dynamics import naive_profiles

RTOL = 1e-5
LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SPEC = DataSpec(seq_len=16, max_tokens=16 * 4, batch_size=2)


@pytest.fixture(scope="module")
def boot(tiny_dirs: dict[str, Path]) -> Any:
    """``boot(arch, dtype)``: a tiny Hugging Face model loaded in ``dtype`` (cached)."""
    from transformer_lens import TransformerBridge

    booted: dict[tuple[str, torch.dtype], Any] = {}

    def get(arch: str, dtype: torch.dtype) -> Any:
        if (arch, dtype) not in booted:
            model = TransformerBridge.boot_transformers(
                str(tiny_dirs[arch]), device="cpu", dtype=dtype
            )
            booted[arch, dtype] = model.eval()
        return booted[arch, dtype]

    return get


# -- an independent float64 readout -----------------------------------------------------------------


def norm64(model: Any, h: torch.Tensor) -> torch.Tensor:
    """The final norm in float64, applied by hand from the Hugging Face module's parameters."""
    ln = model.ln_final
    inner = getattr(ln, "original_component", None) or ln
    x = h.double()
    eps = float(getattr(inner, "eps", None) or inner.variance_epsilon)
    weight = inner.weight.detach().double()
    if str(model.cfg.normalization_type).startswith("RMS"):
        return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * weight
    bias = inner.bias.detach().double() if getattr(inner, "bias", None) is not None else None
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def logits64(model: Any, h: torch.Tensor) -> torch.Tensor:
    return norm64(model, h) @ model.W_U.detach().double() + model.b_U.detach().double()


def resid_names(info: ModelInfo) -> list[str]:
    return [info.resid(layer) for layer in range(info.n_layers + 1)]


def close(got: Any, want: Any, what: str, rtol: float = RTOL) -> None:
    """Relative agreement; entries that are zero in the reference (a KL at the output, a rank)
    are compared against the column's scale."""
    got, want = np.asarray(got, dtype=float), np.asarray(want, dtype=float)
    scale = max(float(np.abs(want).max()), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-3 * rtol * scale, err_msg=what)


def captured(model: Any, spec: DataSpec, names: list[str]) -> list[tuple[Batch, dict[str, Any]]]:
    """The low-precision activations of every batch, captured by hooks."""
    out = []
    with torch.no_grad():
        for batch in batches_of(model, spec):
            _, cache = capture(model, batch.tokens, names, need_logits=False)
            out.append((batch, cache))
    return out


# -- the readout itself -------------------------------------------------------------------------------


def test_readout_dtype() -> None:
    assert readout_dtype(torch.bfloat16) == torch.float32
    assert readout_dtype(torch.float16) == torch.float32
    assert readout_dtype(torch.float32) == torch.float32
    assert readout_dtype(torch.float64) == torch.float64


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_readout_logits_equal_float64_on_low_precision_states(
    boot: Any, arch: str, dtype: str
) -> None:
    model = boot(arch, LOW[dtype])
    info = ModelInfo.from_model(model)
    ((batch, cache),) = captured(model, DataSpec(seq_len=16, max_tokens=32, batch_size=2),
                                 resid_names(info))
    readout = final_readout(model)
    assert readout.dtype == torch.float32 and readout.model_dtype == LOW[dtype]
    assert readout.kind == ("RMS" if arch == "llama" else "LN")
    h = cache[info.resid(1)].reshape(-1, info.d_model)
    ours, want = readout.logits(h), logits64(model, h)
    assert ours.dtype == torch.float32
    assert float((ours - want).abs().max() / want.abs().max()) < 1e-6
    # The model's own half-precision readout is what the policy avoids: far off.
    with torch.no_grad():
        own = model.unembed(model.ln_final(h[None]))[0]
    assert float((own.double() - want).abs().max() / want.abs().max()) > 1e-4


# -- lens --------------------------------------------------------------------------------------------


def lens_reference(model: Any, spec: DataSpec, k: int, every: int = 1) -> dict[str, list[float]]:
    """The logit lens in float64 from the captured states (positions ``t mod every = 0``)."""
    info = ModelInfo.from_model(model)
    names = resid_names(info)
    sums: dict[str, np.ndarray] = {
        key: np.zeros(len(names))
        for key in ("kl", "overlap", "entropy", "ce", "target_prob", "top1_acc", "mean_rank")
    }
    n = n_target = 0
    for batch, cache in captured(model, spec, names):
        keep = batch.positions() & (torch.arange(batch.tokens.shape[1]) % every == 0)
        targets, has_target = batch.next_tokens()
        out = torch.log_softmax(logits64(model, cache[names[-1]])[keep], -1)
        top_out = out.topk(k, -1).indices
        t, w = targets[keep], has_target[keep]
        n += int(keep.sum())
        n_target += int(w.sum())
        for i, name in enumerate(names):
            lp = torch.log_softmax(logits64(model, cache[name])[keep], -1)
            sums["kl"][i] += float((lp.exp() * (lp - out)).sum(-1).sum())
            sums["entropy"][i] += float(-(lp.exp() * lp).sum(-1).sum())
            top = lp.topk(k, -1).indices
            sums["overlap"][i] += sum(
                len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(top, top_out, strict=True)
            )
            t_lp = lp.gather(-1, t[:, None])[:, 0]
            rank = (lp > t_lp[:, None]).sum(-1).double()
            sums["ce"][i] += float(-t_lp[w].sum())
            sums["target_prob"][i] += float(t_lp[w].exp().sum())
            sums["mean_rank"][i] += float(rank[w].sum())
            sums["top1_acc"][i] += float((rank[w] == 0).double().sum())
    per = {key: n if key in ("kl", "overlap", "entropy") else n_target for key in sums}
    return {key: (value / per[key]).tolist() for key, value in sums.items()}


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lens_equals_float64_reference(boot: Any, arch: str, dtype: str) -> None:
    model = boot(arch, LOW[dtype])
    run = analyze(model, data=SPEC, plugins=[LogitLens()], progress=False)
    assert run.ok, run.errors
    result = run["lens"]
    assert run.manifest["model"]["dtype"] == dtype
    assert run.manifest["model"]["readout_dtype"] == "float32"
    assert result.meta["model"]["readout_dtype"] == "float32"
    assert result.meta["readout"] == "float32"
    table = result.table()
    want = lens_reference(model, SPEC, 5)
    for col, key in [("kl", "kl"), ("entropy", "entropy"), ("ce", "ce"),
                     ("target_prob", "target_prob"), ("top5_overlap", "overlap"),
                     ("top1_acc", "top1_acc"), ("mean_rank", "mean_rank")]:
        close(table[col], want[key], col)


@pytest.mark.parametrize("every", [3, 5])
def test_lens_every_reads_every_kth_position(boot: Any, every: int) -> None:
    model = boot("gpt2", torch.float32)
    run = analyze(model, data=SPEC, plugins=[LogitLens(every=every)], progress=False)
    result = run["lens"]
    assert result.meta["every"] == every
    assert result.meta["positions"] == sum(
        int((b.positions() & (torch.arange(b.tokens.shape[1]) % every == 0)).sum())
        for b in batches_of(model, SPEC))
    table, want = result.table(), lens_reference(model, SPEC, 5, every)
    for col, key in [("kl", "kl"), ("ce", "ce"), ("top5_overlap", "overlap")]:
        close(table[col], want[key], col)


def test_bf16_model_against_fp32_model(boot: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The model's own error, stated: the same tiny llama in bfloat16 and float32 (README)."""
    runs = {
        name: analyze(boot("llama", dtype), data=SPEC, plugins=[LogitLens()], progress=False)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    a, b = runs["bfloat16"]["lens"].table(), runs["float32"]["lens"].table()
    diff = {
        col: float(np.max(np.abs(a[col][:-1] - b[col][:-1]) / np.abs(b[col][:-1])))
        for col in ("kl", "ce", "entropy")
    }
    with capsys.disabled():
        print(f"\nlens, bf16 model vs fp32 model (max relative difference over layers): {diff}")
    # Not a precision bound: a sanity check that both models compute the same thing.
    assert all(value < 0.2 for value in diff.values()), diff


# -- contrib -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_contrib_equals_float64_reference(boot: Any, dtype: str) -> None:
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    L = info.n_layers
    analyzer = Contribution()
    run = analyze(model, data=SPEC, plugins=[analyzer], progress=False)
    table = run["contrib"].table()
    names = analyzer.hooks(info)
    sums = {key: np.zeros(L) for key in ("r_attn", "r_mlp", "r_block", "cos_attn", "cos_mlp",
                                          "cos_update", "cos_next", "norm_resid_mean")}
    n = 0

    def cos(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp_min(1e-6)

    for batch, cache in captured(model, SPEC, names):
        keep = batch.positions(exclude_bos=True)
        n += int(keep.sum())
        for layer in range(L):
            h = cache[info.resid(layer)][keep].double()
            nxt = cache[info.resid(layer + 1)][keep].double()
            a = cache[f"blocks.{layer}.hook_attn_out"][keep].double()
            m = cache[f"blocks.{layer}.hook_mlp_out"][keep].double()
            mid = h + a
            sums["r_attn"][layer] += float((a.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-6)).sum())
            sums["r_mlp"][layer] += float((m.norm(dim=-1) / mid.norm(dim=-1).clamp_min(1e-6)).sum())
            sums["r_block"][layer] += float(
                ((a + m).norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-6)).sum())
            sums["cos_attn"][layer] += float(cos(a, h).sum())
            sums["cos_mlp"][layer] += float(cos(m, mid).sum())
            sums["cos_update"][layer] += float(cos(nxt - h, h).sum())
            sums["cos_next"][layer] += float(cos(nxt, h).sum())
            sums["norm_resid_mean"][layer] += float(h.norm(dim=-1).sum())
    for key, value in sums.items():
        close(table[key], value / n, key)


# -- dynamics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_dynamics_equals_float64_reference(boot: Any, dtype: str) -> None:
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    L = info.n_layers
    run = analyze(model, data=SPEC, plugins=[Dynamics(every=1)], progress=False)
    assert run.ok, run.errors
    result = run["dynamics"]
    assert result.meta["every"] == 1 and result.meta["readout"] == "float32"
    names = resid_names(info)
    states, ce, count = [], np.zeros(L), 0
    for batch, cache in captured(model, SPEC, names):
        keep = batch.positions()
        states.append(torch.stack([cache[name][keep] for name in names]).double().numpy())
        targets, has_target = batch.next_tokens()
        scored = keep & has_target
        count += int(scored.sum())
        for layer in range(L):  # h_l written in as the last block's input by a hook: bf16 pass
            seen: dict[str, torch.Tensor] = {}

            def put(x: Any, hook: Any, value: Any = cache[names[layer]]) -> Any:
                return value

            def keep_final(x: Any, hook: Any, seen: dict[str, Any] = seen) -> Any:
                seen["h"] = x
                return x

            hooks = [(names[-1], keep_final)]
            if layer < L - 1:
                hooks.append((info.resid(L - 1), put))
            with torch.no_grad(), model.hooks(fwd_hooks=hooks):
                model(batch.tokens)
            if layer == L - 1:  # the same low-precision activations: bit for bit
                assert torch.equal(seen["h"], cache[names[-1]])
            lp = torch.log_softmax(logits64(model, seen["h"]), -1)
            ce[layer] += float(-lp.gather(-1, targets[..., None])[..., 0][scored].sum())
    want = naive_profiles(np.concatenate(states, axis=1))
    updates, table = result.table("updates"), result.table("states")
    for key in ("theta", "theta_update"):
        close(updates[key][: want[key].shape[1]], want[key].mean(0), key)
    for key in ("norm", "to_final", "progress"):
        close(table[key][1:], want[key].mean(0)[1:], key)  # progress is 0 at h_0
    close(updates["last_block_lens_ce"], ce / count, "last_block_lens_ce")


# -- bias --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_bias_equals_float64_reference(boot: Any, dtype: str) -> None:
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    hooks = member_hooks(info)
    M = 2 * info.n_layers + 1
    run = analyze(model, data=SPEC, plugins=[BiasDiversity(every=1, ce_depth=True)],
                  progress=False)
    assert run.ok, run.errors
    result = run["bias"]
    inner = model.ln_final.original_component
    gamma, eps = inner.weight.detach().double(), float(inner.variance_epsilon)
    W, b = model.W_U.detach().double(), model.b_U.detach().double()
    sums: dict[str, Any] = {}
    n = 0
    for batch, cache in captured(model, SPEC, hooks):
        targets, has_target = batch.next_tokens()
        keep = batch.positions() & has_target
        h_last = cache[hooks[-1]][keep].double()
        sigma = (h_last.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        z = torch.stack([(cache[h][keep].double() / sigma * gamma) @ W for h in hooks[:-1]])
        y = targets[keep]
        n += int(keep.sum())
        for size in range(1, M + 1, 2):  # prefix ensembles h_0 .. h_L, the last is the model
            out = direct_decomposition(size * z[:size] + b, y)
            for key, value in out.items():
                total = value.sum(-1) if key in ("sq_bias", "sq_div", "ce", "kl", "correct") \
                    else value.sum()
                sums[size, key] = sums.get((size, key), 0) + total
    full = {key: sums[M, key] / n / (M if key in ("sq_bias", "sq_div", "ce", "kl") else 1)
            for key in ("sq_bias", "sq_div", "ce", "kl", "correct")}
    members = result.table("members")
    for col, key in [("sq_bias", "sq_bias"), ("sq_diversity", "sq_div"), ("ce_bias", "ce"),
                     ("ce_diversity", "kl"), ("top1_acc", "correct")]:
        close(members[col], full[key].numpy(), col)
    depth = result.table("depth")
    sizes = list(range(1, M + 1, 2))
    for col, key, per_member in [("bias", "sq_bias", True), ("diversity", "sq_div", True),
                                 ("ensemble_loss", "sq_ens", False), ("ce_bias", "ce", True),
                                 ("ce_diversity", "kl", True), ("ce_loss", "ce_ens", False),
                                 ("accuracy", "correct_ens", False)]:
        want = [float(sums[s, key].sum()) / n / (s if per_member else 1) for s in sizes]
        close(depth[col], want, col)


# -- submod ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_submod_scores_equal_float64_reference(boot: Any, dtype: str) -> None:
    """Both modes' measurements, ``F(S)`` summed over positions: direct (member logits) and
    removal (blocks truly skipped, in the model's dtype, then read out)."""
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    L, M = info.n_layers, 2 * info.n_layers + 1
    names = sorted(set(member_hooks(info)) | set(resid_names(info)))
    ((batch, cache),) = captured(model, DataSpec(seq_len=16, max_tokens=32, batch_size=2), names)
    step = Step(batch, cache, None, model, info)
    targets, has_target = batch.next_tokens()
    keep = batch.mask & has_target
    t = targets[keep]
    # Direct: the sum of the members' float64 logits plus the full constant.
    inner = model.ln_final.original_component
    gamma, eps = inner.weight.detach().double(), float(inner.variance_epsilon)
    h_last = cache[info.resid(L)][keep].double()
    sigma = (h_last.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    W, b = model.W_U.detach().double(), model.b_U.detach().double()
    z = torch.stack([(cache[h][keep].double() / sigma * gamma) @ W for h in member_hooks(info)[:-1]])
    masks = [1, 3, 0b1010101, (1 << M) - 1]
    want = []
    for mask in masks:
        lp = torch.log_softmax(sum(z[i] for i in range(M) if mask >> i & 1) + b, -1)
        want.append(float(lp.gather(-1, t[:, None]).sum()))
    close(direct_scores(step, masks, keep, targets).numpy(), want, "direct")
    # Removal: keep blocks {0, 2} by a full low-precision pass with hooks, read out in float64.
    kept = 0b101

    def skip1(x: Any, hook: Any) -> Any:
        return cache[info.resid(1)]

    seen: dict[str, torch.Tensor] = {}

    def final(x: Any, hook: Any) -> Any:
        seen["h"] = x
        return x

    with torch.no_grad(), model.hooks(fwd_hooks=[(info.resid(2), skip1),
                                                 (info.resid(L), final)]):
        model(batch.tokens)
    lp = torch.log_softmax(logits64(model, seen["h"][keep]), -1)
    got = removal_scores(step, [kept, (1 << L) - 1], keep, targets, Resumer(model))
    all_kept = torch.log_softmax(logits64(model, cache[info.resid(L)][keep]), -1)
    close(got.numpy(), [float(lp.gather(-1, t[:, None]).sum()),
                        float(all_kept.gather(-1, t[:, None]).sum())], "removal")


# -- skip (and depth-score, which aggregates the same effects in float64) ---------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_skip_effects_equal_float64_reference(boot: Any, dtype: str) -> None:
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    L = info.n_layers
    names = resid_names(info)
    ((batch, cache),) = captured(model, DataSpec(seq_len=32, max_tokens=64, batch_size=2), names)
    step = Step(batch, cache, None, model, info)
    g = torch.Generator().manual_seed(0)
    intervals = split_intervals(batch.mask, mode="future", splits=2, stride=8, generator=g)
    E, O = skip_effects(step, intervals)  # noqa: E741 - the paper's names
    for p in range(int(intervals.rows.numel())):
        r = int(intervals.rows[p])
        clean = [cache[name][r : r + 1] for name in names]
        skip = intervals.skip[p][None, :, None]
        measure = intervals.measure[p]
        p_clean = torch.softmax(logits64(model, clean[L][0]), -1)
        for s in range(L):
            store: dict[str, torch.Tensor] = {}

            def skip_block(x: Any, hook: Any, keep: Any = clean[s], skip: Any = skip) -> Any:
                return torch.where(skip, keep, x)

            def grab(x: Any, hook: Any, name: str, store: dict[str, Any] = store) -> Any:
                store[name] = x
                return x

            hooks = [(f"blocks.{s}.hook_resid_post", skip_block)]
            hooks += [(n_, lambda x, hook, n_=n_: grab(x, hook, n_)) for n_ in names]
            with torch.no_grad(), model.hooks(fwd_hooks=hooks):
                model(batch.tokens[r : r + 1])
            h = [store[name][0].double() for name in names]
            for layer in range(s, L):
                d_clean = clean[layer + 1][0].double() - clean[layer][0].double()
                ratio = (d_clean - (h[layer + 1] - h[layer])).norm(dim=-1) / d_clean.norm(
                    dim=-1).clamp_min(1e-6)
                close(float(E[p, s, layer]), float(ratio[measure].max()), f"E[{p},{s},{layer}]")
            p_skip = torch.softmax(logits64(model, store[names[-1]][0]), -1)
            dist = (p_clean - p_skip).norm(dim=-1)
            close(float(O[p, s]), float(dist[measure].max()), f"O[{p},{s}]")


# -- patch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_patch_readouts_equal_float64_reference(boot: Any, dtype: str) -> None:
    """Patched and erased passes run in the model's dtype and are read out in float32."""
    model = boot("llama", LOW[dtype])
    info = ModelInfo.from_model(model)
    names = resid_names(info)
    ((batch, cache),) = captured(model, DataSpec(seq_len=12, max_tokens=24, batch_size=2), names)
    layer, n_pos = 1, batch.tokens.shape[1]
    h = cache[info.resid(layer)]
    values = h.mean(1, keepdim=True).expand_as(h)  # the erasure map's kind of patch
    eye = torch.eye(n_pos, dtype=torch.bool)
    got = run_variants(Resumer(model), batch.tokens, layer, h, eye, values)
    assert got.dtype == torch.float32 and got.shape == (n_pos, 2, info.d_vocab)
    for t in range(n_pos):
        seen: dict[str, torch.Tensor] = {}

        def patch(x: Any, hook: Any, t: int = t) -> Any:
            x = x.clone()
            x[:, t] = values[:, t]
            return x

        def final(x: Any, hook: Any, seen: dict[str, Any] = seen) -> Any:
            seen["h"] = x
            return x

        with torch.no_grad(), model.hooks(fwd_hooks=[(info.resid(layer), patch),
                                                     (names[-1], final)]):
            model(batch.tokens)
        want = logits64(model, seen["h"][:, -1])
        err = float((got[t].double() - want).abs().max() / want.abs().max())
        assert err < 1e-6, (t, err)


# -- linmap ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(LOW), ids=list(LOW))
def test_linmap_equals_float64_reference(boot: Any, dtype: str) -> None:
    """Moments of low-precision activations in float64: the maps of least squares on them."""
    model = boot("gpt2", LOW[dtype])
    info = ModelInfo.from_model(model)
    docs = [f"Document {i}: the river ran past mill number {i} and on to the sea." for i in range(24)]
    spec = DataSpec.from_data(docs, seq_len=16, max_tokens=16 * 24, batch_size=4)
    run = analyze(model, data=spec, plugins=[LinearMaps(ridge=0.0)], progress=False)
    assert run.ok, run.errors
    result = run["linmap"]
    names = resid_names(info)
    parts = captured(model, spec, names)
    x = [np.concatenate([c[n].reshape(-1, info.d_model).double().numpy() for _, c in parts])
         for n in names]
    keep = np.concatenate([b.positions(exclude_bos=True).reshape(-1).numpy() for b, _ in parts])
    held = np.concatenate([heldout_mask(b, 0, 0.2).reshape(-1).numpy() for b, _ in parts])
    train, test = keep & ~held, keep & held
    assert result.meta["eval_positions"] == int(test.sum()) > 0
    r2 = np.empty((len(names), len(names)))
    for s in range(len(names)):
        design = np.concatenate([x[s][train], np.ones((int(train.sum()), 1))], axis=1)
        held_design = np.concatenate([x[s][test], np.ones((int(test.sum()), 1))], axis=1)
        for j in range(len(names)):
            coef = np.linalg.lstsq(design, x[j][train], rcond=None)[0]
            err = held_design @ coef - x[j][test]
            y = x[j][test]
            r2[s, j] = 1 - (err**2).sum() / ((y - y.mean(0)) ** 2).sum()
    close(result.arrays["r2"], r2, "r2")


# -- float64 models ----------------------------------------------------------------------------------

# Options that keep each analyzer to a second or two on a tiny model.
LIGHT = {
    "patch": {"ig_steps": 8},
    "skip": {"splits": 1},
    "submod": {"samples": 4, "greedy": 2},
    "depth-score": {"per_grade": 2, "batch_size": 4},
}
BUILTIN = sorted(e.name for e in list_plugins() if e.provider.startswith("lensdiv "))


@pytest.mark.parametrize("name", BUILTIN)
def test_every_analyzer_runs_on_a_float64_model(boot: Any, name: str) -> None:
    """It runs (the final-norm check once refused float64 models) and agrees with float32
    within the float32 model's own rounding."""
    results = {}
    for dtype in (torch.float32, torch.float64):
        model = boot("llama", dtype)
        analyzers = make_analyzers([name], {name: LIGHT.get(name, {})})
        spec = DataSpec(seq_len=24, max_tokens=24 * 4, batch_size=2)
        run = analyze(model, data=spec, plugins=analyzers, progress=False)
        assert run.ok, run.errors
        results[dtype] = run[analyzers[0].name]
    assert results[torch.float64].meta["model"]["readout_dtype"] == "float64"
    problems = []
    for table in results[torch.float32].tables:
        a, b = results[torch.float64].tables[table], results[torch.float32].tables[table]
        for col in a.columns:
            x, y = a[col], b[col]
            what = f"{name}: {table}.{col}"
            if x.dtype.kind not in "fc":
                if x.tolist() != y.tolist():
                    problems.append(what)
                continue
            ok = np.isfinite(y)
            scale = max(float(np.abs(y[ok]).max()), 1e-12) if ok.any() else 1.0
            if col.endswith("_gap"):  # an identity's rounding residue: float64 leaves less
                good = np.abs(x) <= np.abs(y) + 1e-10 * scale
            else:
                # Ratios over small differences (IG's completeness error over f(x) - f(x'))
                # amplify float32's rounding of the model itself.
                rtol = 1e-3 if col.endswith("rel_error") else 1e-4
                good = np.isclose(x, y, rtol=rtol, atol=1e-5 * scale, equal_nan=True)
            if not good.all():
                problems.append(f"{what}: {x.tolist()} vs {y.tolist()}")
    assert not problems, "\n".join(problems)


def test_integrated_gradients_of_a_float64_model_equal_a_float64_riemann_sum(boot: Any) -> None:
    """A float64 model's attributions come back in float64 (issue 29, point 14): they equal a
    plain midpoint Riemann sum of autograd gradients, one float64 pass per step, to float64
    rounding, and so do their completeness errors (float32 attributions miss by ~1e-4)."""
    model = boot("gpt2", torch.float64)  # (Hugging Face's RMSNorm computes in float32)
    info = ModelInfo.from_model(model)
    layer, steps = 1, 6
    ((batch, cache),) = captured(model, DataSpec(seq_len=12, max_tokens=24, batch_size=2),
                                 [info.resid(layer)])
    tokens = batch.tokens
    target = tokens[:, 1]
    x = cache[info.resid(layer)].detach()
    base = x[:, 1:].mean(1, keepdim=True).expand_as(x)

    def fn(lg: torch.Tensor) -> torch.Tensor:  # [k, batch, d_vocab] -> [k, batch]
        return lg.log_softmax(-1).gather(-1, target.expand(lg.shape[0], -1)[..., None])[..., 0]

    def f_and_grad(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h.detach().clone().requires_grad_(True)
        with torch.enable_grad(), model.hooks(fwd_hooks=[(info.resid(layer), lambda t, hook: h)]):
            value = fn(model(tokens)[None, :, -1].double())[0]
            (grad,) = torch.autograd.grad(value.sum(), h)
        return value.detach(), grad

    diff = x - base
    grads = [f_and_grad(base + (k + 0.5) / steps * diff)[1] for k in range(steps)]
    want = (diff * torch.stack(grads).mean(0)).sum(-1)
    want_gap = f_and_grad(x)[0] - f_and_grad(base)[0]
    assert float(want.abs().max()) > 1e-3 and float(want_gap.abs().min()) > 1e-3
    for start in (None, layer):  # the hooked full pass and the resumed one
        attr, f_x, f_base = integrated_gradients(
            model, tokens, info.resid(layer), x, base, fn, steps, start
        )
        assert attr.dtype == torch.float64 and f_x.dtype == torch.float64, start
        torch.testing.assert_close(attr, want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f_x - f_base, want_gap, rtol=1e-10, atol=1e-12)
        completeness = attr.sum(-1) - (f_x - f_base)
        want_completeness = want.sum(-1) - want_gap
        assert float(want_completeness.abs().min()) > 1e-8  # the midpoint rule's own error
        torch.testing.assert_close(completeness, want_completeness, rtol=1e-7, atol=0.0)
    # Lower precision keeps its float32 attributions.
    low = boot("gpt2", torch.bfloat16)
    ((low_batch, low_cache),) = captured(low, DataSpec(seq_len=12, max_tokens=24, batch_size=2),
                                         [info.resid(layer)])
    h = low_cache[info.resid(layer)]
    attr, _, _ = integrated_gradients(
        low, low_batch.tokens, info.resid(layer), h, h.mean(1, keepdim=True).expand_as(h),
        lambda lg: lg.float().log_softmax(-1)[..., 0], 2
    )
    assert attr.dtype == torch.float32


# -- devices: an offloaded lm_head -------------------------------------------------------------------


def test_readout_with_lm_head_offloaded_to_disk(tiny_dirs: dict[str, Path], tmp_path: Path,
                                                boot: Any) -> None:
    """accelerate offloads ``lm_head`` and the final norm to disk (weights on ``meta``): the
    readout reads them under ``align_module_device`` and equals the in-memory model's."""
    from transformer_lens import TransformerBridge

    L = 3
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu",
                  **{f"model.layers.{i}": "cpu" for i in range(L)},
                  "model.norm": "disk", "lm_head": "disk"}
    model = TransformerBridge.boot_transformers(
        str(tiny_dirs["llama"]), device_map=device_map, offload_folder=str(tmp_path / "offload"),
        dtype=torch.float32).eval()
    assert model.unembed.original_component.weight.device.type == "meta"
    assert model.ln_final.original_component.weight.device.type == "meta"
    readout = final_readout(model)
    assert readout.kind == "RMS" and readout.device.type == "cpu"
    reference = boot("llama", torch.float32)
    torch.testing.assert_close(readout.W_U, final_readout(reference).W_U)
    torch.testing.assert_close(readout.weight, final_readout(reference).weight)
    assert model.unembed.original_component.weight.device.type == "meta"  # offloaded again
    runs = [analyze(m, data=SPEC, plugins=["lens", "dynamics", "bias"], progress=False)
            for m in (model, reference)]
    for run in runs:
        assert run.ok, run.errors
    for name in ("lens", "dynamics", "bias"):
        for table in runs[1][name].tables:
            for col, want in runs[1][name].tables[table].columns.items():
                got = runs[0][name].tables[table][col]
                if np.asarray(want).dtype.kind in "fc":
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                               err_msg=f"{name}.{table}.{col}")


def test_lens_statistics_blocks_and_workspace_do_not_change_numbers(native_model: Any) -> None:
    """Rows read in many small blocks with a reused workspace equal one block."""
    info = ModelInfo.from_model(native_model)
    ((batch, cache),) = captured(native_model, DataSpec(seq_len=16, max_tokens=48, batch_size=3),
                                 resid_names(info))
    states = [cache[name] for name in resid_names(info)]
    rows = torch.arange(batch.tokens.numel())
    targets = batch.next_tokens()[0].reshape(-1)
    readout = final_readout(native_model)
    one = lens_statistics(readout, states, rows, targets, k=5)
    ws = Workspace()
    small = lens_statistics(readout, states, rows, targets, k=5, workspace=ws,
                            block_elements=7 * info.d_vocab)
    again = lens_statistics(readout, states, rows, targets, k=5, workspace=ws,
                            block_elements=7 * info.d_vocab)
    for key in ("kl", "entropy", "overlap", "target_logp", "rank"):
        torch.testing.assert_close(getattr(small, key), getattr(one, key), rtol=1e-6, atol=1e-9)
        assert torch.equal(getattr(small, key), getattr(again, key))
    assert math.isclose(float(one.kl[-1].abs().max()), 0.0)
