"""Sublayer contributions (docs/science.md A1) on tiny random models of every architecture.

The residual identity (``h_L`` is ``h_0`` plus every sublayer's write) holds for the cached
activations; the analyzer agrees with a per-token Python loop over ``run_with_cache``
activations in float64. Streaming (merged shards) and padding (pads never enter a statistic)
are checked on the analyzer's own state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.contrib import ContribNumbers, Contribution
from lensdiv.core.analyzer import ModelInfo
from lensdiv.data.sources import DataSpec
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze
from tests.helpers import (
    batches_of,
    check_merged_halves_equal_one_pass,
    check_pads_never_enter_a_statistic,
    run_state,
    sublayer_names,
)

PARALLEL = {"neox"}  # architectures built with a parallel residual (lensdiv/testing/models.py)


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


def test_merged_halves_equal_one_pass(model: Any) -> None:
    check_merged_halves_equal_one_pass(Contribution(), model)


@pytest.mark.parametrize("pad_fill", ["pad", "random"])
def test_pads_never_enter_a_statistic(model: Any, pad_fill: str) -> None:
    check_pads_never_enter_a_statistic(Contribution(), model, pad_fill)


def test_numbers_without_a_result(model: Any, arch: str) -> None:
    """The numbers from the state alone (no ``Result``): the naive loop's means, the halves of
    ``r_block`` over blocks 1..L−1, the positions counted."""
    spec = DataSpec(seq_len=12, max_tokens=30, batch_size=3)
    (batch,) = batches_of(model, spec)
    state = run_state(Contribution(exclude_bos=False), model, [batch])
    numbers = ContribNumbers.from_state(state, ModelInfo.from_model(model))
    with torch.no_grad():
        _, cache = model.run_with_cache(batch.tokens, names_filter=sublayer_names(model))
    L = model.cfg.n_layers
    naive = _naive_contrib(cache, batch.mask, L, arch in PARALLEL, False)
    for key, expected in naive.items():
        np.testing.assert_allclose(numbers.columns[key], expected, rtol=1e-5, atol=1e-5)
    assert numbers.positions == int(batch.mask.sum())
    assert numbers.parallel_residual == (arch in PARALLEL)
    rest = naive["r_block"][1:]
    if len(rest) < 2:
        assert numbers.halves() is None
    else:
        half = len(rest) // 2
        assert numbers.halves() == pytest.approx(
            (np.mean(rest[:half]), np.mean(rest[half:])), rel=1e-5
        )
