"""``linmap`` (docs/science.md A6): closed-form maps against ``numpy.linalg.lstsq`` on naively collected
activations, the self-map and affine identities, streaming state, the document split, the
tokenizer check and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lensdiv.analyzers.linmap import (
    LinearMaps,
    LinmapNumbers,
    cross_cka,
    heldout_mask,
    is_heldout,
    spearman,
    target_layers,
)
from lensdiv.cli import app
from lensdiv.core.analyzer import Batch, ModelInfo
from lensdiv.core.errors import OptionError
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.data.tokenizer import byte_tokenizer
from lensdiv.ops.ridge import augment, fit_affine
from lensdiv.run.engine import Engine
from lensdiv.run.runner import analyze
from lensdiv.testing.models import boot_tiny, save_tiny_model, tiny_config

SPEC = DataSpec(max_tokens=2048, seq_len=64, batch_size=8)  # ~11 documents, 3 held out
SMALL = DataSpec(max_tokens=1024, seq_len=64, batch_size=8)
DEEP_LAYERS, DEEP_WIDTH = 6, 48
FAST = ["--max-tokens", "256", "--seq-len", "32", "--batch-size", "4", "--no-progress"]


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deeper, wider tiny llama with the same byte tokenizer: the target of the pair tests."""
    root = tmp_path_factory.mktemp("linmap_deep")
    return save_tiny_model("llama", root, n_layers=DEEP_LAYERS, d_model=DEEP_WIDTH, seed=1)


def bridge(arch: str, request: pytest.FixtureRequest) -> Any:
    """The session's shared bridge of a tiny architecture (see conftest)."""
    bridges = request.getfixturevalue("_booted_bridges")
    if arch not in bridges:
        bridges[arch] = boot_tiny(arch, request.getfixturevalue("tiny_dirs")[arch])
    return bridges[arch].eval()


def resid_names(n_layers: int) -> list[str]:
    return [f"blocks.{i}.hook_resid_pre" for i in range(n_layers)] + [
        f"blocks.{n_layers - 1}.hook_resid_post"
    ]


def naive_states(model: Any, batches: list[Batch]) -> list[np.ndarray]:
    """``h_0..h_L`` at every position of every batch, by ``run_with_cache``: [layer][rows, d]."""
    names = resid_names(model.cfg.n_layers)
    per_layer: list[list[np.ndarray]] = [[] for _ in names]
    with torch.no_grad():
        for batch in batches:
            _, cache = model.run_with_cache(batch.tokens, names_filter=names)
            for i, name in enumerate(names):
                per_layer[i].append(cache[name].reshape(-1, cache[name].shape[-1]).double().numpy())
    return [np.concatenate(parts) for parts in per_layer]


@pytest.fixture(scope="module")
def pair(deep_dir: Path, tiny_dirs: dict[str, Path]) -> dict[str, Any]:
    """gpt2 (3 layers, d32) mapped onto the deep llama (6 layers, d48) with ridge 0, plus the
    same activations collected naively, and which positions are training / held-out."""
    source = boot_tiny("gpt2", tiny_dirs["gpt2"])
    target = boot_tiny("llama", deep_dir)
    analyzer = LinearMaps(target=str(deep_dir), ridge=0.0)
    run = analyze(source, data=SPEC, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    batches = list(token_batches(SPEC, source.tokenizer))
    keep = np.concatenate([b.positions(exclude_bos=True).reshape(-1).numpy() for b in batches])
    docs = np.concatenate([b.doc.reshape(-1).numpy() for b in batches])
    held = np.array([is_heldout(int(d), 0, 0.2) for d in docs])
    return {
        "source": source,
        "analyzer": analyzer,
        "result": run["linmap"],
        "batches": batches,
        "x": naive_states(source, batches),
        "y": naive_states(target, batches),
        "train": keep & ~held,
        "test": keep & held,
    }


def lstsq_map(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The affine least-squares solution ``[W; bᵀ]`` of ``y ≈ x W + b``."""
    design = np.concatenate([x, np.ones((len(x), 1))], axis=1)
    return np.linalg.lstsq(design, y, rcond=None)[0]


# -- agreement with an independent computation ---------------------------------------------------


def test_fit_matches_lstsq(pair: dict[str, Any], moments: Stats) -> None:
    fit = moments.copy()
    pair["analyzer"].start_pass(fit, ModelInfo.from_model(pair["source"], name="source"), 1)
    maps = fit["maps"]
    d_src = pair["x"][0].shape[1]
    assert maps.shape == (4, d_src + 1, (DEEP_LAYERS + 1) * DEEP_WIDTH)
    train = pair["train"]
    for s, j in [(0, 0), (1, 2), (2, 5), (3, 6), (3, 0)]:
        expected = lstsq_map(pair["x"][s][train], pair["y"][j][train])
        got = maps[s, :, j * DEEP_WIDTH : (j + 1) * DEEP_WIDTH].numpy()
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * scale, err_msg=f"{s},{j}")


def test_scores_match_naive_heldout_computation(pair: dict[str, Any]) -> None:
    result, train, test = pair["result"], pair["train"], pair["test"]
    assert result.meta["evaluation"] == "held-out documents"
    assert result.meta["eval_positions"] == int(test.sum()) > 0
    r2, rel = np.empty((4, DEEP_LAYERS + 1)), np.empty((4, DEEP_LAYERS + 1))
    for s in range(4):
        design = np.concatenate([pair["x"][s][test], np.ones((int(test.sum()), 1))], axis=1)
        for j in range(DEEP_LAYERS + 1):
            y = pair["y"][j][test]
            err = design @ lstsq_map(pair["x"][s][train], pair["y"][j][train]) - y
            r2[s, j] = 1 - (err**2).sum() / ((y - y.mean(0)) ** 2).sum()
            rel[s, j] = np.mean(np.linalg.norm(err, axis=1) / np.linalg.norm(y, axis=1))
    np.testing.assert_allclose(result.arrays["r2"], r2, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(result.arrays["rel_error"], rel, rtol=1e-6, atol=1e-8)
    table = result.table()
    assert table["best_target"].tolist() == r2.argmax(1).tolist()
    np.testing.assert_allclose(table["r2"], r2.max(1), rtol=1e-6)
    rel_src, rel_best = np.arange(4) / 3, r2.argmax(1) / DEEP_LAYERS
    assert result.meta["diagonality"] == pytest.approx(spearman(rel_src, rel_best), nan_ok=True)


@pytest.fixture(scope="module")
def moments(pair: dict[str, Any]) -> Stats:
    """The pass-0 state of the pair, streamed again (read-only: copy before fitting)."""
    analyzer = LinearMaps(target=pair["analyzer"].target, ridge=0.0)
    return pass0(analyzer, pair["source"], pair["batches"])


def test_no_heldout_position_enters_the_fit(pair: dict[str, Any], moments: Stats) -> None:
    """The pass-0 moments are exactly the sums over training-document positions."""
    state = moments
    train, test = pair["train"], pair["test"]
    assert test.sum() > 0 and train.sum() > 0
    assert float(state["heldout_positions"]) == test.sum()
    for s in (0, 3):
        xa = np.concatenate([pair["x"][s], np.ones((len(train), 1))], axis=1)
        np.testing.assert_allclose(state["xtx"][s].numpy(), xa[train].T @ xa[train], rtol=1e-9)
        y = np.concatenate([pair["y"][j] for j in range(DEEP_LAYERS + 1)], axis=1)
        np.testing.assert_allclose(
            state["xty"][s].numpy(), xa[train].T @ y[train], rtol=1e-9, atol=1e-9
        )
    # The held-out documents really are other documents.
    docs = np.concatenate([b.doc.reshape(-1).numpy() for b in pair["batches"]])
    assert not set(docs[train].tolist()) & set(docs[test].tolist())


# -- identities ---------------------------------------------------------------------------------


def test_affine_target_gives_r2_one() -> None:
    """``h' = A h + c``: the fit recovers ``A`` and ``c`` and scores R² = 1 on fresh points."""
    gen = torch.Generator().manual_seed(0)
    d, k, n = 16, 24, 400
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64)
    x = torch.randn(2 * n, d, generator=gen, dtype=torch.float64) @ mix + 3.0
    a = torch.randn(d, k, generator=gen, dtype=torch.float64)
    c = 5 * torch.randn(k, generator=gen, dtype=torch.float64)
    y = x @ a + c
    state = Stats()
    LinearMaps._accumulate(state, x[None, :n], y[:n, None, :])
    truth = y[n:]
    sst = (truth - truth.mean(0)).square().sum()
    maps, lam, exact = fit_affine(state["xtx"][0], state["xty"][0], 0.0)
    assert exact and lam == 0.0
    torch.testing.assert_close(maps[:d], a, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(maps[d], c, rtol=1e-9, atol=1e-9)
    r2 = 1 - (augment(x[n:]) @ maps - truth).square().sum() / sst
    assert float(r2) == pytest.approx(1.0, abs=1e-12)
    # The default ridge shrinks the map a little; λ is relative to the mean eigenvalue.
    maps, lam, _ = fit_affine(state["xtx"][0], state["xty"][0], 1e-4)
    mean_eig = float(torch.cov(x[:n].T).trace()) / d * (n - 1) / n
    assert lam == pytest.approx(1e-4 * mean_eig)
    r2 = 1 - (augment(x[n:]) @ maps - truth).square().sum() / sst
    assert 0.9999 < float(r2) < 1


def _numpy_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA from the paper's formula (Kornblith et al. 2019, eq. 5), in numpy."""
    x, y = x - x.mean(0), y - y.mean(0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def test_cross_model_cka_from_the_moments_is_numpys() -> None:
    """The CKA ``linmap`` reads from its moments (two source states, three target states of
    another width, streamed in two parts) against numpy on the same rows; invariant to a
    rotation, a scale and a shift of a target, and 1 for a state against a copy of itself."""
    gen = torch.Generator().manual_seed(3)
    n, d, e = 300, 6, 5
    x = torch.randn(2, n, d, generator=gen, dtype=torch.float64)
    x[1] = x[0] @ torch.randn(d, d, generator=gen, dtype=torch.float64) + 0.1 * x[1]
    q, _ = torch.linalg.qr(torch.randn(e, e, generator=gen, dtype=torch.float64))
    y0 = torch.randn(n, e, generator=gen, dtype=torch.float64) + x[0, :, :e]
    y = torch.stack([y0, 3 * y0 @ q + 7.0, x[0, :, :e]], 1)  # [n, targets, e]
    state = Stats()
    for part in (slice(0, 120), slice(120, n)):  # streamed: the sums merge
        LinearMaps._accumulate(state, x[:, part], y[part])
    got = cross_cka(state["xtx"], state["xty"], state["yty"]).numpy()
    want = np.array([[_numpy_cka(x[s].numpy(), y[:, j].numpy()) for j in range(3)]
                     for s in range(2)])
    np.testing.assert_allclose(got, want, rtol=1e-10)
    np.testing.assert_allclose(got[:, 0], got[:, 1], rtol=1e-10)  # rotation, scale, shift
    assert got.min() > 0 and got.max() <= 1 + 1e-12
    self_state = Stats()
    LinearMaps._accumulate(self_state, x, x.transpose(0, 1))
    diag = np.diag(cross_cka(self_state["xtx"], self_state["xty"], self_state["yty"]).numpy())
    np.testing.assert_allclose(diag, 1.0, rtol=1e-12)


def test_rank_deficient_source_uses_the_minimum_norm_solution() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(200, 3, generator=gen, dtype=torch.float64)
    x = torch.cat([x, x[:, :1]], dim=1)  # a repeated column: singular covariance
    y = x[:, :1] * 2 + 1
    state = Stats()
    LinearMaps._accumulate(state, x[None], y[:, None, :])
    maps, _, exact = fit_affine(state["xtx"][0], state["xty"][0], 0.0)
    assert not exact
    expected = lstsq_map(x.numpy(), y.numpy())  # lstsq is minimum-norm too
    np.testing.assert_allclose(maps.numpy(), expected, atol=1e-9)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox"])
def test_model_mapped_onto_itself(
    arch: str, request: pytest.FixtureRequest, tiny_dirs: dict[str, Path]
) -> None:
    """Through a second copy of the model (its own forward) and through ``target=self``."""
    model = bridge(arch, request)
    n = model.cfg.n_layers
    for target in (str(tiny_dirs[arch]), "self"):
        run = analyze(model, data=SMALL, plugins=[LinearMaps(target=target)], progress=False)
        assert run.ok, run.errors
        result = run["linmap"]
        diag = np.diag(result.arrays["r2"])
        assert diag.min() >= 0.999, (target, diag)
        assert np.diag(result.arrays["rel_error"]).max() < 0.05
        assert result.table()["best_target"].tolist() == list(range(n + 1))
        assert result.meta["diagonality"] == pytest.approx(1.0)
        assert result.meta["target"]["self"] == (target == "self")
        np.testing.assert_allclose(np.diag(result.arrays["cka"]), 1.0, rtol=1e-9)


# -- invariants on every architecture ------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,exclude_bos",
    [(arch, True) for arch in ("gpt2", "llama", "neox", "qwen2", "olmo", "olmo2")]
    + [("gpt2", False), ("neox", False)],
)
def test_invariants(
    arch: str, exclude_bos: bool, deep_dir: Path, request: pytest.FixtureRequest
) -> None:
    model = bridge(arch, request)
    spec = SMALL
    analyzer = LinearMaps(target=str(deep_dir), exclude_bos=exclude_bos)
    run = analyze(model, data=spec, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["linmap"]
    n_src = model.cfg.n_layers
    r2, rel = result.arrays["r2"], result.arrays["rel_error"]
    assert r2.shape == rel.shape == (n_src + 1, DEEP_LAYERS + 1)
    assert np.isfinite(r2).all() and np.isfinite(rel).all()
    assert (r2 <= 1 + 1e-9).all() and (rel >= 0).all()
    table = result.table()
    assert table["source_layer"].tolist() == list(range(n_src + 1))
    np.testing.assert_allclose(table["r2"], r2.max(1))
    assert all(0 <= j <= DEEP_LAYERS for j in table["best_target"])
    rho = result.meta["diagonality"]
    assert np.isnan(rho) or -1 - 1e-12 <= rho <= 1 + 1e-12
    batches = list(token_batches(spec, model.tokenizer))
    kept = sum(int(b.positions(exclude_bos=exclude_bos).sum()) for b in batches)
    held = result.meta["eval_positions"] if result.meta["evaluation"] == "held-out documents" else 0
    assert result.meta["train_positions"] + held == kept
    assert result.meta["documents"] == int(max(int(b.doc.max()) for b in batches)) + 1
    assert result.summary


# -- streaming -----------------------------------------------------------------------------------


def engine_for(analyzer: LinearMaps, model: Any) -> Engine:
    """The run's loop for ``analyzer`` (its setup loads and checks the target once)."""
    return Engine(model, ModelInfo.from_model(model, name="source"), [analyzer])


def pass0(analyzer: LinearMaps, model: Any, batches: list[Batch]) -> Stats:
    engine = engine_for(analyzer, model)
    states = engine.init()
    engine.feed(0, batches, states)
    return states[analyzer.name]


def feed(engine: Engine, state: Stats, batches: list[Batch], index: int) -> Stats:
    """Stream ``batches`` through pass ``index`` into ``state``; return it."""
    engine.feed(index, batches, {"linmap": state})
    assert not engine.failures, engine.failures
    return state


def state_bytes(state: Stats) -> dict[str, int]:
    return {k: state[k].numel() * state[k].element_size() for k in _sums(state)}


def _sums(state: Stats) -> list[str]:
    return [name for name in state.names() if state.kind(name) == "sum"]


def test_merged_shards_equal_one_pass(pair: dict[str, Any], moments: Stats) -> None:
    model, batches = pair["source"], pair["batches"]
    analyzer = LinearMaps(target=pair["analyzer"].target, ridge=0.0)
    info = ModelInfo.from_model(model, name="source")
    whole = moments
    halves = [pass0(analyzer, model, batches[:2]), pass0(analyzer, model, batches[2:])]
    merged = halves[0].merge(halves[1])
    assert set(_sums(merged)) == set(_sums(whole))
    for key in _sums(whole):
        torch.testing.assert_close(merged[key], whole[key], rtol=1e-12, atol=1e-9)
    assert int(merged["doc_max"]) == int(whole["doc_max"])
    # Fit on the merged moments, score the two shards separately (each from a copy of the
    # fitted state), merge the scores: the same numbers as the runner's single stream.
    engine = engine_for(analyzer, model)
    engine.begin_pass(1, {"linmap": merged})
    scored = [
        feed(engine, merged.copy(), batches[:2], 1),
        feed(engine, merged.copy(), batches[2:], 1),
    ]
    result = analyzer.finalize(scored[0].merge(scored[1]), info)
    for name in ("r2", "rel_error", "cka"):
        np.testing.assert_allclose(result.arrays[name], pair["result"].arrays[name], rtol=1e-9)


def test_state_size_does_not_grow_with_tokens(pair: dict[str, Any], moments: Stats) -> None:
    model, batches = pair["source"], pair["batches"]
    analyzer = LinearMaps(target=pair["analyzer"].target)
    one = pass0(analyzer, model, batches[:1])
    assert state_bytes(one) == state_bytes(moments)  # 1 batch or 4: the same tensors
    d_src = model.cfg.d_model
    expected = 8 * 4 * (d_src + 1) * (d_src + 1 + (DEEP_LAYERS + 1) * DEEP_WIDTH)
    assert state_bytes(one)["xtx"] + state_bytes(one)["xty"] == expected
    assert state_bytes(one)["yty"] == 8 * (DEEP_LAYERS + 1) * DEEP_WIDTH**2
    engine = engine_for(analyzer, model)
    engine.begin_pass(1, {"linmap": one})
    sizes = [state_bytes(feed(engine, one.copy(), batches[:n], 1)) for n in (1, 2)]
    assert sizes[0] == sizes[1]


# -- document split ------------------------------------------------------------------------------


def test_split_is_by_document_and_deterministic(pair: dict[str, Any]) -> None:
    flags: dict[int, bool] = {}
    for batch in pair["batches"]:
        mask = heldout_mask(batch, 0, 0.2)
        assert torch.equal(mask, heldout_mask(batch, 0, 0.2))
        for doc, flag in zip(
            batch.doc.reshape(-1).tolist(), mask.reshape(-1).tolist(), strict=True
        ):
            if doc >= 0:
                assert flags.setdefault(doc, flag) == flag, f"document {doc} split across sides"
    assert any(flags.values()) and not all(flags.values())
    ids = range(4000)
    fraction = np.mean([is_heldout(d, 0, 0.2) for d in ids])
    assert 0.18 < fraction < 0.22
    other = [is_heldout(d, 1, 0.2) for d in ids]
    assert other != [is_heldout(d, 0, 0.2) for d in ids]  # the seed changes the split


def test_rows_are_documents_without_document_ids() -> None:
    tokens = torch.zeros((64, 5), dtype=torch.long)
    batch = Batch(tokens=tokens, mask=torch.ones_like(tokens, dtype=torch.bool), index=2)
    mask = heldout_mask(batch, 0, 0.5)
    assert (mask == mask[:, :1]).all()  # whole rows
    assert 0 < int(mask[:, 0].sum()) < 64


def test_spearman() -> None:
    assert spearman([0, 1, 2], [0, 5, 9]) == pytest.approx(1.0)
    assert spearman([0, 1, 2], [3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([0, 1, 2], [1, 1, 1]))
    x, y = np.array([0.5, 0.5, 2, 3]), np.array([0, 1.5, 1.5, 3])  # average ranks of the ties
    expected = np.corrcoef(x, y)[0, 1]
    assert spearman([1, 1, 2, 7], [0, 4, 4, 9]) == pytest.approx(expected)


# -- memory budget -------------------------------------------------------------------------------


def test_budget_fits_every_kth_target_layer(pair: dict[str, Any], deep_dir: Path) -> None:
    model = pair["source"]
    analyzer = LinearMaps(target=str(deep_dir), ridge=0.0, max_moment_gb=0.00024)
    run = analyze(model, data=SPEC, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["linmap"]
    layers = result.meta["target_layers"]
    assert result.meta["target_stride"] == 3 and layers == list(target_layers(DEEP_LAYERS, 3))
    assert layers == [0, 3, 6] and result.meta["moment_gb"] <= 0.00024
    r2 = result.arrays["r2"]
    assert np.isnan(r2[:, [1, 2, 4, 5]]).all() and np.isfinite(r2[:, layers]).all()
    np.testing.assert_allclose(r2[:, layers], pair["result"].arrays["r2"][:, layers], rtol=1e-9)
    with pytest.raises(OptionError, match="max_moment_gb"):
        analyze(
            model,
            data=SPEC,
            progress=False,
            plugins=[LinearMaps(target=str(deep_dir), max_moment_gb=0.00024, target_stride=1)],
        )


# -- tokenizer check and command line ------------------------------------------------------------

runner = CliRunner()


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


def assert_user_error(result: Any, *needles: str) -> None:
    # Hugging Face's own weight-loading bar (stderr) is not ours to judge here.
    lines = [ln for ln in result.output.splitlines() if not ln.startswith("Loading weights")]
    text = "\n".join(lines).strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text and len(text.splitlines()) == 1, text
    for needle in needles:
        assert needle in text, text


def save_with_tokenizer(directory: Path, tokenizer: Any, vocab_size: int) -> Path:
    from transformers import AutoModelForCausalLM

    config = tiny_config("gpt2")
    config.vocab_size = vocab_size
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def foreign_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gpt2-config models whose tokenizers differ from the byte tokenizer: one extra token
    (vocabulary 261), and the same 260 tokens with two ids swapped."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("linmap_tok")
    base = root / "base"
    byte_tokenizer().save_pretrained(base)
    bigger = PreTrainedTokenizerFast.from_pretrained(base)  # a copy, never the cached one
    bigger.add_tokens(["<extra>"])
    spec = json.loads(Tokenizer.from_file(str(base / "tokenizer.json")).to_str())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    return {
        "extra": save_with_tokenizer(root / "extra", bigger, len(bigger)),
        "swapped": save_with_tokenizer(root / "swapped", swapped, 260),
    }


@pytest.mark.parametrize("kind,needle", [("extra", "260 and 261 tokens"), ("swapped", "has id")])
def test_different_tokenizers_are_one_line_exit_2(
    kind: str,
    needle: str,
    foreign_dirs: dict[str, Path],
    tiny_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    source, target = str(tiny_dirs["gpt2"]), str(foreign_dirs[kind])
    result = invoke(
        "analyze",
        source,
        "--plugins",
        "linmap",
        "--ref",
        target,
        "--out",
        str(tmp_path / "o"),
        *FAST,
    )
    assert_user_error(result, "same tokenizer", source, target, needle)
    assert not (tmp_path / "o" / "manifest.json").exists()  # refused before any work


def test_bad_target_spec_is_one_line(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    result = invoke(
        "analyze",
        str(tiny_dirs["gpt2"]),
        "--plugins",
        "linmap",
        "--ref",
        str(tmp_path / "nodir"),
        *FAST,
    )
    assert_user_error(result, "linmap target", "does not exist")
    assert_user_error(
        invoke("analyze", "toy", "-p", "linmap", "-O", "linmap.heldout=1.5", *FAST), "heldout"
    )
    assert_user_error(
        invoke("analyze", "toy", "-p", "linmap", "--ref", "a", "-O", "linmap.target=b", *FAST),
        "disagree",
    )


def test_cli_ref_and_compare(tiny_dirs: dict[str, Path], deep_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ref"
    result = invoke(
        "analyze",
        str(tiny_dirs["gpt2"]),
        "--plugins",
        "contrib",
        "--ref",
        str(deep_dir),
        "--out",
        str(out),
        *FAST,
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["analyzers"]) == {"contrib", "linmap"}  # --ref adds linmap
    assert manifest["analyzers"]["linmap"]["options"]["target"] == str(deep_dir)
    files = {p.name for p in (out / "linmap").iterdir()}
    assert {"result.json", "linmap.csv", "linmap_r2.png", "linmap_depth.png"} <= files

    out = tmp_path / "compare"
    result = invoke("compare", str(tiny_dirs["gpt2"]), str(deep_dir), "--out", str(out), *FAST)
    assert result.exit_code == 0, result.output
    assert "Spearman" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["analyzers"]) == ["linmap"] and manifest["status"] == "complete"
    saved = json.loads((out / "linmap" / "result.json").read_text())
    assert np.asarray(saved["arrays"]["r2"]).shape == (4, DEEP_LAYERS + 1)


def test_numbers_without_a_result(pair: dict[str, Any], moments: Stats) -> None:
    """The scores from the state alone (no ``Result``): numpy's held-out R² per (source,
    target), the best and same-depth targets, the diagonality, the positions counted."""
    model, batches, train, test = pair["source"], pair["batches"], pair["train"], pair["test"]
    analyzer = LinearMaps(target=pair["analyzer"].target, ridge=0.0)
    engine = engine_for(analyzer, model)
    state = moments.copy()
    engine.begin_pass(1, {"linmap": state})
    feed(engine, state, batches, 1)
    numbers = LinmapNumbers.from_state(state, ModelInfo.from_model(model), analyzer)
    r2 = np.empty((4, DEEP_LAYERS + 1))
    for s in range(4):
        design = np.concatenate([pair["x"][s][test], np.ones((int(test.sum()), 1))], axis=1)
        for j in range(DEEP_LAYERS + 1):
            y = pair["y"][j][test]
            err = design @ lstsq_map(pair["x"][s][train], pair["y"][j][train]) - y
            r2[s, j] = 1 - (err**2).sum() / ((y - y.mean(0)) ** 2).sum()
    np.testing.assert_allclose(numbers.r2, r2, rtol=1e-6, atol=1e-8)
    assert numbers.best == r2.argmax(1).tolist()
    np.testing.assert_allclose(numbers.best_r2, r2.max(1), rtol=1e-6)
    depths = np.arange(DEEP_LAYERS + 1) / DEEP_LAYERS
    same = [int(np.argmin(np.abs(depths - s / 3))) for s in range(4)]
    assert numbers.same == same
    rel_best = r2.argmax(1) / DEEP_LAYERS
    assert numbers.diagonality == pytest.approx(spearman(np.arange(4) / 3, rel_best), nan_ok=True)
    assert (numbers.train_positions, numbers.eval_positions) == (int(train.sum()), int(test.sum()))
    assert numbers.on_heldout and numbers.documents["split"] == "document"
