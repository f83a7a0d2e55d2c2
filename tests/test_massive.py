"""``massive`` (docs/science.md F2): the histogram median against numpy's exact one within the
stated bound, massive entries against a naive loop, and on a model with one planted massive
dimension: where it appears, who writes it, and its removal against a full forward pass."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.massive import Massive
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.ops.capture import capture
from lensdiv.ops.outliers import (
    histogram_median,
    log_histogram,
    lower_median,
    massive_entries,
)
from lensdiv.testing.models import save_tiny_model

DIM, BIAS = 5, 1e4  # the planted massive dimension and the bias that writes it


@pytest.mark.parametrize("bins_per_decade", [10, 100])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_median_is_within_its_bound(bins_per_decade: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = rng.lognormal(mean=rng.normal(), sigma=2.0, size=2 * rng.integers(500, 5000) + 1)
    data *= rng.choice([-1.0, 1.0], size=data.size)
    halves = np.array_split(data, 3)  # merged by summing the parts' histograms
    counts = sum(log_histogram(torch.from_numpy(h), bins_per_decade) for h in halves)
    assert float(counts.sum()) == data.size
    estimate = histogram_median(counts, bins_per_decade)
    exact = float(np.median(np.abs(data)))  # n odd: the middle value itself
    bound = 1 / (2 * bins_per_decade)
    # float32 magnitudes on the way in: a few ulps beyond the bin-width bound.
    assert abs(math.log10(estimate) - math.log10(exact)) <= bound + 1e-6
    assert histogram_median(torch.zeros_like(counts), bins_per_decade) != histogram_median(
        torch.zeros_like(counts), bins_per_decade
    )  # NaN when empty


def test_massive_entries_match_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    x[0, 0, 3], x[1, 2, 3], x[1, 4, 1] = 900.0, -2000.0, 150.0
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 5] = False
    x[1, 5, 0] = 1e6  # a pad: never massive, never in the median
    massive, hist, median, threshold = massive_entries(x, keep, 100.0, 500.0, 100)
    values = np.abs(x.numpy()[keep.numpy()]).reshape(-1)
    assert float(hist.sum()) == values.size  # pads never enter the median
    want_median = np.sort(values)[(values.size + 1) // 2 - 1]
    assert lower_median(x[keep]) == pytest.approx(want_median, rel=1e-6)  # the reference
    assert abs(math.log10(median) - math.log10(want_median)) <= 1 / 200 + 1e-6
    assert threshold == max(100.0, 500.0 * median)
    want = np.abs(x.numpy()) > threshold
    want &= keep.numpy()[..., None]
    assert np.array_equal(massive.numpy(), want)
    assert not massive[1, 5].any() and massive[0, 0, 3] and massive[1, 2, 3]


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A float64 tiny GPT-2 whose block-0 MLP writes ``BIAS`` into dimension ``DIM`` at every
    position (a massive activation by construction)."""
    from transformer_lens.model_bridge import TransformerBridge

    directory = save_tiny_model("gpt2", tmp_path_factory.mktemp("massive") / "gpt2")
    model = TransformerBridge.boot_transformers(str(directory), device="cpu", dtype=torch.float64)
    model = model.eval()
    with torch.no_grad():
        model.blocks[0].mlp.out.original_component.bias[DIM] += BIAS
    return model


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(4, 200, (3, 10), generator=g)
    tokens[:, 0] = 1
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, 6:] = False
    tokens[-1, 6:] = 0
    return Batch(tokens, mask)


def _result(model: Any, analyzer: Massive, batch: Batch) -> Any:
    info = ModelInfo.from_model(model)
    logits, cache = capture(model, batch.tokens, analyzer.hooks(info), need_logits=False)
    state = analyzer.init(info)
    for index in range(analyzer.n_passes(info)):  # as the engine runs them
        if index:
            state.freeze()
            analyzer.start_pass(state, info, index)
            state.freeze()
        analyzer.update(state, Step(batch, cache, logits, model, info, pass_index=index))
    return analyzer.finalize(state, info), cache


def test_planted_dimension_appears_where_it_is_written(planted: Any) -> None:
    batch = _batch()
    result, cache = _result(planted, Massive(), batch)
    meta = result.meta
    assert meta["appear"] == 1 and meta["writer"] == "mlp"
    assert result.tables["massive_dims"]["dim"].tolist()[0] == DIM
    counts = result.tables["massive"]["massive"]
    assert counts[0] == 0 and counts[1] >= batch.n_tokens  # every real position carries it
    assert result.tables["massive_blocks"]["mlp_massive"][0] == batch.n_tokens
    # The largest |x| per state is the cache's, over real positions.
    info = ModelInfo.from_model(planted)
    for layer in range(info.n_layers + 1):
        h = cache[info.resid(layer)][batch.mask]
        assert result.tables["massive"]["max_abs"][layer] == float(h.abs().max())


def test_removal_matches_a_full_pass(planted: Any) -> None:
    """Set to zero / to the mean at h_1, against a full forward pass editing
    ``blocks.1.hook_resid_pre`` (float64); the mean barely moves the output, zero does."""
    batch = _batch()
    result, cache = _result(planted, Massive(), batch)
    h = cache["blocks.1.hook_resid_pre"]
    massive, _, _, _ = massive_entries(h, batch.mask, 100.0, 1000.0, 100)
    mean = (h * massive).sum((0, 1)) / massive.sum((0, 1)).clamp_min(1)
    with torch.no_grad():
        clean = planted(batch.tokens).log_softmax(-1)
    truth = result.tables["massive_truth"]
    targets, has = batch.next_tokens()
    for row, value in enumerate((torch.zeros_like(h), mean[None, None].expand_as(h))):

        def edit(t: torch.Tensor, *, hook: Any, value: torch.Tensor = value) -> torch.Tensor:
            return torch.where(massive, value, t)

        with torch.no_grad(), planted.hooks(fwd_hooks=[("blocks.1.hook_resid_pre", edit)]):
            edited = planted(batch.tokens).log_softmax(-1)
        kl = (edited.exp() * (edited - clean)).sum(-1)[batch.mask].mean()
        nll = lambda lp: -lp.gather(-1, targets[..., None])[..., 0]  # noqa: E731
        dce = (nll(edited) - nll(clean))[batch.mask & has].mean()
        assert truth["kl"][row] == pytest.approx(float(kl), rel=1e-6, abs=1e-12)
        assert truth["dce"][row] == pytest.approx(float(dce), rel=1e-6, abs=1e-12)
    assert truth["kl"][0] > 10 * truth["kl"][1]  # zero breaks the model, the mean does not


def test_the_mean_edit_uses_the_data_mean_not_the_batch(planted: Any) -> None:
    """With one row per batch a batch's own mean is that row's (and with one carrier, a shared
    BOS, the entry itself: an edit to it would change nothing). The mean edit uses the data's
    mean over every batch, per state and dimension, summed in the first pass."""
    info = ModelInfo.from_model(planted)
    rows = _batch().tokens[:2]
    analyzer = Massive()
    state = analyzer.init(info)
    steps = []
    for i in range(2):
        batch = Batch(rows[i : i + 1], torch.ones_like(rows[i : i + 1], dtype=torch.bool))
        _, cache = capture(planted, batch.tokens, analyzer.hooks(info), need_logits=False)
        steps.append(Step(batch, cache, None, planted, info))
    for index in range(analyzer.n_passes(info)):
        if index:
            state.freeze()
            analyzer.start_pass(state, info, index)
            state.freeze()
        for step in steps:
            analyzer.update(state, Step(step.batch, step.cache, None, planted, info,
                                        pass_index=index))
    at = 1  # the planted entry appears at h_1
    h = torch.cat([s.cache[info.resid(at)] for s in steps])  # both rows: the data
    massive = torch.cat([list(analyzer._found(s))[at] for s in steps])
    want = (h * massive).sum((0, 1)) / massive.sum((0, 1)).clamp_min(1)
    torch.testing.assert_close(state["mass_mean"][at], want, rtol=1e-12, atol=0)
    one_row = (h[:1] * massive[:1]).sum((0, 1)) / massive[:1].sum((0, 1)).clamp_min(1)
    assert not torch.allclose(state["mass_mean"][at][DIM], one_row[DIM])  # not a batch's mean


def test_model_without_outliers_says_so(native_model: Any) -> None:
    result, _ = _result(native_model, Massive(), _batch())
    assert result.meta["appear"] is None and "No massive activation" in result.summary
    assert "massive_truth" not in result.tables
