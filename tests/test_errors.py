"""Never lose finished work, never show a traceback for a user's mistake (issue 16).

One group of cases per way things went wrong, each through the command line and the Python API:
a mistake is one line naming the thing to change and exit code 2, found before any work; a fault
(a broken plugin, a full disk, a signal) keeps every finished analyzer's files on disk beside a
manifest in a final state. Every CLI case also asserts that no traceback was printed.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import lensdiv
from lensdiv.analyzers.lens import LogitLens
from lensdiv.cli import app
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.errors import (
    DataError,
    LensdivError,
    ModelLoadError,
    OptionError,
    PluginError,
    ResultError,
    UnsupportedModelError,
)
from lensdiv.core.registry import default_registry
from lensdiv.core.results import Plot, Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.tokenizer import byte_tokenizer
from lensdiv.testing.models import save_softcapped_model, tiny_config

runner = CliRunner()
FAST = ["--max-tokens", "256", "--seq-len", "32", "--batch-size", "4", "--no-progress"]
API_FAST: dict[str, Any] = {"max_tokens": 256, "seq_len": 32, "batch_size": 4, "progress": False}
FINAL = ("complete", "partial", "failed", "interrupted")


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


def first_line(result: Any) -> str:
    return result.output.strip().splitlines()[0] if result.output.strip() else ""


def assert_mistake(result: Any, *needles: str) -> None:
    """Exit 2, no traceback, and a first line that says ``error:`` and names the thing."""
    text = result.output
    assert "Traceback" not in text, text
    assert result.exit_code == 2, text
    line = first_line(result)
    assert line.startswith("error:"), text
    for needle in needles:
        assert needle in line, text


def assert_api_mistake(err: pytest.ExceptionInfo[LensdivError], *needles: str) -> None:
    message = str(err.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message


def manifest(out: Path) -> dict[str, Any]:
    return json.loads((out / "manifest.json").read_text())


def assert_kept(out: Path, name: str) -> None:
    """A finished analyzer's result.json and CSV tables are on disk and listed."""
    entry = manifest(out)["analyzers"][name]
    assert (out / name / "result.json").is_file(), entry
    assert list((out / name).glob("*.csv")), entry
    assert f"{name}/result.json" in entry["files"], entry
    assert not list(out.rglob(".*.tmp*")), "temporary files left behind"


# -- analyzers that break in one hook each --------------------------------------------------------


@dataclass(frozen=True)
class Broken(Analyzer):
    """Raises in the hook named by ``where``; otherwise a one-number analyzer."""

    name = "broken"
    where: str = "init"

    def _maybe(self, hook: str) -> None:
        if self.where == hook:
            raise RuntimeError(f"boom in {hook}")

    def hooks(self, info: ModelInfo) -> list[str]:
        self._maybe("hooks")
        return [info.resid(0)]

    def examples(self, model: Any, info: ModelInfo) -> list[Batch] | None:
        self._maybe("examples")
        return None

    def setup(self, model: Any, info: ModelInfo) -> None:
        self._maybe("setup")

    def init(self, info: ModelInfo) -> Stats:
        self._maybe("init")
        return Stats()

    def update(self, state: Stats, step: Any) -> None:
        self._maybe("update")
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        self._maybe("finalize")
        return Result(self.name, "n", tables={"t": Table("t", {"n": [int(state["n"])]})})


@dataclass(frozen=True)
class BadPlot(Broken):
    """Finishes, but its plot names a table that does not exist."""

    name = "badplot"
    where: str = ""

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        result = super().finalize(state, info)
        plot = Plot("line", "missing", "no such table", source="nowhere", x="a", y=("b",))
        return Result(self.name, "n", tables=result.tables, plots=(plot,))


@dataclass(frozen=True)
class NeedsSomethingElse(Broken):
    """Cannot support any model: says so from setup."""

    name = "picky"
    where: str = ""

    def setup(self, model: Any, info: ModelInfo) -> None:
        raise UnsupportedModelError(f"{info.name} lacks the frobnicator this analyzer reads")


# -- models built here -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Local Hugging Face folders that each break one assumption, plus a soft-capped Gemma 2."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("faulty_models")
    made = {}
    for name, change, tokenizer in (
        ("ctx64", {"n_positions": 64}, True),
        ("vocab100", {"vocab_size": 100}, True),
        ("no_tokenizer", {}, False),
    ):
        config = tiny_config("gpt2", n_layers=2)
        for key, value in change.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        folder = root / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        if tokenizer:
            byte_tokenizer().save_pretrained(folder)
        made[name] = folder
    made["softcap"] = save_softcapped_model(root / "softcap")
    return made


# == 1. context length and vocabulary ===============================================================


def test_seq_len_past_a_toy_context_is_refused_before_anything(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert_mistake(
        invoke("analyze", "toy", "-p", "lens", "--seq-len", "300", "--out", str(out), "--no-progress"),
        "--seq-len 300",
        "256",
    )
    assert not out.exists()


def test_seq_len_past_a_local_hf_context_fails_before_any_batch(
    local_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import lensdiv.run.engine as engine

    def no_forward(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a batch was run")

    monkeypatch.setattr(engine, "capture", no_forward)
    with pytest.raises(OptionError) as err:  # the default --seq-len 128 on 64 positions
        lensdiv.analyze(local_models["ctx64"], plugins="lens", max_tokens=512, progress=False)
    assert_api_mistake(err, "--seq-len 128", "64 positions", "--seq-len 64")
    result = invoke("analyze", str(local_models["ctx64"]), "-p", "lens", "--no-progress",
                    "--out", str(tmp_path / "o"))
    assert_mistake(result, "--seq-len 128", "64")


def test_task_prompts_past_the_context_are_refused(tmp_path: Path) -> None:
    tasks = tmp_path / "long.jsonl"
    tasks.write_text(json.dumps({"prompt": "a" * 300, "answer": "b", "grade": 1}) + "\n")
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens,depth-score", "-O",
                    f"depth-score.tasks={tasks}", "--out", str(out), *FAST)
    assert_mistake(result, "depth-score", "depth-score.tasks", "more than the 256 positions")
    assert not out.exists()


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(local_models: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError) as err:
        lensdiv.analyze(local_models["vocab100"], plugins="lens", **API_FAST)
    assert_api_mistake(err, "260 tokens", "only 100")
    assert_mistake(invoke("analyze", str(local_models["vocab100"]), "-p", "lens", *FAST),
                   "tokenizer has 260 tokens")


def test_token_data_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(DataError) as err:
        lensdiv.analyze("toy", data=torch.full((2, 8), 999), plugins="lens", **API_FAST)
    assert_api_mistake(err, "id 999", "260")


# == 2. output, cache and disk ======================================================================


def test_out_naming_a_file_or_a_path_under_one(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert_mistake(invoke("analyze", "toy", "--out", str(afile), *FAST), "--out", "is a file")
    assert_mistake(invoke("analyze", "toy", "--out", str(afile / "sub"), *FAST),
                   "--out", "afile is a file")
    with pytest.raises(OptionError) as err:
        lensdiv.analyze("toy", out=afile / "sub", **API_FAST)
    assert_api_mistake(err, "afile is a file")


def test_a_read_only_out_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):  # root writes anywhere: ask the kernel's question ourselves
        import lensdiv.core.files as files

        real = os.access
        monkeypatch.setattr(files.os, "access",
                            lambda p, mode: False if Path(p) == folder else real(p, mode))
    try:
        result = invoke("analyze", "toy", "--out", str(folder / "run"), *FAST)
        assert_mistake(result, "--out", "not writable")
    finally:
        folder.chmod(0o755)


def test_a_full_disk_keeps_every_file_that_could_be_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lensdiv.core import results

    original = results._atomic.__exit__

    def full_disk(self: Any, exc_type: Any, *rest: Any) -> None:
        if exc_type is None and self.path.parent.name == "contrib":
            original(self, OSError, None, None)  # the temporary file is removed, as on failure
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))
        original(self, exc_type, *rest)

    monkeypatch.setattr(results._atomic, "__exit__", full_disk)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens,contrib", "--out", str(out), *FAST)
    assert "Traceback" not in result.output
    assert result.exit_code == 1, result.output
    assert "could not write" in result.output and "No space left on device" in result.output
    assert "contrib.csv" in result.output and "result.json" in result.output
    data = manifest(out)
    assert data["status"] == "partial"
    assert data["analyzers"]["contrib"]["status"] == "failed"
    assert "contrib/result.json" in data["analyzers"]["contrib"]["not_written"]
    assert_kept(out, "lens")
    assert not (out / "contrib").exists() or not list((out / "contrib").iterdir())


def test_a_manifest_that_cannot_be_written_is_said_and_the_results_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lensdiv.run.outcome as outcome

    def full(path: Path, data: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(outcome, "write_json_atomic", full)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens", "--out", str(out), *FAST)
    assert "Traceback" not in result.output and result.exit_code == 1, result.output
    assert f"error: {out / 'manifest.json'} could not be written: No space left on device" in (
        result.output)
    assert (out / "lens" / "result.json").is_file()


def _refuse(monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """The disk refuses ``what``: the contrib folder's files, or the manifest and the report."""
    from lensdiv.core import results
    from lensdiv.run import outcome, report

    if what == "contrib":
        original = results._atomic.__exit__

        def full_disk(self: Any, exc_type: Any, *rest: Any) -> None:
            if exc_type is None and self.path.parent.name == "contrib":
                original(self, OSError, None, None)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))
            original(self, exc_type, *rest)

        monkeypatch.setattr(results._atomic, "__exit__", full_disk)
        return

    def too_big(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr(outcome, "write_json_atomic", too_big)
    monkeypatch.setattr(report, "report_html", too_big)


@pytest.mark.parametrize("what", ["contrib", "manifest"])
def test_files_not_written_are_errors_on_stderr_and_the_last_line_says_which(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str
) -> None:
    """Issue 29, point 7: "analyzer failed" and "error:" lines go to standard error, and the
    last line says what was written and what was not (through the CLI and the API)."""
    _refuse(monkeypatch, what)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens,contrib", "--out", str(out), *FAST)
    assert "Traceback" not in result.output and result.exit_code == 1, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"results in {out} are incomplete: not written: "), last
    assert "one folder per analyzer" not in last
    written = last.split("; written: ")[1]
    assert "lens/" in written.split(", ")
    if what == "contrib":
        assert "analyzer 'contrib' failed" in result.stderr, result.stderr
        assert "failed" not in result.stdout and "No space left" not in result.stdout
        assert "contrib/result.json" in last and "contrib/contrib.csv" in last
        assert "manifest.json" in written and "report.html" in written
        assert "contrib/" not in written and (out / "manifest.json").is_file()
    else:
        assert f"error: {out / 'manifest.json'} could not be written: File too large" in (
            result.stderr.replace("\n", " "))
        assert "error:" not in result.stdout and "File too large" not in result.stdout
        assert "not written: manifest.json, report.html;" in last
        assert "contrib/" in written.split(", ")
        assert not (out / "manifest.json").exists() and not (out / "report.html").exists()
    # The API: the run says the same.
    run = lensdiv.analyze("toy", plugins="lens,contrib", out=tmp_path / "api", **API_FAST)
    done = run.written()
    assert done is not None and not done.complete
    assert done.line() == last.replace(str(out), str(tmp_path / "api"))
    if what == "contrib":
        assert {"contrib/result.json", "contrib/contrib.csv"} <= set(done.missing)
        assert "contrib" in run.errors and "lens/" in done.files
    else:
        assert done.missing == ("manifest.json", "report.html") and run.unwritten
        assert set(run.unwritten) == {"manifest.json", "report.html"}
    # A run whose files are all there says so as before.
    monkeypatch.undo()
    ok = invoke("analyze", "toy", "-p", "lens", "--out", str(tmp_path / "ok"), *FAST)
    assert ok.exit_code == 0 and ok.stderr.strip() == "", ok.output
    assert ok.stdout.strip().splitlines()[-1] == (
        f"results in {tmp_path / 'ok'} (report.html, manifest.json, one folder per analyzer)")
    assert lensdiv.analyze("toy", plugins="lens", out=tmp_path / "ok2", **API_FAST).written() == (
        lensdiv.Run(out=tmp_path / "ok2", manifest=manifest(tmp_path / "ok2")).written())


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_a_file_size_limit_says_what_was_and_was_not_written(tmp_path: Path) -> None:
    """Issue 29, point 7, for real: under `ulimit -f` (20 kB) the plots and the report do not
    fit; every error is on standard error and the last line lists exactly what is on disk."""
    import resource

    lensdiv.load_model("toy", progress=False)  # trained and cached before the limit
    limit = 20_000
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "lensdiv", "analyze", "toy", "-p", "lens,contrib", "--out",
         str(out), *FAST],
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "LENSDIV_TOKEN_CACHE": "off"},
    )  # fmt: skip
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 1, proc.stderr
    assert "File too large" in proc.stderr and "ulimit -f" in proc.stderr
    assert "File too large" not in proc.stdout and "error:" not in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    head = f"results in {out} are incomplete: not written: "
    assert last.startswith(head), last
    missing, written = (part.split(", ") for part in last[len(head):].split("; written: "))
    assert "report.html" in missing and "manifest.json" in written
    assert all(not (out / name).exists() for name in missing), missing
    assert all((out / name.split(" (")[0]).exists() for name in written), written
    assert all(f"{name}/result.json" in manifest(out)["analyzers"][name]["files"]
               for name in ("lens", "contrib"))


def test_report_plots_into_an_unwritable_run_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert invoke("analyze", "toy", "-p", "lens", "--out", str(out), *FAST).exit_code == 0
    png = next((out / "lens").glob("*.png"))
    png.unlink()
    png.mkdir()  # a folder where the PNG goes: the write fails whoever we are
    result = invoke("report", str(out), "--plots")
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output
    assert f"error: lens: could not write 1 file(s) in {out / 'lens'}: {png.name}" in result.output
    assert (out / "lens" / "result.json").is_file()


def test_an_unwritable_toy_cache_is_found_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    monkeypatch.setenv("LENSDIV_CACHE", str(cache))
    t0 = time.perf_counter()
    assert_mistake(invoke("analyze", "toy:d1-w32", "-p", "lens", *FAST),
                   f"cannot cache toy models in {cache}", "is a file", "LENSDIV_CACHE")
    with pytest.raises(ModelLoadError) as err:
        lensdiv.load_model("toy:d1-w32", progress=False)
    assert_api_mistake(err, "cannot cache toy models", "LENSDIV_CACHE")
    assert time.perf_counter() - t0 < 20  # no model was trained


def test_a_non_empty_out_needs_overwrite_which_clears_the_old_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert invoke("analyze", "toy", "-p", "lens,contrib", "--out", str(out), *FAST).exit_code == 0
    (out / "notes.txt").write_text("mine")
    assert_mistake(invoke("analyze", "toy", "-p", "lens", "--out", str(out), *FAST),
                   "already holds a run", "manifest.json")
    with pytest.raises(OptionError, match="--overwrite"):
        lensdiv.analyze("toy", plugins="lens", out=out, **API_FAST)
    result = invoke("analyze", "toy", "-p", "lens", "--out", str(out), "--overwrite", *FAST)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "lens", "manifest.json", "notes.txt", "prompt_views.json", "report.html"]
    assert not (out / "contrib").exists()
    assert list(manifest(out)["analyzers"]) == ["lens"]


def test_overwrite_never_removes_a_folder_lensdiv_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "lens").mkdir()
    (tmp_path / "lens" / "thesis.tex").write_text("mine")
    assert_mistake(invoke("analyze", "toy", "-p", "lens", "--out", str(tmp_path), "--overwrite",
                          *FAST), "lens/ that is no lensdiv result")
    assert (tmp_path / "lens" / "thesis.tex").read_text() == "mine"


# == 3. a plugin failing outside update/finalize ==================================================


@pytest.mark.parametrize("where", ["hooks", "examples", "setup", "init", "update", "finalize"])
def test_a_plugin_failing_in_any_hook_leaves_the_others_finished(where: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = lensdiv.analyze("toy", plugins=["lens", Broken(where=where)], out=out, **API_FAST)
    assert f"boom in {where}" in run.errors["broken"] and "\n" not in run.errors["broken"]
    data = manifest(out)
    assert data["status"] == "partial"
    assert data["analyzers"]["broken"]["status"] == "failed"
    assert data["analyzers"]["lens"]["status"] == "complete"
    assert_kept(out, "lens")


def test_a_plugin_raising_in_init_through_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lensdiv.analyzers.contrib import Contribution

    def broken(self: Any, info: ModelInfo) -> Stats:
        raise RuntimeError("init exploded")

    monkeypatch.setattr(Contribution, "init", broken)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "-p", "lens,contrib", "--out", str(out), *FAST)
    assert "Traceback" not in result.output
    assert result.exit_code == 1
    assert "analyzer 'contrib' failed: RuntimeError: init exploded (init)" in result.output
    assert manifest(out)["status"] == "partial"
    assert_kept(out, "lens")


def test_a_plot_that_names_a_missing_table_keeps_the_numbers(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run = lensdiv.analyze("toy", plugins=["lens", BadPlot()], out=out, **API_FAST)
    error = run.errors["badplot"]
    assert "missing.png" in error and "cannot draw" in error and "\n" not in error
    entry = manifest(out)["analyzers"]["badplot"]
    assert entry["status"] == "failed" and entry["not_written"] == ["badplot/missing.png"]
    assert entry["files"] == ["badplot/result.json", "badplot/t.csv"]
    assert (out / "badplot" / "result.json").is_file() and (out / "badplot" / "t.csv").is_file()
    assert_kept(out, "lens")
    assert manifest(out)["status"] == "partial"


# == 4. devices =====================================================================================


@pytest.mark.parametrize("device", ["cuda:99", "tpu", "nonsense", "mps", "cuda"])
def test_devices_this_machine_lacks(device: str) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    assert_mistake(invoke("analyze", "toy", "--device", device, *FAST), f"{device!r}")
    with pytest.raises(ModelLoadError) as err:
        lensdiv.analyze("toy", device=device, **API_FAST)
    assert_api_mistake(err, repr(device))
    with pytest.raises(ModelLoadError):
        lensdiv.load_model("toy", device=device)


# == 5. damaged runs ================================================================================


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[1, 2]", "a JSON array"),
        ('{"analyzers": [1]}', "'analyzers' is a JSON array"),
        ('{"analyzers": {"lens": 5}}', "entry of 'lens'"),
        ('{"model": "toy", "analyzers": {}}', "'model' is a JSON string"),
    ],
)
def test_report_on_a_manifest_of_the_wrong_shape(text: str, needle: str, tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(text)
    assert_mistake(invoke("report", str(tmp_path)), needle)
    with pytest.raises(ResultError):
        lensdiv.load_run(tmp_path)


def test_report_on_a_damaged_result(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert invoke("analyze", "toy", "-p", "lens", "--out", str(out), *FAST).exit_code == 0
    (out / "lens" / "result.json").write_text('{"analyzer": "lens", "tables": {"x": {}}}')
    assert_mistake(invoke("report", str(out)), "lens/result.json", "not a lensdiv result")
    # A result without tables renders; its plots (naming tables) cannot be drawn: one line.
    (out / "lens" / "result.json").write_text(
        json.dumps({"analyzer": "lens", "plots": [{"kind": "line", "name": "p", "title": "",
                                                   "source": "gone", "x": "a", "y": ["b"]}]})
    )
    result = invoke("report", str(out), "--plots")
    assert "Traceback" not in result.output and result.exit_code == 2
    assert "p.png (cannot draw: the result has no table 'gone' (it has none))" in result.output


# == 6. the Python API: in-memory data and wrong types ===========================================


def test_in_memory_data_works(tmp_path: Path) -> None:
    docs = ["the cat sat on the mat. " * 8, "one two three four five six seven. " * 6]
    run = lensdiv.analyze("toy", data=docs, plugins="lens", **API_FAST)
    assert run.ok and run.manifest["data"]["source"] == "memory:2 documents"
    assert len(run.manifest["data"]["sha256"]) == 64
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "one.txt").write_text(docs[0])
    (tmp_path / "docs" / "two.txt").write_text(docs[1])
    from_files = lensdiv.analyze("toy", data=tmp_path / "docs", plugins="lens", **API_FAST)
    assert run["lens"].tables["lens"].columns == from_files["lens"].tables["lens"].columns
    inline = lensdiv.analyze("toy", data="text:" + docs[0], plugins="lens", **API_FAST)
    (tmp_path / "one.txt").write_text(docs[0])
    from_file = lensdiv.analyze("toy", data=tmp_path / "one.txt", plugins="lens", **API_FAST)
    assert inline["lens"].tables["lens"].columns == from_file["lens"].tables["lens"].columns
    tokens = torch.randint(4, 200, (3, 20))
    run = lensdiv.analyze("toy", data=tokens, plugins="lens", **API_FAST)
    assert run.ok and run.manifest["timings"]["tokens"] == 60  # rows used as they are
    assert run.manifest["data"]["source"] == "memory:tokens[3, 20]"


def test_a_plain_string_is_a_path_never_text() -> None:
    with pytest.raises(DataError) as err:
        lensdiv.analyze("toy", data="the cat sat on the mat", plugins="lens", **API_FAST)
    assert_api_mistake(err, "does not exist", "text:")


# The API as users call it: the tests run lensdiv under a runtime type checker (beartype, through
# jaxtyping's import hook), which would refuse these arguments before lensdiv's own checks. So
# the cases run in one plain Python process; each prints one JSON line.
API_MISUSE = {
    "plugins=None": "plugins must be",
    "plugins=42": "plugins must be",
    "plugins=['lens', 42]": "plugins holds 42",
    "options={'lens': 5}": "options['lens']",
    "options=[('lens', {})]": "options must map",
    "max_tokens='1024'": "--max-tokens must be a whole number, not '1024'",
    "seq_len=64.5": "--seq-len must be a whole number, not 64.5",
    "batch_size=True": "--batch-size must be a whole number, not True",
    "out=42": "out must be a folder path",
    "progress='no'": "progress must be True or False",
    "data=42": "cannot read data from 42",
    "data=['text', None]": "data[1] is None",
    "data=torch.rand(2, 8)": "integer ids",
    "options={'lens': {'top_k': 2.5}}": "lens.top_k expects int, got 2.5",
    "options={'lens': {'top_k': True}}": "lens.top_k expects int, got True",
    "plugins=[LogitLens(top_k=True)]": "lens.top_k expects int, got True",
    "data=float('nan')": "cannot read data from nan",
    "seed=None": "--seed must be a whole number",
    "trust_remote_code=1": "trust_remote_code must be True or False",
    # Calls of their own (not analyze):
    "lensdiv.get_analyzer(None)": "an analyzer name must be text, not None",
    "lensdiv.load_run(42)": "a run folder is a path, not 42",
    "lensdiv.load_model('toy', device=1.5)": "device must be a name",
}
API_WORKS = {
    "plugins=[LogitLens], options={'lens': {'top_k': 3}}": 3,
    "plugins=[LogitLens(top_k=2.0)]": 2,  # an integral float is converted
    "plugins=LogitLens(top_k=4)": 4,
}
_API_SCRIPT = """
import json, sys, torch, lensdiv
from lensdiv.analyzers.lens import LogitLens
base = dict(plugins="lens", max_tokens=64, seq_len=16, batch_size=4, progress=False)
for case in json.loads(sys.argv[1]):
    try:
        if case.startswith("lensdiv."):
            print(json.dumps([case, "ok", repr(eval(case))[:50]]), flush=True)
            continue
        run = lensdiv.analyze("toy", **{**base, **eval(f"dict({case})")})
        print(json.dumps([case, "ok", run["lens"].meta["options"]["top_k"]]), flush=True)
    except lensdiv.LensdivError as err:
        print(json.dumps([case, "LensdivError", str(err)]), flush=True)
    except Exception as err:
        print(json.dumps([case, type(err).__name__, str(err)]), flush=True)
"""


@pytest.fixture(scope="module")
def api_outcomes() -> dict[str, tuple[str, Any]]:
    cases = json.dumps([*API_MISUSE, *API_WORKS])
    done = subprocess.run([sys.executable, "-c", _API_SCRIPT, cases], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    return {case: (kind, value) for case, kind, value in lines}


@pytest.mark.parametrize("case", list(API_MISUSE))
def test_api_misuse_is_a_lensdiv_error(case: str, api_outcomes: dict[str, tuple[str, Any]]) -> None:
    kind, message = api_outcomes[case]
    assert kind == "LensdivError", (kind, message)
    assert API_MISUSE[case] in message and "\n" not in message, message


@pytest.mark.parametrize("case", list(API_WORKS))
def test_an_analyzer_class_or_instance_works_like_its_name(
    case: str, api_outcomes: dict[str, tuple[str, Any]]
) -> None:
    assert api_outcomes[case] == ("ok", API_WORKS[case])


# == 7. silent nonsense becomes an error ===========================================================


def test_a_model_folder_without_a_tokenizer(local_models: dict[str, Path]) -> None:
    assert_mistake(invoke("analyze", str(local_models["no_tokenizer"]), "-p", "lens", *FAST),
                   "no usable tokenizer")
    # Token ids need no tokenizer.
    run = lensdiv.analyze(local_models["no_tokenizer"], data=torch.randint(4, 200, (2, 16)),
                          plugins="lens", **API_FAST)
    assert run.ok


@pytest.mark.parametrize("value,kind", [(None, "null"), (12345, "a number (12345)"),
                                        ({"a": 1}, "an object")])
def test_jsonl_values_that_are_not_text(value: Any, kind: str, tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "fine text"}) + "\n" + json.dumps({"text": value}) + "\n")
    out = tmp_path / "run"
    assert_mistake(invoke("analyze", "toy", "--data", str(data), "--out", str(out), *FAST),
                   "d.jsonl line 2", kind)
    assert not out.exists()


def test_task_files_with_values_that_are_not_text(tmp_path: Path) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"prompt": None, "answer": "x", "grade": 1}) + "\n")
    assert_mistake(invoke("analyze", "toy", "-p", "depth-score", "-O",
                          f"depth-score.tasks={tasks}", *FAST), "t.jsonl line 1", "'prompt'", "null")
    labels = tmp_path / "b.jsonl"
    labels.write_text(json.dumps({"prompt": 12345, "label": "a"}) + "\n")
    assert_mistake(invoke("analyze", "toy", "-p", "bias", "-O", f"bias.tasks={labels}", *FAST),
                   "b.jsonl line 1", "'prompt'", "a number")


def test_top_k_beyond_the_vocabulary() -> None:
    assert_mistake(invoke("analyze", "toy", "-p", "lens", "-O", "lens.top_k=100000", *FAST),
                   "lens.top_k=100000", "260")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_options(value: str) -> None:
    assert_mistake(invoke("analyze", "toy", "-p", "linmap", "-O", f"linmap.ridge={value}", *FAST),
                   "linmap.ridge", "finite")
    with pytest.raises(OptionError, match="finite"):
        lensdiv.analyze("toy", plugins="linmap", options={"linmap": {"ridge": float(value)}},
                        **API_FAST)


def test_data_smaller_than_an_analyzer_needs(tmp_path: Path) -> None:
    assert_mistake(invoke("analyze", "toy", "-p", "linmap", "--max-tokens", "20", "--seq-len", "8",
                          "--no-progress"), "linmap needs at least", "--max-tokens 20")
    short = tmp_path / "short.txt"
    short.write_text("just a few words here")
    run = lensdiv.analyze("toy", data=short, plugins="lens,linmap", **API_FAST)
    (warning,) = run["linmap"].warnings
    assert "fewer than the" in warning and not run["lens"].warnings
    assert run.manifest["analyzers"]["linmap"]["warnings"] == [warning]


# == 8. signals =====================================================================================

_SLOW_SAVE = """
import sys, time
from lensdiv.core import results
write = results.Table.to_csv
def slow(self, path):  # saving takes a second per table, so signals arrive while it runs
    print("SAVING", flush=True)
    time.sleep(1.0)
    write(self, path)
results.Table.to_csv = slow
from lensdiv.cli import main
sys.argv = ["lensdiv", *sys.argv[1:]]
main()
"""


def _spawn(args: list[str], script: str | None = None) -> subprocess.Popen[str]:
    command = [sys.executable, "-c", script, *args] if script else [
        sys.executable, "-m", "lensdiv", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "the run never started"
        time.sleep(0.05)


def test_two_ctrl_c_while_saving_keep_every_finished_file(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _spawn(["analyze", "toy", "-p", "lens,depth-score", "--out", str(out), *FAST],
                  _SLOW_SAVE)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "SAVING" in line:
            break
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stdout + stderr, stderr
    assert proc.returncode == 130, stderr
    assert "SIGINT: finishing the results" in stderr and "still writing" in stderr
    data = manifest(out)
    assert data["status"] == "interrupted" and data["signal"] == "SIGINT"
    assert data["analyzers"]["lens"]["status"] == "complete"
    assert data["analyzers"]["depth-score"]["status"] == "interrupted"
    assert_kept(out, "lens")
    assert sorted(data["analyzers"]["lens"]["files"]) == sorted(
        p.relative_to(out).as_posix() for p in (out / "lens").iterdir())


def test_sigterm_keeps_partial_results(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _spawn(["analyze", "toy", "-p", "lens", "--out", str(out),
                   "--max-tokens", "100000000", "--seq-len", "32", "--batch-size", "4",
                   "--no-progress"])
    _wait_for(out / "manifest.json", proc)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert "Traceback" not in stdout + stderr, stderr
    assert proc.returncode == 143, stderr
    data = manifest(out)
    assert data["status"] == "interrupted" and data["signal"] == "SIGTERM"
    assert data["analyzers"]["lens"]["status"] == "partial"
    assert_kept(out, "lens")
    assert json.loads((out / "lens" / "result.json").read_text())["meta"]["partial"] is True


def test_a_signal_in_a_batch_takes_effect_after_it(tmp_path: Path) -> None:
    """In-process, with real signals: SIGTERM in the middle of an update waits for the batch."""

    @dataclass(frozen=True)
    class Kill(Broken):
        name = "kill"
        where: str = ""

        def update(self, state: Stats, step: Any) -> None:
            if step.batch.index == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            state.add("n", step.batch.n_tokens)  # still counted: the batch finishes
            state.add("batches", 1)

        def finalize(self, state: Stats, info: ModelInfo) -> Result:
            assert int(state["batches"]) == 2
            return super().finalize(state, info)

    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    run = lensdiv.analyze("toy", plugins=["lens", Kill()], out=out, **API_FAST)
    assert run.manifest["status"] == "interrupted" and run.manifest["signal"] == "SIGTERM"
    assert run["kill"].table()["n"][0] == run.manifest["timings"]["tokens"]
    assert_kept(out, "lens")
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


# == 9. messages that point the right way ===========================================================


def test_empty_data_is_an_error_in_every_command(tmp_path: Path) -> None:
    # Before any model loads or trains: an empty --data never means the built-in corpus.
    for args in (["analyze", "toy"], ["scaling", "family", "toy:d2,toy:d4"]):
        assert_mistake(invoke(*args, "--data", "", "--out", str(tmp_path / args[0])),
                       "the data source is empty")


def test_seq_len_and_max_tokens_name_themselves() -> None:
    assert_mistake(invoke("analyze", "toy", "--seq-len", "1", "--no-progress"),
                   "--seq-len 1 is too short")
    assert_mistake(invoke("analyze", "toy", "--max-tokens", "1", "--no-progress"),
                   "--max-tokens 1 is too few")


@pytest.mark.parametrize(
    "args,needle",
    [
        (["analyze", "--seq-len", "x"], "'--seq-len'"),
        (["analyze", "--nope"], "--nope"),
        (["report"], "Missing argument"),
        (["toy", "zzz"], "No such command 'zzz'"),
    ],
)
def test_usage_errors_say_first_what_was_wrong(args: list[str], needle: str) -> None:
    result = invoke(*args)
    assert_mistake(result, needle)
    assert "Usage:" in result.output  # typer's usage still follows


def test_no_progress_silences_every_bar(
    tiny_dirs: dict[str, Path], capfd: pytest.CaptureFixture[str]
) -> None:
    lensdiv.analyze(tiny_dirs["gpt2"], plugins="linmap", max_tokens=256, seq_len=32,
                    options={"linmap": {"target": str(tiny_dirs["gpt2"])}}, progress=False)
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "%|" not in err, err


# == 10. what one analyzer cannot handle ============================================================


def test_softcapped_logits_skip_bias_and_submod(local_models: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = invoke("analyze", str(local_models["softcap"]), "-p", "lens,bias,submod",
                    "--out", str(out), *FAST)
    assert "Traceback" not in result.output
    assert result.exit_code == 0, result.output
    assert "analyzer 'bias' skipped:" in result.output and "softcap" in result.output
    data = manifest(out)
    assert data["status"] == "complete"
    for name in ("bias", "submod"):
        assert data["analyzers"][name]["status"] == "skipped"
        assert "non-linearly" in data["analyzers"][name]["reason"]
    assert_kept(out, "lens")
    # Only analyzers that cannot run: a mistake, named before any work.
    with pytest.raises(UnsupportedModelError, match="no selected analyzer supports"):
        lensdiv.analyze(local_models["softcap"], plugins="bias,submod", **API_FAST)


def test_an_analyzer_may_declare_itself_unsupported() -> None:
    run = lensdiv.analyze("toy", plugins=["lens", NeedsSomethingElse()], **API_FAST)
    assert run.ok and "frobnicator" in run.skipped["picky"]


@pytest.fixture()
def claimed_lens(tmp_path: Path) -> Any:
    """An installed third-party distribution whose plugin claims the built-in name ``lens``."""
    (tmp_path / "fakelens.py").write_text(
        "from dataclasses import dataclass\n"
        "from lensdiv.analyzers.lens import LogitLens\n\n"
        "@dataclass(frozen=True)\nclass Lens(LogitLens):\n    name = 'lens'\n"
    )
    info = tmp_path / "lensdiv_fakelens-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lensdiv-fakelens\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[lensdiv.plugins]\nlens = fakelens:Lens\n")
    sys.path.insert(0, str(tmp_path))
    default_registry.cache_clear()
    yield
    sys.path.remove(str(tmp_path))
    sys.modules.pop("fakelens", None)
    default_registry.cache_clear()


def test_a_plugin_claiming_a_builtin_name_is_refused(claimed_lens: None, tmp_path: Path) -> None:
    listing = invoke("plugins", "list")
    assert listing.exit_code == 0
    (warning,) = [line for line in listing.output.splitlines() if "fakelens" in line]
    assert "lensdiv-fakelens 1.0" in warning and f"lensdiv {lensdiv.__version__}" in warning
    assert "is a built-in analyzer" in warning and "refused" in warning
    assert lensdiv.get_analyzer("lens") is LogitLens
    result = invoke("analyze", "toy", "-p", "lens", "--out", str(tmp_path / "o"), *FAST)
    assert result.exit_code == 0, result.output
    with pytest.raises(PluginError, match="unknown analyzer"):
        lensdiv.get_analyzer("fakelens")
