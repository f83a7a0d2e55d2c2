"""Depth surgery (docs/science.md E1, E2): ``prune`` and ``reorder`` against the identities their
sections state — removing nothing or the identity order is the full model bit for bit, removing
the last ``n`` blocks is the logit lens of ``h_{L−n}``, one block is ``skip``'s whole-block skip,
a set is ``submod``'s removal value, the signals are plain float64 arithmetic — and the analyzer
contract (shards merge)."""

from __future__ import annotations

import math
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.lens import LogitLens
from lensdiv.analyzers.surgery import Prune, Reorder
from lensdiv.analyzers.surgery.numbers import PruneNumbers, ReorderNumbers
from lensdiv.core.analyzer import ModelInfo, Step
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec
from lensdiv.ops.readout import final_readout
from lensdiv.ops.resume import Resumer
from lensdiv.ops.skipping import skip_effects, split_intervals
from lensdiv.ops.subsets import removal_scores
from lensdiv.ops.surgery import (
    Program,
    cosines,
    last_positions,
    linearity,
    moment_update,
    output_sums,
    program_final,
    range_mask,
    removed_finals,
    set_mask,
    signal_sums,
)
from lensdiv.run.runner import analyze, load_run
from lensdiv.testing import check_analyzer
from lensdiv.testing.contract import assert_results_close
from lensdiv.testing.models import save_tiny_model
from tests.helpers import random_step

ARCHS = ["gpt2", "llama", "neox", "native"]


def make_step(model: Any, seed: int = 0, width: int = 24) -> Step:
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    return random_step(model, names, rows=3, width=width, pad=7, seed=seed)


def finals_of(step: Step, masks: list[int]) -> list[torch.Tensor]:
    """Final residuals of each mask, in the order of ``masks``."""
    out: list[Any] = [None] * len(masks)
    for indices, finals in removed_finals(step, masks, Resumer(step.model)):
        for j, i in enumerate(indices):
            out[i] = finals[j]
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_removing_nothing_and_the_identity_order_are_the_full_model(model: Any) -> None:
    step = make_step(model)
    L = step.info.n_layers
    clean = step.resid(L)
    (nothing,) = finals_of(step, [range_mask(L, 0, 0)])
    assert torch.equal(nothing, clean)
    resumer = Resumer(model)
    for a, b in [(0, L), (L // 4, L - L // 4), (1, 2)]:
        same = program_final(step, Program(a, b, tuple(range(a, b))), resumer)
        # the resumed blocks run as Hugging Face wrote them (ops/purelayers): the bridge's
        # clean pass to float rounding
        torch.testing.assert_close(same, clean, atol=1e-5, rtol=1e-5, msg=str((a, b)))
    sums = output_sums(step, [nothing], step.batch.mask)
    assert float(sums["kl"][0]) == 0.0 and float(sums["dce"][0]) == 0.0
    assert float(sums["agree"][0]) == float(sums["n"][0])


@pytest.mark.parametrize("arch", ARCHS)
def test_removing_the_last_blocks_is_the_lens_readout(model: Any) -> None:
    step = make_step(model, seed=1)
    L = step.info.n_layers
    lens = Stats()
    LogitLens().update(lens, step)
    lens_kl = lens["kl"] / float(lens["n"])  # KL(p_l ‖ p_out) per state h_l
    lens_ce = lens["ce"] / float(lens["n_target"])
    for n in range(1, L + 1):
        (final,) = finals_of(step, [range_mask(L, L - n, n)])
        assert torch.equal(final, step.resid(L - n))
        sums = output_sums(step, [final], step.batch.mask)
        assert float(sums["kl"][0] / sums["n"][0]) == pytest.approx(
            float(lens_kl[L - n]), rel=1e-6, abs=1e-9
        )
        assert float(sums["ce"][0] / sums["n_target"][0]) == pytest.approx(
            float(lens_ce[L - n]), rel=1e-6
        )


@pytest.mark.parametrize("arch", ARCHS)
def test_removing_one_block_is_skip_current_at_the_same_positions(model: Any) -> None:
    """``skip``'s current mode with ``skip_bos`` is the removal of one block: its output effect
    (max over positions of ‖p − p̃‖₂) and its KL per position; without ``skip_bos`` it differs."""
    step = make_step(model, seed=2)
    L = step.info.n_layers
    mask = step.batch.mask
    g = torch.Generator().manual_seed(0)
    intervals = split_intervals(
        mask, mode="current", splits=1, stride=8, generator=g, skip_bos=True
    )
    assert torch.equal(intervals.skip, mask) and torch.equal(intervals.measure, mask)
    kl = torch.zeros(mask.shape[0], L, dtype=torch.float64)
    _, output = skip_effects(step, intervals, kl=kl)
    readout = final_readout(model)
    clean = readout.probabilities(step.resid(L)[mask])
    removals = output_sums(step, finals_of(step, [range_mask(L, s, 1) for s in range(L)]), mask)
    for s in range(L):
        (final,) = finals_of(step, [range_mask(L, s, 1)])
        dist = (readout.probabilities(final[mask]) - clean).norm(dim=-1).double()
        per_pos = torch.zeros(mask.shape, dtype=torch.float64)
        per_pos[mask] = dist
        torch.testing.assert_close(per_pos.amax(1), output[:, s], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(kl.sum(0), removals["kl"], atol=1e-6, rtol=1e-5)
    source = split_intervals(mask, mode="current", splits=1, stride=8, generator=g)
    untouched = torch.zeros(source.rows.numel(), L, dtype=torch.float64)
    skip_effects(step, source, kl=untouched)
    assert not torch.allclose(untouched.sum(0), removals["kl"], rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_removing_a_set_is_submod_removal(model: Any) -> None:
    step = make_step(model, seed=3)
    L = step.info.n_layers
    targets, has_target = step.batch.next_tokens()
    keep = step.batch.mask & has_target
    removed = [0, L - 1] if L > 2 else [1]
    mask = set_mask(L, removed)
    (final,) = finals_of(step, [mask])
    ours = output_sums(step, [final], keep)
    F = removal_scores(step, [mask], keep, targets, Resumer(model), metric="neg_ce")
    assert float(-F[0]) == pytest.approx(float(ours["ce"][0]), rel=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_signals_are_plain_float64_arithmetic(model: Any) -> None:
    step = make_step(model, seed=4)
    L = step.info.n_layers
    mask = step.batch.mask
    h = [step.resid(layer) for layer in range(L + 1)]
    last = last_positions(mask)
    sums = signal_sums(h, mask, last, L)
    H = [x.detach().double().numpy() for x in h]
    where = list(zip(*np.nonzero(mask.numpy()), strict=True))
    ends = [(r, int(mask[r].sum()) - 1) for r in range(mask.shape[0])]
    for s in range(L):
        for n in range(1, L - s + 1):

            def cos(r: int, t: int, s: int = s, n: int = n) -> float:
                a, b = H[s][r, t], H[s + n][r, t]
                return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))

            if n == 1:
                bi = sum(1 - cos(r, t) for r, t in where)
                assert float(sums["bi"][s]) == pytest.approx(bi, rel=1e-9, abs=1e-12)
            angle = sum(math.acos(max(-1.0, min(1.0, cos(r, t)))) / math.pi for r, t in where)
            assert float(sums["ang_all"][s, n - 1]) == pytest.approx(angle, rel=1e-9, abs=1e-9)
            at_end = sum(math.acos(max(-1.0, min(1.0, cos(r, t)))) / math.pi for r, t in ends)
            assert float(sums["ang_last"][s, n - 1]) == pytest.approx(at_end, rel=1e-9, abs=1e-9)
    assert float(cosines(torch.zeros(3), torch.zeros(3))) == 1.0


def naive_r2(x: np.ndarray, y: np.ndarray) -> float:
    """``1 − min_A ‖X̃A − Ỹ‖²/‖Ỹ‖²`` by numpy's least squares on the centred float64 states."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    coef, *_ = np.linalg.lstsq(xc, yc, rcond=None)
    return float(1 - ((xc @ coef - yc) ** 2).sum() / (yc**2).sum())


def scores_of(states: list[torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    state = Stats()
    moment_update(state.add, states, keep)
    return linearity(float(state["lin_n"]), state["lin_sx"], state["lin_sxx"], state["lin_sxy"])


def test_linearity_is_the_r2_of_a_least_squares_map() -> None:
    """The documented ``R²`` exactly (no ridge): numpy's float64 least squares to 1e-10, on
    noisy maps, an exact affine map (R² = 1), states with a few huge coordinates and a
    constant one, and fewer tokens than dimensions (R² = 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 6, generator=g, dtype=torch.float64)
    y_lin = x @ torch.randn(6, 6, generator=g, dtype=torch.float64) + 3.0
    y = y_lin + 0.5 * torch.randn(400, 6, generator=g, dtype=torch.float64) ** 2
    wide = torch.randn(400, 6, generator=g, dtype=torch.float64) * torch.tensor(
        [1e3, 1.0, 1.0, 1e-2, 1.0, 1.0], dtype=torch.float64
    )
    wide[:, 2] = 7.0  # a constant coordinate
    chain = [y, x, y_lin, wide, y]
    score = scores_of([h[None] for h in chain], torch.ones(1, 400, dtype=torch.bool))
    for j in range(len(chain) - 1):
        expected = naive_r2(chain[j].numpy(), chain[j + 1].numpy())
        assert float(score[j]) == pytest.approx(expected, abs=1e-10), j
    assert 0.0 < float(score[0]) < 1.0 and float(score[1]) == pytest.approx(1.0, abs=1e-10)
    few = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
    few_score = scores_of([few, few.tanh()], torch.ones(1, 5, dtype=torch.bool))
    assert float(few_score[0]) == pytest.approx(1.0, abs=1e-10)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_linearity_of_real_states_is_numpys_least_squares(model: Any) -> None:
    """A model's own residual states (real tokens only), against numpy's lstsq to 1e-10."""
    step = make_step(model, seed=5, width=48)
    mask = step.batch.mask
    h = [step.resid(layer).detach() for layer in range(step.info.n_layers + 1)]
    score = scores_of(h, mask)
    X = [x[mask].double().numpy() for x in h]
    for j in range(len(X) - 1):
        assert float(score[j]) == pytest.approx(naive_r2(X[j], X[j + 1]), abs=1e-10), j


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prune_numbers_pick_the_true_best_and_greedy_starts_at_it(model: Any) -> None:
    """The analyzer's state through all its passes: the best start per n is the grid's
    minimum, regrets are never negative, greedy's first step is the best single block."""
    info = ModelInfo.from_model(model)
    analyzer = Prune()
    state = analyzer.init(info)
    steps = [make_step(model, seed=s) for s in (5, 6)]
    for index in range(analyzer.n_passes(info)):
        for step in steps:
            step.context.pass_index = index
            analyzer.update(state, step)
        state.freeze()
    numbers = PruneNumbers.from_state(state, info, analyzer)
    kl = numbers.effects["kl"][0]
    for row in numbers.picks():
        n = row["n"]
        column = kl[: info.n_layers - n + 1, n - 1]
        assert row["best"] == pytest.approx(float(column.min()))
        assert all(row[k] >= 0 for k in row if k.endswith("_regret"))
    assert numbers.curves["greedy"][1] == pytest.approx(numbers.curves["contiguous_best"][1])
    assert numbers.greedy_order[0] == int(kl[:, 0].argmin())
    assert numbers.block_runs_per_row == sum(
        info.n_layers - s - n
        for n in range(1, numbers.longest + 1)
        for s in range(info.n_layers - n + 1)
    )
    result = analyzer.finalize(state, info)
    assert set(result.tables) == {"grid", "picks", "curves", "blocks"}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reorder_numbers_without_a_result(model: Any) -> None:
    """``reorder``'s numbers from its state alone: each removal is ``prune``'s one-block removal
    on the same data, the swaps table is the variants' own numbers, the counts and picks follow
    from them."""
    info = ModelInfo.from_model(model)
    L = info.n_layers
    reorder, prune = Reorder(shuffles=1), Prune(max_n=1, curves=False, linearity=False)
    states = {reorder.name: reorder.init(info), prune.name: prune.init(info)}
    for step in [make_step(model, seed=s) for s in (8, 9)]:
        reorder.update(states["reorder"], step)
        prune.update(states["prune"], step)
    numbers = ReorderNumbers.from_state(states["reorder"], info, reorder)
    removed = PruneNumbers.from_state(states["prune"], info, prune).effects["kl"][0][:, 0]
    swaps = numbers.swaps()
    torch.testing.assert_close(
        torch.tensor(swaps["kl_remove"], dtype=torch.float64), removed, rtol=1e-6, atol=1e-9
    )
    assert math.isnan(swaps["kl_swap"][-1]) and len(swaps["dce_remove"]) == L
    for s in range(L - 1):
        assert swaps["kl_swap"][s] == numbers.of("kl", f"swap{s}")
    assert numbers.cheaper_swaps() == sum(
        swaps["kl_swap"][s] < swaps["kl_remove"][s] for s in range(L - 1)
    )
    gentlest, worst = numbers.gentlest_and_worst()
    middle = [numbers.of("kl", n) for n in numbers.middle_variants]
    assert numbers.of("kl", gentlest) == min(middle) and numbers.of("kl", worst) == max(middle)
    assert numbers.accuracy is None and numbers.most_accurate() is None


@pytest.mark.parametrize("arch", ARCHS)
def test_reorder_variants_are_their_definitions(model: Any) -> None:
    step = make_step(model, seed=7)
    L = step.info.n_layers
    resumer = Resumer(model)
    clean = step.resid(L)
    # A loop of one is the block itself; parallel of one block is that block.
    torch.testing.assert_close(program_final(step, Program(1, 2, (1,)), resumer), clean,
                               atol=1e-5, rtol=1e-5)
    one = program_final(step, Program(0, 1, (0,), mode="parallel"), resumer)
    torch.testing.assert_close(one, clean, atol=1e-5, rtol=1e-5)
    # An empty program is prune's removal.
    for s in range(L):
        (removed,) = finals_of(step, [range_mask(L, s, 1)])
        torch.testing.assert_close(
            program_final(step, Program(s, s + 1, ()), resumer), removed, atol=1e-6, rtol=1e-6
        )
    # A swap is not the full model (the blocks do not commute).
    swapped = program_final(step, Program(0, 2, (1, 0)), resumer)
    assert not torch.allclose(swapped, clean)


@pytest.mark.parametrize("analyzer", [Prune(), Reorder(shuffles=2)], ids=["prune", "reorder"])
def test_contract(analyzer: Any) -> None:
    report = check_analyzer(analyzer, architectures=("gpt2", "llama"))
    assert report.checked == ["gpt2", "llama"], report.skipped


# -- two gloo processes give the results of one ----------------------------------------------------
# 3 batches of 2 rows (the last short and padded): an odd count for 2 ranks.
DIST_SPEC = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)
DIST_OPTIONS = {"reorder": {"shuffles": "1"}}


def _rank_main(rank: int, store: str, model: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    try:
        analyze(model, data=DIST_SPEC, plugins="prune,reorder", options=DIST_OPTIONS,
                out=f"{out}/run", progress=False)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_give_the_results_of_one_process(tmp_path: Path) -> None:
    llama = save_tiny_model("llama", tmp_path / "llama")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_surgery"])
    procs = [
        ctx.Process(target=_rank_main, args=(rank, str(tmp_path / "store"), str(llama),
                                             str(tmp_path)))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    one = analyze(str(llama), data=DIST_SPEC, plugins="prune,reorder", options=DIST_OPTIONS,
                  progress=False)
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    two = load_run(tmp_path / "run")
    assert two.manifest["distributed"]["world_size"] == 2
    assert not one.errors and not two.errors, (one.errors, two.errors)
    for name in ("prune", "reorder"):
        assert_results_close(two[name], one[name], rtol=1e-6, what=name)


# -- the progress bar counts the interventions actually made --------------------------------------
def test_progress_bar_counts_the_interventions_made(
    tmp_path: Path, capsys: Any, monkeypatch: Any
) -> None:
    import lensdiv.analyzers.surgery.prune as prune_module
    import lensdiv.analyzers.surgery.reorder as reorder_module

    made = {"prune": 0, "reorder": 0}
    real_removed, real_program = prune_module.removed_finals, reorder_module.program_final

    def removed(step: Step, masks: Any, *args: Any, **kwargs: Any) -> Any:
        made["prune"] += len(masks) * step.batch.tokens.shape[0]
        return real_removed(step, masks, *args, **kwargs)

    def program(step: Step, *args: Any, **kwargs: Any) -> Any:
        made["reorder"] += step.batch.tokens.shape[0]
        return real_program(step, *args, **kwargs)

    monkeypatch.setattr(prune_module, "removed_finals", removed)
    monkeypatch.setattr(reorder_module, "program_final", program)
    spec = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)
    run = analyze("toy", data=spec, plugins="prune,reorder", progress=True,
                  options={"reorder": {"shuffles": "1"}})
    assert not run.errors, run.errors
    lines = [line for line in capsys.readouterr().err.splitlines() if "interventions" in line]
    # The last line of each pass: its declared count per sequence and the total done.
    last: dict[str, tuple[int, int]] = {}
    for line in lines:
        title = line.split(" interventions/sequence")[0]
        label, per_row = title.rsplit(" ", 1)
        done = int(line.split("sequence, ")[1].split(" done")[0].replace(",", ""))
        last[label] = (int(per_row.replace(",", "")), done)
    # Pass 0 (the grid, every variant), then one per point of the pruning curves.
    assert len(last) == 1 + int(run["prune"].meta["longest"]), last
    # Every pass reads the same 6 rows (3 batches of 2): done = declared per sequence × rows.
    assert {done for _, done in last.values()} != {0}
    assert all(done == per * 6 for per, done in last.values()), last
    assert sum(done for _, done in last.values()) == made["prune"] + made["reorder"]
    assert made["reorder"] == 6 * len(run["reorder"].table("variants")["variant"])


# -- accuracy on a task file -----------------------------------------------------------------------
def toy_task(path: Path) -> list[tuple[str, str, str]]:
    """A task file of the toy's own greedy next character after knowledge-base facts cut short:
    the full model answers every example, a removal fewer."""
    import json

    from lensdiv.data.corpus import KnowledgeBase
    from lensdiv.models.load import load_model

    toy = load_model("toy")
    facts = [p for _, p in KnowledgeBase(seed=0).asked_queries(4, seed=1)[1]][:4]
    prompts = [f"{fact[: len(fact) - cut]}" for fact in facts for cut in (2, 4, 6)]
    rows = []
    for prompt in prompts:
        ids = [toy.tokenizer.bos_token_id, *toy.tokenizer(prompt, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            logits = toy(torch.tensor([ids]), return_type="logits")
        rows.append((prompt, toy.tokenizer.decode([int(logits[0, -1].argmax())]), "g"))
    path.write_text("".join(json.dumps({"prompt": p, "answer": a, "grade": g}) + "\n"
                            for p, a, g in rows))
    return rows


def test_task_accuracy_of_the_full_model_is_depth_scores(tmp_path: Path) -> None:
    task = tmp_path / "task.jsonl"
    rows = toy_task(task)
    run = analyze("toy", plugins="prune,depth-score", progress=False, options={
        "prune": {"task": str(task), "curves": "False", "linearity": "False"},
        "depth-score": {"tasks": str(task), "model": "self"},
    })
    assert not run.errors, run.errors
    prune, score = run["prune"], run["depth-score"].table("depth_score")
    assert prune.meta["examples"] == len(rows) == sum(score["examples"])
    assert prune.meta["clean_accuracy"] == sum(score["correct"]) / len(rows)
    accuracy = prune.table("grid")["accuracy"]
    assert prune.meta["clean_accuracy"] == 1.0 and len(set(accuracy)) > 1, accuracy
    assert all(0.0 <= a <= 1.0 for a in accuracy)
    assert f"Task accuracy over {len(rows)} examples" in prune.summary


def test_reorder_task_accuracy_is_prunes_and_the_identity_is_the_full_model(
    tmp_path: Path,
) -> None:
    task = tmp_path / "task.jsonl"
    rows = toy_task(task)
    run = analyze("toy", plugins="prune,reorder", progress=False, options={
        "prune": {"task": str(task), "curves": "False", "linearity": "False", "max_n": "1"},
        "reorder": {"task": str(task), "loops": "1,2", "shuffles": "1"},
    })
    assert not run.errors, run.errors
    prune, reorder = run["prune"], run["reorder"]
    assert reorder.meta["examples"] == prune.meta["examples"] == len(rows)
    assert reorder.meta["clean_accuracy"] == prune.meta["clean_accuracy"] == 1.0
    variants = reorder.table("variants")
    accuracy = dict(zip(variants["variant"], variants["accuracy"], strict=True))
    assert accuracy["loop1"] == 1.0  # looping the centre block once is the full model
    assert len(set(accuracy.values())) > 1, accuracy
    grid = prune.table("grid")
    for start, n, removed in zip(grid["start"], grid["n"], grid["accuracy"], strict=True):
        assert n == 1 and accuracy[f"remove{start}"] == removed, (start, removed)
    assert f"Task accuracy over {len(rows)} examples" in reorder.summary


def test_removing_nothing_answers_as_the_full_model(model: Any) -> None:
    from lensdiv.ops.surgery import answered

    step = make_step(model)
    L = step.info.n_layers
    resumer = Resumer(model)
    mask = step.batch.mask
    measure = mask & (torch.arange(mask.shape[1]) >= 3) & (torch.rand(mask.shape) < 0.3)
    (nothing, last) = finals_of(step, [range_mask(L, 0, 0), range_mask(L, L - 1, 1)])
    tokens = step.batch.tokens
    clean = answered(resumer, tokens, step.resid(L), measure)
    assert torch.equal(answered(resumer, tokens, nothing, measure), clean)
    # Its definition: every answer position's greedy token is the next token.
    before = torch.zeros_like(measure)
    before[:, :-1] = measure[:, 1:]
    for h, got in [(step.resid(L), clean), (last, answered(resumer, tokens, last, measure))]:
        greedy = resumer.readout(h[before]).argmax(-1) == tokens[measure]
        per_row = [bool(greedy[(before.nonzero()[:, 0] == r)].all()) for r in range(len(got))]
        assert got.tolist() == per_row
