"""``sinks`` (docs/science.md F1): the patterns against Hugging Face's eager attention weights in
float64, the statistics against a naive loop, the example plugin where they overlap, and the
sink removal's identities (masking nothing changes nothing; a one-layer model's removal equals
Hugging Face's forward pass with the sink masked out of its attention mask)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from lensdiv.analyzers.sinks import Sinks
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.data.tokenizer import byte_tokenizer
from lensdiv.ops.attention import final_with, pattern_hook, remove_sink
from lensdiv.ops.capture import capture
from lensdiv.ops.resume import Resumer
from lensdiv.testing.models import boot_tiny, save_tiny_model, softcap_config

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 4  # the Gemma-2-style model's sliding window (its layer 0)


def _gemma2(directory: Path) -> Path:
    """A tiny Gemma-2-style model: a sliding-window layer, a global one, attention-logit and
    final-logit soft-capping, grouped-query attention."""
    config = softcap_config(n_layers=2)
    config.sliding_window = WINDOW
    config.layer_types = ["sliding_attention", "full_attention"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sinks_models")
    out = {arch: save_tiny_model(arch, root / arch) for arch in ("gpt2", "llama", "neox")}
    out["gemma2"] = _gemma2(root / "gemma2")
    out["gpt2-1"] = save_tiny_model("gpt2", root / "gpt2-1", n_layers=1)
    out["llama-1"] = save_tiny_model("llama", root / "llama-1", n_layers=1)
    return out


def _pair(directory: Path) -> tuple[Any, Any]:
    """The model booted through TransformerLens and loaded by Hugging Face (eager), float64."""
    from transformer_lens.model_bridge import TransformerBridge

    bridge = TransformerBridge.boot_transformers(str(directory), device="cpu", dtype=torch.float64)
    hf = AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", dtype=torch.float64
    )
    return bridge.eval(), hf.eval()


def _batch(width: int = 12, pad: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 200, (3, width), generator=g)
    tokens[:, 0] = 1
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, width - pad :] = False
    tokens[-1, width - pad :] = 0
    return Batch(tokens, mask)


def _step(model: Any, analyzer: Sinks, batch: Batch) -> Step:
    info = ModelInfo.from_model(model)
    _, cache = capture(model, batch.tokens, analyzer.hooks(info), need_logits=False)
    return Step(batch, cache, None, model, info)


def _naive(attn: list[np.ndarray], mask: np.ndarray, first: int, start: int) -> dict:
    """Per-head means over real queries ≥ start, by loops (float64)."""
    out = {k: np.zeros((len(attn), attn[0].shape[1])) for k in ("mass0", "mass_first", "entropy")}
    n = 0
    for b in range(mask.shape[0]):
        for q in range(start, mask.shape[1]):
            if not mask[b, q]:
                continue
            n += 1
            for layer, p in enumerate(attn):
                for h in range(p.shape[1]):
                    row = p[b, h, q, : q + 1]
                    out["mass0"][layer, h] += row[0]
                    out["mass_first"][layer, h] += row[:first].sum()
                    out["entropy"][layer, h] -= sum(x * math.log(x) for x in row if x > 0)
    return {k: v / n for k, v in out.items()}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "gemma2"])
def test_statistics_match_hf_eager_attention(arch: str, saved: dict[str, Path]) -> None:
    bridge, hf = _pair(saved[arch])
    batch = _batch()
    analyzer = Sinks(first=2, min_query=1, truth=False)
    step = _step(bridge, analyzer, batch)
    with torch.no_grad():
        attn = [a.numpy() for a in hf(batch.tokens, output_attentions=True).attentions]
    mask = batch.mask.numpy()
    for layer, want in enumerate(attn):
        got = step.cache[pattern_hook(layer)].numpy()
        assert got.shape == want.shape  # one row per query head (GQA repeats key heads)
        np.testing.assert_allclose(got[mask.nonzero()[0], :, mask.nonzero()[1]],
                                   want[mask.nonzero()[0], :, mask.nonzero()[1]], atol=1e-6)
    if arch == "gemma2":  # the window is on: layer 0's late queries see no key 0, layer 1's do
        assert (attn[0][:, :, WINDOW:, 0] == 0).all() and (attn[1][:, :, WINDOW:, 0] > 0).all()
    info = ModelInfo.from_model(bridge)
    state = analyzer.init(info)
    analyzer.update(state, step)
    result = analyzer.finalize(state, info)
    want = _naive(attn, mask, first=2, start=1)
    for key, value in want.items():
        np.testing.assert_allclose(result.arrays[key], value, atol=1e-6, err_msg=key)
    assert result.meta["queries"] == int(mask[:, 1:].sum())


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_agrees_with_the_attention_plugin(arch: str, saved: dict[str, Path]) -> None:
    """Where they overlap: the plugin's BOS mass and entropy with BOS left out as a query are
    ``mass0`` and ``entropy`` with ``min_query=1`` (float32 model)."""
    tiny_model = boot_tiny(arch, saved[arch])
    sys.path.insert(0, str(ROOT / "plugins" / "lensdiv-attention"))
    try:
        from lensdiv_attention import AttentionEntropy
    finally:
        sys.path.pop(0)
    info = ModelInfo.from_model(tiny_model)
    batch = _batch()
    ours, theirs = Sinks(first=1, min_query=1, truth=False), AttentionEntropy(exclude_bos=True)
    results = []
    for analyzer in (ours, theirs):
        state = analyzer.init(info)
        analyzer.update(state, _step(tiny_model, analyzer, batch))
        results.append(analyzer.finalize(state, info))
    np.testing.assert_allclose(results[0].arrays["mass0"], results[1].arrays["bos_mass"],
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(results[0].arrays["entropy"], results[1].arrays["entropy"],
                               rtol=1e-6, atol=1e-6)


def test_remove_sink_conventions() -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, 7, 7, generator=g, dtype=torch.float64)
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
    p = scores.softmax(-1)
    assert remove_sink(p, 0) is p  # masking no key: the very same pattern
    out = remove_sink(p, 3)
    assert torch.equal(out[:, :, :3], p[:, :, :3])  # queries 0..2 see only sink keys: as they are
    assert (out[:, :, 3:, :3] == 0).all()
    torch.testing.assert_close(out[:, :, 3:].sum(-1), torch.ones(2, 3, 4, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # The rest is the softmax over the keys left.
    want = scores[:, :, 3:, 3:].softmax(-1)
    torch.testing.assert_close(out[:, :, 3:, 3:], want, rtol=0, atol=1e-12)
    # Keys that receive no attention: masking them changes nothing.
    q = p.clone()
    q[..., 0] = 0
    q = q / q.sum(-1, keepdim=True)
    torch.testing.assert_close(remove_sink(q, 1)[:, :, 1:], q[:, :, 1:], rtol=0, atol=1e-12)
    only = remove_sink(p, 2, heads=[1])
    assert torch.equal(only[:, [0, 2]], p[:, [0, 2]]) and not torch.equal(only[:, 1], p[:, 1])


def test_masking_nothing_changes_nothing(saved: dict[str, Path]) -> None:
    bridge, _ = _pair(saved["llama"])
    batch = _batch()
    info = ModelInfo.from_model(bridge)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    _, cache = capture(bridge, batch.tokens, names, need_logits=False)
    resumer = Resumer(bridge)

    def identity(t: torch.Tensor, *, hook: Any) -> torch.Tensor:
        return remove_sink(t, 0)

    for layer in range(info.n_layers):
        final = final_with(resumer, batch.tokens, layer, cache[info.resid(layer)],
                           [(pattern_hook(layer), identity)])
        assert torch.equal(final, cache[info.resid(info.n_layers)]), layer
    assert resumer.mode == "resume"


@pytest.mark.parametrize("arch", ["gpt2-1", "llama-1"])
@pytest.mark.parametrize("first", [1, 2])
def test_one_layer_removal_equals_hf_with_the_sink_masked(
    arch: str, first: int, saved: dict[str, Path]
) -> None:
    """One layer: removing the sink is Hugging Face's forward pass with keys < first removed
    from the attention mask of queries ≥ first (float64, by hand from the logits)."""
    bridge, hf = _pair(saved[arch])
    batch = _batch()
    T = batch.tokens.shape[1]
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    allowed[first:, :first] = False  # queries < first keep their keys: the stated convention
    additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(~allowed, -torch.inf)
    with torch.no_grad():
        clean = hf(batch.tokens).logits.log_softmax(-1)
        removed = hf(batch.tokens, attention_mask=additive.expand(3, 1, T, T)).logits
    removed = removed.log_softmax(-1)
    assert torch.equal(removed[:, :first], clean[:, :first])
    queries = batch.mask & (torch.arange(T) >= first)
    kl = (removed.exp() * (removed - clean)).sum(-1)[queries]
    targets, has = batch.next_tokens()
    ce = lambda lp: -lp.gather(-1, targets[..., None])[..., 0]  # noqa: E731
    dce = (ce(removed) - ce(clean))[queries & has]
    agree = (removed.argmax(-1) == clean.argmax(-1))[queries].double()

    analyzer = Sinks(first=first)
    info = ModelInfo.from_model(bridge)
    state = analyzer.init(info)
    analyzer.update(state, _step(bridge, analyzer, batch))
    table = analyzer.finalize(state, info).tables["sinks"]
    # 1e-6: Hugging Face's RMSNorm computes in float32 whatever the model's dtype.
    assert table["kl"][0] == pytest.approx(float(kl.mean()), rel=1e-6, abs=1e-12)
    assert table["dce"][0] == pytest.approx(float(dce.mean()), rel=1e-6, abs=1e-12)
    assert table["agree"][0] == pytest.approx(float(agree.mean()), abs=1e-12)
    assert float(kl.mean()) > 1e-3  # the removal does something on this model


def test_per_head_removal_sums_over_heads(saved: dict[str, Path]) -> None:
    """Removing one head's sink at a time: a KL ≥ 0 per (layer, head), in the arrays, the table
    and the heatmap."""
    bridge, _ = _pair(saved["gpt2"])
    analyzer = Sinks(per_head=True)
    info = ModelInfo.from_model(bridge)
    state = analyzer.init(info)
    analyzer.update(state, _step(bridge, analyzer, _batch()))
    result = analyzer.finalize(state, info)
    kl = result.arrays["removed_kl"]
    assert kl.shape == (info.n_layers, info.n_heads) and (kl >= -1e-12).all()
    assert len(result.tables["sinks_heads"]["kl"]) == info.n_layers * info.n_heads
    assert result.plots[-1].source == "removed_kl"


def test_options_the_rows_cannot_serve_are_refused_before_any_pass(tmp_path: Path) -> None:
    """``first`` (or ``min_query``) at or past the rows' length leaves no query: refused with
    the option the user set, before a forward pass; ``per_head`` without ``truth`` too."""
    from lensdiv.core.errors import OptionError
    from lensdiv.run.runner import analyze

    for options, named in (({"first": 40}, "sinks.first=40"), ({"min_query": 32}, "min_query=32")):
        with pytest.raises(OptionError, match=f"{named} leaves no query.*seq-len 32"):
            analyze("toy", plugins="sinks", options={"sinks": options}, seq_len=32,
                    max_tokens=256, out=tmp_path / "run", progress=False)
        assert not (tmp_path / "run" / "manifest.json").exists()
    with pytest.raises(ValueError, match="per_head .* needs truth=true"):
        Sinks(per_head=True, truth=False)
