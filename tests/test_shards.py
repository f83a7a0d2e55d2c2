"""Shards without a launcher: ``--shard i/n`` + ``lensdiv merge`` equal one run; mismatched,
missing or multi-pass shards are refused in one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import LensdivError, ResultError, StateError
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec
from lensdiv.run.feed import every_nth
from lensdiv.run.merge import first_difference, merge_runs
from lensdiv.run.runner import analyze
from lensdiv.run.shards import parse_shard
from lensdiv.testing.contract import assert_results_close
from lensdiv.testing.models import save_tiny_model

# Every single-pass analyzer (submod with one greedy step is one pass).
SINGLE_PASS = "lens,contrib,skip,depth-score,bias,submod,dynamics"
OPTIONS = {
    "depth-score": {"per_grade": "3", "batch_size": "4"},
    "submod": {"samples": "8", "greedy": "1"},
    "skip": {"splits": "2"},
}
# 3 corpus batches: shard 0 of 2 gets batches 0 and 2, shard 1 batch 1.
SPEC = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("shards") / "llama")


@pytest.fixture(scope="module")
def shards(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("run")
    for index in range(2):
        analyze(str(llama_dir), data=SPEC, plugins=SINGLE_PASS, options=OPTIONS,
                out=root / f"shard-{index}", shard=f"{index}/2", progress=False)
    return [root / "shard-0", root / "shard-1"]


def test_merged_shards_equal_one_run(llama_dir: Path, shards: list[Path], tmp_path: Path) -> None:
    one = analyze(str(llama_dir), data=SPEC, plugins=SINGLE_PASS, options=OPTIONS,
                  progress=False)
    merged = merge_runs(list(reversed(shards)), tmp_path / "all")  # any order
    assert not one.errors and not merged.errors
    assert sorted(merged.results) == sorted(one.results) == sorted(SINGLE_PASS.split(","))
    for name, result in one.results.items():
        assert_results_close(merged[name], result, rtol=1e-6, what=name)
    manifest = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["merged"]["shards"] == 2
    assert manifest["timings"]["tokens"] == one.manifest["timings"]["tokens"]
    assert (tmp_path / "all" / "lens" / "result.json").is_file()


def test_a_shard_saves_states_not_results(shards: list[Path]) -> None:
    manifest = json.loads((shards[1] / "manifest.json").read_text())
    assert manifest["shard"] == {"index": 1, "count": 2}
    assert manifest["status"] == "complete"
    assert manifest["model_info"]["n_layers"] == 3
    entry = manifest["analyzers"]["lens"]
    assert (entry["status"], entry["state"]) == ("saved", "lens")
    assert sorted(p.name for p in (shards[1] / "lens").iterdir()) == [
        "state.json", "state.safetensors"]
    # Shard 1 of 2 ran one of the three corpus batches (2 rows, 48 tokens).
    assert manifest["timings"]["tokens"] == 48
    assert float(Stats.load(shards[1] / "contrib")["n"]) > 0


def test_the_shards_partition_the_batches() -> None:
    batches = [Batch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                     index=i) for i in range(7)]
    parts = [[b.index for b in every_nth(batches, i, 3)] for i in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    assert list(every_nth([], 0, 2)) == []


@pytest.mark.parametrize("text, expected", [("3/16", (3, 16)), (" 0/1 ", (0, 1)), ((1, 2), (1, 2)),
                                            (None, None)])
def test_parse_shard(text: Any, expected: Any) -> None:
    assert parse_shard(text) == expected


@pytest.mark.parametrize("text, message", [("3", "bad shard '3'"), ("a/b", "bad shard"),
                                           ("2/2", "shard 2/2 does not exist"),
                                           ("0/0", "shard 0/0 does not exist")])
def test_bad_shards_are_refused(text: str, message: str) -> None:
    with pytest.raises(LensdivError, match=message):
        parse_shard(text)


def test_multi_pass_analyzers_are_refused_with_a_pointer_to_torchrun(llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    for plugin in ("linmap", "patch", "submod"):
        with pytest.raises(LensdivError, match=f"analyzer '{plugin}' needs [0-9]+ passes") as err:
            analyze(str(llama_dir), data=SPEC, plugins=plugin, shard="0/2", out=tmp_path,
                    progress=False)
        assert "torchrun --nproc-per-node" in str(err.value)
    assert not (tmp_path / "manifest.json").exists()  # refused before any work


def _copy_shard(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of a shard folder with some manifest entries changed."""
    import shutil

    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        entry = manifest
        for p in parents:
            entry = entry[p]
        entry[key] = value
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_merge_names_the_first_difference(shards: list[Path], tmp_path: Path) -> None:
    other = _copy_shard(shards[1], tmp_path / "other", data__max_tokens=999)
    with pytest.raises(StateError) as err:
        merge_runs([shards[0], other])
    message = str(err.value)
    assert message.startswith(f"the shards disagree on data.max_tokens: 129 in {shards[0]}, "
                              f"999 in {other}")
    seed = _copy_shard(shards[1], tmp_path / "seed", seed=1)
    with pytest.raises(StateError, match="disagree on seed: 0 in .* 1 in"):
        merge_runs([shards[0], seed])
    options = _copy_shard(shards[1], tmp_path / "options",
                          analyzers__lens__options__top_k=3)
    with pytest.raises(StateError, match="disagree on analyzers.lens.options.top_k: 5 in"):
        merge_runs([shards[0], options])
    versions = _copy_shard(shards[1], tmp_path / "versions", versions__torch="0.0")
    with pytest.raises(StateError, match="disagree on versions.torch"):
        merge_runs([shards[0], versions])
    placed = _copy_shard(shards[1], tmp_path / "placed", model__device="cuda:3")
    assert not merge_runs([shards[0], placed]).errors  # where a shard ran does not matter


@pytest.mark.parametrize("case, message", [
    ("missing", "shard 1/2 is missing"),
    ("twice", "shard 0/2 is given twice"),
    ("unfinished", "did not finish (status 'interrupted')"),
    ("count", "is shard 1 of 3, the others of 2"),
])
def test_merge_refuses_incomplete_sets(shards: list[Path], tmp_path: Path, case: str,
                                       message: str) -> None:
    folders = {
        "missing": lambda: [shards[0]],
        "twice": lambda: [shards[0], shards[0], shards[1]],
        "unfinished": lambda: [shards[0], _copy_shard(shards[1], tmp_path / "s",
                                                      status="interrupted")],
        "count": lambda: [shards[0], _copy_shard(shards[1], tmp_path / "s", shard__count=3)],
    }[case]()
    with pytest.raises(StateError, match=re.escape(message)):
        merge_runs(folders)


def test_an_analyzer_failed_in_a_shard_fails_the_merge_alone(shards: list[Path],
                                                            tmp_path: Path) -> None:
    bad = _copy_shard(shards[1], tmp_path / "bad", status="failed",
                      analyzers__contrib__status="failed",
                      analyzers__contrib__error="ValueError: boom (batch 1)")
    run = merge_runs([shards[0], bad], tmp_path / "all")
    assert run.errors == {"contrib": "shard 1: ValueError: boom (batch 1)"}
    assert "lens" in run.results and "contrib" not in run.results
    manifest = json.loads((tmp_path / "all" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert manifest["analyzers"]["contrib"]["status"] == "failed"


def test_merge_refuses_a_folder_that_is_no_shard(shards: list[Path], tmp_path: Path) -> None:
    with pytest.raises(ResultError, match="is not a lensdiv run folder"):
        merge_runs([tmp_path])
    plain = _copy_shard(shards[0], tmp_path / "plain")
    manifest = json.loads((plain / "manifest.json").read_text())
    del manifest["shard"]
    (plain / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StateError, match="is not a shard"):
        merge_runs([plain, shards[1]])
    # A damaged manifest is one line naming the file (read as `lensdiv report` reads one).
    for text, message in [("{", "is not valid JSON"), ("[]", "is not a lensdiv manifest"),
                          ('{"analyzers": []}', "'analyzers' is a JSON array")]:
        (plain / "manifest.json").write_text(text)
        with pytest.raises(ResultError, match=message):
            merge_runs([plain, shards[1]])


def test_first_difference() -> None:
    assert first_difference({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1, 2]}) is None
    assert first_difference({"a": 1, "b": [1, 2]}, {"a": 1, "b": [1, 3]}) == ("b[1]", 2, 3)
    assert first_difference({"a": 1}, {"a": 1, "c": 2}) == ("c", "(missing)", 2)


def test_cli_merge_and_its_one_line_error(shards: list[Path], tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "all"
    result = runner.invoke(app, ["merge", *map(str, shards), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 shards merged" in result.output and (out / "manifest.json").is_file()
    other = _copy_shard(shards[1], tmp_path / "other", data__seq_len=32)
    result = runner.invoke(app, ["merge", str(shards[0]), str(other), "--out", str(out / "x")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the shards disagree on data.seq_len")


def test_cli_shard_run_and_refusals(llama_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "s0"
    result = runner.invoke(app, ["analyze", str(llama_dir), "--plugins", "contrib", "--seq-len",
                                 "24", "--max-tokens", "60", "--shard", "0/2", "--out", str(out),
                                 "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "shard 0/2: states in" in result.output and "lensdiv merge" in result.output
    for args, message in ((["--shard", "5/2"], "error: shard 5/2 does not exist"),
                          (["--plugins", "linmap", "--shard", "0/2"], "error: analyzer 'linmap'")):
        result = runner.invoke(app, ["analyze", str(llama_dir), *args, "--out",
                                     str(tmp_path / "x"), "--no-progress"])
        assert result.exit_code == 2
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(message), result.output
