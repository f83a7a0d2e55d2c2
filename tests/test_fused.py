"""The readout's fused row sums (``lensdiv.ops.fused``) and exp's fast path (``core.numerics``):
the fused kernel agrees with the eager passes and with float64, the tier fuses only after
enough logits (or when told), and a compiler that fails leaves the exact eager path, said once.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lensdiv.core.numerics import EXP_FLOOR, exp, exp_
from lensdiv.ops import fused
from lensdiv.ops.kvcache import FallbackWarning
from lensdiv.ops.rowstats import RowStats, row_stats

FIELDS = ("lse", "expect", "shift", "target", "rank", "top")


def _case(dtype: torch.dtype, n: int = 40, vocab: int = 3000) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, vocab, generator=g, dtype=dtype) * 8
    z[0, :] -= 400  # a row whose centred logits fall far below exp's normal range
    z[0, 7] = 30.0
    ref = z + 0.3 * torch.randn(n, vocab, generator=g, dtype=dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    return z, ref, targets


def _stats(z: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> tuple[RowStats, ...]:
    against = row_stats(
        z.clone(), torch.empty_like(z), targets=targets, k=5, expect=True, reference=ref.clone()
    )
    alone = row_stats(
        ref.clone(), torch.empty_like(z), targets=targets, k=5, expect=True,
        product=torch.empty_like(z),
    )
    return against, alone


def _float64(z: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    z, ref = z.double(), ref.double()
    logp, logq = z.log_softmax(-1), ref.log_softmax(-1)
    p = logp.exp()
    t = z.gather(1, targets[:, None])
    return {
        "lse": z.logsumexp(-1),
        "entropy": -(p * logp).sum(-1),
        "kl": (p * (logp - logq)).sum(-1),
        "rank": (z > t).sum(-1).double(),
    }


@pytest.fixture
def mode(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def set_mode(value: str) -> None:
        monkeypatch.setenv(fused.ENV, value)

    return set_mode


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_agrees_with_eager_and_float64(dtype: torch.dtype, mode) -> None:  # noqa: ANN001
    z, ref, targets = _case(dtype)
    mode("0")
    eager = _stats(z, ref, targets)
    mode("1")
    fast = _stats(z, ref, targets)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    truth = _float64(z, ref, targets)
    for e, f in zip(eager, fast, strict=True):
        for name in FIELDS:
            a, b = getattr(e, name), getattr(f, name)
            assert (a is None) == (b is None), name
            if a is None:
                continue
            if name in ("target", "rank", "top"):
                assert torch.equal(a, b), name  # exact: counts, indices, gathered logits
            else:
                torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    against, alone = fast
    assert against.shift is not None and against.expect is not None and alone.expect is not None
    kl = against.shift - against.lse + alone.lse
    torch.testing.assert_close(against.lse, truth["lse"], rtol=tol, atol=tol)
    torch.testing.assert_close(against.lse - against.expect, truth["entropy"], rtol=tol, atol=tol)
    torch.testing.assert_close(kl, truth["kl"], rtol=tol, atol=tol)
    assert torch.equal(against.rank, truth["rank"])


def test_the_tier_fuses_after_enough_logits(mode, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    tier = fused._Tier()
    monkeypatch.setattr(fused, "_TIER", tier)
    monkeypatch.setattr(fused, "AFTER_LOGITS", 1000)
    mode("auto")
    assert not fused.fuse(600)  # 600 read
    assert fused.fuse(600)  # 1200 > 1000: from now on
    mode("0")
    assert not fused.fuse(10**9)
    mode("1")
    fresh = fused._Tier()
    monkeypatch.setattr(fused, "_TIER", fresh)
    assert fused.fuse(1)


def test_a_failing_compiler_falls_back_once(mode, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(fused, "_TIER", fused._Tier())

    def broken(*args: object, **kwargs: object) -> object:
        def kernel(*a: object, **k: object) -> object:
            raise RuntimeError("no C++ compiler found\nsecond line")

        return kernel

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr("lensdiv.ops.kvcache._WARNED", set())
    z, ref, targets = _case(torch.float32)
    mode("0")
    eager = _stats(z, ref, targets)
    mode("1")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fallen = _stats(z, ref, targets)
        _stats(z, ref, targets)
    said = [w for w in seen if issubclass(w.category, FallbackWarning)]
    assert len(said) == 1 and "no C++ compiler found" in str(said[0].message)
    assert "second line" not in str(said[0].message)
    for e, f in zip(eager, fallen, strict=True):
        for name in FIELDS:
            a, b = getattr(e, name), getattr(f, name)
            assert (a is None and b is None) or torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_fast_path_is_exp(dtype: torch.dtype) -> None:
    """Raised to the floor below it, equal to ``torch.exp`` above; ``exp`` leaves its input."""
    floor = EXP_FLOOR[dtype]
    x = torch.linspace(floor - 900, 50, 20001, dtype=dtype)
    x0 = x.clone()
    y = exp(x)
    assert torch.equal(x, x0)
    above = x >= floor
    assert torch.equal(y[above], torch.exp(x[above]))
    assert (y[~above] == torch.exp(torch.tensor(floor, dtype=dtype))).all()
    # beside any term >= e^-40 (a row's largest, see rowstats), the raised terms vanish
    assert float(y[~above].sum()) < 1e-13 * float(torch.exp(torch.tensor(-40.0, dtype=dtype)))
    out = torch.empty_like(x)
    assert exp(x, out=out) is out and torch.equal(out, y)
    assert torch.equal(exp_(x.clone()), y)


def test_the_sums_accumulate_in_float32_only_on_a_cpu() -> None:
    """A CPU reads a large vocabulary in tiles (float32 sums of at most a tile's columns); a row
    read whole elsewhere keeps float64 accumulation."""
    assert fused.accumulation(torch.zeros(2, 3)) == torch.float32
    assert fused.accumulation(torch.zeros(2, 3, dtype=torch.float64)) == torch.float64
    assert fused.accumulation(torch.zeros(2, 3, device="meta")) == torch.float64
