"""Submodularity of depth (docs/science.md B4).

The set-function statistics are checked on synthetic functions whose answer is known (concave of a
sum and coverage: submodular; square of a sum: supermodular; a + b log |S|: exact log fit;
modular: greedy by weight). ``F`` on a model is checked against independent computations: the
model's own logits for ``F(all)``; for direct-path subsets, the model's own final norm and
unembedding applied to a partial residual rescaled to the final residual's norm scale; for block
removal, a full re-run per subset with plain TransformerLens hooks.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import pytest
import torch

from lensdiv.analyzers.submod import SubmodCurves, Submodularity
from lensdiv.analyzers.submod.present import present
from lensdiv.analyzers.submod.setfunction import (
    curve,
    greedy_order,
    greedy_round_masks,
    log_fit,
    make_plan,
    sample_nested,
    set_function_stats,
    units_mask,
)
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.capture import capture
from lensdiv.ops.members import member_hooks
from lensdiv.ops.resume import Resumer
from lensdiv.ops.subsets import direct_scores, removal_scores
from lensdiv.run.engine import Engine
from lensdiv.run.runner import analyze
from lensdiv.testing.contract import assert_results_close, assert_states_close
from lensdiv.testing.models import boot_native_tiny
from tests.helpers import assert_results_equal, random_step

ARCHS = ["gpt2", "llama", "neox", "native"]


def members_of(mask: int) -> list[int]:
    return [u for u in range(mask.bit_length()) if mask >> u & 1]


# -- synthetic set functions ---------------------------------------------------------------------

WEIGHTS = [5.0, 4.0, 3.0, 2.0, 1.5, 1.0]  # decreasing in depth order


def sqrt_sum(mask: int) -> float:
    return math.sqrt(sum(WEIGHTS[u] for u in members_of(mask)))


def square_sum(mask: int) -> float:
    return sum(WEIGHTS[::-1][u] for u in members_of(mask)) ** 2  # weights growing with depth


COVER = [{0, 1, 2}, {2, 3}, {3, 4, 5, 6}, {0, 6}, {7}, {1, 7, 8}]


def coverage(mask: int) -> float:
    return float(len(set().union(*(COVER[u] for u in members_of(mask)))))


@pytest.mark.parametrize("F", [sqrt_sum, coverage], ids=["sqrt-of-sum", "coverage"])
def test_submodular_functions_show_no_violation(F: Any) -> None:
    plan = make_plan(len(WEIGHTS), 300, 0)
    stats = set_function_stats(F, plan, tol=1e-12, greedy_steps=len(WEIGHTS))
    assert len(stats.margins) == 300 and stats.violations == 0
    assert min(stats.margins) >= -1e-12 and max(stats.margins) > 0  # strict somewhere
    assert all(x >= y - 1e-12 for x, y in zip(stats.alone, stats.last, strict=True))
    if F is sqrt_sum:  # decreasing weights in depth order: every prefix gain diminishes
        assert stats.prefix.diminishing_fraction == 1.0


def test_supermodular_function_is_flagged() -> None:
    plan = make_plan(len(WEIGHTS), 300, 0)
    stats = set_function_stats(square_sum, plan, tol=1e-9, greedy_steps=3)
    assert stats.violation_rate == 1.0  # every S ⊊ T with positive weights violates
    assert stats.prefix.diminishing_fraction == 0.0  # gains (W + w)² − W² grow with W and w
    assert all(g > 0 for g in stats.prefix.gains)
    assert all(x < y for x, y in zip(stats.alone, stats.last, strict=True))


def test_tolerance_decides_a_violation() -> None:
    plan = make_plan(4, 50, 1)
    eps = 1e-7

    def F(mask: int) -> float:  # modular plus a tiny supermodular term
        n = bin(mask).count("1")
        return n + eps * n * n

    assert set_function_stats(F, plan, tol=1e-5, greedy_steps=0).violations == 0
    assert set_function_stats(F, plan, tol=0.0, greedy_steps=0).violation_rate == 1.0


def test_log_fit_recovers_a_and_b() -> None:
    a, b = 1.25, 0.75

    def F(mask: int) -> float:
        k = bin(mask).count("1")
        return a + b * math.log(k) if k else -3.0

    stats = set_function_stats(F, make_plan(7, 40, 2), tol=1e-12, greedy_steps=7)
    fa, fb, r2 = stats.prefix.fit
    assert fa == pytest.approx(a, abs=1e-12) and fb == pytest.approx(b, abs=1e-12)
    assert r2 == pytest.approx(1.0, abs=1e-12)
    assert stats.violations == 0 and stats.prefix.diminishing_fraction == 1.0
    # Noise lowers R², a straight line in k is not log-shaped.
    _, _, r2_line = log_fit([float(k) for k in range(1, 8)])
    assert 0.8 < r2_line < 0.99
    assert math.isnan(log_fit([2.0])[1]) and math.isnan(log_fit([1.0, 1.0, 1.0])[2])


def test_curve_gains_and_diminishing() -> None:
    c = curve([0.0, 3.0, 5.0, 6.0, 8.0], tol=0.0)
    assert c.gains == [3.0, 2.0, 1.0, 2.0]
    assert c.diminishing == [True, True, False]
    assert c.diminishing_fraction == pytest.approx(2 / 3)


def test_greedy_on_a_modular_function_picks_by_weight() -> None:
    weights = [0.5, 3.0, -1.0, 2.0, 3.0, 0.1]

    def F(mask: int) -> float:
        return sum(weights[u] for u in members_of(mask))

    order = greedy_order(F, len(weights), len(weights))
    assert order == [1, 4, 3, 0, 5, 2]  # by weight; the tie 1/4 goes to the shallower unit
    stats = set_function_stats(F, make_plan(6, 10, 0), tol=1e-9, greedy_steps=6)
    assert stats.greedy == order
    assert stats.greedy_values[-1] == pytest.approx(sum(weights))
    assert greedy_order(F, 6, 2) == [1, 4]  # fewer steps: a prefix of the order
    assert greedy_order(F, 6, 5) == order  # the sixth unit is forced
    assert greedy_round_masks(F, 6, 2) == [units_mask([1, 4, u]) for u in (0, 2, 3, 5)]


def test_nested_sampling_is_uniform_over_triples() -> None:
    triples = sample_nested(3, 3000, seed=7)
    assert triples == sample_nested(3, 3000, seed=7)
    assert triples != sample_nested(3, 3000, seed=8)
    for s, t, j in triples:
        assert s & ~t == 0 and s != t and not t >> j & 1
    # 3 choices of j × (3² − 2²) strict pairs S ⊊ T of the other two units = 15 triples.
    counts = Counter(triples)
    assert len(counts) == 15
    assert all(150 < c < 250 for c in counts.values()), counts  # 200 expected each
    assert sample_nested(1, 10, 0) == []


def test_submod_curves_of_a_concave_set_function() -> None:
    """``SubmodCurves`` (the computation alone, no model) on ``F = sqrt(Σ w)``, submodular: no
    violation, every unit helps at least as much first as last, the block curve is every other
    point of the member curve, greedy by weight; the headline is what the result's fit table
    holds. With only the first pass measured, the greedy curve stops where the table does."""
    K = 5  # direct mode on two blocks: embed, attn0, mlp0, attn1, mlp1
    plan = make_plan(K, 24, 0)
    table = {mask: sqrt_sum(mask) for mask in range(1 << K)}
    units = ["embed", "attn0", "mlp0", "attn1", "mlp1"]
    curves = SubmodCurves.from_table(
        table, plan, units=units, tol=1e-9, greedy=3, blocks=True, positions=7
    )
    stats = curves.stats
    assert stats.violations == 0 and curves.alone_ge_last == K
    assert curves.blocks is not None
    assert curves.blocks.values == stats.prefix.values[1::2]
    assert stats.greedy == [0, 1, 2]  # the largest weights first
    gain_s, gain_t = curves.triple_gains()
    assert [a - b for a, b in zip(gain_s, gain_t, strict=True)] == pytest.approx(stats.margins)
    assert curves.greedy_gains == pytest.approx(
        [sqrt_sum(0b1), sqrt_sum(0b11) - sqrt_sum(0b1), sqrt_sum(0b111) - sqrt_sum(0b11)]
    )
    headline = curves.headline
    assert headline["violation_rate"] == 0.0 and headline["F_all"] == sqrt_sum((1 << K) - 1)
    assert headline["alone_ge_last_fraction"] == 1.0 and "block_fit_b" in headline
    result = present(curves, Submodularity(tol=1e-9))
    fit = result.table("fit")
    assert dict(zip(fit["statistic"], fit["value"], strict=True)) == pytest.approx(headline)

    bare = make_plan(K, 0, 0)  # prefixes, singletons and leave-one-outs only
    first_pass = {mask: table[mask] for mask in bare.first}
    partial = SubmodCurves.from_table(
        first_pass, bare, units=units, tol=1e-9, greedy=3, blocks=False, positions=7
    )
    assert partial.stats.greedy == [0] and partial.blocks is None


def test_plan_covers_every_needed_subset_once() -> None:
    plan = make_plan(5, 20, 3)
    first = set(plan.first)
    assert len(first) == len(plan.first)
    assert {(1 << k) - 1 for k in range(6)} <= first
    assert all(1 << u in first and 31 & ~(1 << u) in first for u in range(5))
    for s, t, j in plan.triples:
        assert {s, t, s | 1 << j, t | 1 << j} <= first


# -- F on models ---------------------------------------------------------------------------------


def make_step(model: Any, hooks: list[str], seed: int = 0, width: int = 24) -> Step:
    """Three rows of random tokens after BOS; the last one right-padded."""
    return random_step(model, hooks, rows=3, width=width, pad=7, seed=seed)


def kept_targets(step: Step, metric: str = "neg_ce") -> tuple[torch.Tensor, torch.Tensor]:
    """Scored positions and targets: the next tokens, or for accuracy the model's own top-1
    (random tiny models almost never predict random tokens: every subset would score 0)."""
    targets, has = step.batch.next_tokens()
    if metric == "accuracy":
        targets = step.logits.argmax(-1)
    return step.batch.positions() & has, targets


def metric_sum(logits: torch.Tensor, targets: torch.Tensor, metric: str) -> float:
    """The metric summed over rows of ``[n, vocab]`` logits, in float64."""
    logp = torch.log_softmax(logits.double(), -1)
    t = logp.gather(-1, targets[:, None])[:, 0]
    if metric == "neg_ce":
        return float(t.sum())
    return float(((logp > t[:, None]).sum(-1) == 0).double().sum())


def naive_direct(model: Any, step: Step, members: list[int], constant: str) -> torch.Tensor:
    """Logits of a member subset at the kept positions, from the model's own ``ln_final`` and
    ``unembed``: the final norm is affine once its scale is fixed, so the partial residual is
    rescaled to the final residual's scale, normalised by the model and scaled back."""
    info = step.info
    keep = kept_targets(step)[0]
    parts = [step.cache[info.resid(0)]]
    for layer in range(info.n_layers):
        parts += [step.cache[f"blocks.{layer}.hook_attn_out"]]
        parts += [step.cache[f"blocks.{layer}.hook_mlp_out"]]
    h_last = step.cache[info.resid(info.n_layers)][keep].double()
    h_s = sum((parts[i][keep].double() for i in members), torch.zeros_like(h_last))
    rms = model.cfg.normalization_type.startswith("RMS")
    if not rms:  # LayerNorm ignores the mean
        h_s = h_s - h_s.mean(-1, keepdim=True)
        h_last = h_last - h_last.mean(-1, keepdim=True)
    alpha = (h_last.pow(2).mean(-1, keepdim=True) / h_s.pow(2).mean(-1, keepdim=True)).sqrt()
    with torch.no_grad():
        beta = model.ln_final(torch.zeros_like(h_last[None]).float())[0].double()  # LN(0) = β
        normed = (model.ln_final((alpha * h_s).float()[None])[0].double() - beta) / alpha + beta
        logits = model.unembed(normed.float()[None])[0].double()
        const = model.unembed(beta.float()[None])[0].double()  # β·W_U + b_U
    if constant == "shared":
        logits = logits - (1 - len(members) / (2 * info.n_layers + 1)) * const
    return logits


@pytest.mark.parametrize("constant", ["full", "shared"])
@pytest.mark.parametrize("metric", ["neg_ce", "accuracy"])
@pytest.mark.parametrize("arch", ARCHS)
def test_direct_scores_match_the_model_and_a_naive_readout(
    model: Any, metric: str, constant: str
) -> None:
    check_direct(model, metric, constant)


@pytest.mark.parametrize("constant", ["full", "shared"])
def test_direct_constant_handling(tiny_dirs: Any, constant: str) -> None:
    """Randomly initialised models have β = 0 and no b_U, so the constant is 0 and any handling
    of it passes: a private GPT-2 gets a final-norm bias first."""
    from lensdiv.testing.models import boot_tiny

    model = boot_tiny("gpt2", tiny_dirs["gpt2"])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        bias = model.ln_final._original_component.bias
        bias.copy_(torch.randn(bias.shape, generator=g))
        const = model.unembed(model.ln_final(torch.zeros(1, 1, bias.shape[0])))[0, 0]
    assert float(const.std()) > 0.3  # far from a uniform shift of the logits
    check_direct(model, "neg_ce", constant)


def check_direct(model: Any, metric: str, constant: str) -> None:
    info = ModelInfo.from_model(model)
    step = make_step(model, member_hooks(info))
    keep, targets = kept_targets(step, metric)
    n = int(keep.sum())
    M = 2 * info.n_layers + 1
    masks = [(1 << k) - 1 for k in range(1, M + 1)] + [0b1010110, 0b0101]
    sums = direct_scores(step, masks, keep, targets, metric=metric, constant=constant)
    ours = (sums / n).tolist()
    own = metric_sum(step.logits[keep], targets[keep], metric) / n
    assert ours[M - 1] == pytest.approx(own, abs=1e-5)  # F(all) is the model's own metric
    for mask, value in zip(masks, ours, strict=True):
        naive = naive_direct(model, step, members_of(mask), constant)
        want = metric_sum(naive, targets[keep], metric) / n
        assert value == pytest.approx(want, abs=1e-5), bin(mask)
    # F(∅) with the full constant is the constant's prediction alone.
    (empty,) = (direct_scores(step, [0], keep, targets, metric=metric) / n).tolist()
    with torch.no_grad():
        const = model.unembed(model.ln_final(torch.zeros(1, 1, info.d_model)))[0, 0]
    want = metric_sum(const.expand(n, -1), targets[keep], metric) / n
    assert empty == pytest.approx(want, abs=1e-5)


def naive_removal(model: Any, step: Step, kept: int) -> torch.Tensor:
    """Logits with only the blocks of ``kept``: a full re-run that overwrites each skipped block's
    output by its input, captured at the same block's ``hook_resid_pre``."""
    inputs: dict[int, torch.Tensor] = {}
    hooks: list[Any] = []
    for layer in range(step.info.n_layers):
        if kept >> layer & 1:
            continue

        def save(x: Any, hook: Any, layer: int = layer) -> Any:
            inputs[layer] = x.clone()
            return x

        def restore(x: Any, hook: Any, layer: int = layer) -> Any:
            return inputs[layer]

        hooks += [(f"blocks.{layer}.hook_resid_pre", save)]
        hooks += [(f"blocks.{layer}.hook_resid_post", restore)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        return model(step.batch.tokens)


@pytest.mark.parametrize("metric", ["neg_ce", "accuracy"])
@pytest.mark.parametrize("arch", ARCHS)
def test_removal_scores_match_a_naive_full_rerun(model: Any, metric: str) -> None:
    info = ModelInfo.from_model(model)
    L = info.n_layers
    step = make_step(model, [info.resid(layer) for layer in range(L + 1)], seed=1)
    keep, targets = kept_targets(step, metric)
    n = int(keep.sum())
    masks = list(range(1 << L))  # every subset of the blocks
    resumer = Resumer(model)
    ours = (removal_scores(step, masks, keep, targets, resumer, metric=metric) / n).tolist()
    assert resumer.mode == "resume", resumer.reason
    own = metric_sum(step.logits[keep], targets[keep], metric) / n
    assert ours[-1] == pytest.approx(own, abs=1e-5)  # F(all blocks): the model itself
    for mask in masks:
        want = metric_sum(naive_removal(model, step, mask)[keep], targets[keep], metric) / n
        assert ours[mask] == pytest.approx(want, abs=1e-5), bin(mask)
    assert len(set(ours)) > L  # the subsets really differ
    # One subset per forward pass, and the exact re-run fallback, agree.
    one = removal_scores(step, masks, keep, targets, Resumer(model), metric=metric, chunk=1)
    slow = Resumer(model)
    slow.mode, slow._tuple_output = "rerun", False
    rerun = removal_scores(step, masks, keep, targets, slow, metric=metric, chunk=3)
    torch.testing.assert_close((one / n).tolist(), ours, atol=1e-5, rtol=0)
    torch.testing.assert_close((rerun / n).tolist(), ours, atol=1e-5, rtol=0)


# -- the analyzer --------------------------------------------------------------------------------

SPEC = DataSpec(max_tokens=160, seq_len=20, batch_size=4)


@pytest.fixture(scope="module")
def deep_model() -> Any:
    """A TL-native tiny model with 5 blocks: in removal mode greedy step 2 (pass 1) and 3
    (pass 2) have candidates the first pass did not measure (with 3 blocks every later
    candidate is a leave-one-out set, measured in pass 0)."""
    return boot_native_tiny(n_layers=5)


def copies(batches: list[Batch]) -> list[Batch]:
    """The engine moves a batch's tensors in place: give it shallow copies."""
    return [dataclasses.replace(b, extra=dict(b.extra)) for b in batches]


@pytest.mark.parametrize("mode", ["direct", "removal"])
def test_shards_merge_into_one_pass(deep_model: Any, mode: str) -> None:
    """Two shards, pass by pass as a sharded run goes (the Engine freezes what earlier passes
    wrote and calls start_pass on the merged state; each shard of a later pass starts from a copy
    of it), finalize to the result of one run over all batches: counts exact, floats 1e-6."""
    info = ModelInfo.from_model(deep_model)
    analyzer = Submodularity(mode=mode, samples=2, greedy=4)
    batches = list(token_batches(SPEC, deep_model.tokenizer))
    assert len(batches) == 2
    engine = Engine(deep_model, info, [analyzer])
    # Greedy steps 2..4 need a pass each, except a step among the leave-one-out sets (step K-1,
    # measured in pass 0): removal mode's 5 blocks make step 4 that one.
    assert engine.n_passes == (4 if mode == "direct" else 3)
    name = analyzer.name
    whole, merged = analyzer.init(info), analyzer.init(info)
    for index in range(engine.n_passes):
        engine.begin_pass(index, {name: whole})
        if index:
            engine.begin_pass(index, {name: merged})
            assert whole.frozen == set(whole.names()) == set(merged.names()) == merged.frozen
        before = set(whole.names())
        engine.feed(index, copies(batches), {name: whole})
        halves = []
        for part in (batches[:1], batches[1:]):
            shard = merged.copy()
            engine.feed(index, copies(part), {name: shard})
            halves.append(shard)
        # A write to an entry of a finished pass raises StateError: the engine drops the analyzer.
        assert not engine.failures, engine.failures
        merged = halves[0].merge(halves[1])
        assert_states_close(merged, whole, rtol=1e-6, what=f"{mode}, pass {index}")
        assert torch.equal(merged["n"], whole["n"])  # positions: exact
        new = set(whole.names()) - before
        if index == 0:
            assert new == {"n", "F0"} | ({"resume"} if mode == "removal" else set())
            torch.testing.assert_close(merged["F0"], whole["F0"], rtol=1e-12, atol=1e-9)
            assert {k: whole.kind(k) for k in new} == {k: "sum" for k in ("n", "F0")} | (
                {"resume": "set"} if mode == "removal" else {}
            )
        elif f"round{index + 1}" in new:  # the step had candidates pass 0 did not measure
            assert new == {f"round{index + 1}"} | (
                {f"resume{index + 1}"} if mode == "removal" else set()
            )
            assert whole.kind(f"round{index + 1}") == "sum"
        else:
            assert new == set()
    assert {f"round{i}" for i in (2, 3)} <= set(whole.names())  # later passes really measured
    a, b = analyzer.finalize(merged, info), analyzer.finalize(whole, info)
    assert_results_close(a, b, rtol=1e-6, what=f"{mode}: merged halves")
    for table in ("prefix", "greedy", "units"):
        column = "F" if table != "units" else "alone"
        torch.testing.assert_close(
            torch.tensor(a.tables[table][column]), torch.tensor(b.tables[table][column])
        )
    assert a.meta["greedy_order"] == b.meta["greedy_order"]
    assert a.meta["positions"] == b.meta["positions"] == int(float(whole["n"]))
    assert a.meta["resume"] == b.meta["resume"] == ("resume" if mode == "removal" else None)


def test_resume_mode_is_recorded_once_decided(native_model: Any) -> None:
    """A batch with no position to score decides nothing; it must not record a mode."""
    info = ModelInfo.from_model(native_model)
    analyzer = Submodularity(mode="removal", samples=4, greedy=1)
    batches = list(token_batches(SPEC, native_model.tokenizer))
    empty = dataclasses.replace(batches[0], mask=torch.zeros_like(batches[0].mask))
    engine = Engine(native_model, info, [analyzer])
    state = analyzer.init(info)
    engine.feed(0, [empty], {analyzer.name: state})
    assert "resume" not in state and float(state["n"]) == 0
    engine.feed(0, copies(batches), {analyzer.name: state})
    assert not engine.failures, engine.failures
    assert state["resume"] == {"resume"}
    assert analyzer.finalize(state, info).meta["resume"] == "resume"


def test_greedy_over_passes_equals_greedy_on_every_subset(native_model: Any) -> None:
    """The multi-pass greedy (one pass per step) agrees with greedy on a table of all 2^M
    subsets measured directly on the same data."""
    info = ModelInfo.from_model(native_model)
    M = 2 * info.n_layers + 1
    analyzer = Submodularity(samples=8, greedy=M)
    run = analyze(native_model, data=SPEC, plugins=[analyzer], progress=False)
    assert run.ok, run.errors
    result = run["submod"]
    batches = list(token_batches(SPEC, native_model.tokenizer))
    totals = torch.zeros(1 << M, dtype=torch.float64)
    n = 0
    for batch in batches:
        _, cache = capture(native_model, batch.tokens, member_hooks(info), need_logits=False)
        step = Step(batch, cache, None, native_model, info)
        keep, targets = kept_targets(step)
        totals += direct_scores(step, list(range(1 << M)), keep, targets)
        n += int(keep.sum())
    table = (totals / n).tolist()
    order = greedy_order(table.__getitem__, M, M)
    names = result.meta["units"]
    assert result.meta["greedy_order"] == [names[u] for u in order]
    greedy_values = [table[units_mask(order[:k])] for k in range(M + 1)]
    torch.testing.assert_close(result.tables["greedy"]["F"].tolist(), greedy_values)
    prefix = [table[(1 << k) - 1] for k in range(M + 1)]
    torch.testing.assert_close(result.tables["prefix"]["F"].tolist(), prefix)
    assert result.meta["positions"] == n


def test_end_to_end_both_modes(native_model: Any, tmp_path: Any) -> None:
    from lensdiv.analyzers.lens import LogitLens

    info = ModelInfo.from_model(native_model)
    plugins = [
        Submodularity(samples=8, greedy=2),
        LogitLens(),
    ]
    run = analyze(native_model, data=SPEC, plugins=plugins, out=tmp_path, progress=False)
    assert run.ok, run.errors
    direct = run["submod"]
    model_ce = float(run["lens"].table()["ce"][-1])
    assert direct.table()["F"][-1] == pytest.approx(-model_ce, abs=1e-5)
    assert direct.table()["F"][-1] == pytest.approx(direct.tables["blocks"]["F"][-1])
    assert len(direct.tables["greedy"]) == 3  # F(∅) and two greedy steps
    assert (tmp_path / "submod" / "submod_prefix.png").is_file()
    analyzer = Submodularity(mode="removal", samples=8, greedy=5)
    assert analyzer.n_passes(info) == max(1, min(5, info.n_layers - 2))  # no idle passes
    removal = analyze(native_model, data=SPEC, plugins=[analyzer], progress=False)["submod"]
    assert removal.meta["resume"] == "resume"
    assert len(removal.tables["greedy"]) == info.n_layers + 1  # complete: the last is forced
    assert removal.table()["F"][-1] == pytest.approx(-model_ce, abs=1e-5)
    assert removal.meta["options"]["mode"] == "removal"
    stats = dict(
        zip(removal.tables["fit"]["statistic"], removal.tables["fit"]["value"], strict=True)
    )
    assert 0 <= stats["violation_rate"] <= 1
    assert_results_equal(type(removal).from_json(removal.to_json()), removal)
