"""The readout's own pieces on wide vocabularies (the test models' are too narrow to reach them):
top-k from chunk maxima against ``torch.topk``, the unembedding without a bias pass, and the
lens statistics against a float64 reference with ``torch.topk``'s sets."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensdiv.ops import readout as readout_module
from lensdiv.ops.norms import NoNorm
from lensdiv.ops.readout import FinalReadout
from lensdiv.ops.rowstats import TOPK_CHUNK, lens_statistics, merge_stats, row_stats, top_k


@pytest.mark.parametrize("vocab", [50257, 4 * 5 * TOPK_CHUNK, 3000, 700])
@pytest.mark.parametrize("rows", [1, 9])
def test_top_k_equals_torch_topk(vocab: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(vocab + rows)
    z = torch.randn(rows, vocab, generator=gen) * 4
    z[0, -1] = 99.0  # the largest logit in the last, incomplete chunk
    for k in (1, 5, 12):
        values, indices = top_k(z, k)
        want_values, want_indices = z.topk(k, dim=-1)
        assert torch.equal(values, want_values)
        assert torch.equal(indices, want_indices)  # no ties: the same indices too


def test_top_k_with_ties_gives_distinct_tokens_of_the_top_values() -> None:
    z = torch.randn(3, 8000, generator=torch.Generator().manual_seed(1))
    z[:, 130:140] = 7.0  # ten equal largest logits across two chunks, k = 5 of them
    z[1, 5000] = 7.0
    values, indices = top_k(z, 5)
    assert torch.equal(values, z.topk(5, dim=-1).values)
    assert torch.equal(z.gather(1, indices), values)
    assert all(len(set(row.tolist())) == 5 for row in indices)


def _readout(vocab: int, d: int, bias: bool) -> FinalReadout:
    gen = torch.Generator().manual_seed(2)
    b_U = torch.randn(vocab, generator=gen) if bias else torch.zeros(vocab)
    norm = NoNorm(torch.ones(d), torch.zeros(d), 0.0)
    return FinalReadout(norm, torch.randn(d, vocab, generator=gen) / d**0.5, b_U, torch.float32)


def test_logits_without_a_bias_pass_are_the_product_and_a_bias_set_later_counts() -> None:
    readout = _readout(3000, 16, bias=False)
    h = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    assert not readout.biased
    assert torch.equal(readout.logits(h), torch.addmm(readout.b_U, h, readout.W_U))
    readout.b_U.add_(0.5)  # written in place: seen
    assert readout.biased
    torch.testing.assert_close(readout.logits(h), h @ readout.W_U + 0.5, rtol=0, atol=1e-6)
    out = torch.empty(5, 3000)
    assert readout.logits(h, out=out).data_ptr() == out.data_ptr()


@pytest.mark.parametrize(("tiles", "block"), [(1, 7), (10, 7), (1, 40)])
@pytest.mark.parametrize("bias", [False, True])
def test_lens_statistics_on_a_wide_vocabulary_equal_a_float64_reference(
    bias: bool, tiles: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``block``: rows a block holds; 40 (more than the 14 rows read) reads two states per
    call, stacked against one reference."""
    if tiles > 1:
        monkeypatch.setattr(readout_module, "TILE_COLUMNS", 640)
    vocab, d, n, k = 6000, 24, 40, 5
    readout = _readout(vocab, d, bias)
    gen = torch.Generator().manual_seed(4)
    states = [torch.randn(2, n // 2, d, generator=gen) * (1 + i) for i in range(4)]
    rows = torch.arange(0, n, 3)
    targets = torch.randint(0, vocab, (rows.numel(),), generator=gen)
    # 7 rows a block; ten tiles: 9 of 640 columns and one of 240, each target in one of them
    tile = 7 * 640 if tiles > 1 else block * vocab
    r = min(block, rows.numel())
    assert len(range(0, vocab, readout.tile_columns(r, tile))) == tiles
    got = lens_statistics(
        readout, states, rows, targets, k=k, block_elements=block * vocab, tile_elements=tile
    )
    W, b = readout.W_U.double(), readout.b_U.double()
    logp = [torch.log_softmax(s.reshape(-1, d)[rows].double() @ W + b, dim=-1) for s in states]
    ref_top = logp[-1].topk(k, dim=-1).indices
    close = {"rtol": 1e-4, "atol": 1e-5}  # float32 logits against float64 ones
    for i, lp in enumerate(logp):
        p = lp.exp()
        torch.testing.assert_close(got.kl[i], (p * (lp - logp[-1])).sum(-1), **close)
        torch.testing.assert_close(got.entropy[i], -(p * lp).sum(-1), **close)
        want = lp.gather(1, targets[:, None])[:, 0]
        torch.testing.assert_close(got.target_logp[i], want, **close)
        assert torch.equal(got.rank[i], (lp > want[:, None]).sum(-1).double())
        top = lp.topk(k, dim=-1).indices
        same = (top[:, :, None] == ref_top[:, None, :]).any(-1).sum(-1).double() / k
        assert torch.equal(got.overlap[i], same)


@pytest.mark.parametrize("fused", ["0", "1"])
def test_merged_parts_of_the_vocabulary_are_the_whole_rows_statistics(
    fused: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LENSDIV_FUSED", fused)  # the eager passes and the fused kernel
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(30, 3000, generator=gen) * 6
    z[0] -= 500  # a row far below exp's normal range, in every part
    ref = z + torch.randn(30, 3000, generator=gen)
    threshold = z[:, 11:12].clone()  # a target of column 11, in the first part
    whole = row_stats(
        z.clone(), torch.empty_like(z), k=5, expect=True, reference=ref, threshold=threshold
    )
    merged = None
    for lo, hi in [(0, 1000), (1000, 1984), (1984, 3000)]:
        part = z[:, lo:hi].clone()
        got = row_stats(
            part,
            torch.empty_like(part),
            k=5,
            expect=True,
            reference=ref[:, lo:hi].contiguous(),
            threshold=threshold,
        )
        merged = merge_stats(merged, got, lo)
    assert merged is not None
    for name in ("lse", "expect", "shift"):
        torch.testing.assert_close(
            getattr(merged, name), getattr(whole, name), rtol=1e-6, atol=1e-6
        )
    for name in ("rank", "top", "top_values"):
        assert torch.equal(getattr(merged, name), getattr(whole, name)), name


def test_target_logits_of_stacked_states_are_the_products_target_entries() -> None:
    """The target columns are gathered once; each state's rows (two stacked here) give the
    full product's logit of their own target, to rounding."""
    readout = _readout(500, 16, bias=True)
    gen = torch.Generator().manual_seed(9)
    x, targets = torch.randn(2 * 7, 16, generator=gen), torch.randint(0, 500, (7,), generator=gen)
    got = readout.target_logits(x, readout.target_columns(targets))
    want = readout.unembed(x).gather(1, targets.repeat(2)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rounding", [-1, 1])
def test_a_tiled_rank_never_counts_the_target_itself(
    rounding: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a tiled lens are counted against each row's target logit from a dot
    product, which may round an ulp off the product's: the target is not above itself."""
    vocab, d = 2000, 16
    readout = _readout(vocab, d, bias=False)
    gen = torch.Generator().manual_seed(8)
    states = [torch.randn(12, d, generator=gen) for _ in range(2)]
    rows, targets = torch.arange(12), torch.randint(0, vocab, (12,), generator=gen)
    want = lens_statistics(readout, states, rows, targets, k=3)
    exact = readout.target_logits

    def off(x: torch.Tensor, columns: Any) -> torch.Tensor:  # as far off as rounding can be
        z = exact(x, columns)
        return torch.nextafter(z, z + rounding * torch.inf)

    monkeypatch.setattr(readout, "target_logits", off)
    monkeypatch.setattr(readout_module, "TILE_COLUMNS", 320)
    assert readout.tile_columns(12) == 320
    got = lens_statistics(readout, states, rows, targets, k=3)
    assert torch.equal(got.rank, want.rank)
    torch.testing.assert_close(got.target_logp, want.target_logp, rtol=1e-6, atol=1e-6)


def test_a_bridge_is_put_in_eval_mode_only_when_a_module_is_training() -> None:
    from lensdiv.models.load import load_model
    from lensdiv.testing.models import boot_native_tiny

    model = boot_native_tiny().eval()
    model.blocks[0].train()  # one module left training: the whole model goes to eval mode
    assert load_model(model) is model
    assert not any(module.training for module in model.modules())
