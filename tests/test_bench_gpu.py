"""``bench/gpu.sh`` without a GPU, and ``bench/gpu_report.py``'s section of bench/README.md (issue
32). The smoke run of every script (``bench/gpu.sh --smoke``, minutes) is not run here: see
bench/README.md, "gpu.sh"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_report.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU here: gpu.sh would run")
def test_gpu_sh_without_a_gpu_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    before = sorted(p.name for p in (ROOT / "bench").iterdir())
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh")], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "bench/gpu.sh: no GPU here (torch sees no CUDA device): nothing run, no *_gpu.json "
        "written"]
    assert sorted(p.name for p in (ROOT / "bench").iterdir()) == before
    bad = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--fast"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "usage: bench/gpu.sh [--smoke]" in bad.stderr


def test_the_readme_section_is_written_from_the_files_present(tmp_path: Path) -> None:
    """Between the markers only; a file present becomes its table, a missing one is named."""
    readme = tmp_path / "README.md"
    readme.write_text("# head\n\n<!-- gpu-figures:start -->\nold\n<!-- gpu-figures:end -->\n\n"
                      "## tail\n")
    (tmp_path / "fused_gpu.json").write_text(json.dumps({
        "model": "2 layers", "dtype": "bfloat16", "tokens": 256, "device": "NVIDIA H100",
        "fused_over_lens": 1.0625, "lens_over_forward": 1.5, "contrib_over_forward": 1.25,
        "seconds": {"lens": 0.5}}))
    (tmp_path / "tuned_gpu.json").write_text(json.dumps({"toy:d8 cpu": {"runs": {
        "baseline": {"seconds": 10.0, "time_vs_baseline": 1.0, "kl_vs_baseline": [1, 1, 1],
                     "within_2pct": True},
        "fast-16": {"seconds": 1.0, "time_vs_baseline": 0.1, "kl_vs_baseline": [0.9, 1.03, 1],
                    "within_2pct": False}}}}))
    done = _report("--folder", str(tmp_path), "--readme", str(readme))
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("# head\n\n<!-- gpu-figures:start -->") and text.endswith("## tail\n")
    assert "old" not in text and "NVIDIA H100" in text
    assert "lens,contrib / lens **1.06**" in text
    assert "| `toy:d8 cpu` | fast-16 | 1 | 0.1 | 1.03 | no |" in text
    assert "floor_gpu.json" in text.split("Not written by this run")[1]  # named as missing
    again = _report("--folder", str(tmp_path), "--readme", str(readme))
    assert again.returncode == 0 and readme.read_text() == text  # replaced, not appended


def test_no_figures_or_no_markers_leave_the_readme_as_it_is(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    empty = _report("--folder", str(tmp_path), "--readme", str(readme))
    assert empty.returncode == 1 and "no *_gpu.json" in empty.stderr
    (tmp_path / "study_gpu.json").write_text(json.dumps({"family": "zoo:depth"}))
    unmarked = _report("--folder", str(tmp_path), "--readme", str(readme))
    assert unmarked.returncode == 1 and "no <!-- gpu-figures:start -->" in unmarked.stderr
    assert readme.read_text() == "no markers\n"


def test_the_bench_readme_has_the_section_gpu_sh_writes() -> None:
    text = (ROOT / "bench" / "README.md").read_text()
    assert text.count("<!-- gpu-figures:start -->") == text.count("<!-- gpu-figures:end -->") == 1
