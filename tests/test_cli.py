"""The command line: every bad input is one line and exit code 2; good runs write everything."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lensdiv.cli import app

runner = CliRunner()
FAST = ["--max-tokens", "256", "--seq-len", "32", "--batch-size", "4", "--no-progress"]


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def assert_user_error(result, *needles: str) -> None:
    text = result.output.strip()
    assert result.exit_code == 2, text
    assert "Traceback" not in text
    assert len(text.splitlines()) == 1, text
    assert text.startswith("error:")
    for needle in needles:
        assert needle in text, text


@pytest.fixture()
def bad_files(tmp_path: Path) -> dict[str, Path]:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n ")
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1") * 10)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"body": "hello"}\n')
    return {"empty": empty, "blank": blank, "binary": binary, "latin": latin, "jsonl": rows}


def test_no_such_model(tmp_path: Path) -> None:
    assert_user_error(invoke("analyze", "no-such-model", "--out", str(tmp_path / "o"), *FAST),
                      "no-such-model", "toy")


def test_missing_model_folder(tmp_path: Path) -> None:
    assert_user_error(invoke("analyze", str(tmp_path / "nodir"), *FAST), "does not exist")


def test_folder_without_config(tmp_path: Path) -> None:
    assert_user_error(invoke("analyze", str(tmp_path), *FAST), "config.json")


def test_bad_toy_spec() -> None:
    assert_user_error(invoke("analyze", "toy:dx", *FAST), "toy:d4")


def test_unknown_plugin_suggests() -> None:
    assert_user_error(invoke("analyze", "toy", "--plugins", "nosuch", *FAST), "nosuch", "plugins list")
    assert_user_error(invoke("analyze", "toy", "--plugins", "lenz", *FAST), "did you mean 'lens'")


def test_missing_data() -> None:
    assert_user_error(invoke("analyze", "toy", "--data", "missing.txt", *FAST), "missing.txt", "does not exist")


@pytest.mark.parametrize("kind,needle", [("empty", "empty"), ("blank", "empty"),
                                         ("binary", "binary"), ("latin", "UTF-8")])
def test_bad_data_files(bad_files: dict[str, Path], kind: str, needle: str) -> None:
    assert_user_error(invoke("analyze", "toy", "--data", str(bad_files[kind]), *FAST), needle)


def test_jsonl_missing_field(bad_files: dict[str, Path]) -> None:
    assert_user_error(invoke("analyze", "toy", "--data", str(bad_files["jsonl"]), *FAST),
                      "line 1", "'text'", "--field")


@pytest.mark.parametrize("option,needle", [("lens.topk=3", "did you mean 'top_k'"),
                                           ("lens.top_k=abc", "expects int"),
                                           ("lens.top_k=0", "top_k"),
                                           ("lens", "ANALYZER.OPTION=VALUE"),
                                           ("contrib.exclude_bos=maybe", "bool")])
def test_bad_options(option: str, needle: str) -> None:
    assert_user_error(invoke("analyze", "toy", "--plugins", "lens,contrib", "-O", option, *FAST), needle)


def test_option_for_unselected_analyzer() -> None:
    assert_user_error(invoke("analyze", "toy", "--plugins", "lens", "-O", "contrib.exclude_bos=false", *FAST),
                      "contrib")


def test_bad_numbers() -> None:
    assert_user_error(invoke("analyze", "toy", "--seq-len", "1", "--no-progress"), "seq-len")
    assert_user_error(invoke("analyze", "toy", "--bos", "sometimes", *FAST), "bos")
    assert_user_error(invoke("analyze", "toy", "--dtype", "float8", *FAST), "dtype")


def test_analyze_writes_everything_and_report_rerenders(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "--plugins", "lens,contrib", "--out", str(out),
                    "-O", "lens.top_k=3", *FAST)
    assert result.exit_code == 0, result.output
    assert "lens" in result.output and "contrib" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert manifest["model"]["spec"] == "toy"
    assert manifest["analyzers"]["lens"]["options"]["top_k"] == 3
    assert manifest["seed"] == 0 and "torch" in manifest["versions"]
    assert manifest["timings"]["tokens"] == 256
    for name in ("lens", "contrib"):
        assert manifest["analyzers"][name]["status"] == "complete"
        folder = out / name
        assert (folder / "result.json").is_file()
        assert list(folder.glob("*.csv")) and list(folder.glob("*.png"))
    for png in out.rglob("*.png"):
        png.unlink()
    report = invoke("report", str(out), "--plots")
    assert report.exit_code == 0, report.output
    assert "complete" in report.output and "top3_overlap" in report.output
    assert list((out / "lens").glob("*.png"))


def test_report_on_a_non_run(tmp_path: Path) -> None:
    assert_user_error(invoke("report", str(tmp_path)), "manifest.json")


def test_plugins_list_and_show() -> None:
    listing = invoke("plugins", "list")
    assert listing.exit_code == 0
    assert re.search(r"lens\s.*logit-lens", listing.output)
    assert "lensdiv" in listing.output
    show = invoke("plugins", "show", "logit-lens")
    assert show.exit_code == 0
    assert re.search(r"-O lens\.top_k\s+5\s+int\s+Size of the top-k", show.output), show.output
    skip = invoke("plugins", "show", "skip")  # choices spelled out, help from the docstring
    assert re.search(r"-O skip\.mode\s+future\s+future\|current\|local", skip.output)
    assert_user_error(invoke("plugins", "show", "nosuch"), "nosuch")


def test_failing_analyzer_does_not_stop_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lensdiv.analyzers.contrib import Contribution

    def broken(self, state, step):
        raise RuntimeError("boom")

    monkeypatch.setattr(Contribution, "update", broken)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "--plugins", "lens,contrib", "--out", str(out), *FAST)
    assert result.exit_code == 1
    assert "boom" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["analyzers"]["lens"]["status"] == "complete"
    assert manifest["analyzers"]["contrib"]["status"] == "failed"
    assert "boom" in manifest["analyzers"]["contrib"]["error"]
    assert (out / "lens" / "result.json").is_file()
    assert not (out / "contrib").exists()


def test_interrupt_keeps_partial_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lensdiv.analyzers.contrib import Contribution

    calls = {"n": 0}
    original = Contribution.update

    def interrupt_on_third(self, state, step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        original(self, state, step)

    monkeypatch.setattr(Contribution, "update", interrupt_on_third)
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "--plugins", "lens,contrib", "--out", str(out),
                    "--max-tokens", "1024", "--seq-len", "32", "--batch-size", "4", "--no-progress")
    assert result.exit_code == 130
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "interrupted"
    assert manifest["analyzers"]["lens"]["status"] == "partial"
    lens = json.loads((out / "lens" / "result.json").read_text())
    assert lens["meta"]["partial"] is True
    assert 0 < lens["meta"]["tokens"] < 1024


def test_help_does_not_import_heavy_modules() -> None:
    code = ("import sys; from lensdiv.cli import app; from typer.testing import CliRunner;"
            "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output;"
            "heavy = [m for m in ('torch', 'transformer_lens', 'transformers') if m in sys.modules];"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_help_has_examples() -> None:
    for args in (["--help"], ["analyze", "--help"], ["report", "--help"], ["merge", "--help"], ["lens", "--help"],
                 ["plugins", "list", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0
        assert "Example" in result.output


def test_analyze_local_hf_folder_every_architecture(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    for arch, folder in tiny_dirs.items():
        out = tmp_path / arch
        result = invoke("analyze", str(folder), "--plugins", "lens,contrib", "--out", str(out), *FAST)
        assert result.exit_code == 0, f"{arch}: {result.output}"
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["model"]["kind"] == "local"
        assert manifest["status"] == "complete", arch
        lens = json.loads((out / "lens" / "result.json").read_text())
        assert lens["tables"]["lens"]["columns"]["kl"][-1] == pytest.approx(0.0, abs=1e-6), arch


def test_bad_data_mid_stream_keeps_partial_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lensdiv.data import sources

    monkeypatch.setattr(sources, "_SNIFF_BYTES", 256)  # only the head is checked before the run
    data = tmp_path / "rows.jsonl"
    good = "".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(40))
    data.write_text(good + '{"body": "no text field here"}\n')
    out = tmp_path / "run"
    result = invoke("analyze", "toy", "--plugins", "lens", "--data", str(data), "--out", str(out),
                    "--max-tokens", "100000", "--seq-len", "32", "--batch-size", "4", "--no-progress")
    assert_user_error(result, "line 41", "'text'")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "partial" and "line 41" in manifest["error"]
    lens = json.loads((out / "lens" / "result.json").read_text())
    assert lens["meta"]["partial"] is True and lens["meta"]["tokens"] > 0
