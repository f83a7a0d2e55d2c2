"""Studies (lensdiv study, lensdiv.run_study): a study of tiny models is the runs `analyze` makes
one by one, resumes after a kill, splits into tasks that one report gathers, keeps going past a
model that cannot be loaded, writes a tidy Parquet pandas reads and a page a browser opens."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import lensdiv
from lensdiv.cli import app
from lensdiv.core.depth import depth_index, depth_profiles
from lensdiv.core.errors import OptionError, StudyError
from lensdiv.core.results import Plot, Result, Table
from lensdiv.run.runner import analyze
from lensdiv.studies.crossmodel import (
    COLUMNS,
    FAMILIES,
    parse_task,
    read_study,
    report_study,
    resolve_models,
    run_names,
    run_study,
)
from lensdiv.testing.models import save_tiny_model

FAST = {"max_tokens": 128, "seq_len": 32, "batch_size": 4}
PLUGINS = "lens"  # one plot per run: the runs' files cost little to draw
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Three tiny GPT-2s of depths 1, 2 and 3 (the byte tokenizer, saved locally)."""
    root = tmp_path_factory.mktemp("family")
    return [str(save_tiny_model("gpt2", root / f"d{n}", n_layers=n, seed=n)) for n in (1, 2, 3)]


@pytest.fixture(scope="module")
def study(family: list[str], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One study of the family, every model loaded only once the one before is gone."""
    import lensdiv.run.runner as runner

    alive: list[weakref.ref[Any]] = []
    overlaps: list[int] = []
    real = runner.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        overlaps.append(sum(ref() is not None for ref in alive))
        model = real(*args, **kwargs)
        alive.append(weakref.ref(model))
        return model

    out = tmp_path_factory.mktemp("study") / "study"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runner, "load_model", load_model)
        done = run_study(family, plugins=PLUGINS, out=out, progress=False, **FAST)
    done.overlaps = overlaps
    return done


def files(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder but its manifest and report (they hold times), by path."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", "report.html")
    }


def without_times(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in ("started", "timings")}


# -- the acceptance checks -------------------------------------------------------------------------
def test_a_study_is_the_runs_analyze_makes(study: Any, family: list[str], tmp_path: Path) -> None:
    assert study.ok and [m.status for m in study.models] == ["complete"] * 3
    assert study.overlaps == [0, 0, 0]  # each model freed before the next one loaded
    for spec, entry in zip(family, study.models, strict=True):
        alone = tmp_path / entry.run
        analyze(spec, plugins=PLUGINS, out=alone, progress=False, **FAST)
        ours = study.out / "runs" / entry.run
        assert files(ours) == files(alone)
        assert {"lens/result.json", "lens/lens.csv", "prompt_views.json"} <= set(files(ours))
        manifests = [json.loads((f / "manifest.json").read_text()) for f in (ours, alone)]
        assert without_times(manifests[0]) == without_times(manifests[1])
        assert (ours / "report.html").is_file()
        assert entry.size["n_layers"] == int(Path(spec).name[1:])
    saved = lensdiv.load_run(study.out / "runs" / study.models[0].run)  # lensdiv report reads it
    assert set(saved.results) == {"lens"}


def test_the_study_manifest_lists_every_model(study: Any) -> None:
    manifest = read_study(study.out)
    assert manifest["status"] == "complete" and manifest["counts"] == {"complete": 3}
    rows = manifest["models"]
    assert [r["run"] for r in rows] == ["d1", "d2", "d3"]
    assert all(r["status"] == "complete" and r["params"] > 0 for r in rows)
    assert manifest["settings"]["plugins"].keys() == {"lens"}


def test_pandas_reads_the_parquet_with_the_documented_columns(study: Any) -> None:
    import pandas as pd

    frame = pd.read_parquet(study.out / "study.parquet")
    assert list(frame.columns) == list(COLUMNS)
    pd.testing.assert_frame_equal(frame, lensdiv.load_study(study.out), check_dtype=False)
    csv = pd.read_csv(study.out / "study.csv")
    assert list(csv.columns) == list(COLUMNS) and len(csv) == len(frame)
    kl = frame[(frame.analyzer == "lens") & (frame.metric == "kl")]
    assert kl.profile.all() and len(kl) == 2 + 3 + 4  # states h_0..h_L of L = 1, 2, 3
    deep = kl[kl.n_layers == 3].sort_values("layer")
    assert list(deep.rel_depth) == pytest.approx([0, 1 / 3, 2 / 3, 1])
    saved = lensdiv.load_run(study.out / "runs" / "d3")["lens"].table()
    assert list(deep.value) == pytest.approx(list(saved["kl"]), rel=1e-12)
    loaded = lensdiv.load_study(study.out)
    assert loaded.params.dtype == "Int64" and (loaded.params > 0).all()
    assert loaded.layer.isna().sum() == 0  # every lens row is per-layer


def test_the_summary_draws_each_profile_over_relative_depth(study: Any) -> None:
    summary = Result.load(study.out / "summary")
    assert {"models", "numbers", "lens-kl", "lens-ce"} <= set(summary.tables)
    plot = next(p for p in summary.plots if p.name == "lens-kl")
    assert (plot.x, plot.group, plot.color) == ("rel_depth", "label", "params")
    assert "Csordás" in plot.caption and "ℓ/L" in plot.caption
    assert (study.out / "summary" / "lens-kl.png").read_bytes()[:4] == b"\x89PNG"
    numbers = summary.table("numbers")
    assert list(numbers["n_layers"]) == [1, 2, 3]
    assert np.isfinite(numbers["lens_kl_mid"]).all() and "update_norm" not in numbers.columns


def test_killed_after_the_first_model_a_rerun_runs_only_the_others(
    family: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "study"
    command = [sys.executable, "-m", "lensdiv", "study", "run", ",".join(family), "--plugins",
               "lens", "--out", str(out), "--no-progress", "--max-tokens", "128", "--seq-len",
               "32", "--batch-size", "4"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = out / "status" / "d1.json"
    deadline = time.time() + 300
    while not first.is_file() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)  # no chance to write anything more
    process.wait(timeout=60)
    assert first.is_file(), process.stderr.read().decode() if process.stderr else ""
    kept = (out / "runs" / "d1" / "manifest.json").read_bytes()
    again = run_study(family, plugins="lens", out=out, progress=False, **FAST)
    assert [m.action for m in again.models] == ["kept", "ran", "ran"]
    assert [m.status for m in again.models] == ["complete"] * 3
    assert (out / "runs" / "d1" / "manifest.json").read_bytes() == kept


def test_sigterm_stops_after_the_model_in_hand(
    family: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lensdiv.studies.crossmodel.study as module

    calls = []

    def analyze_then_term(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's time limit, while loading
        return analyze(*args, **kwargs)

    monkeypatch.setattr(module, "analyze", analyze_then_term)
    out = tmp_path / "study"
    stopped = run_study(family[:2], plugins="lens", out=out, progress=False, **FAST)
    assert stopped.interrupted == "SIGTERM" and len(calls) == 2
    assert [m.status for m in stopped.models] == ["complete", "interrupted"]
    monkeypatch.setattr(module, "analyze", analyze)
    again = run_study(family[:2], plugins="lens", out=out, progress=False, **FAST)
    assert [m.action for m in again.models] == ["kept", "ran"] and again.ok


def test_tasks_and_a_report_make_the_same_study(
    study: Any, family: list[str], tmp_path: Path
) -> None:
    import pandas as pd

    out = tmp_path / "split"
    first = run_study(family, plugins=PLUGINS, out=out, task="0/2", progress=False, **FAST)
    assert [m.action for m in first.models] == ["ran", "", "ran"] and first.ok
    assert not (out / "study.html").exists()  # the gathering waits for every task
    environ = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in environ.items():
            patch.setenv(key, value)
        second = run_study(family, plugins=PLUGINS, out=out, progress=False, **FAST)
    assert second.task.source == "SLURM_ARRAY_TASK_ID"
    assert [m.action for m in second.models] == ["", "ran", ""]
    gathered = report_study(out, progress=False)
    assert [m.status for m in gathered.models] == ["complete"] * 3
    for entry in study.models:
        assert files(out / "runs" / entry.run) == files(study.out / "runs" / entry.run)
    pd.testing.assert_frame_equal(
        pd.read_parquet(out / "study.parquet"), pd.read_parquet(study.out / "study.parquet")
    )
    strip = {"seconds", "task"}
    rows = [[{k: v for k, v in r.items() if k not in strip} for r in read_study(f)["models"]]
            for f in (out, study.out)]  # fmt: skip
    assert rows[0] == rows[1]


def test_a_model_that_cannot_load_is_listed_and_the_others_finish(
    family: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "study"
    missing = str(tmp_path / "no-such-model")
    result = CliRunner().invoke(
        app,
        ["study", "run", f"{family[0]},{missing}", "--plugins", "lens", "--out", str(out),
         "--no-progress", "--max-tokens", "128", "--seq-len", "32", "--batch-size", "4"],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    # The terminal folds long paths anywhere: compare without whitespace.
    assert f"model'{missing}'failed:modelfolder" in "".join(result.output.split())
    rows = {r["model"]: r for r in read_study(out)["models"]}
    assert rows[family[0]]["status"] == "complete"
    assert rows[missing]["status"] == "failed" and "does not exist" in rows[missing]["reason"]
    assert (out / "runs" / "d1" / "lens" / "result.json").is_file()
    assert "no-such-model" in (out / "study.html").read_text()
    again = run_study(f"{family[0]},{missing}", plugins="lens", out=out, progress=False, **FAST)
    assert [m.action for m in again.models] == ["kept", "ran"]  # the failed one is tried again


def test_a_study_page_the_disk_refuses_is_said_on_stderr_and_in_the_last_line(
    family: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29, point 7, for `lensdiv study`: errors on standard error, and the last line says
    what was and was not written (the API: ``Study.unwritten``)."""
    import errno

    import lensdiv.studies.crossmodel.study as module

    def too_big(*args: Any, **kwargs: Any) -> str:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(module, "study_html", too_big)
    out = tmp_path / "study"
    result = CliRunner().invoke(
        app,
        ["study", "run", family[0], "--plugins", "lens", "--out", str(out), "--no-progress",
         "--max-tokens", "128", "--seq-len", "32", "--batch-size", "4"],
    )  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "error: study.html could not be written: OSError: [Errno 27] File too large" in (
        result.stderr), result.stderr
    assert "error:" not in result.stdout
    last = result.stdout.strip().splitlines()[-1]
    assert last == (f"results in {out} are incomplete: not written: study.html; written: "
                    "study.parquet, study.csv, study.json, summary/"), last
    assert not (out / "study.html").exists() and (out / "study.parquet").is_file()
    again = run_study(family[0], plugins="lens", out=tmp_path / "api", progress=False, **FAST)
    assert again.unwritten == ["study.html"] and not again.ok


# -- mistakes, before any model ------------------------------------------------------------------
def test_mistakes_are_one_line_before_any_model(
    study: Any, family: list[str], tmp_path: Path
) -> None:
    def error(*args: str) -> str:
        result = CliRunner().invoke(app, ["study", "run", *args])
        text = result.output.strip()
        assert result.exit_code == 2 and len(text.splitlines()) == 1, text
        assert text.startswith("error:") and "Traceback" not in text
        return text

    out = str(tmp_path / "s")
    assert "did you mean 'zoo:depth'" in error("zoo:dpth", "--out", out)
    assert "unknown analyzer" in error(family[0], "--plugins", "lense", "--out", out).lower()
    assert "--task 2/2" in error(family[0], "--task", "2/2", "--out", out)
    assert not Path(out).exists()
    same = [",".join(family), "--plugins", PLUGINS, "--out", str(study.out)]
    assert "other data" in error(*same, "--max-tokens", "64", "--seq-len", "32")
    with pytest.raises(StudyError, match="not a lensdiv study folder"):
        report_study(tmp_path)


def test_help_has_examples() -> None:
    for command in (["study", "--help"], ["study", "run", "--help"], ["study", "report", "--help"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 0 and "Example: lensdiv study" in result.output


# -- the pieces ----------------------------------------------------------------------------------
def test_models_read_as_a_shell_user_writes_them(family: list[str], tmp_path: Path) -> None:
    assert resolve_models("EleutherAI/pythia-{70m,160m},gpt2") == [
        "EleutherAI/pythia-70m", "EleutherAI/pythia-160m", "gpt2"]  # fmt: skip
    assert resolve_models(["zoo:width", "toy:d4-w32"]) == ["toy:d4-w32", "toy:d4-w64",
                                                          "toy:d4-w128"]  # fmt: skip
    listing = tmp_path / "models.txt"
    listing.write_text(f"# a family\n{family[0]}\n\ntoy:d{{2,3}}  # braces too\nzoo:width\n")
    width = FAMILIES["zoo:width"]
    assert resolve_models(str(listing)) == [family[0], "toy:d2", "toy:d3", *width]
    assert resolve_models(str(Path(family[0]).parent)) == family  # a folder of model folders
    (tmp_path / "empty").mkdir()
    with pytest.raises(OptionError, match="holds no model"):
        resolve_models(str(tmp_path / "empty"))
    assert run_names(["toy:d4", "EleutherAI/pythia-70m", family[0], family[0] + "/"]) == [
        "toy-d4", "EleutherAI-pythia-70m", "d1", "d1-2"]  # fmt: skip


def test_tasks_from_the_flag_and_from_slurm() -> None:
    assert str(parse_task("1/3")) == "1/3" and parse_task(None, {}).count == 1
    task = parse_task(None, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "3",
                             "SLURM_ARRAY_TASK_COUNT": "4"})  # fmt: skip
    assert (task.index, task.count, task.source) == (2, 4, "SLURM_ARRAY_TASK_ID")
    assert [i for i in range(10) if task.runs(i)] == [2, 6]
    stepped = parse_task(None, {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_STEP": "2",
                                "SLURM_ARRAY_TASK_MAX": "6"})  # fmt: skip
    assert (stepped.index, stepped.count) == (2, 4)
    for bad in ("1", "a/b", "3/3", "0/0", (-1, 2)):
        with pytest.raises(OptionError):
            parse_task(bad)
    with pytest.raises(OptionError, match="job array"):
        parse_task(None, {"SLURM_ARRAY_TASK_ID": "9", "SLURM_ARRAY_TASK_COUNT": "2"})


def test_the_papers_numbers() -> None:
    from lensdiv.studies.crossmodel.summary import fall_depth, half_ratio, loglog_slope

    # blocks 1..L-1 of r_block: (0.4, 0.4) first half, (0.2, 0.2) second half
    assert half_ratio([9.0, 0.4, 0.4, 0.2, 0.2]) == pytest.approx(0.5)
    assert math.isnan(half_ratio([9.0, 0.4]))
    # later_mean over blocks 1..L-2 = 0.6, 0.5, 0.25, 0.2: halves at block 3, (3 + ½)/6
    assert fall_depth([2.0, 0.6, 0.5, 0.25, 0.2, float("nan")], 6) == pytest.approx(3.5 / 6)
    assert math.isnan(fall_depth([2.0, 0.6, 0.5, 0.4, 0.35, 0.0], 6))
    slope, intercept = loglog_slope([2, 4, 8], [0.5, 0.25, 0.125])
    assert slope == pytest.approx(-1.0) and intercept == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(loglog_slope([4, 4], [1.0, 2.0])[0])


def test_per_layer_tables_and_the_default_profiles() -> None:
    states = Table("t", {"layer": [0, 1, 2], "x": [1.0, 2.0, 3.0], "name": ["a", "b", "c"]})
    blocks = Table("b", {"skipped": [1, 0], "y": [0.5, 0.1], "flag": [True, False]})
    long = Table("l", {"layer": [0, 0, 1, 1], "z": [1, 2, 3, 4]})
    assert depth_index(states, 2).kind == "state" and depth_index(states, 2).relative(1) == 0.5
    assert depth_index(blocks, 2).column == "skipped" and depth_index(blocks, 2).relative(0) == 0.25
    assert depth_index(long, 2) is None and depth_index(states, 4) is None
    assert depth_index(states, 3).kind == "block"  # three rows of a 3-block model: blocks
    result = Result("mine", tables={"t": states, "b": blocks, "l": long})
    assert depth_profiles(result, 2) == [("t", "x"), ("b", "y"), ("b", "flag")]
    assert depth_profiles(result, 2, ("b.y", "t.missing")) == [("b", "y")]
    assert lensdiv.Analyzer.depth_profiles is None  # third-party analyzers get the default


def test_plot_colours_lines_by_size() -> None:
    table = Table("p", {"x": [0, 1, 0, 1], "y": [1.0, 2.0, 3.0, 4.0], "m": ["a", "a", "b", "b"],
                        "size": [1e3, 1e3, 1e5, 1e5]})  # fmt: skip
    plot = Plot("line", "p", "t", "p", x="x", y=("y",), group="m", color="size", clabel="params")
    fig, ax = plot.figure(Result("r", tables={"p": table}))
    colours = [line.get_color() for line in ax.get_lines()]
    assert colours[0] != colours[1] and [t.get_text() for t in ax.get_legend().get_texts()] == [
        "a", "b"]  # fmt: skip
    assert fig.axes[1].get_ylabel() == "params"  # the colour bar
    assert Plot.from_dict(plot.to_dict()) == plot
    assert "color" not in Plot("line", "q", "t", "p", x="x", y=("y",)).to_dict()


def test_study_html_opens_in_a_browser(study: Any, tmp_path: Path) -> None:
    from tests.browser import Browser, find_chromium
    from tests.test_browser import not_blank

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium)")
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    page = study.out / "study.html"
    with Browser(chromium, width=1400, height=1000) as browser:
        browser.open(page)
        assert browser.errors == []
        assert [u for u in browser.requests if not u.startswith("data:")] == [page.as_uri()]
        rows = browser.evaluate(
            "[...document.querySelectorAll('#model-status tbody tr')].map(r => r.dataset.model)"
        )
        assert rows == [m.model for m in study.models]
        links = browser.evaluate("[...document.querySelectorAll('a.report')].map(a => a.href)")
        assert len(links) == 3 and all(Path(link[len("file://") :]).is_file() for link in links)
        assert browser.evaluate("document.getElementById('study-status').textContent") == (
            "complete")  # fmt: skip
        images = browser.evaluate("[...document.images].map(i => i.complete && i.naturalWidth)")
        assert len(images) >= 2 and all(images)
        not_blank(browser.screenshot(tmp_path / "study.png", full_page=True))


def test_the_prunable_fraction() -> None:
    from lensdiv.studies.crossmodel.summary import prunable

    # L = 4, prune's grid up to n = 2: removing blocks 1..2 costs 0.08 nats, block 2 alone 0.02.
    cells = [(0, 1, 0.5), (1, 1, 0.05), (2, 1, 0.02), (3, 1, 0.3), (0, 2, 0.9), (1, 2, 0.08),
             (2, 2, 0.4)]  # fmt: skip
    grid = Table("grid", {"start": [c[0] for c in cells], "n": [c[1] for c in cells],
                          "kl": [c[2] for c in cells]})  # fmt: skip
    assert prunable(grid, 4, 0.1) == (0.5, 0.25, 0.75)
    assert prunable(grid, 4, 0.03) == (0.25, 0.5, 0.75)
    fraction, start, stop = prunable(grid, 4, 0.01)
    assert fraction == 0.0 and math.isnan(start) and math.isnan(stop)


def test_the_study_page_compares_the_prunable_fraction(family: list[str], tmp_path: Path) -> None:
    from lensdiv.studies.crossmodel.summary import PRUNE_KL, PRUNE_THRESHOLDS, prunable

    options = {"prune": {"curves": "False", "linearity": "False"}}
    done = run_study(family, plugins="prune", options=options, out=tmp_path / "s", progress=False,
                     **FAST)  # fmt: skip
    assert done.ok, [m.reason for m in done.models]
    summary = done.summary
    table = summary.table("prune_fraction")
    numbers = summary.table("numbers")
    for i, model in enumerate(done.models):
        grid = done[model.model]["prune"].table("grid")
        L = i + 1  # the family's depths are 1, 2, 3
        rows = [j for j, m in enumerate(table["model"]) if m == model.model]
        assert [table["kl"][j] for j in rows] == list(PRUNE_THRESHOLDS)
        got = [table["fraction"][j] for j in rows]
        assert got == [prunable(grid, L, kl)[0] for kl in PRUNE_THRESHOLDS]
        assert got == sorted(got)  # a looser threshold never prunes less
        assert numbers["prunable_fraction"][i] == prunable(grid, L, PRUNE_KL)[0]
    plots = {p.name: p for p in summary.plots}
    assert plots["prune_fraction"].logx and plots["prune-blocks-kl_remove"].logy
    page = (tmp_path / "s" / "study.html").read_text()
    assert "Prunable fraction of the depth" in page and "prunable_fraction" in page
