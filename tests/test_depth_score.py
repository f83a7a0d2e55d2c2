"""The multi-hop depth score (SCIENCE.md A5): its definition, agreement with a naive full re-run,
the built-in graded tasks, and one-line errors for bad example files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lensdiv.analyzers.depth_score import (
    DepthScore,
    arith_examples,
    depth_score,
    kb_examples,
)
from lensdiv.core.analyzer import Batch, ModelInfo, Step
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
    assert all(eval(p[:-1]) == int(a) for p, a, _ in arith_examples(5, 0))  # noqa: S307


def test_toy_end_to_end(tmp_path: Path) -> None:
    run = analyze(
        "toy",
        plugins="depth-score",
        options={"depth-score": {"per_grade": 4}},
        out=tmp_path,
        progress=False,
    )
    result = run["depth-score"]
    assert result.meta["tasks"] == "kb"
    assert list(result.table()["grade"]) == ["1-hop", "2-hop", "3-hop", "4-hop"]
    assert (tmp_path / "depth-score" / "depth_score.png").is_file()


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
