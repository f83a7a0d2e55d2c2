"""The plugin's own tests: its numbers against a naive loop, and lensdiv's analyzer contract.

Run from this folder (with the plugin and lensdiv installed): ``python -m pytest tests``. They
need no download: ``toy`` is lensdiv's built-in model, and the contract runs on tiny models that
lensdiv builds locally.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from lensdiv_attention import AttentionEntropy

import lensdiv
from lensdiv.testing import check_analyzer


def _naive(pattern: Any, mask: Any, exclude_bos: bool) -> tuple[list, list, list]:
    """Per-head means by explicit loops over rows, queries and keys (float64 Python)."""
    batch, n_heads, n_pos, _ = pattern.shape
    p = pattern.double().tolist()
    ent, norm, bos = [0.0] * n_heads, [0.0] * n_heads, [0.0] * n_heads
    n = n_norm = 0
    for b in range(batch):
        for q in range(n_pos):
            if not mask[b][q] or (exclude_bos and q == 0):
                continue
            n += 1
            n_norm += q >= 1
            for h in range(n_heads):
                row = p[b][h][q]
                entropy = -sum(x * math.log(x) for x in row[: q + 1] if x > 0)
                ent[h] += entropy
                bos[h] += row[0]
                if q >= 1:
                    norm[h] += entropy / math.log(q + 1)
    return [e / n for e in ent], [e / n_norm for e in norm], [x / n for x in bos]


@pytest.mark.parametrize("exclude_bos", [True, False])
def test_entropy_matches_naive_loop(exclude_bos: bool) -> None:
    model = lensdiv.load_model("toy", device="cpu")
    info = lensdiv.ModelInfo.from_model(model, name="toy")
    analyzer = AttentionEntropy(exclude_bos=exclude_bos)
    hooks = [f"blocks.{layer}.attn.hook_pattern" for layer in range(info.n_layers)]
    assert analyzer.hooks(info) == hooks

    torch.manual_seed(0)
    n_pos = 12
    tokens = torch.randint(3, 200, (3, n_pos))
    tokens[:, 0] = model.tokenizer.bos_token_id
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 7:] = False  # right padding: queries 7.. of row 1 must not count
    mask[2, 2:] = False
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern0 = cache["blocks.0.attn.hook_pattern"]
    assert pattern0.shape == (3, info.n_heads, n_pos, n_pos)  # [batch, head, query, key]
    assert torch.allclose(pattern0.sum(-1), torch.ones(()), atol=1e-5)

    state = analyzer.init(info)
    step = lensdiv.Step(lensdiv.Batch(tokens=tokens, mask=mask), dict(cache.items()), None,
                        model, info)
    analyzer.update(state, step)
    result = analyzer.finalize(state, info)

    kept = int(mask.sum()) - (3 if exclude_bos else 0)
    assert result.meta["positions"] == kept
    for layer in range(info.n_layers):
        ent, norm, bos = _naive(cache[f"blocks.{layer}.attn.hook_pattern"], mask.tolist(),
                                exclude_bos)
        assert result.arrays["entropy"][layer].tolist() == pytest.approx(ent, abs=1e-5)
        assert result.arrays["norm_entropy"][layer].tolist() == pytest.approx(norm, abs=1e-5)
        assert result.arrays["bos_mass"][layer].tolist() == pytest.approx(bos, abs=1e-5)

    # Streaming: two shards merged give the same means as one pass over both.
    shard = analyzer.init(info)
    analyzer.update(shard, step)
    merged = analyzer.finalize(state.merge(shard), info)
    assert merged.arrays["entropy"] == pytest.approx(result.arrays["entropy"])
    assert merged.meta["positions"] == 2 * kept


def test_obeys_the_contract() -> None:
    """The whole analyzer contract (lensdiv.testing), on three architectures."""
    report = check_analyzer(AttentionEntropy, architectures=("gpt2", "llama", "native"))
    assert report.checked == ["gpt2", "llama", "native"], report.skipped
