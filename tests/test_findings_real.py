"""docs/findings_real.py: the document is what its recorded runs render (no model is loaded)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def findings_real() -> ModuleType:
    sys.path.insert(0, str(DOCS))  # it imports docs/findings.py as `findings`
    spec = importlib.util.spec_from_file_location(
        "lensdiv_findings_real", DOCS / "findings_real.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_document_is_what_its_record_renders(
    findings_real: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPLBACKEND", "Agg")
    shutil.copy(DOCS / "findings_real.json", tmp_path / "findings_real.json")
    findings_real.main(["--render", "--out", str(tmp_path)])
    ours = (DOCS / "findings_real.md").read_text(encoding="utf-8")
    theirs = (tmp_path / "findings_real.md").read_text(encoding="utf-8")
    # the run's date is the rendering's: compare everything else
    strip = [line for line in ours.splitlines() if not line.startswith("**This run:**")]
    assert strip == [line for line in theirs.splitlines() if not line.startswith("**This run:**")]


def test_every_row_states_its_rule_and_command(findings_real: ModuleType) -> None:
    text = (DOCS / "findings_real.md").read_text(encoding="utf-8")
    assert "4-bit GGUF" in text and "dequantizes" in text
    assert text.count("Rule:") == len(findings_real.ROWS)
    assert text.count("- **Command:** `") == len(findings_real.ROWS)
