"""report.html: written by every analyze, self-contained, complete (manifest summary, every
analyzer's section, warnings, failures, prompt views), rebuilt by `lensdiv report DIR --html`."""

from __future__ import annotations

import html as htmllib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.run.report import REPORT, VIEWS, write_report
from lensdiv.run.runner import analyze, load_run
from tests.conftest import ALL_ANALYZERS


def sections(page: str) -> list[str]:
    return re.findall(r'<section class="card analyzer" id="analyzer-([^"]+)"', page)


def test_every_analyze_writes_a_complete_report(full_run: Any) -> None:
    page = (full_run.out / REPORT).read_text()
    assert sections(page) == list(ALL_ANALYZERS)
    text = htmllib.unescape(page)
    manifest = full_run.manifest
    for fact in (manifest["model"]["spec"], manifest["model"]["resolved"], "complete",
                 str(manifest["timings"]["tokens"]), manifest["versions"]["torch"],
                 manifest["started"], "top_k=5"):
        assert fact in text, fact
    for name in ALL_ANALYZERS:
        result = full_run[name]
        assert result.summary in text, name
        assert result.table().description in text, name
        assert f"{name}/" in page  # its table or plot files are named
    n_plots = sum(len(full_run[name].plots) for name in ALL_ANALYZERS)
    assert page.count('<img src="data:image/png;base64,') == n_plots
    # The prompt views of the example prompts (lens ran), plus the last-block lens (dynamics ran).
    views = json.loads((full_run.out / VIEWS).read_text())
    assert len(views) == 4 and [v["lens"] for v in views] == ["logit"] * 3 + ["last-block"]
    assert page.count('class="lensdiv-pv"') == 4 and "KL to the output" in page


def test_the_report_loads_nothing_from_the_network(full_run: Any) -> None:
    page = (full_run.out / REPORT).read_text()
    links = re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', page)
    assert links and all(link.startswith(("data:", "#")) for link in links), links
    assert "<script" not in page and "@import" not in page and "url(" not in page
    assert "http://" not in page and "https://" not in page


@dataclass(frozen=True)
class Cautious(Analyzer):
    """A result that carries a warning."""

    name = "cautious"
    description = "warns"

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "n tokens", tables={"n": Table("n", {"n": [int(state["n"])]})},
                      warnings=("accuracy is at chance level: the score means nothing",))


@dataclass(frozen=True)
class Broken(Cautious):
    """An analyzer that fails."""

    name = "broken"

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        raise RuntimeError("boom <b>not markup</b>")


def test_warnings_and_failures_come_first(native_model: Any, tmp_path: Path) -> None:
    run = analyze(native_model, plugins=[Cautious(), Broken(), "contrib"], out=tmp_path,
                  max_tokens=128, seq_len=32, progress=False)
    assert "broken" in run.errors
    page = (tmp_path / REPORT).read_text()
    assert sections(page) == ["cautious", "broken", "contrib"]
    warning = "accuracy is at chance level: the score means nothing"
    # In the box at the top, before any section, and again in the analyzer's own section.
    assert page.index(warning) < page.index('id="run"') < page.rindex(warning)
    assert page.index("1 analyzer failed") < page.index('id="run"')
    assert "boom &lt;b&gt;not markup&lt;/b&gt;" in page and "<b>not markup</b>" not in page
    assert 'class="lensdiv-pv"' not in page  # no lens: no prompt views
    assert not (tmp_path / VIEWS).exists()


def test_report_command_rebuilds_the_page(full_run: Any, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(full_run.out, out)
    before = (out / REPORT).read_text()
    (out / REPORT).unlink()
    result = CliRunner().invoke(app, ["report", str(out), "--html"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "report.html" in "".join(result.output.split())  # a long path folds anywhere
    again = (out / REPORT).read_text()
    assert sections(again) == sections(before)
    assert again.count('class="lensdiv-pv"') == before.count('class="lensdiv-pv"') == 4
    # Without the saved prompt views the page still has every section.
    (out / VIEWS).unlink()
    write_report(load_run(out))
    assert sections((out / REPORT).read_text()) == list(ALL_ANALYZERS)
