"""Rough edges a user still met (issue 24), each through the command line and the Python API:
one clear line, the right exit code, nothing lost.

- a third-party analyzer whose method returns (or raises) what the contract does not allow
  fails alone, with one line naming it, the method and the value; the others finish;
- a plugin refused for claiming a built-in's name warns when that name is selected, not only
  in ``plugins list``;
- an option the data cannot serve (a ``skip`` stride longer than any row) is refused before
  any forward pass, by the analyzer's ``check_data``;
- an architecture TransformerLens boots but cannot run is one line naming it, exit 2, found by a
  probe forward pass before the run;
- ``lensdiv report`` on a result with a table missing names the table.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import lensdiv
from lensdiv.analyzers.lens import LogitLens
from lensdiv.cli import app
from lensdiv.core.analyzer import Analyzer, DataFacts, ModelInfo
from lensdiv.core.errors import DataError, ModelLoadError, OptionError, PluginWarning
from lensdiv.core.registry import default_registry
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec
from lensdiv.data.tokenizer import byte_tokenizer
from lensdiv.run.validate import corpus_facts
from lensdiv.testing.models import save_codegen_model

FAST = ["--max-tokens", "256", "--seq-len", "32", "--batch-size", "4", "--no-progress"]
API_FAST: dict[str, Any] = {"max_tokens": 256, "seq_len": 32, "batch_size": 4, "progress": False}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def assert_one_line(result: Any, code: int, *needles: str) -> str:
    """No traceback, exit ``code``, and an ``error:``/``warning:`` line holding every needle;
    returns that line."""
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if all(n in line for n in needles)]
    assert lines, result.output
    return lines[0]


@pytest.fixture
def install(tmp_path: Path) -> Iterator[Any]:
    """``install(distribution, {name: "module:Class"})``: an installed distribution whose
    entry points register those plugins (a ``.dist-info`` folder on ``sys.path``)."""
    site = tmp_path / "site"
    site.mkdir()
    sys.path.insert(0, str(site))

    def make(distribution: str, plugins: dict[str, str]) -> None:
        info = site / f"{distribution.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n"
        )
        lines = "".join(f"{name} = {target}\n" for name, target in plugins.items())
        (info / "entry_points.txt").write_text(f"[lensdiv.plugins]\n{lines}")
        default_registry.cache_clear()

    yield make
    sys.path.remove(str(site))
    default_registry.cache_clear()


# == 1. an analyzer that returns what the contract does not allow ==================================


@dataclass(frozen=True)
class Odd(Analyzer):
    """Counts tokens in two passes; ``where`` returns (or raises) ``what`` instead."""

    name = "odd"
    passes = 2
    where: str = "finalize"
    what: str = "dict"

    def _odd(self, where: str, normal: Any) -> Any:
        if where != self.where:
            return normal
        if self.what == "exit":
            raise SystemExit(3)
        return {"dict": {"n": 1}, "none": None, "list": [1, 2]}[self.what]

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def init(self, info: ModelInfo) -> Stats:
        return self._odd("init", Stats())  # type: ignore[no-any-return]

    def update(self, state: Stats, step: Any) -> None:
        if step.pass_index == 0:
            state.add("n", step.batch.n_tokens)
        return self._odd("update", None)  # type: ignore[no-any-return]

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        return self._odd("start_pass", None)  # type: ignore[no-any-return]

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        table = Table("t", {"n": [int(state["n"])]})
        return self._odd("finalize", Result(self.name, "counted", tables={"t": table}))  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "where,what,line",
    [
        ("finalize", "dict", "finalize returned a dict ({'n': 1}), expected a Result"),
        ("finalize", "none", "finalize returned None, expected a Result"),
        ("init", "dict", "init returned a dict ({'n': 1}), expected a Stats"),
        ("update", "list", "update returned a list ([1, 2]), expected None"),
        ("start_pass", "dict", "start_pass returned a dict ({'n': 1}), expected None"),
        ("update", "exit", "SystemExit: 3 (batch 0)"),
    ],
)
def test_a_method_returning_the_wrong_thing_fails_that_analyzer(
    where: str, what: str, line: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = lensdiv.analyze("toy", plugins=["contrib", Odd(where=where, what=what)], out=out,
                          **API_FAST)
    assert line in run.errors["odd"] and "\n" not in run.errors["odd"]
    assert ("failed", f"analyzer 'odd' failed: {run.errors['odd']}") in run.notes()
    assert run.manifest["status"] == "partial" and run.manifest["analyzers"]["odd"]["status"] == \
        "failed"
    assert "contrib" in run.results and (out / "contrib" / "result.json").is_file()


def test_a_plugin_returning_a_dict_through_the_cli(install: Any, tmp_path: Path) -> None:
    install("lensdiv-odd", {"odd": "tests.test_edges:Odd"})
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "contrib,odd", "--out", str(out), *FAST)
    assert_one_line(result, 1, "analyzer 'odd' failed: finalize returned a dict ({'n': 1}), "
                               "expected a Result")
    result = invoke("analyze", "toy", "-p", "contrib,odd", "-O", "odd.where=update",
                    "-O", "odd.what=exit", "--out", str(out), "--overwrite", *FAST)
    assert_one_line(result, 1, "analyzer 'odd' failed: SystemExit: 3 (batch 0)")
    saved = lensdiv.load_run(out)
    assert saved.manifest["status"] == "partial" and "contrib" in saved.results


def test_hooks_and_passes_of_the_wrong_kind_fail_that_analyzer() -> None:
    @dataclass(frozen=True)
    class OneHook(Odd):
        name = "onehook"
        where: str = ""

        def hooks(self, info: ModelInfo) -> list[str]:
            return info.resid(0)  # type: ignore[return-value]  # the mistake under test

    @dataclass(frozen=True)
    class Passes(Odd):
        name = "passes"
        where: str = ""

        def n_passes(self, info: ModelInfo) -> int:
            return "2"  # type: ignore[return-value]  # the mistake under test

    run = lensdiv.analyze("toy", plugins=["contrib", OneHook(), Passes()], **API_FAST)
    assert run.errors["onehook"] == ("TypeError: hooks returned a str ('blocks.0.hook_resid_pre')"
                                     ", expected a list of hook names (hooks)")
    assert run.errors["passes"] == ("TypeError: n_passes returned a str ('2'), expected a whole "
                                    "number of at least 1 (hooks)")
    assert "contrib" in run.results


# == 2. a plugin claiming a built-in's name ========================================================


FAKE_LENS = (
    "from dataclasses import dataclass\n"
    "from lensdiv.analyzers.lens import LogitLens\n\n"
    "@dataclass(frozen=True)\nclass Lens(LogitLens):\n    name = 'lens'\n\n"
    "@dataclass(frozen=True)\nclass Alias(LogitLens):\n    name = 'logit-lens'\n"
)


@pytest.fixture
def claimed(install: Any, tmp_path: Path) -> Iterator[None]:
    (tmp_path / "site" / "fakelens.py").write_text(FAKE_LENS)
    install("lensdiv-fakelens", {"lens": "fakelens:Lens", "logit-lens": "fakelens:Alias"})
    yield
    sys.modules.pop("fakelens", None)


def test_analyze_warns_when_a_refused_plugin_claimed_the_name(
    claimed: None, tmp_path: Path
) -> None:
    result = invoke("analyze", "toy", "-p", "lens", "--out", str(tmp_path / "a"), *FAST)
    line = assert_one_line(result, 0, "warning:", "'lens'", "lensdiv-fakelens 1.0")
    assert "is a built-in analyzer of lensdiv" in line and "the built-in kept" in line
    assert lensdiv.load_run(tmp_path / "a").manifest["analyzers"]["lens"]["status"] == "complete"
    result = invoke("analyze", "toy", "-p", "logit-lens", "--out", str(tmp_path / "b"), *FAST)
    assert "is an alias of 'lens'" in assert_one_line(result, 0, "warning:", "'logit-lens'")
    quiet = invoke("analyze", "toy", "-p", "contrib", "--out", str(tmp_path / "c"), *FAST)
    assert quiet.exit_code == 0 and "warning:" not in quiet.output
    with pytest.warns(PluginWarning, match="'lens' of lensdiv-fakelens 1.0 .* the built-in kept"):
        run = lensdiv.analyze("toy", plugins="lens", **API_FAST)
    assert run.ok and isinstance(lensdiv.get_analyzer("lens")(), LogitLens)
    assert type(lensdiv.get_analyzer("lens")()) is LogitLens


# == 3. options the data cannot serve, refused before any forward pass ============================


def test_a_stride_longer_than_any_row_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lensdiv.run import engine

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(engine, "capture", no_forward)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens,skip", "--seq-len", "12", "--out", str(out),
                    "--max-tokens", "256", "--no-progress")
    line = assert_one_line(result, 2, "error:", "skip.stride=8 needs rows of at least 13 tokens")
    assert "--seq-len 12 makes rows of at most 12 tokens" in line and "skip.stride=7" in line
    assert not out.exists()  # nothing written
    with pytest.raises(OptionError) as err:
        lensdiv.analyze("toy", data="text:a cat", plugins="skip", **API_FAST)
    assert "the data makes one row of only 7 tokens" in str(err.value)  # BOS + 5 + EOS
    with pytest.raises(OptionError, match="--max-tokens 10 leaves one row of 10 tokens"):
        lensdiv.analyze("toy", plugins="skip", max_tokens=10, progress=False)


def test_the_modes_and_strides_that_fit_still_run() -> None:
    run = lensdiv.analyze("toy", plugins="skip", options={"skip": {"mode": "current"}},
                          seq_len=12, max_tokens=96, batch_size=4, progress=False)
    assert run.ok, run.errors
    run = lensdiv.analyze("toy", plugins="skip", options={"skip": {"stride": 7}},
                          seq_len=12, max_tokens=96, batch_size=4, progress=False)
    assert run.ok, run.errors


def test_a_plugins_own_check_data(tmp_path: Path) -> None:
    seen: list[int] = []

    @dataclass(frozen=True)
    class Picky(Odd):
        name = "picky"
        where: str = ""
        need: int = 1000

        def check_data(self, data: DataFacts, info: ModelInfo) -> None:
            seen.append(data.longest)
            if data.longest < self.need:
                raise OptionError(f"picky.need={self.need} is more than {data.limit}")

    with pytest.raises(OptionError, match="picky.need=1000 is more than --seq-len 32 makes"):
        lensdiv.analyze("toy", plugins=["lens", Picky()], out=tmp_path / "o", **API_FAST)
    assert seen == [32] and not (tmp_path / "o").exists()

    @dataclass(frozen=True)
    class Crashing(Picky):
        name = "crashing"

        def check_data(self, data: DataFacts, info: ModelInfo) -> None:
            raise RuntimeError("bug")

    run = lensdiv.analyze("toy", plugins=["lens", Crashing()], **API_FAST)
    assert run.errors == {"crashing": "RuntimeError: bug (check_data)"} and "lens" in run.results


def test_the_data_is_read_for_the_check_only_when_asked(tmp_path: Path) -> None:
    facts = corpus_facts(DataSpec(source=str(tmp_path / "missing.txt")), byte_tokenizer())
    assert facts.seq_len == 128  # nothing read yet
    with pytest.raises(DataError, match="does not exist"):
        _ = facts.longest
    tokens = DataSpec.from_data(__import__("torch").arange(4, 40).reshape(3, 12))
    assert corpus_facts(tokens, byte_tokenizer()).limit == "the token tensor's rows hold 12 tokens"


# == 4. an architecture TransformerLens boots but cannot run ======================================


@pytest.fixture(scope="module")
def codegen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("codegen")
    return {"runs": save_codegen_model(root / "runs"),
            "broken": save_codegen_model(root / "broken", rotary_dim=64)}


def _without_embed_positions(model: Any) -> Any:
    """The failure of the issue: TransformerLens' CodeGen attention reads a buffer that the
    installed ``transformers`` (a version without it) does not have."""
    for block in model.blocks:
        del block.attn.original_component.embed_positions
    return model


def test_an_architecture_that_cannot_run_is_one_line(
    codegen: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    result = invoke("analyze", str(codegen["broken"]), "-p", "lens,contrib,skip", "--out",
                    str(out), *FAST)
    line = assert_one_line(result, 2, "error:", "(CodeGenForCausalLM) but cannot run it")
    assert "TransformerLens 4." in line and "RuntimeError" in line
    assert not out.exists()
    model = _without_embed_positions(lensdiv.load_model(str(codegen["runs"]), progress=False))
    with pytest.raises(ModelLoadError) as err:
        lensdiv.analyze(model, plugins="lens,contrib,skip", **API_FAST)
    message = str(err.value)
    assert "(CodeGenForCausalLM) but cannot run it: AttributeError: 'CodeGenAttention' object " \
        "has no attribute 'embed_positions'" in message and "\n" not in message
    # The same through the command line: one line instead of an error per analyzer.
    from lensdiv.run import runner

    load = runner.load_model
    monkeypatch.setattr(runner, "load_model", lambda *a, **k: _without_embed_positions(
        load(*a, **k)))
    result = invoke("analyze", str(codegen["runs"]), "-p", "lens,contrib,skip", "--out", str(out),
                    *FAST)
    assert_one_line(result, 2, "error:", "cannot run it: AttributeError", "embed_positions")
    assert not out.exists()


def test_a_codegen_model_that_runs_is_analysed(codegen: dict[str, Path]) -> None:
    run = lensdiv.analyze(str(codegen["runs"]), plugins="lens,contrib", **API_FAST)
    assert run.ok, run.errors


# == 5. report on a damaged result ==================================================================


def test_report_names_the_missing_table(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert invoke("analyze", "toy", "-p", "lens,contrib", "--out", str(out), *FAST).exit_code == 0
    path = out / "lens" / "result.json"
    data = json.loads(path.read_text())
    del data["tables"]["lens"]
    path.write_text(json.dumps(data))
    result = invoke("report", str(out))
    line = assert_one_line(result, 2, "error:", "lens/result.json is damaged")
    assert "the result has no table 'lens' (it has none)" in line and "KeyError" not in line
    assert "contrib" in result.output  # the sound result is still shown
    result = invoke("report", str(out), "--plots", "--html")
    line = assert_one_line(result, 2, "error:", "cannot draw: the result has no table 'lens'")
    assert "lens_kl.png" in line and "KeyError" not in result.output
    assert "the result has no table &#39;lens&#39;" in (out / "report.html").read_text()
    assert lensdiv.load_run(out)["lens"].missing() == ["the result has no table 'lens' (it has none)"]
    # A column gone from a table says which.
    shutil.copy(out / "contrib" / "result.json", tmp_path / "contrib.json")
    data = json.loads((out / "contrib" / "result.json").read_text())
    first_plot = data["plots"][0]
    column = first_plot["y"][0]
    del data["tables"][first_plot["source"]]["columns"][column]
    (out / "contrib" / "result.json").write_text(json.dumps(data))
    line = assert_one_line(invoke("report", str(out)), 2, "contrib/result.json is damaged")
    assert f"table {first_plot['source']!r} has no column {column!r}" in line
