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
