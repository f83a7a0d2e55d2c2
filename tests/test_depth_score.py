"""The multi-hop depth score (docs/science.md A5): its definition, agreement with a naive full re-run,
the built-in graded tasks, and one-line errors for bad example files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.depth_score import (
    DepthScore,
    DepthScores,
    arith_examples,
    depth_score,
    kb_examples,
)
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.core.stats import Stats
from lensdiv.data.corpus import KnowledgeBase
from lensdiv.ops.capture import capture
from lensdiv.ops.skipping import Intervals, later_effect
from lensdiv.run.engine import Engine
from lensdiv.run.runner import analyze
from lensdiv.testing import assert_results_close
from tests.helpers import naive_effects
from tests.test_cli import assert_user_error, invoke

EXAMPLES = [
    {"prompt": "boss(ka)=", "answer": "mi", "grade": 1},
    {"prompt": "the cat sat on the", "answer": " mat", "grade": 1},
    {"prompt": "friend(boss(ka))=", "answer": "lu", "grade": 2},
    {"prompt": "one two three four five six", "answer": " seven eight", "grade": 2},
    {"prompt": "rival(friend(boss(ka)))=", "answer": "so", "grade": 3},
]


def test_depth_score_definition() -> None:
    L = 6
    for k in range(L):
        e = torch.zeros(L, dtype=torch.float64)
        e[k] = 0.7
        assert float(depth_score(e)) == pytest.approx(k)  # concentrated at k gives k
    assert float(depth_score(torch.ones(L, dtype=torch.float64))) == pytest.approx((L - 1) / 2)
    assert torch.isnan(depth_score(torch.zeros(L, dtype=torch.float64)))
    batch = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(depth_score(batch), torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_depth_scores_of_a_hand_made_state() -> None:
    """``DepthScores`` (the computation alone, no model, no Result) on sums written by hand: an
    effect concentrated at block k scores k, a uniform one (L − 1)/2 (docs/science.md A5); means,
    accuracy, baseline and the slope are what the sums say, and the table shows them."""
    L, n = 5, 4
    state = Stats()
    state.fix("n_layers", L)
    state.fix("scored_model", "m")
    state.fix("tasks", "arith")
    profiles = {"1-op": torch.eye(L, dtype=torch.float64)[3], "2-op": torch.ones(L).double()}
    for grade, right in (("1-op", 4), ("2-op", 1)):
        e = profiles[grade] * n
        state.include("grades", grade)
        state.add(f"{grade}/n", n)
        state.add(f"{grade}/correct", right)
        state.add(f"{grade}/baseline", 0.25 * n)
        state.add(f"{grade}/E", torch.zeros(L, L, dtype=torch.float64))
        state.add(f"{grade}/correct_layer_e", e / n * right)
        for kind in ("layer", "output"):
            state.add(f"{grade}/{kind}_e", e)
            state.add(f"{grade}/{kind}_n", n)
            state.add(f"{grade}/{kind}_sum", 2.0 * n)  # every example scores 2
            state.add(f"{grade}/{kind}_sq", 4.0 * n)
    info = ModelInfo(name="m", n_layers=L, d_model=8, d_vocab=16, n_heads=2,
                     normalization="LN", parallel_residual=False, hook_names=frozenset())
    numbers = DepthScores.from_state(state, info)
    one, two = numbers.grades
    assert (one.grade, two.grade) == ("1-op", "2-op") and numbers.n_layers == L
    assert numbers.scores("layer") == [pytest.approx(3.0), pytest.approx((L - 1) / 2)]
    assert numbers.slope == pytest.approx((L - 1) / 2 - 3.0)
    assert (one.accuracy, two.accuracy) == (1.0, 0.25) and one.baseline == 0.25
    assert one.mean["layer"] == 2.0 and one.se["layer"] == 0.0
    assert one.score_layer_correct == pytest.approx(3.0)
    assert one.above_baseline and not two.above_baseline  # 1 of 4 at a baseline of 1/4
    result = DepthScore(tasks="arith").finalize(state, info)
    table = result.table("depth_score")
    assert table["score_layer"].tolist() == numbers.scores("layer")
    assert table["p_above_baseline"].tolist() == [g.p_above_baseline for g in numbers.grades]
    assert len(result.warnings) == 1 and result.warnings[0].startswith("2-op:")


@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "native"])
def test_agrees_with_naive_full_rerun(model: Any, tmp_path: Path) -> None:
    path = tmp_path / "examples.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in EXAMPLES))
    analyzer = DepthScore(tasks=str(path), batch_size=2)
    run = analyze(model, plugins=[analyzer], progress=False)
    table = run["depth-score"].table("depth_score")
    assert list(table["grade"]) == ["1", "2", "3"]
    # Naive: one full re-run per (example, skipped block), split at the first answer token.
    info = ModelInfo.from_model(model)
    tok = model.tokenizer
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    by_grade: dict[str, list[Any]] = {}
    for row in EXAMPLES:
        prompt = bos + tok(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tok(row["answer"], add_special_tokens=False)["input_ids"]
        tokens = torch.tensor([prompt + answer])
        logits, cache = capture(model, tokens, names, need_logits=True)
        step = Step(
            Batch(tokens, torch.ones_like(tokens, dtype=torch.bool)), cache, logits, model, info
        )
        pos = torch.arange(tokens.shape[1])
        t = len(prompt)
        iv = Intervals(torch.tensor([0]), ((pos >= 1) & (pos < t))[None], (pos >= t)[None])
        E, _ = naive_effects(step, iv, "block", False)
        by_grade.setdefault(str(row["grade"]), []).append(later_effect(E[0]))
    for i, grade in enumerate(table["grade"]):
        profile = torch.stack(by_grade[grade]).mean(0)
        assert table["score_layer"][i] == pytest.approx(float(depth_score(profile)), abs=1e-5)
        scores = torch.stack([depth_score(e) for e in by_grade[grade]])
        assert table["mean_layer"][i] == pytest.approx(float(scores.mean()), abs=1e-5)


def test_builtin_tasks_split_at_the_answer(native_model: Any) -> None:
    info = ModelInfo.from_model(native_model)
    for tasks in ("kb", "arith"):
        batches = DepthScore(tasks=tasks, per_grade=3).examples(native_model, info)
        grades = [g for b in batches for g in b.extra["grade"]]
        assert len(grades) == 12 and len(set(grades)) == 4
        for batch in batches:
            for r, t in enumerate(batch.extra["split"].tolist()):
                answer = batch.tokens[r, t : int(batch.mask[r].sum())]
                text = native_model.tokenizer.decode(answer)
                assert text and all(ch.isalnum() for ch in text)  # the answer, nothing else
    # Deterministic given the seed; another seed differs.
    assert kb_examples(5, 0) == kb_examples(5, 0) != kb_examples(5, 1)
    assert arith_examples(5, 0) == arith_examples(5, 0) != arith_examples(5, 1)
    assert all(eval(p[:-1]) == int(a) for p, a, _, _ in arith_examples(5, 0))  # noqa: S307


def test_toy_end_to_end(tmp_path: Path) -> None:
    """On a zoo toy, the kb tasks are scored on toy:kb (unless model=self), with accuracy."""
    run = analyze(
        "toy",
        plugins="depth-score",
        options={"depth-score": {"per_grade": 4}},
        out=tmp_path,
        progress=False,
    )
    result = run["depth-score"]
    assert result.meta["tasks"] == "kb"
    assert result.meta["scored_model"] == "toy:kb" and "toy:kb" in result.summary
    table = result.table()
    assert list(table["grade"]) == ["1-hop", "2-hop", "3-hop", "4-hop"]
    assert ((table["accuracy"] >= 0) & (table["accuracy"] <= 1)).all()
    assert (tmp_path / "depth-score" / "depth_score.png").is_file()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["analyzers"]["depth-score"].get("warnings", []) == list(result.warnings)
    itself = analyze(
        "toy",
        plugins="depth-score",
        options={"depth-score": {"per_grade": 2, "model": "self"}},
        progress=False,
    )["depth-score"]
    assert itself.meta["scored_model"] == "toy" and itself.meta["n_layers"] == 4


def test_kb_baselines_are_the_chains_best_constant_answer() -> None:
    """The prior baseline of a query is the share of start entities whose chain ends at the
    chain's most common end, counted by brute force here."""
    kb = KnowledgeBase(seed=0)
    for prompt, answer, grade, baseline in kb_examples(3, 0):
        query = prompt.split(" ")[-1]  # e.g. friend(boss(ka))=
        relations = tuple(reversed(query.split("(")[:-1]))
        ends = [kb.answer(relations, e) for e in kb.entities]
        assert baseline == max(ends.count(x) for x in ends) / len(ends)
        assert kb.answer(relations, query.split("(")[-1].rstrip(")=")) == answer
        assert int(grade[0]) == len(relations)
    # The most likely sum of two digits 1..9 is 10 (9 of 81 pairs).
    assert arith_examples(1, 0)[0][3] == pytest.approx(9 / 81)


def _own_answers(model: Any, n: int) -> list[tuple[str, str]]:
    """Prompts and the model's own greedy next byte, with distinct answers (so the grade's prior
    baseline is 1/n)."""
    tok = model.tokenizer
    rng = torch.Generator().manual_seed(0)
    found: dict[str, str] = {}
    for _ in range(400):
        prompt = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (6,), generator=rng))
        ids = [tok.bos_token_id, *tok(prompt, add_special_tokens=False)["input_ids"]]
        with torch.no_grad():
            nxt = int(model(torch.tensor([ids]))[0, -1].argmax())
        answer = tok.decode([nxt])
        if answer.isalnum() and tok(answer, add_special_tokens=False)["input_ids"] == [nxt]:
            found.setdefault(answer, prompt)
        if len(found) == n:
            break
    assert len(found) == n, f"only {len(found)} distinct greedy answers"
    return [(p, a) for a, p in found.items()]


def test_accuracy_and_warnings(native_model: Any, tmp_path: Path) -> None:
    """Answers the model gives itself are 100 % right and significantly above their baseline
    (no warning); the same prompts with other answers are 0 % right (a warning naming the
    grade and the baseline)."""
    own = _own_answers(native_model, 6)
    rows = [{"prompt": p, "answer": a, "grade": "1-own"} for p, a in own]
    shifted = [own[(i + 1) % len(own)][1] for i in range(len(own))]
    rows += [{"prompt": p, "answer": b, "grade": "2-other"} for (p, _), b in zip(own, shifted, strict=True)]
    path = tmp_path / "own.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    result = analyze(
        native_model,
        plugins=[DepthScore(tasks=str(path), batch_size=5)],
        progress=False,
    )["depth-score"]
    table = result.table()
    assert list(table["grade"]) == ["1-own", "2-other"]
    assert list(table["accuracy"]) == [1.0, 0.0]
    assert list(table["correct"]) == [6, 0]
    assert list(table["baseline"]) == pytest.approx([1 / 6, 1 / 6])
    assert table["p_above_baseline"][0] == pytest.approx((1 / 6) ** 6)  # all 6 right by luck
    assert table["p_above_baseline"][1] == pytest.approx(1.0)
    assert np.isnan(table["score_layer_correct"][1])
    assert table["score_layer_correct"][0] == pytest.approx(table["score_layer"][0])
    assert len(result.warnings) == 1
    warning = result.warnings[0]
    assert warning.startswith("2-other:") and "0 of 6" in warning and "17%" in warning


def test_model_option_is_checked(native_model: Any) -> None:
    with pytest.raises(ValueError, match="model"):
        DepthScore(model=" ")


@pytest.mark.parametrize(
    ("rows", "needles"),
    [
        ([{"prompt": "a", "answer": "b"}], ["line 1", "'grade'"]),
        ([{"prompt": "a", "answer": "", "grade": 1}], ["not in the vocabulary"]),
        (["{not json"], ["line 1", "not valid JSON"]),
        ([], ["is empty"]),
    ],
    ids=["no-grade", "answer-not-in-vocab", "bad-json", "empty"],
)
def test_bad_examples_are_one_line(tmp_path: Path, rows: list[Any], needles: list[str]) -> None:
    path = tmp_path / "ex.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows))
    result = invoke(
        "analyze",
        "toy",
        "--plugins",
        "depth-score",
        "-O",
        f"depth-score.tasks={path}",
        "--no-progress",
        "--out",
        str(tmp_path / "out"),
    )
    assert_user_error(result, *needles)


def test_missing_examples_file(tmp_path: Path) -> None:
    result = invoke(
        "analyze",
        "toy",
        "--plugins",
        "depth-score",
        "-O",
        f"depth-score.tasks={tmp_path / 'nope.jsonl'}",
        "--no-progress",
    )
    assert_user_error(result, "does not exist")


def test_two_shards_merge_into_one_run(native_model: Any) -> None:
    """Regression: merging two shards' states lost the grades, and finalize then raised
    "no examples were processed"."""
    analyzer = DepthScore(tasks="arith", per_grade=3, batch_size=4)
    info = ModelInfo.from_model(native_model)
    batches = analyzer.examples(native_model, info)
    engine = Engine(native_model, info, [analyzer])
    shards = []
    for part in (batches[:1], batches[1:]):
        state = engine.init()["depth-score"]
        engine.feed(0, part, {"depth-score": state})
        shards.append(state)
    whole = engine.init()["depth-score"]
    engine.feed(0, batches, {"depth-score": whole})
    merged = engine.finalize({"depth-score": shards[0].merge(shards[1])})["depth-score"]
    one = engine.finalize({"depth-score": whole})["depth-score"]
    assert not engine.failures, engine.failures
    assert merged.meta["grades"] == one.meta["grades"] == ["1-op", "2-op", "3-op", "4-op"]
    assert_results_close(merged, one, rtol=1e-9, what="depth-score shards")
