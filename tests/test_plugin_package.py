"""The third-party plugin package ``plugins/lensdiv-attention``: install, discover, run, check."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import pip_install

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plugins" / "lensdiv-attention"
TOL = 1e-6


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed (wheel build, no dependencies, offline) into a private folder."""
    root = tmp_path_factory.mktemp("plugin")
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the repository.
    source = root / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = root / "site"
    pip_install(source, target)
    assert (target / "lensdiv_attention" / "__init__.py").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    # Wide enough that rich does not wrap the "provided by" cell of `plugins list`.
    env["COLUMNS"] = "250"
    return env


def _lensdiv(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lensdiv", *args], capture_output=True,
                          text=True, env=_env(site), cwd=ROOT, timeout=300)


def test_plugins_list_shows_provider(site: Path) -> None:
    proc = _lensdiv(site, "plugins", "list")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "attn-entropy" in line]
    assert rows, proc.stdout
    assert "lensdiv-attention 0.1.0" in rows[0]
    assert "attent" in rows[0]
    assert "failed to load" not in proc.stdout
    assert "attn-entropy" not in proc.stderr  # no registry warning about it


def test_analyze_writes_result(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _lensdiv(site, "analyze", "toy", "--plugins", "attn-entropy,lens", "--max-tokens",
                    "512", "--seq-len", "64", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    folder = out / "attn-entropy"
    data = json.loads((folder / "result.json").read_text())
    assert data["analyzer"] == "attn-entropy"
    assert data["summary"]
    assert data["meta"]["options"] == {"exclude_bos": True}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["analyzers"]["attn-entropy"]["status"] == "complete"
    n_layers = manifest["model"]["n_layers"]

    with open(folder / "attn_entropy.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == n_layers
    assert {"layer", "entropy", "norm_entropy", "bos_mass", "max_entropy_head",
            "min_entropy_head"} <= set(rows[0])
    for plot in data["plots"]:
        assert (folder / f"{plot['name']}.png").stat().st_size > 0
    assert {p["kind"] for p in data["plots"]} == {"heatmap", "line"}
    assert any(p["kind"] == "heatmap" and p["source"] == "entropy" for p in data["plots"])

    entropy, norm, bos = (data["arrays"][k] for k in ("entropy", "norm_entropy", "bos_mass"))
    assert len(entropy) == len(bos) == n_layers
    n_heads = len(entropy[0])
    for layer in range(n_layers):
        assert len(entropy[layer]) == len(bos[layer]) == n_heads
        for head in range(n_heads):
            assert entropy[layer][head] >= -TOL
            # No head can beat uniform attention over the longest context seen.
            assert entropy[layer][head] <= math.log(64) + TOL
            assert -TOL <= norm[layer][head] <= 1 + TOL
            assert -TOL <= bos[layer][head] <= 1 + TOL
        # The table's per-layer values are the head means of the arrays.
        assert float(rows[layer]["entropy"]) == pytest.approx(sum(entropy[layer]) / n_heads)
        most = int(rows[layer]["max_entropy_head"])
        assert entropy[layer][most] == max(entropy[layer])


def test_the_plugins_own_tests_pass(site: Path, tmp_path: Path) -> None:
    """The package carries its own tests (a naive-loop check and lensdiv's contract); they pass
    against the installed plugin, run as its author runs them."""
    tests = tmp_path / "tests"
    shutil.copytree(PACKAGE / "tests", tests)
    shutil.copy(PACKAGE / "pyproject.toml", tmp_path / "pyproject.toml")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
        capture_output=True, text=True, env=_env(site), cwd=tmp_path, timeout=600,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "3 passed" in proc.stdout, proc.stdout


def test_the_packages_data_source_is_found_through_its_entry_point(
    site: Path, tmp_path: Path
) -> None:
    """The package's ``lensdiv.data_sources`` entry: listed in ``--data``'s help, read by a run
    (the same tokens as the same documents in a file), refused with one line when empty."""
    help_text = _lensdiv(site, "analyze", "--help").stdout
    assert "lines:A|B" in " ".join(help_text.split()).replace("│", "")
    docs = ["The cat sat on the mat.", "A dog ran in the park and then sat down."]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokens = {}
    for name, data in (("lines", "lines:" + "|".join(docs)), ("file", str(tmp_path / "docs.jsonl"))):
        out = tmp_path / name
        proc = _lensdiv(site, "analyze", "toy", "--plugins", "lens", "--data", data,
                        "--seq-len", "16", "--out", str(out), "--no-progress")
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        manifest = json.loads((out / "manifest.json").read_text())
        tokens[name] = json.loads((out / "lens" / "result.json").read_text())["meta"]["tokens"]
        assert manifest["data"]["source"] == data
    assert tokens["lines"] == tokens["file"] > 0
    proc = _lensdiv(site, "analyze", "toy", "--plugins", "lens", "--data", "lines:|")
    assert proc.returncode != 0 and "'lines:' holds no text" in proc.stderr
    assert "Traceback" not in proc.stderr
