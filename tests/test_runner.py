"""The runner: multi-pass analyzers, analyzers with their own examples, runs saved and loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze, load_run
from tests.helpers import assert_results_equal

# -- multi-pass analyzers and analyzers with their own examples ------------------------------------


@dataclass(frozen=True)
class CenteredNorm(Analyzer):
    """Two passes: the mean residual in pass 0, the mean distance to it in pass 1."""

    name = "centered"
    passes = 2

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Any) -> None:
        h = step.resid(0)[step.batch.mask].double()
        if step.pass_index == 0:
            state.add("sum", h.sum(0))
            state.add("n", h.shape[0])
        else:
            state.add("dist", (h - state.mean).norm(dim=-1).sum())
            state.add("n1", h.shape[0])

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        state.mean = state["sum"] / state["n"]  # type: ignore[attr-defined]

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        value = float(state["dist"] / state["n1"])
        return Result(self.name, "", tables={"t": Table("t", {"dist": [value]})})


@dataclass(frozen=True)
class OwnExamples(Analyzer):
    """Measures on its own two examples, not the corpus."""

    name = "own"

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def examples(self, model: Any, info: ModelInfo) -> list[Batch]:
        tokens = torch.tensor([[0, 5, 6, 7], [0, 8, 9, 2]])
        mask = torch.tensor([[True] * 4, [True, True, True, False]])
        return [Batch(tokens, mask, extra={"label": ["a", "b"]})]

    def update(self, state: Stats, step: Any) -> None:
        state.add("tokens", step.batch.n_tokens)
        state.add("labels", len(step.batch.extra["label"]))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "", tables={"t": Table("t", {"n": [int(state["tokens"])]})})


def test_two_pass_analyzer_sees_the_data_twice(native_model: Any) -> None:
    run = analyze(native_model, plugins=[CenteredNorm(), "contrib"], max_tokens=300,
                  seq_len=32, progress=False)
    assert run.ok
    spec = DataSpec(max_tokens=300, seq_len=32)
    rows = [t[m] for b in token_batches(spec, native_model.tokenizer)
            for t, m in zip(b.tokens, b.mask, strict=True)]
    with torch.no_grad():
        h = torch.cat([capture(native_model, r[None], ["blocks.0.hook_resid_pre"],
                               need_logits=False)[1]["blocks.0.hook_resid_pre"][0] for r in rows])
    h = h.double()
    want = (h - h.mean(0)).norm(dim=-1).mean()
    assert run["centered"].table()["dist"][0] == pytest.approx(float(want), rel=1e-6)
    assert run.manifest["timings"]["tokens"] == 300


def test_own_examples_replace_the_corpus(native_model: Any) -> None:
    run = analyze(native_model, plugins=[OwnExamples(), "contrib"], max_tokens=256,
                  seq_len=32, progress=False)
    assert run.ok
    assert run["own"].table()["n"][0] == 7
    assert run["own"].meta["data"] == "own examples" and run["own"].meta["tokens"] == 7
    assert run["contrib"].meta["tokens"] == 256


# -- runs on disk -----------------------------------------------------------------------------------


def test_run_saves_and_loads(native_model: Any, tmp_path: Path) -> None:
    spec = DataSpec(max_tokens=64, seq_len=16, batch_size=2)
    run = analyze(native_model, data=spec, plugins="lens,contrib", out=tmp_path, progress=False)
    assert run.ok
    loaded = load_run(tmp_path)
    assert loaded.ok and set(loaded.results) == {"lens", "contrib"}
    for name, result in run.results.items():
        assert_results_equal(loaded.results[name], result)


def test_threads_are_set_and_recorded(native_model: Any, tmp_path: Path) -> None:
    from lensdiv.core.errors import OptionError

    before = torch.get_num_threads()
    spec = DataSpec(max_tokens=32, seq_len=16, batch_size=2)
    try:
        run = analyze(native_model, data=spec, plugins="contrib", threads=1, out=tmp_path,
                      progress=False)
        assert run.ok and torch.get_num_threads() == 1
        assert run.manifest["threads"] == 1
        assert load_run(tmp_path).manifest["threads"] == 1
        assert run.manifest["model"]["dtype"] == run.manifest["model"]["readout_dtype"] == "float32"
    finally:
        torch.set_num_threads(before)
    for bad in (0, -2, True):
        with pytest.raises(OptionError, match="threads"):
            analyze(native_model, data=spec, plugins="contrib", threads=bad, progress=False)


# -- the progress bar's total: the tokens that will be read (issue 29, point 4) -------------------


def _progress_lines(text: str) -> list[tuple[int, int]]:
    """``(done, total)`` of each ``lens: DONE/TOTAL tokens`` line a run logged."""
    import re

    return [(int(a.replace(",", "")), int(b.replace(",", ""))) for a, b in
            re.findall(r"^lens: ([\d,]+)/([\d,]+) tokens", text, flags=re.M)]


def test_progress_counts_the_tokens_of_token_ids_from_the_start(
    native_model: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """288 token ids under the default budget of 16384: every line's total is 288, the last line
    288/288 — through the API (the command line reads no token tensors)."""
    ids = torch.randint(3, 200, (9, 32), generator=torch.Generator().manual_seed(0))
    run = analyze(native_model, data=ids, plugins="lens", batch_size=4)
    lines = _progress_lines(capsys.readouterr().err)
    assert run.manifest["timings"]["tokens"] == 288
    assert lines and {total for _, total in lines} == {288} and lines[-1] == (288, 288)
    # A budget that cuts the last row short: still the tokens read, exactly.
    analyze(native_model, data=ids, plugins="lens", batch_size=4, max_tokens=100)
    lines = _progress_lines(capsys.readouterr().err)
    assert lines and {total for _, total in lines} == {100} and lines[-1] == (100, 100)


def test_progress_of_data_shorter_than_the_budget_ends_at_its_tokens(
    native_model: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Documents in memory, ``text:`` and a small file hold fewer tokens than ``max_tokens``: the
    bar's total becomes their tokens as soon as the reader reaches their end, and the run ends at
    100 %, through the API and the command line."""
    from typer.testing import CliRunner

    from lensdiv.cli import app

    for data in (["The cat sleeps on the mat. " * 10, "A dog."], "text:hello there, a short text"):
        run = analyze(native_model, data=data, plugins="lens", seq_len=32, batch_size=2)
        tokens = run.manifest["timings"]["tokens"]
        lines = _progress_lines(capsys.readouterr().err)
        assert 0 < tokens < 16384 and lines[-1] == (tokens, tokens), (data, lines)
    path = tmp_path / "short.txt"
    path.write_text("A short file of a few words. " * 5)
    result = CliRunner().invoke(app, ["analyze", "toy", "--data", str(path), "--plugins", "lens",
                                      "--seq-len", "32", "--batch-size", "2",
                                      "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    tokens = load_run(tmp_path / "run").manifest["timings"]["tokens"]
    lines = _progress_lines(result.output)  # standard output and error, as a terminal shows them
    assert 0 < tokens < 16384 and lines and lines[-1] == (tokens, tokens), result.output


def test_most_tokens_is_what_a_token_tensor_yields() -> None:
    """The up-front total of a token tensor is exactly the real tokens of its batches, whatever
    the budget, batch size and skipped tokens; other data says its budget."""
    from lensdiv.data.sources import most_tokens
    from lensdiv.data.tokenizer import byte_tokenizer

    ids = torch.randint(3, 200, (7, 5), generator=torch.Generator().manual_seed(1))
    for max_tokens in (2, 3, 5, 6, 9, 11, 34, 35, 36, 1000):
        for batch_size in (1, 2, 3, 8):
            for skip in (0, 5, 11):
                spec = DataSpec.from_data(ids, max_tokens=max_tokens, batch_size=batch_size,
                                          skip_tokens=skip)
                real = sum(b.n_tokens for b in token_batches(spec, byte_tokenizer()))
                bound = most_tokens(spec)
                assert bound == real if not skip else bound >= real, (spec, bound, real)
    assert most_tokens(DataSpec(max_tokens=777)) == 777


def test_the_probe_runs_once_per_model(native_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The validation's forward pass (an architecture that boots but cannot run) is a run's
    largest fixed cost: a model that passed it is not probed again, unless it was moved to
    another dtype (or device, or its weights replaced)."""
    import copy

    from lensdiv.run import validate

    model = copy.deepcopy(native_model)
    info = ModelInfo.from_model(model)
    probes: list[int] = []
    real = validate.capture
    monkeypatch.setattr(validate, "capture", lambda *a, **k: probes.append(1) or real(*a, **k))
    validate.check_runs(model, info)
    validate.check_runs(model, info)
    assert probes == [1]
    model.to(torch.float64)
    validate.check_runs(model, info)
    assert probes == [1, 1]
    # Through a run: the probe is not in the second run's forward passes.
    spec = DataSpec(max_tokens=64, seq_len=32, batch_size=2)
    analyze(model, data=spec, plugins="lens", progress=False)
    assert probes == [1, 1]
