"""``similarity`` and ``spectrum`` (docs/science.md G1, G2): the identities of the geometry of a
layer's states, in float64 — CKA's invariances and its three forms against a plain numpy
implementation of the papers' formulas, the unbiased estimator's unbiasedness, CCA's invariance,
Procrustes, the spectra of rank-k isotropic data, TwoNN on a planted manifold — then the streamed
states (one batch, many, shards, two gloo ranks) and planted effects on a model."""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.similarity import Similarity
from lensdiv.analyzers.spectrum import Spectrum
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.core.stats import Stats, plan_reduce
from lensdiv.ops import geometry as geo

L, D, ROWS, POS = 3, 12, 3, 10
INFO = ModelInfo("synthetic", L, D, 50, 2, "LN", False, frozenset())


# -- a plain numpy implementation of the papers' formulas ---------------------------------------
def np_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Kornblith et al. (2019), eq. for linear CKA: HSIC of the Grams with the centring matrix."""
    n = len(x)
    h = np.eye(n) - np.ones((n, n)) / n
    k, l_ = x @ x.T, y @ y.T
    hsic = lambda a, b: np.trace(a @ h @ b @ h) / (n - 1) ** 2  # noqa: E731
    return hsic(k, l_) / math.sqrt(hsic(k, k) * hsic(l_, l_))


def np_hsic1(k: np.ndarray, l_: np.ndarray) -> float:
    """Song et al. (2012), Theorem 2."""
    n = len(k)
    kt, lt = k - np.diag(np.diag(k)), l_ - np.diag(np.diag(l_))
    one = np.ones(n)
    return (
        np.trace(kt @ lt)
        + (one @ kt @ one) * (one @ lt @ one) / ((n - 1) * (n - 2))
        - 2 / (n - 2) * one @ kt @ lt @ one
    ) / (n * (n - 3))


def np_cca(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Canonical correlations: singular values of ``Σxx^{-1/2} Σxy Σyy^{-1/2}``."""
    x, y = x - x.mean(0), y - y.mean(0)

    def inv_sqrt(c: np.ndarray) -> np.ndarray:
        w, v = np.linalg.eigh(c)
        return v @ np.diag(w**-0.5) @ v.T

    m = inv_sqrt(x.T @ x) @ x.T @ y @ inv_sqrt(y.T @ y)
    return np.linalg.svd(m, compute_uv=False)


def np_procrustes(x: np.ndarray, y: np.ndarray) -> float:
    """Ding et al. (2021): ``‖X‖² + ‖Y‖² − 2‖XᵀY‖_*`` on centred, unit-Frobenius X, Y."""
    x, y = x - x.mean(0), y - y.mean(0)
    x, y = x / np.linalg.norm(x), y / np.linalg.norm(y)
    return 2 - 2 * np.linalg.svd(x.T @ y, compute_uv=False).sum()


def _rng_pair(seed: int, n: int = 60, d: int = 8, e: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.tanh(
        x[:, :e] @ torch.randn(e, e, generator=g, dtype=torch.float64)
    ) + 0.3 * torch.randn(n, e, generator=g, dtype=torch.float64)
    return x, y


def _orthogonal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q


# -- the identities of the pure functions -------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_cka_is_invariant_to_scaling_rotation_and_translation(seed: int) -> None:
    x, y = _rng_pair(seed)
    q = _orthogonal(x.shape[1], seed)
    b = torch.randn(x.shape[1], dtype=torch.float64)
    for s in (2.5, -0.3):
        z = s * x @ q + b
        assert geo.linear_cka(x, z) == pytest.approx(1.0, abs=1e-12)
        kx, kz = x @ x.T, z @ z.T
        assert geo.cka_gram(kx, kz) == pytest.approx(1.0, abs=1e-12)
        assert geo.cka_gram(kx, kz, unbiased=True) == pytest.approx(1.0, abs=1e-12)
        assert geo.cka_gram(geo.rbf_gram(x), geo.rbf_gram(z)) == pytest.approx(1.0, abs=1e-12)
    assert geo.linear_cka(x, y) == pytest.approx(geo.linear_cka(y, x), abs=1e-15)
    assert geo.cka_gram(x @ x.T, y @ y.T, unbiased=True) == pytest.approx(
        geo.cka_gram(y @ y.T, x @ x.T, unbiased=True), abs=1e-14
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cka_forms_agree_with_each_other_and_with_numpy(seed: int) -> None:
    x, y = _rng_pair(seed)
    want = np_cka(x.numpy(), y.numpy())
    assert geo.linear_cka(x, y) == pytest.approx(want, rel=1e-12)
    assert geo.cka_gram(x @ x.T, y @ y.T) == pytest.approx(want, rel=1e-12)
    n = float(len(x))
    cov = lambda a, b: geo.covariance(n, a.sum(0), b.sum(0), a.T @ b)  # noqa: E731
    assert geo.cka_from_covariances(cov(y, x), cov(x, x), cov(y, y)) == pytest.approx(
        want, rel=1e-12
    )
    kx, ky = (x @ x.T).numpy(), (y @ y.T).numpy()
    assert geo.hsic_unbiased(x @ x.T, y @ y.T) == pytest.approx(np_hsic1(kx, ky), rel=1e-12)


def test_unbiased_hsic_is_unbiased_under_subsampling() -> None:
    """Draws of n rows (with replacement: i.i.d. from the population) — HSIC₁'s mean is the
    population HSIC ``tr(KHLH)/N²``; the biased estimator's is visibly not."""
    x, y = _rng_pair(3, n=40)
    N = len(x)
    kx, ky = x @ x.T, y @ y.T
    truth = geo.hsic_biased(kx, ky) * (N - 1) ** 2 / N**2
    g = torch.Generator().manual_seed(0)
    draws, n = 4000, 8
    unbiased, biased = [], []
    for _ in range(draws):
        i = torch.randint(0, N, (n,), generator=g)
        unbiased.append(geo.hsic_unbiased(kx[i][:, i], ky[i][:, i]))
        biased.append(geo.hsic_biased(kx[i][:, i], ky[i][:, i]) * (n - 1) ** 2 / n**2)
    u = np.array(unbiased)
    se = u.std(ddof=1) / math.sqrt(draws)
    assert abs(u.mean() - truth) < 4 * se
    assert abs(np.mean(biased) - truth) > 10 * se


def test_cca_is_invariant_to_invertible_maps_and_matches_numpy() -> None:
    x, y = _rng_pair(4, n=80)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=g, dtype=torch.float64) + 3 * torch.eye(8, dtype=torch.float64)
    b = torch.randn(6, 6, generator=g, dtype=torch.float64) + 3 * torch.eye(6, dtype=torch.float64)
    rho = geo.canonical_correlations(geo.Basis.of(x), geo.Basis.of(y))
    np.testing.assert_allclose(rho.numpy(), np_cca(x.numpy(), y.numpy()), rtol=1e-10)
    moved = geo.mean_cca(x @ a + 1.0, y @ b - 2.0)
    assert moved == pytest.approx(geo.mean_cca(x, y), abs=1e-12)
    # SVCCA keeping everything is the mean canonical correlation; PWCCA's weights sum to one.
    bx, by = geo.Basis.of(x), geo.Basis.of(y)
    assert geo.svcca(bx, by, keep=1.0) == pytest.approx(float(rho.mean()), abs=1e-12)
    assert float(rho.min()) - 1e-12 <= geo.pwcca(bx, by, keep=1.0) <= float(rho.max()) + 1e-12
    assert geo.pwcca(bx, geo.Basis.of(x @ a), keep=1.0) == pytest.approx(1.0, abs=1e-10)


def test_procrustes_is_zero_for_a_rotated_copy_and_matches_numpy() -> None:
    x, y = _rng_pair(5)
    q = _orthogonal(8, 2)
    assert geo.procrustes(geo.Basis.of(x), geo.Basis.of(3 * x @ q + 7)) == pytest.approx(
        0, abs=1e-12
    )
    want = np_procrustes(x.numpy(), y.numpy())
    assert geo.procrustes(geo.Basis.of(x), geo.Basis.of(y)) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_rank_k_isotropic_data_has_entropy_log_k_and_rank_k(k: int) -> None:
    n, d = 40, 16
    u = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64))[0]
    u = u - u.mean(0)  # centred columns, then orthonormal again: equal variances
    u = torch.linalg.qr(u)[0]
    z = u @ _orthogonal(d, k)[:k] * 5.0
    eig = geo.gram_eigenvalues(z)
    assert geo.matrix_entropy(eig) == pytest.approx(math.log(k), abs=1e-10)
    assert geo.matrix_entropy(eig, alpha=2.0) == pytest.approx(math.log(k), abs=1e-10)
    assert geo.effective_rank(eig) == pytest.approx(k, rel=1e-10)
    assert geo.participation_ratio(eig) == pytest.approx(k, rel=1e-10)
    # XXᵀ and XᵀX share their nonzero eigenvalues: the streamed d×d moments give the Gram's.
    from_moments = geo.covariance_eigenvalues(float(n), z.sum(0), z.T @ z)
    zc = z - z.mean(0)
    gram = torch.linalg.eigvalsh(zc @ zc.T).flip(0)
    np.testing.assert_allclose(from_moments[:k].numpy(), gram[:k].numpy(), rtol=1e-10)
    assert float(gram[k:].abs().max()) < 1e-10 and float(from_moments[k:].abs().max()) < 1e-10


@pytest.mark.parametrize("dim", [2, 5])
def test_twonn_recovers_a_planted_manifold(dim: int) -> None:
    """A ``dim``-dimensional Gaussian rotated into 30 dimensions, and a curved one (a sphere
    ``S^dim``): within 10 % (the MLE's standard error is ``d/√N``, 2.2 % at N = 2000)."""
    g = torch.Generator().manual_seed(dim)
    n = 2000
    flat = torch.randn(n, dim, generator=g, dtype=torch.float64) @ _orthogonal(30, 0)[:dim]
    d, se, used = geo.twonn(flat)
    assert used == n and abs(d - dim) < 0.1 * dim and se == pytest.approx(d / math.sqrt(n))
    sphere = torch.randn(n, dim + 1, generator=g, dtype=torch.float64)
    sphere = sphere / sphere.norm(dim=1, keepdim=True)
    d, _, _ = geo.twonn(sphere @ _orthogonal(30, 1)[: dim + 1])
    assert abs(d - dim) < 0.1 * dim
    doubled, _, used = geo.twonn(torch.cat([flat[:50], flat[:50]]))
    assert used == 0 and math.isnan(doubled)  # duplicates have no first-neighbour distance


def test_curvature_of_a_straight_line_is_zero_and_of_a_zigzag_is_known() -> None:
    t = torch.arange(6, dtype=torch.float64)[None, :, None]
    line = t * torch.tensor([1.0, 2.0, 0.0], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.bool)
    total, _, count = geo.curvature_sums(line, mask)
    assert count == 4 and float(total) == pytest.approx(0.0, abs=1e-7)
    zig = torch.tensor([[[0, 0], [1, 0], [1, 1], [2, 1], [2, 2]]], dtype=torch.float64)
    total, squares, count = geo.curvature_sums(zig, torch.ones(1, 5, dtype=torch.bool))
    assert count == 3 and float(total) == pytest.approx(3 * math.pi / 2)
    assert float(squares) == pytest.approx(3 * (math.pi / 2) ** 2)
    mask[0, 5] = False  # a pad: its triple is left out
    assert geo.curvature_sums(line, mask)[2] == 3


def test_batched_spectra_equal_one_at_a_time() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 7, 5, generator=g, dtype=torch.float64)
    z[0, 0] = 0.0  # an all-zero set: NaN
    z[1, 1, :, 2:] = 0.0  # rank 2
    eig = geo.batched_gram_eigenvalues(z)
    for alpha in (1.0, 2.0, 0.5):
        got = geo.spectral_measures(eig, alpha)
        for i in range(3):
            for j in range(4):
                one = geo.gram_eigenvalues(z[i, j])
                want = (
                    geo.matrix_entropy(one, alpha),
                    geo.effective_rank(one),
                    geo.participation_ratio(one),
                )
                for g_, w in zip(got, want, strict=True):
                    assert float(g_[i, j]) == pytest.approx(w, rel=1e-10, nan_ok=True)


# -- the streamed states ------------------------------------------------------------------------
def synthetic_steps(seed: int = 0, batches: int = 4, sink: float = 0.0) -> list[Step]:
    """Batches of float64 states ``h_0 … h_L`` with structure across depth (each a noisy map of
    the one before), the last row of each batch padded; ``sink`` adds a massive value to
    dimension 3 at position 0 of ``h_1 … h_L``."""
    g = torch.Generator().manual_seed(seed)
    maps = [torch.randn(D, D, generator=g, dtype=torch.float64) / math.sqrt(D) for _ in range(L)]
    steps = []
    for b in range(batches):
        h = [torch.randn(ROWS, POS, D, generator=g, dtype=torch.float64) + 0.5]
        for m in maps:
            h.append(
                h[-1]
                + torch.tanh(h[-1] @ m)
                + 0.1 * torch.randn(ROWS, POS, D, generator=g, dtype=torch.float64)
            )
        for layer in range(1, L + 1):
            h[layer][:, 0, 3] += sink
        mask = torch.ones(ROWS, POS, dtype=torch.bool)
        mask[-1, POS - 3 :] = False
        tokens = torch.randint(0, 50, (ROWS, POS), generator=g)
        cache = {INFO.resid(layer): h[layer] for layer in range(L + 1)}
        steps.append(Step(Batch(tokens, mask, index=b), cache, None, model=object(), info=INFO))
    return steps


ANALYZERS = [
    Similarity(sample=96, per_batch=24, per_row=8, groups=3),
    Spectrum(sample=96, per_batch=24, per_row=8, groups=2),
]


def _state(analyzer: Any, steps: list[Step]) -> Stats:
    state = analyzer.init(INFO)
    for step in steps:
        analyzer.update(state, step)
    return state


def _close(a: Any, b: Any, rtol: float = 1e-12) -> None:
    """Two results' arrays and numeric table columns within ``rtol`` (relative, float64)."""
    assert sorted(a.arrays) == sorted(b.arrays)
    for key in a.arrays:
        np.testing.assert_allclose(
            np.asarray(b.arrays[key], float),
            np.asarray(a.arrays[key], float),
            rtol=rtol,
            atol=rtol,
            equal_nan=True,
            err_msg=key,
        )
    for name, table in a.tables.items():
        for column, values in table.columns.items():
            values = np.asarray(values)
            if values.dtype.kind in "fi":
                np.testing.assert_allclose(
                    np.asarray(b.tables[name][column], float),
                    values.astype(float),
                    rtol=rtol,
                    atol=rtol,
                    equal_nan=True,
                    err_msg=f"{name}.{column}",
                )


@pytest.mark.parametrize("analyzer", ANALYZERS, ids=lambda a: a.name)
def test_streamed_equals_one_batch_and_shards_merge(analyzer: Any) -> None:
    steps = synthetic_steps()
    whole = analyzer.finalize(_state(analyzer, steps), INFO)
    # One batch holding every row: the streamed statistics are the same sums (the sample and the
    # jackknife's groups differ).
    rows = Batch(
        torch.cat([s.batch.tokens for s in steps]), torch.cat([s.batch.mask for s in steps])
    )
    cache = {k: torch.cat([s.cache[k] for s in steps]) for k in steps[0].cache}
    one = analyzer.finalize(
        _state(analyzer, [Step(rows, cache, None, model=object(), info=INFO)]), INFO
    )
    for key in ("linear_all", "linear_no_sink", "linear_no_massive"):
        if key in whole.arrays:
            np.testing.assert_allclose(one.arrays[key], whole.arrays[key], rtol=1e-12)
    for name, table in whole.tables.items():
        for column in table.columns:
            if column.startswith(
                ("token_", "prompt_", "curvature", "block_influence", "angular", "dataset_entropy")
            ) and not column.endswith(("_se", "_lo", "_hi")):
                np.testing.assert_allclose(
                    one.tables[name][column], table[column], rtol=1e-12, err_msg=f"{name}.{column}"
                )
    odd, even = _state(analyzer, steps[1::2]), _state(analyzer, steps[0::2])
    merged = odd.merge(even)
    _close(whole, analyzer.finalize(merged, INFO))
    _close(whole, analyzer.finalize(even.merge(odd), INFO))
    _close(whole, analyzer.finalize(merged.merge(analyzer.init(INFO)), INFO))


def test_linear_cka_streamed_matches_numpy_over_every_position() -> None:
    steps = synthetic_steps()
    result = Similarity(sample=96, per_batch=24, groups=3).finalize(
        _state(Similarity(sample=96, per_batch=24, groups=3), steps), INFO
    )
    rows = [
        torch.cat([s.resid(layer)[s.batch.mask] for s in steps]).numpy() for layer in range(L + 1)
    ]
    for i in range(L + 1):
        for j in range(L + 1):
            assert result.arrays["linear_all"][i, j] == pytest.approx(
                np_cka(rows[i], rows[j]), rel=1e-10
            )
    # Without the sink: every position but the first of each row.
    rest = [
        torch.cat([s.resid(layer)[:, 1:][s.batch.mask[:, 1:]] for s in steps]).numpy()
        for layer in range(L + 1)
    ]
    assert result.arrays["linear_no_sink"][0, L] == pytest.approx(
        np_cka(rest[0], rest[L]), rel=1e-10
    )


def test_a_planted_sink_outlier_lowers_plain_cka_and_not_the_outlier_aware_one() -> None:
    analyzer = Similarity(sample=96, per_batch=24, groups=3, absolute=50.0, ratio=20.0)
    clean = analyzer.finalize(_state(analyzer, synthetic_steps()), INFO)
    planted = analyzer.finalize(_state(analyzer, synthetic_steps(sink=400.0)), INFO)
    assert clean.meta["massive_dims"] == [] and planted.meta["massive_dims"] == [3]
    off = ~np.eye(L + 1, dtype=bool)
    drop = clean.arrays["linear_all"][0, 1:] - planted.arrays["linear_all"][0, 1:]
    assert (drop > 0.2).all()  # h_0 against the planted states: plain CKA falls
    for variant in ("no_sink",):
        np.testing.assert_allclose(
            planted.arrays[f"linear_{variant}"], clean.arrays[f"linear_{variant}"], rtol=1e-10
        )
    # The dimension removed: the clean states' CKA without dimension 3 (numpy).
    steps = synthetic_steps()
    keep = [j for j in range(D) if j != 3]
    rows = [
        torch.cat([s.resid(layer)[s.batch.mask] for s in steps])[:, keep].numpy()
        for layer in range(L + 1)
    ]
    want = np.array([[np_cka(a, b) for b in rows] for a in rows])
    np.testing.assert_allclose(planted.arrays["linear_no_massive"], want, rtol=1e-10)
    assert np.abs(want - clean.arrays["linear_all"])[off].max() < 0.05  # barely moved
    change = planted.tables["similarity_change"]
    linear = [
        i
        for i, (m, v) in enumerate(zip(change["measure"], change["variant"], strict=True))
        if m == "linear"
    ]
    assert min(change["max_abs_change"][i] for i in linear) > 0.2


# -- two gloo ranks ----------------------------------------------------------------------------
def _rank_main(rank: int, store: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=120),
    )
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    try:
        steps = synthetic_steps()
        for analyzer in ANALYZERS:
            state = _state(analyzer, steps[rank::2])
            summaries: list[Any] = [None, None]
            dist.all_gather_object(summaries, state.summary())
            state.reduce(
                plan_reduce(summaries), lambda t, op: dist.all_reduce(t, op=ops[op]), "cpu"
            )
            if rank == 0:
                result = analyzer.finalize(state, INFO)
                np.savez(Path(out) / f"{analyzer.name}.npz", **result.arrays)
    finally:
        dist.destroy_process_group()
    sys.exit(0)


def test_two_gloo_ranks_give_one_process_states(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_similarity"])
    procs = [
        ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), str(tmp_path)))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0]
    steps = synthetic_steps()
    for analyzer in ANALYZERS:
        single = analyzer.finalize(_state(analyzer, steps), INFO)
        two = np.load(tmp_path / f"{analyzer.name}.npz")
        for key, value in single.arrays.items():
            np.testing.assert_allclose(
                two[key],
                np.asarray(value, float),
                rtol=1e-12,
                atol=1e-12,
                equal_nan=True,
                err_msg=f"{analyzer.name}: {key}",
            )


# -- on models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def zeroed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A float64 tiny GPT-2 whose block 1 writes nothing (attention and MLP outputs zero)."""
    from transformer_lens.model_bridge import TransformerBridge

    from lensdiv.testing.models import save_tiny_model

    directory = save_tiny_model("gpt2", tmp_path_factory.mktemp("geometry") / "gpt2")
    model = TransformerBridge.boot_transformers(str(directory), device="cpu", dtype=torch.float64)
    model = model.eval()
    with torch.no_grad():
        block = model.blocks[1]
        for module in (block.attn.o.original_component, block.mlp.out.original_component):
            module.weight.zero_()
            module.bias.zero_()
    return model


def _model_steps(model: Any, batches: int = 3) -> tuple[ModelInfo, list[Step]]:
    from lensdiv.ops.capture import capture

    info = ModelInfo.from_model(model)
    g = torch.Generator().manual_seed(0)
    steps = []
    for b in range(batches):
        tokens = torch.randint(4, 200, (3, 12), generator=g)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        hooks = [info.resid(layer) for layer in range(info.n_layers + 1)]
        _, cache = capture(model, tokens, hooks, need_logits=False)
        steps.append(Step(Batch(tokens, mask, index=b), cache, None, model, info))
    return info, steps


def test_a_block_that_writes_nothing_has_cka_one_and_block_influence_zero(zeroed: Any) -> None:
    from lensdiv.ops.surgery import signal_sums

    info, steps = _model_steps(zeroed)
    analyzer = Similarity(sample=72, per_batch=24, groups=3)
    state = analyzer.init(info)
    for step in steps:
        analyzer.update(state, step)
    result = analyzer.finalize(state, info)
    blocks = result.tables["similarity_blocks"]
    assert blocks["cka_next"][1] == pytest.approx(1.0, abs=1e-12)
    assert blocks["block_influence"][1] == pytest.approx(0.0, abs=1e-12)
    assert blocks["cka_next"][0] < 1 - 1e-6 and blocks["block_influence"][0] > 1e-6
    for measure in ("unbiased", "rbf", "svcca"):
        assert result.arrays[f"{measure}_all"][1, 2] == pytest.approx(1.0, abs=1e-9), measure
    assert result.arrays["procrustes_all"][1, 2] == pytest.approx(0.0, abs=1e-9)
    # prune's code path: the same sums give the same block influence.
    h = [[s.resid(layer) for layer in range(info.n_layers + 1)] for s in steps]
    bi = sum(
        signal_sums(x, s.batch.mask, s.batch.mask, 1)["bi"] for x, s in zip(h, steps, strict=True)
    )
    n = sum(float(s.batch.mask.sum()) for s in steps)
    np.testing.assert_allclose(blocks["block_influence"], (bi / n).numpy(), rtol=1e-12)
    spectrum = Spectrum(sample=72, per_batch=24)
    state = spectrum.init(info)
    for step in steps:
        spectrum.update(state, step)
    table = spectrum.finalize(state, info).tables["spectrum"]
    for column in ("token_entropy", "dataset_entropy", "prompt_entropy", "curvature"):
        assert table[column][1] == pytest.approx(table[column][2], rel=1e-9), column


@pytest.mark.parametrize("analyzer", ANALYZERS, ids=lambda a: a.name)
def test_the_contract_on_tiny_models(analyzer: Any) -> None:
    from lensdiv.testing.contract import check_analyzer

    report = check_analyzer(type(analyzer)(), architectures=("gpt2", "llama"))  # defaults
    assert report.checked == ["gpt2", "llama"], report.skipped


def test_a_run_draws_readable_figures(tmp_path: Path) -> None:
    from lensdiv.data.sources import DataSpec
    from lensdiv.run.runner import analyze
    from lensdiv.testing.models import save_tiny_model

    model = save_tiny_model("llama", tmp_path / "llama")
    run = analyze(
        str(model),
        data=DataSpec(seq_len=24, max_tokens=24 * 6, batch_size=2),
        plugins=[Similarity(sample=64, per_batch=32, groups=3), Spectrum(sample=64, per_batch=32)],
        out=tmp_path / "run",
        progress=False,
    )
    assert not run.errors, run.errors
    assert (tmp_path / "run" / "similarity" / "similarity_linear_all.png").exists()
    assert (tmp_path / "run" / "spectrum" / "spectrum_entropy.png").exists()
    assert 0.0 <= run["similarity"].arrays["linear_all"].min() <= 1.0


@pytest.mark.parametrize("k", [8, 32, 128])
def test_the_sketch_stays_within_its_stated_error(k: int) -> None:
    """The right-hand side of the cross-products projected on ``k`` Gaussian directions
    (docs/science.md G1): each squared norm is unbiased with relative standard deviation at most
    ``√(2/k)``; linear CKA, over 20 draws of the sketch, stays within ``√(2/k)/4`` on a mixture
    of high-rank states and within that on low-rank ones."""
    from lensdiv.analyzers.similarity import moments_cka

    g = torch.Generator().manual_seed(k)
    x = torch.randn(400, 256, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, 256)
    y = torch.tanh(x @ torch.randn(256, 256, generator=g, dtype=torch.float64) / 16) + x / 4
    low = torch.randn(400, 3, generator=g, dtype=torch.float64) @ torch.randn(
        3, 256, generator=g, dtype=torch.float64
    )
    for a, b in (
        (x, y),
        (low, low + 0.3 * torch.randn(400, 256, generator=g, dtype=torch.float64)),
    ):
        exact = geo.linear_cka(a, b)
        rows = torch.cat([a, b], 1)
        errors = []
        for seed in range(20):
            p = geo.sketch_matrix(256, k, seed)
            right = torch.cat([a @ p, b @ p], 1)
            got = moments_cka(400.0, rows.sum(0), rows.T @ right, 2, None, right.sum(0))
            errors.append(abs(got[0, 1] - exact))
        assert max(errors) <= math.sqrt(2 / k) / 4, (max(errors), exact)


def test_a_sketched_run_is_close_to_the_exact_one() -> None:
    steps = synthetic_steps()
    exact = Similarity(sample=96, per_batch=24, groups=3)
    sketched = Similarity(sample=96, per_batch=24, groups=3, sketch=8)
    a = exact.finalize(_state(exact, steps), INFO).arrays["linear_all"]
    b = sketched.finalize(_state(sketched, steps), INFO).arrays["linear_all"]
    assert np.abs(a - b).max() <= 2 / math.sqrt(8)
    assert sketched.state_bytes(INFO) < exact.state_bytes(INFO)
