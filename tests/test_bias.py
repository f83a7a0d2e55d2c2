"""The ensemble view of the residual stream (docs/science.md B1–B3): members and ``bias``.

Checked on every tiny architecture plus the TL-native model: the members' logit contributions
plus the constant are the model's logits (also with random final-norm weights and biases, which
the test models otherwise initialise to 1 and 0); the Gram-matrix squared error equals the naive
full-vocabulary computation for every prefix ensemble; bias − diversity equals the ensemble loss
computed independently from the model's own logits, in both forms; the normalised geometric mean
of the member softmaxes is the model's softmax. Then the decomposition functions on synthetic
members, streaming, pads, the label-set mode and its CLI errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lensdiv.analyzers.bias import (
    BiasDiversity,
    Decomposition,
    ce_terms,
    direct_decomposition,
    gram_squared_error,
)
from lensdiv.core.analyzer import Batch, ModelInfo
from lensdiv.core.errors import DataError, HookError
from lensdiv.data.sources import DataSpec
from lensdiv.ops.capture import capture
from lensdiv.ops.members import (
    iter_member_logits,
    member_hooks,
    member_inputs,
    member_logits,
    member_names,
    member_readout,
)
from lensdiv.run.runner import analyze
from lensdiv.testing.models import boot_native_tiny, boot_tiny
from tests.helpers import assert_tables_close, batches_of, run_state
from tests.test_cli import assert_user_error, invoke

RTOL = 1e-4
SPEC = DataSpec(seq_len=16, max_tokens=16 * 5 + 6, batch_size=3)  # last batch padded


def _cache(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    info = ModelInfo.from_model(model)
    logits, cache = capture(model, tokens, member_hooks(info), need_logits=True)
    assert logits is not None
    return logits, cache


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _fresh(arch: str, request: pytest.FixtureRequest) -> Any:
    if arch == "native":
        return boot_native_tiny()
    return boot_tiny(arch, request.getfixturevalue("tiny_dirs")[arch])


# -- B1: members ------------------------------------------------------------------------------


def test_members_add_up_to_the_logits(model: Any) -> None:
    info = ModelInfo.from_model(model)
    names = member_names(info)
    assert len(names) == 2 * info.n_layers + 1
    assert names[:3] == ["embed", "attn0", "mlp0"] and names[-1] == f"mlp{info.n_layers - 1}"
    assert all(h in model.hook_dict for h in member_hooks(info))
    (batch,) = batches_of(model, DataSpec(seq_len=16, max_tokens=40, batch_size=3))
    logits, cache = _cache(model, batch.tokens)
    keep = batch.mask
    z = member_logits(model, cache, info, keep)
    assert z.shape == (len(names), int(keep.sum()), info.d_vocab)
    assert _rel(z.sum(0), logits[keep]) < RTOL
    # "separate" leaves the constant out; the chunked iterator gives the same rows.
    separate = member_logits(model, cache, info, keep, constant="separate")
    assert _rel(separate.sum(0) + member_readout(model).const, logits[keep]) < RTOL
    chunks = list(iter_member_logits(model, cache, info, keep, max_elements=4 * 260 * 7))
    assert len(chunks) > 1
    torch.testing.assert_close(torch.cat([c for _, c in chunks], 1), z)


def test_members_with_random_final_norm(arch: str, request: pytest.FixtureRequest) -> None:
    """γ and β (and eps, through small probe vectors) must really be the model's own."""
    model = _fresh(arch, request)
    ln = model.ln_final
    inner = getattr(ln, "original_component", None) or ln
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5 + (name == "weight"))
    info = ModelInfo.from_model(model)
    (batch,) = batches_of(model, DataSpec(seq_len=16, max_tokens=32, batch_size=2))
    logits, cache = _cache(model, batch.tokens)
    readout = member_readout(model)
    if arch != "olmo":  # OLMo's final LayerNorm has no parameters at all
        assert float(readout.weight.std()) > 0.1
    u, const = member_inputs(model, cache, info, batch.mask)
    assert _rel(u.sum(0) @ readout.W_U + const, logits[batch.mask]) < RTOL


def test_wrong_norm_parameters_are_refused(
    native_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lensdiv.ops.members as members
    import lensdiv.ops.readout as readout

    monkeypatch.setattr(readout, "_eps", lambda module, cfg: 0.5)
    monkeypatch.setattr(readout, "_READOUTS", readout.weakref.WeakKeyDictionary())
    monkeypatch.setattr(members, "_READOUTS", members.weakref.WeakKeyDictionary())
    with pytest.raises(HookError, match="final norm"):
        members.member_readout(native_model)
    # The readout itself falls back to running the model's own norm module.
    assert readout.final_readout(native_model).kind == "module"


def test_geometric_mean_of_members_is_the_softmax(model: Any) -> None:
    info = ModelInfo.from_model(model)
    (batch,) = batches_of(model, DataSpec(seq_len=16, max_tokens=32, batch_size=2))
    logits, cache = _cache(model, batch.tokens)
    z = member_logits(model, cache, info, batch.mask).double()
    n_members = z.shape[0]
    log_q = torch.log_softmax(n_members * z, -1)  # q_i = softmax(M z_i)
    geo = torch.softmax(log_q.mean(0), -1)  # normalised geometric mean
    p = torch.softmax(logits[batch.mask].double(), -1)
    assert float((geo - p).abs().max()) < 1e-5
    assert float((p - log_q.exp().mean(0)).abs().max()) > 1e-3  # the arithmetic mean is not


# -- B2: the Gram-matrix path against the naive full-vocabulary one ------------------------------


def test_gram_squared_error_matches_naive(model: Any) -> None:
    info = ModelInfo.from_model(model)
    (batch,) = batches_of(model, DataSpec(seq_len=16, max_tokens=40, batch_size=3))
    _, cache = _cache(model, batch.tokens)
    targets, valid = batch.next_tokens()
    keep = batch.mask & valid
    y = targets[keep]
    readout = member_readout(model)
    u, c = member_inputs(model, cache, info, keep)
    sizes = [1, 2, 4, u.shape[0]]
    bias, div, ens = gram_squared_error(
        u, readout.gram, readout.W_U @ c, float(c.double().pow(2).sum()),
        readout.W_U[:, y].T, c[y], sizes,
    )
    z = (u.double() @ readout.W_U.double())  # [M, n, V]
    for p, m in enumerate(sizes):
        naive = direct_decomposition(m * z[:m] + c.double(), y)
        scale = float(naive["sq_bias"].max())  # a single member's diversity is exactly 0
        for got, key in ((bias[p, :m], "sq_bias"), (div[p, :m], "sq_div"), (ens[p], "sq_ens")):
            torch.testing.assert_close(got, naive[key], rtol=RTOL, atol=1e-7 * scale,
                                       msg=f"{key}, {m} members")
        assert not bias[p, m:].any() and not div[p, m:].any()
        # bias − diversity = ensemble loss, per position
        gap = bias[p].sum(0) / m - div[p].sum(0) / m - ens[p]
        assert float(gap.abs().max()) <= RTOL * float(ens[p].abs().max())


def test_ce_terms_match_direct() -> None:
    gen = torch.Generator().manual_seed(0)
    f = torch.randn(5, 7, 50, generator=gen) * 3
    y = torch.randint(0, 50, (7,), generator=gen)
    fast, naive = ce_terms(f, y), direct_decomposition(f, y)
    for key in ("ce", "kl", "ce_ens", "correct", "correct_ens"):
        torch.testing.assert_close(fast[key], naive[key], rtol=1e-5, atol=1e-5)


# -- B2/B3 identities on synthetic members -------------------------------------------------------


def test_identities_on_synthetic_members() -> None:
    gen = torch.Generator().manual_seed(1)
    f = torch.randn(6, 9, 11, generator=gen, dtype=torch.float64) * 2
    y = torch.randint(0, 11, (9,), generator=gen)
    out = direct_decomposition(f, y)
    m = f.shape[0]
    torch.testing.assert_close(out["sq_bias"].mean(0) - out["sq_div"].mean(0), out["sq_ens"])
    torch.testing.assert_close(out["ce"].mean(0) - out["kl"].mean(0), out["ce_ens"])
    assert bool((out["sq_div"] >= 0).all()) and bool((out["kl"] >= -1e-12).all())
    assert float(out["sq_div"].sum()) > 0 and m == 6


def test_identical_members_have_no_diversity() -> None:
    gen = torch.Generator().manual_seed(2)
    one = torch.randn(1, 5, 13, generator=gen)
    y = torch.randint(0, 13, (5,), generator=gen)
    out = direct_decomposition(one.expand(4, -1, -1), y)
    assert float(out["sq_div"].abs().max()) < 1e-10 and float(out["kl"].abs().max()) < 1e-10
    torch.testing.assert_close(out["sq_bias"].mean(0), out["sq_ens"])
    torch.testing.assert_close(out["ce"].mean(0), out["ce_ens"])
    # Duplicating every member of {a, b} changes neither the ensemble nor its diversity.
    pair = torch.randn(2, 5, 13, generator=gen)
    twice = direct_decomposition(pair.repeat_interleave(2, 0), y)
    once = direct_decomposition(pair, y)
    for key in ("sq_ens", "ce_ens"):
        torch.testing.assert_close(twice[key], once[key])
    torch.testing.assert_close(twice["sq_div"].mean(0), once["sq_div"].mean(0))
    torch.testing.assert_close(twice["kl"].mean(0), once["kl"].mean(0))


def test_duplicated_member_vectors_through_the_gram_path() -> None:
    gen = torch.Generator().manual_seed(3)
    d, v, n = 8, 30, 6
    W = torch.randn(d, v, generator=gen)
    c = torch.randn(v, generator=gen)
    a = torch.randn(1, n, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    args = (W @ W.T, W @ c, float(c.double().pow(2).sum()), W[:, y].T, c[y])
    bias, div, ens = gram_squared_error(a.expand(3, -1, -1), *args, [3])
    assert float(div.abs().max()) <= 1e-4 * float(bias.abs().max())
    torch.testing.assert_close(bias[0].mean(0), ens[0], rtol=1e-5, atol=1e-5)
    b = torch.randn(1, n, d, generator=gen)
    _, div_ab, _ = gram_squared_error(torch.cat([a, b]), *args, [2])
    # Halving and doubling each contribution keeps every prediction f_i = M u_i: a, a, b, b.
    _, div_aabb, _ = gram_squared_error(torch.cat([a, a, b, b]) / 2, *args, [4])
    torch.testing.assert_close(div_aabb[0].mean(0), div_ab[0].mean(0), rtol=1e-4, atol=1e-4)


# -- the analyzer end to end: identities against the model's own logits --------------------------


def _naive_losses(model: Any, batches: list[Batch], exclude_bos: bool, every: int) -> dict:
    """Mean ||z − y||² and next-token CE from the model's logits (CE at t mod every = 0)."""
    sq, ce, n, n_ce = 0.0, 0.0, 0, 0
    for batch in batches:
        with torch.no_grad():
            logits = model(batch.tokens).double()
        targets, valid = batch.next_tokens()
        keep = batch.positions(exclude_bos=exclude_bos) & valid
        z, y = logits[keep], targets[keep]
        sq += float((z - F.one_hot(y, z.shape[-1])).pow(2).sum())
        n += int(keep.sum())
        pos = torch.arange(keep.shape[1]).expand_as(keep)
        sub = keep & (pos % every == 0)
        ce += float(F.cross_entropy(logits[sub], targets[sub], reduction="sum"))
        n_ce += int(sub.sum())
    return {"sq": sq / n, "ce": ce / n_ce, "n": n, "n_ce": n_ce}


@pytest.mark.parametrize("exclude_bos", [False, True])
def test_bias_minus_diversity_is_the_model_loss(model: Any, exclude_bos: bool) -> None:
    analyzer = BiasDiversity(every=2, exclude_bos=exclude_bos)
    run = analyze(model, data=SPEC, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["bias"]
    main = result.table()
    assert main["form"].tolist() == ["squared", "ce"]
    naive = _naive_losses(model, batches_of(model, SPEC), exclude_bos, 2)
    assert main["positions"].tolist() == [naive["n"], naive["n_ce"]]
    np.testing.assert_allclose(main["ensemble_loss"], [naive["sq"], naive["ce"]], rtol=RTOL)
    np.testing.assert_allclose(main["bias"] - main["diversity"], main["ensemble_loss"], rtol=RTOL)
    assert np.all(main["diversity"] > 0)
    members = result.table("members")
    assert members["name"].tolist() == member_names(ModelInfo.from_model(model))
    assert np.all(members["sq_diversity"] >= 0) and np.all(members["ce_diversity"] >= 0)
    np.testing.assert_allclose(members["sq_bias"].sum(), main["bias"][0], rtol=1e-9)
    np.testing.assert_allclose(members["ce_diversity"].sum(), main["diversity"][1], rtol=1e-9)
    depth = result.table("depth")
    assert depth["members"].tolist() == [2 * i + 1 for i in range(model.cfg.n_layers + 1)]
    np.testing.assert_allclose(depth["bias"] - depth["diversity"], depth["ensemble_loss"],
                               rtol=RTOL)
    assert np.all(depth["diversity"] >= 0)
    assert depth["diversity"][0] <= 1e-9 * depth["bias"][0]  # a single member has no spread
    np.testing.assert_allclose(depth["ensemble_loss"][-1], naive["sq"], rtol=RTOL)
    meta = result.meta
    assert meta["constant"].startswith("shared") and meta["weighting"] == "mean"
    assert meta["every"] == 2 and meta["target"].startswith("next token")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "olmo2"])
def test_cross_entropy_along_depth(model: Any) -> None:
    analyzer = BiasDiversity(every=3, ce_depth=True)
    run = analyze(model, data=SPEC, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["bias"]
    depth, main = result.table("depth"), result.table()
    np.testing.assert_allclose(depth["ce_bias"] - depth["ce_diversity"], depth["ce_loss"],
                               rtol=RTOL)
    assert np.all(depth["ce_diversity"] >= 0) and depth["ce_diversity"][0] <= 1e-6
    naive = _naive_losses(model, batches_of(model, SPEC), False, 3)
    np.testing.assert_allclose(depth["ce_loss"][-1], naive["ce"], rtol=RTOL)
    np.testing.assert_allclose(depth["ce_bias"][-1], main["bias"][1], rtol=1e-6)
    assert result.meta["ce_depth"] is True


def test_sum_weighting_only_rescales(native_model: Any) -> None:
    tables = {}
    for weighting in ("mean", "sum"):
        run = analyze(native_model, data=SPEC, plugins=[BiasDiversity(weighting=weighting)],
                      progress=False)
        tables[weighting] = run["bias"]
        assert run["bias"].meta["weighting"] == weighting
    m = 2 * native_model.cfg.n_layers + 1
    for col in ("bias", "diversity", "ensemble_loss"):
        np.testing.assert_allclose(tables["sum"].table()[col], m * tables["mean"].table()[col],
                                   rtol=1e-9)
    np.testing.assert_allclose(tables["sum"].table("members")["sq_bias"],
                               m * tables["mean"].table("members")["sq_bias"], rtol=1e-9)


def test_decomposition_holds_the_identities_and_the_tables_numbers(native_model: Any) -> None:
    """``Decomposition`` (the computation alone, no Result): ensemble loss = bias − diversity in
    both forms, diversity ≥ 0, the last prefix ensemble is the full one (docs/science.md B2–B3); the
    result's tables hold exactly these numbers."""
    analyzer = BiasDiversity(every=2, ce_depth=True)
    info = ModelInfo.from_model(native_model)
    state = run_state(analyzer, native_model, batches_of(native_model, SPEC))
    numbers = Decomposition.from_state(state, info, "mean")
    M = 2 * info.n_layers + 1
    assert numbers.names[0] == "embed" and len(numbers.names) == M
    assert numbers.sizes == [2 * layer + 1 for layer in range(info.n_layers + 1)]
    for form in (numbers.squared, numbers.ce):
        assert form.identity_gap == pytest.approx(0.0, abs=1e-6 * abs(form.bias))
        assert form.diversity >= 0
    assert min(numbers.members.sq_diversity) >= 0 and min(numbers.depth.diversity) >= 0
    assert numbers.depth.loss[-1] == pytest.approx(numbers.squared.ensemble_loss, rel=1e-12)
    assert numbers.depth_ce is not None
    assert numbers.depth_ce.loss[-1] == pytest.approx(numbers.ce.ensemble_loss, rel=1e-9)
    result = analyzer.finalize(state, info)
    assert result.table("bias")["bias"].tolist() == [numbers.squared.bias, numbers.ce.bias]
    assert result.table("members")["ce_diversity"].tolist() == numbers.members.ce_diversity
    assert result.table("depth")["accuracy"].tolist() == numbers.depth_ce.accuracy
    summed = Decomposition.from_state(state, info, "sum")
    assert summed.squared.bias == pytest.approx(M * numbers.squared.bias, rel=1e-12)


# -- streaming and pads --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "neox", "native"])
def test_merged_shards_equal_one_pass(model: Any) -> None:
    analyzer = BiasDiversity(every=3)
    spec = DataSpec(seq_len=16, max_tokens=16 * 7 + 5, batch_size=2)
    batches = batches_of(model, spec)
    assert len(batches) == 4 and not batches[-1].mask.all()
    info = ModelInfo.from_model(model)
    whole = run_state(analyzer, model, batches)
    merged = run_state(analyzer, model, batches[:2]).merge(run_state(analyzer, model, batches[2:]))
    assert float(merged["n"]) == float(whole["n"]) and float(whole["n_ce"]) > 0
    one, two = analyzer.finalize(whole, info), analyzer.finalize(merged, info)
    assert_tables_close(two, one, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "olmo2", "native"])
@pytest.mark.parametrize("pad_fill", ["pad", "random"])
def test_pads_never_counted(model: Any, pad_fill: str) -> None:
    analyzer = BiasDiversity(every=1)
    (full,) = batches_of(model, DataSpec(seq_len=16, max_tokens=48, batch_size=3))
    tokens, half = full.tokens.clone(), 8
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, half:] = False
    if pad_fill == "pad":
        tokens[-1, half:] = model.tokenizer.pad_token_id
    else:
        gen = torch.Generator().manual_seed(11)
        tokens[-1, half:] = torch.randint(4, model.cfg.d_vocab, (16 - half,), generator=gen)
    info = ModelInfo.from_model(model)
    with_pads = run_state(analyzer, model, [Batch(tokens=tokens, mask=mask)])
    pieces = [Batch(tokens=tokens[:-1], mask=mask[:-1]),
              Batch(tokens=tokens[-1:, :half], mask=mask[-1:, :half], index=1)]
    without = run_state(analyzer, model, pieces[:1]).merge(run_state(analyzer, model, pieces[1:]))
    assert float(with_pads["n"]) == float(without["n"]) == 2 * 15 + 7
    assert_tables_close(analyzer.finalize(with_pads, info), analyzer.finalize(without, info),
                        rtol=1e-5, atol=1e-6)


# -- label-set mode ------------------------------------------------------------------------------

ROWS = [
    {"prompt": "the cat sat on", "label": "a"},
    {"prompt": "one two three", "label": "b"},
    {"prompt": "x", "label": "c"},
    {"prompt": "a longer prompt, padded", "label": "a"},
    {"prompt": "zz", "label": "b"},
]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "olmo", "native"])
def test_label_set_mode(model: Any, tmp_path: Path) -> None:
    tasks = _write(tmp_path / "cls.jsonl", ROWS)
    analyzer = BiasDiversity(tasks=str(tasks), labels=("a", "b", "c"), batch_size=2)
    run = analyze(model, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["bias"]
    main = result.table()
    assert main["positions"].tolist() == [len(ROWS), len(ROWS)]
    np.testing.assert_allclose(main["bias"] - main["diversity"], main["ensemble_loss"], rtol=RTOL)
    # Independently: the model's logits at the last prompt token, restricted to the labels.
    ids = [model.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in "abc"]
    bos = [model.tokenizer.bos_token_id]
    sq = ce = 0.0
    for row in ROWS:
        tokens = bos + model.tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            z = model(torch.tensor([tokens]))[0, -1, ids].double()
        y = "abc".index(row["label"])
        sq += float((z - F.one_hot(torch.tensor(y), 3)).pow(2).sum())
        ce += float(-torch.log_softmax(z, -1)[y])
    np.testing.assert_allclose(main["ensemble_loss"], [sq / len(ROWS), ce / len(ROWS)], rtol=RTOL)
    depth = result.table("depth")
    np.testing.assert_allclose(depth["ce_bias"] - depth["ce_diversity"], depth["ce_loss"],
                               rtol=RTOL, atol=1e-9)
    np.testing.assert_allclose(depth["ce_loss"][-1], ce / len(ROWS), rtol=RTOL)
    assert result.meta["target"].startswith("label set ['a', 'b', 'c']")
    assert result.meta["data"] == "own examples"


def test_label_words_default_to_the_file(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    tasks = _write(tmp_path / "cls.jsonl", ROWS)
    batches = BiasDiversity(tasks=str(tasks)).examples(native_model, info)
    assert batches is not None and batches[0].extra["label_words"] == ["a", "b", "c"]
    with_field = [{**r, "labels": ["c", "b", "a"]} for r in ROWS]
    tasks = _write(tmp_path / "field.jsonl", with_field)
    batches = BiasDiversity(tasks=str(tasks)).examples(native_model, info)
    assert batches is not None and batches[0].extra["label_words"] == ["c", "b", "a"]
    assert int(batches[0].extra["target"][0]) == 2  # "a" is the third label word
    with_field[1]["labels"] = ["a", "b"]
    tasks = _write(tmp_path / "bad.jsonl", with_field)
    with pytest.raises(DataError, match="line 2"):
        BiasDiversity(tasks=str(tasks)).examples(native_model, info)


def test_cli_label_errors(tmp_path: Path) -> None:
    good = _write(tmp_path / "cls.jsonl", ROWS)
    base = ["analyze", "toy", "--plugins", "bias", "--no-progress", "--out", str(tmp_path / "o")]
    # The byte tokenizer spells "cat" with three tokens.
    result = invoke(*base, "-O", f"bias.tasks={good}", "-O", "bias.labels=a,cat")
    assert_user_error(result, "'cat'", "single token")
    missing = _write(tmp_path / "missing.jsonl", [{"prompt": "x"}])
    assert_user_error(invoke(*base, "-O", f"bias.tasks={missing}"), "missing key 'label'")
    unknown = _write(tmp_path / "unknown.jsonl", [*ROWS, {"prompt": "q", "label": "d"}])
    assert_user_error(invoke(*base, "-O", f"bias.tasks={unknown}", "-O", "bias.labels=a,b,c"),
                      "'d'")
    assert_user_error(invoke(*base, "-O", f"bias.tasks={good}", "-O", "bias.labels=a,a"),
                      "repeat")
