"""The prompt view's cells (`lensdiv.ops.cells`): float32 products against a plain float64
log-softmax of the float32 logits, in blocks of every size; bf16 products against float32 on a
GPT-2-shaped unembedding (the shown probabilities within 1e-3); the setting."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lensdiv.core.errors import OptionError
from lensdiv.ops.cells import Cells, cells, products_of
from lensdiv.ops.kl_grad import unembedding
from lensdiv.ops.norms import declared_norm
from lensdiv.ops.readout import FinalReadout


def readout(d_model: int, d_vocab: int, *, offset: float, seed: int = 0,
            dtype: torch.dtype = torch.float32) -> FinalReadout:
    """A LayerNorm + unembedding whose columns share a mean direction of weight ``offset``
    (GPT-2's unembedding has one: every logit shifts by a large per-row constant)."""
    gen = torch.Generator().manual_seed(seed)
    W = 0.1 * torch.randn(d_model, d_vocab, generator=gen)
    W += offset * torch.randn(d_model, 1, generator=gen)
    b = 0.5 * torch.randn(d_vocab, generator=gen)
    norm = declared_norm("LN")(torch.ones(d_model), torch.zeros(d_model), 1e-5)
    return FinalReadout(norm=norm, W_U=W.to(dtype), b_U=b.to(dtype), model_dtype=dtype)


def grid_states(ro: FinalReadout, n_rows: int, n_pos: int, seed: int = 1) -> list[torch.Tensor]:
    """Rows from flat (noise) to peaked (a growing share of one token's unembedding per
    position), all along the mean direction too (a large common logit)."""
    gen = torch.Generator().manual_seed(seed)
    W = ro.W_U.float()
    mean = W.mean(1)
    tokens = torch.randint(0, W.shape[1], (n_pos,), generator=gen)
    return [
        torch.randn(n_pos, W.shape[0], generator=gen)
        + (0.05 * r) * W[:, tokens].t() / 0.1
        - 5.0 * mean / mean.norm()
        for r in range(n_rows)
    ]


def plain(ro: FinalReadout, states: list[torch.Tensor], reference: torch.Tensor,
          following: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The cells from a float64 log-softmax of the float32 logits, over the whole grid."""
    z = torch.stack([ro.logits(h) for h in states])
    logp = z.double().log_softmax(-1)
    ref = ro.logits(reference).double().log_softmax(-1)
    p = logp.exp()
    top = logp.topk(k, dim=-1)
    nxt = following.view(1, -1, 1).expand(len(states), -1, 1)
    return {
        "top": top.indices,
        "top_logp": top.values,
        "logp": logp,
        "kl": (p * (logp - ref)).sum(-1),
        "entropy": -(p * logp).sum(-1),
        "next_logp": logp.gather(-1, nxt)[..., 0],
        "next_rank": (z > z.gather(-1, nxt)).sum(-1),
    }


# Rows per product and per sub-block of the statistics: positions cut, states grouped.
@pytest.mark.parametrize(("block", "sub"), [(3, 2), (7, 3), (10_000, 10_000), (10_000, 3)])
def test_float32_cells_are_the_log_softmax(block: int, sub: int) -> None:
    ro = readout(32, 500, offset=0.5)
    states = grid_states(ro, 5, 8)
    reference = states[-1]
    following = torch.randint(0, 500, (8,), generator=torch.Generator().manual_seed(2))
    got = cells(ro, states, reference, following, k=4, block_elements=block * 500,
                stat_elements=sub * 500)
    want = plain(ro, states, reference, following, 4)
    assert got.products == "float32"
    assert torch.equal(got.top, want["top"])
    for key in ("top_logp", "entropy", "next_logp"):
        torch.testing.assert_close(getattr(got, key), want[key], rtol=0, atol=2e-5)
    torch.testing.assert_close(got.kl, want["kl"].clamp_min(0), rtol=1e-5, atol=2e-5)
    assert torch.equal(got.next_rank, want["next_rank"])
    assert torch.equal(got.kl[-1], torch.zeros(8, dtype=torch.float64))  # the reference row
    assert got.kl[:-1].min() > 0


def test_kl_to_a_reference_that_is_no_row() -> None:
    """A skipped block's grid: the KL is to the unskipped output, which no row equals."""
    ro = readout(32, 300, offset=0.0)
    states = grid_states(ro, 4, 6)
    reference = states[-1] + 0.3 * torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    following = torch.arange(6)
    got = cells(ro, states, reference, following, k=3, block_elements=4 * 300,
                stat_elements=3 * 300)
    want = plain(ro, states, reference, following, 3)
    torch.testing.assert_close(got.kl, want["kl"], rtol=1e-5, atol=2e-5)
    assert got.kl.min() > 0


def shown_close(got: Cells, want: dict[str, Any], tol: float) -> None:
    """What the page shows from bf16 products is the float32 readout's within ``tol``: each shown
    token's probability, the ranking (the j-th shown is at least the true j-th), the next
    token's probability."""
    true = want["logp"].gather(-1, got.top).exp()
    assert (got.top_logp.exp() - true).abs().max() <= tol
    assert (true - want["top_logp"].exp()).min() >= -tol
    assert (got.next_logp.exp() - want["next_logp"].exp()).abs().max() <= tol


def test_bf16_products_show_the_float32_numbers() -> None:
    """GPT-2's shape (d_model 768, vocabulary 50257), a large common logit, rows from flat to
    peaked: the shown probabilities within 1e-3 of float32's, the output row exact."""
    ro = readout(768, 50257, offset=0.5)
    states = grid_states(ro, 8, 16)
    following = torch.randint(0, 50257, (16,), generator=torch.Generator().manual_seed(2))
    got = cells(ro, states, states[-1], following, k=5, products="bf16")
    exact = cells(ro, states, states[-1], following, k=5, products="float32")
    want = plain(ro, states, states[-1], following, 5)
    assert got.products == "bf16"
    top1 = want["top_logp"][..., 0].exp().mean(-1)  # from flat to peaked
    assert top1[0] < 0.15 and top1[-1] > 0.3
    shown_close(got, want, 1e-3)
    shown_close(exact, want, 1e-6)
    for key in ("top", "top_logp", "kl", "entropy", "next_logp", "next_rank"):  # the output row
        assert torch.equal(getattr(got, key)[-1], getattr(exact, key)[-1]), key
    # The vocabulary-wide sums carry the bf16 rounding of the logits outside the candidates.
    assert (got.kl - want["kl"]).abs().max() <= 1e-2 + 1e-3 * want["kl"].abs().max()
    assert (got.entropy - want["entropy"]).abs().max() <= 1e-2


def test_bf16_copies_follow_the_unembedding() -> None:
    """One cache, one rule for the bfloat16 copies of the unembedding (``cells`` and
    ``kl_grad``): made once per readout, made again when ``W_U`` or ``b_U`` is written in place
    or replaced — the cells of a changed readout are those of a fresh one with its weights."""
    ro = readout(16, 50, offset=0.3)
    states = grid_states(ro, 3, 4)
    following = torch.randint(0, 50, (4,), generator=torch.Generator().manual_seed(3))

    def shown(r: FinalReadout) -> Cells:
        return cells(r, states, states[-1], following, k=3, products="bf16", block_elements=20)

    def fresh() -> FinalReadout:
        return FinalReadout(
            norm=ro.norm, W_U=ro.W_U.clone(), b_U=ro.b_U.clone(), model_dtype=ro.model_dtype
        )

    shown(ro)
    low = unembedding(ro, bf16=True)
    assert unembedding(ro, bf16=True)[0] is low[0]  # made once
    changes = [
        lambda: ro.W_U.mul_(-1.5),  # in place: the version moves
        lambda: ro.b_U.add_(2.0),
        lambda: setattr(ro, "W_U", ro.W_U.flip(1).contiguous()),  # another tensor
    ]
    for change in changes:
        with torch.no_grad():
            change()
        got, want = shown(ro), shown(fresh())
        for key in ("top", "top_logp", "kl", "entropy", "next_logp", "next_rank"):
            assert torch.equal(getattr(got, key), getattr(want, key)), key
        assert torch.equal(unembedding(ro, bf16=True)[0], ro.W_U.to(torch.bfloat16))
        assert torch.equal(unembedding(ro, bf16=True)[1], ro.b_U.to(torch.bfloat16))


def test_bf16_products_on_a_tiny_vocabulary() -> None:
    """Fewer tokens than the candidates: every logit re-read in float32."""
    ro = readout(16, 10, offset=0.5)
    states = grid_states(ro, 3, 5)
    following = torch.arange(5)
    got = cells(ro, states, states[-1], following, k=3, products="bf16", block_elements=20,
                stat_elements=20)  # two positions per product and sub-block
    want = plain(ro, states, states[-1], following, 3)
    shown_close(got, want, 1e-5)
    torch.testing.assert_close(got.entropy, want["entropy"], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.kl, want["kl"].clamp_min(0), rtol=0, atol=1e-5)


def test_the_products_setting() -> None:
    small = readout(16, 50, offset=0.0)
    assert products_of("auto", small) == "float32"  # a small unembedding stays exact
    assert products_of("float32", small) == "float32"
    assert products_of("bf16", small) == "bf16"
    with pytest.raises(OptionError, match="unknown products 'fast'"):
        products_of("fast", small)
    with pytest.raises(OptionError, match="float32 readout"):
        products_of("bf16", readout(16, 50, offset=0.0, dtype=torch.float64))


def test_prompt_view_records_bf16_products(native_model: Any) -> None:
    from lensdiv.ops.prompt import prompt_view

    exact = prompt_view(native_model, "The happy dog", top_k=3)
    fast = prompt_view(native_model, "The happy dog", top_k=3, products="bf16")
    assert "bf16 products" in fast.meta["readout"] and "bf16" not in exact.meta["readout"]
    assert fast.top_tokens[-1] == exact.top_tokens[-1]  # the output row: float32 in both
    assert fast.top_probs[-1] == exact.top_probs[-1]
    for row_fast, row_exact in zip(fast.top_probs, exact.top_probs, strict=True):
        for a, b in zip(row_fast, row_exact, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-3
