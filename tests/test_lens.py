"""The logit lens (docs/science.md A2) on tiny random models of every architecture (and a TL-native one).

Checked against independent computations: a naive logit lens built from ``ln_final``/``W_U``/
``b_U``, TransformerLens' own ``logit_lens`` and the model's own cross-entropy. Streaming (merged
shards) and padding (pads never enter a statistic) are checked on the analyzer's own state.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lensdiv.analyzers.lens import LogitLens
from lensdiv.data.sources import DataSpec
from lensdiv.run.runner import analyze
from tests.helpers import (
    batches_of,
    check_merged_halves_equal_one_pass,
    check_pads_never_enter_a_statistic,
)


def resid_names(model: Any) -> list[str]:
    n = model.cfg.n_layers
    return [f"blocks.{i}.hook_resid_pre" for i in range(n)] + [f"blocks.{n - 1}.hook_resid_post"]


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


# -- streaming and padding -----------------------------------------------------------------------


def test_merged_halves_equal_one_pass(model: Any) -> None:
    check_merged_halves_equal_one_pass(LogitLens(), model)


@pytest.mark.parametrize("pad_fill", ["pad", "random"])
def test_pads_never_enter_a_statistic(model: Any, pad_fill: str) -> None:
    check_pads_never_enter_a_statistic(LogitLens(), model, pad_fill)
