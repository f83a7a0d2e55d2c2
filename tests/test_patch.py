"""The ``patch`` analyzer (docs/science.md A4) on tiny random models.

Patching agrees with TransformerLens' own ``get_act_patch_*`` sweeps (per pair and as normalised
means and standard errors); erasure agrees with a naive one-position-at-a-time hook loop; the
identities hold (patch everything = clean, patch nothing = corrupt, patch the final residual at
the answer = the clean output, erase a residual by itself = 0, IG completeness converging with
the number of steps); end alignment of pairs of different lengths is checked against separate
runs; bad task data is one line and exit 2 through the CLI.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from lensdiv.analyzers.patch import Patching, PatchingMaps
from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import DataError, OptionError
from lensdiv.core.stats import Stats
from lensdiv.data.corpus import KnowledgeBase, Query
from lensdiv.data.pairs import Pair, builtin_pairs, read_pairs
from lensdiv.ops.capture import capture
from lensdiv.ops.patching import integrated_gradients, run_patches, run_variants
from lensdiv.ops.readout import final_readout
from lensdiv.ops.resume import Resumer
from lensdiv.run.engine import Engine
from lensdiv.run.runner import analyze
from tests.helpers import assert_results_equal
from tests.test_cli import assert_user_error, invoke

SITES = ("resid_pre", "attn_out", "mlp_out")


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(params=["gpt2", "llama", "neox", "native"])
def arch(request: pytest.FixtureRequest) -> str:
    """Three Hugging Face families and the TL-native model (``model`` comes from conftest)."""
    return request.param


def fact_pairs(relation: str, n: int) -> list[dict[str, str]]:
    """``n`` clean/corrupt facts of one relation (equal lengths), answers differing."""
    kb = KnowledgeBase(seed=0)
    rows = []
    entities = kb.entities
    for i, entity in enumerate(entities):
        other = entities[(i + 1) % len(entities)]
        target, foil = kb.answer((relation,), entity), kb.answer((relation,), other)
        if target[0] == foil[0]:
            continue
        rows.append(
            {
                "clean": Query((relation,), entity, target).prompt,
                "corrupt": Query((relation,), other, foil).prompt,
                "target": target,
                "foil": foil,
            }
        )
        if len(rows) == n:
            break
    return rows


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def metric_of(logits: torch.Tensor, target: torch.Tensor, foil: torch.Tensor) -> torch.Tensor:
    """Logit difference at the last position, written independently of the analyzer."""
    last = logits[:, -1]
    return last[torch.arange(len(target)), target] - last[torch.arange(len(foil)), foil]


def one_batch(model: Any, rows: list[dict[str, str]], tmp_path: Path) -> Any:
    analyzer = Patching(pairs=str(write_jsonl(tmp_path / "pairs.jsonl", rows)), batch_size=64)
    (batch,) = analyzer.examples(model, ModelInfo.from_model(model))
    return batch


# -- agreement with TransformerLens' patching ------------------------------------------------------
def test_patching_matches_transformer_lens(model: Any, tmp_path: Path) -> None:
    from transformer_lens.patching import (
        PatchingResult,
        generic_activation_patch,
        layer_pos_patch_setter,
    )
    from transformer_lens.utilities.statistics import standard_error

    rows = fact_pairs("boss", 5)
    path = write_jsonl(tmp_path / "boss.jsonl", rows)
    analyzer = Patching(pairs=str(path), ig_steps=0, erasure=False)
    run = analyze(model, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["patch"]
    assert result.meta["n_pairs"] == 5 and result.meta["degenerate_pairs"] == 0

    (batch,) = analyzer.examples(model, ModelInfo.from_model(model))
    clean, corrupt = batch.tokens, batch.extra["corrupt"]
    target, foil = batch.extra["target"], batch.extra["foil"]
    info = ModelInfo.from_model(model)
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
    corrupt_logits, corrupt_cache = capture(model, corrupt, analyzer.hooks(info), need_logits=True)
    n_pos, L = clean.shape[1], info.n_layers
    # The analyzer reads the clean and corrupt outputs through the same float32 readout as the
    # patched passes (issue 15), so a patch that changes nothing scores exactly 0; the model's
    # own logits agree with it to float32 rounding, which the normalisation can amplify.
    readout = final_readout(model)
    m_clean = metric_of(readout.logits(clean_cache[info.resid(L)][:, -1])[:, None], target, foil)
    m_corrupt = metric_of(readout.logits(corrupt_cache[info.resid(L)][:, -1])[:, None], target,
                          foil)
    for own, ours_ in ((clean_logits, m_clean), (corrupt_logits, m_corrupt)):
        torch.testing.assert_close(metric_of(own, target, foil), ours_, atol=1e-5, rtol=1e-5)
    assert (clean != corrupt).sum(0).nonzero().flatten().tolist() == [6, 7]  # the entity

    # Ours: every (layer, position) of every site, batched and resumed.
    eye = torch.eye(n_pos, dtype=torch.bool)
    ours = torch.zeros(len(SITES), L, n_pos, 5)
    resumer = Resumer(model)
    for layer in range(L):
        patches = [(site, eye, clean_cache[f"blocks.{layer}.hook_{site}"]) for site in SITES]
        outs = run_patches(resumer, corrupt, layer, corrupt_cache[info.resid(layer)], patches)
        for i, logits in enumerate(outs):
            ours[i, layer] = torch.stack([metric_of(lg[:, None], target, foil) for lg in logits])

    # TransformerLens: one patched forward per cell, on the entity and answer positions.
    cells = pd.DataFrame(
        [(layer, pos) for layer in range(L) for pos in (6, n_pos - 1)], columns=["layer", "pos"]
    )
    for i, site in enumerate(SITES):
        tl = generic_activation_patch(
            model,
            corrupt,
            clean_cache,
            lambda lg: metric_of(lg, target, foil),
            layer_pos_patch_setter,
            site,
            index_df=cells,
            reduce="none",
        )
        expected = ours[i][cells["layer"].tolist(), cells["pos"].tolist()]
        torch.testing.assert_close(tl.values, expected, atol=1e-5, rtol=0)

        # The analyzer's normalised mean and standard error are TL's statistics of these values.
        per_pair = PatchingResult(
            values=ours[i],
            axis_names=["layer", "pos"],
            index_df=cells,
            metric_names=["metric"],
            reduced=False,
            baseline=m_corrupt,
        )
        normalised = per_pair.normalized(m_clean).double()
        np.testing.assert_allclose(
            result.arrays[f"patch_{site}"],
            normalised.mean(-1).numpy(),
            rtol=1e-5,
            atol=1e-5,
            err_msg=site,
        )
        np.testing.assert_allclose(
            result.arrays[f"patch_{site}_stderr"],
            standard_error(normalised, dim=-1).numpy(),
            rtol=1e-4,
            atol=1e-5,
            err_msg=site,
        )
    table = result.tables["pairs"]
    np.testing.assert_allclose(table["clean_logit_diff"], m_clean.numpy(), atol=1e-5)
    np.testing.assert_allclose(table["corrupt_logit_diff"], m_corrupt.numpy(), atol=1e-5)


# -- identities -----------------------------------------------------------------------------------
def test_patching_identities(model: Any, tmp_path: Path) -> None:
    batch = one_batch(model, fact_pairs("rival", 4), tmp_path)
    clean, corrupt = batch.tokens, batch.extra["corrupt"]
    target, foil = batch.extra["target"], batch.extra["foil"]
    info = ModelInfo.from_model(model)
    names = Patching().hooks(info)
    clean_logits, clean_cache = capture(model, clean, names, need_logits=True)
    corrupt_logits, corrupt_cache = capture(model, corrupt, names, need_logits=True)
    m_clean = metric_of(clean_logits, target, foil)
    m_corrupt = metric_of(corrupt_logits, target, foil)
    assert (m_clean - m_corrupt).abs().min() > 1e-4  # the scores below are well defined
    resumer = Resumer(model)
    n_pos, L = clean.shape[1], info.n_layers
    everything_nothing = torch.tensor([[True] * n_pos, [False] * n_pos])
    for layer in range(L + 1):
        # Patching the whole residual at any depth (layer 0 included) gives the clean metric
        # (normalised score 1); patching nothing gives the corrupt one (score 0).
        patches = [("resid_pre", everything_nothing, clean_cache[info.resid(layer)])]
        if layer == 0:
            patches += [
                (site, everything_nothing[1:], clean_cache[f"blocks.0.hook_{site}"])
                for site in ("attn_out", "mlp_out")
            ]
        outs = run_patches(resumer, corrupt, layer, corrupt_cache[info.resid(layer)], patches)
        values = [metric_of(lg[:, None], target, foil) for out in outs for lg in out]
        torch.testing.assert_close(values[0], m_clean, atol=1e-5, rtol=0)
        for value in values[1:]:
            torch.testing.assert_close(value, m_corrupt, atol=1e-5, rtol=0)
    # The final residual at the answer position alone restores the clean output exactly; at
    # every other position it does nothing.
    answer = torch.zeros(2, n_pos, dtype=torch.bool)
    answer[0, -1] = True
    answer[1, :-1] = True
    restored, untouched = run_variants(
        resumer, corrupt, L, corrupt_cache[info.resid(L)], answer, clean_cache[info.resid(L)]
    )
    torch.testing.assert_close(restored, clean_logits[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(untouched, corrupt_logits[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["neox", "native"])
def test_erasure_matches_naive_loop_and_self_erasure_is_zero(model: Any, tmp_path: Path) -> None:
    rows = fact_pairs("mentor", 3)
    path = write_jsonl(tmp_path / "mentor.jsonl", rows)
    analyzer = Patching(pairs=str(path), ig_steps=0, sites=("resid_pre",), exclude_bos=True)
    run = analyze(model, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    erasure = run["patch"].arrays["erasure"]
    (batch,) = analyzer.examples(model, ModelInfo.from_model(model))
    tokens = batch.tokens
    info = ModelInfo.from_model(model)
    L, n_pos = info.n_layers, tokens.shape[1]
    assert erasure.shape == (L + 1, n_pos)
    assert np.all(erasure[L, :-1] <= 1e-6)  # the final residual matters only at the answer
    assert erasure.max() > 1e-3
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        p = logits[:, -1].softmax(-1)
        for layer in range(L + 1):
            h = cache[info.resid(layer)]
            mean = h[:, 1:].reshape(-1, h.shape[-1]).mean(0)  # every prompt's non-BOS positions
            for t in (1, 8, n_pos - 1):  # BOS excluded from the mean, the entity, the answer

                def erase(
                    x: torch.Tensor, *, hook: Any, t: int = t, mean: torch.Tensor = mean
                ) -> torch.Tensor:
                    x = x.clone()
                    x[:, t] = mean
                    return x

                erased = model.run_with_hooks(tokens, fwd_hooks=[(info.resid(layer), erase)])
                naive = float((erased[:, -1].softmax(-1) - p).norm(dim=-1).mean())
                assert abs(erasure[layer, t] - naive) <= 1e-5, (layer, t)
    # A residual replaced by itself changes nothing.
    resumer = Resumer(model)
    eye = torch.eye(n_pos, dtype=torch.bool)
    for layer in range(L + 1):
        h = cache[info.resid(layer)]
        same = run_variants(resumer, tokens, layer, h, eye, h)
        assert float((same.softmax(-1) - p).norm(dim=-1).max()) <= 1e-5


@pytest.mark.parametrize(
    "arch,metric",
    [
        ("gpt2", "logit_diff"),
        ("llama", "logit_diff"),
        ("neox", "logit_diff"),
        ("native", "logit_diff"),
        ("native", "prob"),
    ],
)
def test_ig_completeness_converges(model: Any, arch: str, metric: str, tmp_path: Path) -> None:
    batch = one_batch(model, fact_pairs("friend", 2), tmp_path)
    tokens, target, foil = batch.tokens, batch.extra["target"], batch.extra["foil"]
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    logits, cache = capture(model, tokens, names, need_logits=True)

    def fn(lg: torch.Tensor) -> torch.Tensor:
        k = lg.shape[0]
        flat = lg.reshape(-1, lg.shape[-1])
        if metric == "prob":
            values = flat.log_softmax(-1)[torch.arange(len(flat)), target.repeat(k)].exp()
        else:
            values = metric_of(flat[:, None], target.repeat(k), foil.repeat(k))
        return values.reshape(k, -1)

    clean_value = fn(logits[None, :, -1])[0]
    for layer in (0, info.n_layers // 2, info.n_layers):
        x = cache[info.resid(layer)]
        base = x[:, 1:].mean(1, keepdim=True).expand_as(x)
        errors = []
        for steps in (4, 32):
            attr, f_x, f_base = integrated_gradients(
                model, tokens, info.resid(layer), x, base, fn, steps
            )
            torch.testing.assert_close(f_x, clean_value, atol=1e-5, rtol=1e-5)
            gap = (f_x - f_base).abs()
            assert float(gap.min()) > 1e-5  # a relative error means something
            errors.append(float(((attr.sum(-1) - (f_x - f_base)).abs() / gap).max()))
            if layer == info.n_layers:  # only the answer position reaches the output
                assert float(attr[:, :-1].abs().max()) <= 1e-6
        # Resuming from h_layer (blocks before it not run) gives the same attributions.
        resumed = integrated_gradients(
            model, tokens, info.resid(layer), x, base, fn, 32, start=layer
        )
        for got, want in zip(resumed, (attr, f_x, f_base), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        # The midpoint rule's error falls ~64x for 8x the steps; allow float noise at the end.
        assert errors[1] < 3e-3, (layer, errors)
        assert errors[1] < errors[0] / 8 or errors[1] < 1e-5, (layer, errors)


def test_pairs_of_different_lengths_align_at_the_end(native_model: Any, tmp_path: Path) -> None:
    short, long = fact_pairs("boss", 3), fact_pairs("mentor", 2)  # 10 and 12 tokens with BOS
    options = {"ig_steps": 4, "sites": ("resid_pre",)}

    def maps(rows: list[dict[str, str]], name: str) -> dict[str, np.ndarray]:
        path = write_jsonl(tmp_path / name, rows)
        run = analyze(native_model, plugins=[Patching(pairs=str(path), **options)], progress=False)
        assert run.ok, run.errors
        return dict(run["patch"].arrays)

    a, b, both = maps(short, "a.jsonl"), maps(long, "b.jsonl"), maps(short + long, "ab.jsonl")
    n_a, n_b = len(short), len(long)
    width_a, width_b = a["erasure"].shape[1], b["erasure"].shape[1]
    assert width_b == width_a + 2 and both["erasure"].shape[1] == width_b
    # Per-pair maps combine by the number of pairs having each column. (Erasure is left out:
    # its dataset-mean residual depends on every pair.)
    for key in ("patch_resid_pre", "patch_resid_pre_stderr", "ig"):
        if key.endswith("stderr"):
            continue
        expected = b[key].copy()
        expected[:, -width_a:] = (n_a * a[key] + n_b * b[key][:, -width_a:]) / (n_a + n_b)
        np.testing.assert_allclose(both[key], expected, rtol=1e-6, atol=1e-9, err_msg=key)


# -- shards ---------------------------------------------------------------------------------------
def assert_results_close(got: Any, want: Any, *, rtol: float) -> None:
    """Counts and text exactly, floats within ``rtol`` (NaN where NaN)."""
    assert list(got.tables) == list(want.tables) and list(got.arrays) == list(want.arrays)
    for name, table in want.tables.items():
        assert list(got.tables[name].columns) == list(table.columns), name
        for col in table.columns:
            x, y = np.asarray(got.tables[name][col]), np.asarray(table[col])
            if y.dtype.kind == "f":
                np.testing.assert_allclose(x, y, rtol=rtol, atol=0, err_msg=f"{name}.{col}")
            else:
                assert x.tolist() == y.tolist(), f"{name}.{col}"
    for name, value in want.arrays.items():
        np.testing.assert_allclose(got.arrays[name], value, rtol=rtol, atol=0, err_msg=name)
    assert got.meta == want.meta
    assert got.plots == want.plots


def test_merged_shards_finalize_like_one_run(native_model: Any, tmp_path: Path) -> None:
    """Two shards, pass by pass: pass 0 on each half, merge, start pass 1 on the merged state,
    pass 1 on each half from a copy of it, merge; then finalize as one run over every batch."""
    rows = fact_pairs("boss", 3) + fact_pairs("mentor", 2)  # 10 and 12 tokens with BOS
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    analyzer = Patching(pairs=str(path), ig_steps=4, batch_size=2)
    info = ModelInfo.from_model(native_model)
    batches = analyzer.examples(native_model, info)
    assert [tuple(b.tokens.shape) for b in batches] == [(2, 10), (1, 10), (2, 12)]
    halves = [batches[1:], batches[:1]]  # a length in both shards, one in a single shard

    whole = Engine(native_model, info, [analyzer])
    results = whole.run(lambda: batches)
    assert not whole.failures, whole.failures
    want = results["patch"]

    shards = [Engine(native_model, info, [analyzer]) for _ in halves]  # a resumer each
    states = [engine.init() for engine in shards]
    for engine, half, state in zip(shards, halves, states, strict=True):
        engine.begin_pass(0, state)
        engine.feed(0, half, state)
    merged = {"patch": states[0]["patch"].merge(states[1]["patch"])}
    assert merged["patch"]["lengths"] == {"10", "12"}
    shards[0].begin_pass(1, merged)  # freezes pass 0, fits the erasure mean
    states = [{"patch": merged["patch"].copy()} for _ in halves]
    for engine, half, state in zip(shards, halves, states, strict=True):
        engine.feed(1, half, state)
    final = states[0]["patch"].merge(states[1]["patch"])
    # Pass 1 wrote only new names (a write to a frozen one would have failed the analyzer).
    assert not any(engine.failures for engine in shards), [e.failures for e in shards]
    assert {n for n in final.names() if n not in final.frozen} == {
        *(f"erase/{t}/{s}" for t in (10, 12) for s in ("sum", "sq", "n")),
        "erase/intervention",
    }
    got = shards[0].finalize({"patch": final})["patch"]
    assert got.meta["n_pairs"] == 5 and got.tables["pairs"]["line"].tolist() == [1, 2, 3, 4, 5]
    assert_results_close(got, want, rtol=1e-6)

    # finalize needs the state alone: saved, loaded and finalized by a fresh analyzer.
    final.save(tmp_path / "state")
    again = Patching(pairs=str(path), ig_steps=4, batch_size=2).finalize(
        Stats.load(tmp_path / "state"), info
    )
    assert_results_equal(again, got)


def test_patching_maps_are_the_numbers_of_the_result(native_model: Any, tmp_path: Path) -> None:
    """``PatchingMaps`` (the computation alone, no Result) from a two-pass state: the position
    axis ends at the answer, patching h_0 where clean and corrupt tokens agree changes nothing,
    erasure distances lie in [0, √2], and the result's tables hold exactly these numbers."""
    rows = fact_pairs("boss", 4)
    analyzer = Patching(pairs=str(write_jsonl(tmp_path / "pairs.jsonl", rows)), ig_steps=2)
    info = ModelInfo.from_model(native_model)
    batches = analyzer.examples(native_model, info)
    engine = Engine(native_model, info, [analyzer])
    states = engine.init()
    for index in range(2):
        engine.begin_pass(index, states)
        engine.feed(index, batches, states)
    assert not engine.failures, engine.failures
    maps = PatchingMaps.from_state(states["patch"], info, SITES)
    (batch,) = batches
    T = batch.tokens.shape[1]
    assert maps.offsets == list(range(-(T - 1), 1)) and maps.n_pos == T
    assert [p.line for p in maps.pairs] == [1, 2, 3, 4] and maps.degenerate == 0
    same = (batch.tokens == batch.extra["corrupt"]).all(0)
    np.testing.assert_allclose(maps.patch["resid_pre"].mean[0, same], 0.0, atol=1e-4)
    assert maps.erasure is not None and maps.ig is not None and maps.ig_rel_error is not None
    assert (maps.erasure.mean >= 0).all() and (maps.erasure.mean <= 2**0.5 + 1e-6).all()
    assert maps.patch["mlp_out"].pairs.tolist() == [4.0] * T

    result = analyzer.finalize(states["patch"], info)
    patching = result.table("patching")
    scores = torch.stack([maps.patch[site].mean for site in SITES]).flatten().tolist()
    np.testing.assert_array_equal(patching["score"], scores)
    np.testing.assert_array_equal(result.table("erasure")["distance"], maps.erasure.mean.flatten())
    np.testing.assert_array_equal(result.arrays["patch_attn_out"], maps.patch["attn_out"].mean)
    assert result.meta["ig_completeness_rel_error"] == float(maps.ig_rel_error.max())
    assert result.table("pairs")["clean_logit_diff"].tolist() == [p.clean for p in maps.pairs]


# -- task data ------------------------------------------------------------------------------------
def test_builtin_pairs_for_the_byte_tokenizer(native_model: Any) -> None:
    pairs = builtin_pairs(native_model.tokenizer)
    assert len(pairs) == 16
    for pair in pairs:
        assert len(pair.clean) == len(pair.corrupt) and pair.clean != pair.corrupt
        assert isinstance(pair.target, str) and isinstance(pair.foil, str)
        assert pair.target[0] != pair.foil[0]
        assert pair.clean.endswith("=")


def test_builtin_pairs_for_a_word_tokenizer() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lensdiv.data.pairs import _CAPITALS

    words = ["<unk>", "The", "capital", "of", "is"]
    for country, capital in _CAPITALS[:6]:
        words += [country, capital]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    pairs = builtin_pairs(tokenizer)
    assert len(pairs) >= 6
    for pair in pairs:
        assert pair.clean.startswith("The capital of")
        clean = tokenizer(pair.clean, add_special_tokens=False)["input_ids"]
        corrupt = tokenizer(pair.corrupt, add_special_tokens=False)["input_ids"]
        assert len(clean) == len(corrupt) == 5
    # Countries the tokenizer does not know have unknown capitals: such pairs are not built.
    assert all(
        tokenizer.unk_token_id
        not in tokenizer(p.clean + p.target, add_special_tokens=False)["input_ids"]
        for p in pairs
    )


def test_answer_token_is_the_continuation(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    rows = [
        {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "xy", "foil": 120},
        {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": " q", "foil": "z"},
    ]
    analyzer = Patching(pairs=str(write_jsonl(tmp_path / "t.jsonl", rows)))
    (batch,) = analyzer.examples(native_model, info)
    tok = native_model.tokenizer
    first = tok("x", add_special_tokens=False)["input_ids"][0]
    space = tok(" ", add_special_tokens=False)["input_ids"][0]
    assert batch.extra["target"].tolist() == [first, space]
    assert batch.extra["foil"].tolist() == [120, tok("z", add_special_tokens=False)["input_ids"][0]]
    assert batch.tokens[0, 0] == tok.bos_token_id
    assert batch.extra["line"] == [1, 2]


@pytest.mark.parametrize(
    "lines,needles",
    [
        ([], ["empty"]),
        (["", "   "], ["empty"]),
        (['{"clean": "a", "corrupt": "b", "target": "c"}', "{oops"], ["line 2", "JSON"]),
        (['{"clean": "a", "target": "c"}'], ["line 1", "'corrupt'"]),
        (['["clean", "corrupt"]'], ["line 1", "object"]),
        (['{"clean": "a", "corrupt": "b", "target": null}'], ["line 1", "target"]),
        (['{"clean": "", "corrupt": "b", "target": "c"}'], ["line 1", "clean"]),
    ],
)
def test_read_pairs_rejects_bad_files(tmp_path: Path, lines: list[str], needles: list[str]) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", lines) if lines else tmp_path / "empty.jsonl"
    if not lines:
        path.write_text("")
    with pytest.raises(DataError) as err:
        read_pairs(path)
    for needle in needles:
        assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_read_pairs_skips_blank_lines_and_keeps_numbers(tmp_path: Path) -> None:
    rows = [
        '{"clean": "a", "corrupt": "b", "target": "c"}',
        "",
        '{"clean": "d", "corrupt": "e", "target": 7, "foil": "f"}',
    ]
    pairs = read_pairs(write_jsonl(tmp_path / "p.jsonl", rows))
    assert pairs == [Pair(1, "a", "b", "c", None), Pair(3, "d", "e", 7, "f")]


@pytest.mark.parametrize(
    "row,needles",
    [
        (
            {"clean": "boss(ka)=", "corrupt": "friend(mi)=", "target": "a", "foil": "b"},
            ["line 2", "different lengths", "10 vs 12"],
        ),
        (
            {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "<unk>", "foil": "b"},
            ["line 2", "not in the vocabulary"],
        ),
        (
            {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": 999, "foil": "b"},
            ["line 2", "999", "d_vocab=260"],
        ),
        (
            {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "", "foil": "b"},
            ["line 2", "nothing"],
        ),
        ({"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "a"}, ["line 2", "foil"]),
        (
            {"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "ab", "foil": "ac"},
            ["line 2", "same token"],
        ),
    ],
)
def test_examples_reject_bad_pairs(
    native_model: Any, tmp_path: Path, row: dict[str, Any], needles: list[str]
) -> None:
    good = fact_pairs("boss", 1)[0]
    path = write_jsonl(tmp_path / "pairs.jsonl", [good, row])
    with pytest.raises(DataError) as err:
        Patching(pairs=str(path)).examples(native_model, ModelInfo.from_model(native_model))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_prob_metric_needs_no_foil(native_model: Any, tmp_path: Path) -> None:
    rows = [{k: v for k, v in r.items() if k != "foil"} for r in fact_pairs("boss", 3)]
    path = write_jsonl(tmp_path / "nofoil.jsonl", rows)
    run = analyze(
        native_model,
        plugins=[Patching(pairs=str(path), metric="prob", ig_steps=8, sites=("resid_pre",))],
        progress=False,
    )
    assert run.ok, run.errors
    result = run["patch"]
    assert result.meta["metric"] == "prob"
    assert "clean_prob" in result.tables["pairs"].columns
    assert result.meta["ig_completeness_rel_error"] < 5e-2


def test_bad_options() -> None:
    with pytest.raises(OptionError, match="sites"):
        Patching.from_options({"sites": "resid_pre,resid_mid"})
    with pytest.raises(OptionError, match="metric"):
        Patching.from_options({"metric": "kl"})
    with pytest.raises(OptionError, match="ig_steps"):
        Patching.from_options({"ig_steps": "-1"})
    assert Patching.from_options({"sites": "attn_out"}).sites == ("attn_out",)


# -- command line ---------------------------------------------------------------------------------
def run_cli(tmp_path: Path, pairs: Path) -> Any:
    return invoke(
        "analyze",
        "toy",
        "--plugins",
        "patch",
        "-O",
        f"patch.pairs={pairs}",
        "--no-progress",
        "--out",
        str(tmp_path / "out"),
    )


@pytest.mark.parametrize(
    "lines,needles",
    [
        (
            [{"clean": "boss(ka)=", "corrupt": "friend(mi)=", "target": "a", "foil": "b"}],
            ["line 2", "different lengths", "10 vs 12"],
        ),
        (
            [{"clean": "boss(ka)=", "corrupt": "boss(mi)=", "target": "<unk>", "foil": "b"}],
            ["line 2", "not in the vocabulary"],
        ),
        (
            [{"clean": "boss(ka)=", "corrupt": "boss(mi)=", "foil": "b"}],
            ["line 2", "missing key 'target'"],
        ),
        (['{"clean": "boss(ka)=", "corrupt": '], ["line 2", "not valid JSON"]),
    ],
)
def test_cli_bad_pairs(tmp_path: Path, lines: list[Any], needles: list[str]) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [fact_pairs("boss", 1)[0], *lines])
    assert_user_error(run_cli(tmp_path, path), "pairs.jsonl", *needles)


def test_cli_empty_and_missing_pairs_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for path, needle in ((empty, "empty"), (tmp_path / "none.jsonl", "does not exist")):
        assert_user_error(run_cli(tmp_path, path), needle)


def test_cli_runs_and_writes_everything(tmp_path: Path) -> None:
    from lensdiv.core.results import Result

    path = write_jsonl(tmp_path / "pairs.jsonl", fact_pairs("boss", 3) + fact_pairs("friend", 2))
    out = tmp_path / "out"
    result = invoke(
        "analyze",
        "toy",
        "--plugins",
        "patch",
        "-O",
        f"patch.pairs={path}",
        "-O",
        "patch.ig_steps=4",
        "-O",
        "patch.sites=resid_pre,mlp_out",
        "--no-progress",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert "answer" in result.output
    files = {p.name for p in (out / "patch").iterdir()}
    assert files == {
        "result.json",
        "depth.csv",
        "patching.csv",
        "erasure.csv",
        "ig.csv",
        "pairs.csv",
        "patch_resid_pre.png",
        "patch_mlp_out.png",
        "erasure.png",
        "ig.png",
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["analyzers"]["patch"]["data"] == "own examples"
    saved = Result.load(out / "patch")
    meta, arrays = saved.meta, saved.arrays
    L, n_pos = meta["model"]["n_layers"], 12  # friend(..)= and BOS; boss pairs are shorter
    assert meta["n_pairs"] == 5 and meta["positions"] == n_pos and "end" in meta["alignment"]
    assert meta["sites"] == ["resid_pre", "mlp_out"] and meta["ig_steps"] == 4
    assert meta["metric"] == "logit_diff" and meta["intervention"] == "resume"
    assert 0 <= meta["ig_completeness_rel_error"] < 0.5
    assert arrays["patch_resid_pre"].shape == (L, n_pos) and "patch_attn_out" not in arrays
    assert arrays["erasure"].shape == arrays["ig"].shape == (L + 1, n_pos)
    assert arrays["positions"].tolist() == list(range(-(n_pos - 1), 1))
    # The two leftmost columns exist only for the longer pairs.
    assert saved.tables["patching"].rows[0]["pairs"] == 2
    assert saved.tables["patching"].rows[n_pos - 1]["pairs"] == 5
    assert saved.tables["depth"]["layer"].tolist() == list(range(L + 1))
