"""``docs/findings.py`` (``make findings``): its verdict rules, and its mechanics at tiny sizes —
every finding gets a row, a section and a figure, and the numbers in the document are the
measured ones it records in ``findings.json`` (the timing of a full run is not tested)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "findings.py"


@pytest.fixture(scope="module")
def findings() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lensdiv_findings", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def test_halves_rule(findings: ModuleType) -> None:
    reproduced, partly, no = findings.REPRODUCED, findings.PARTLY, findings.NOT
    assert findings.halves_verdict([1, 1, 1, 1, 0.2, 0.2, 0.2, 0.2])[0] == reproduced
    # Only block 0 stands out: the second half is smaller, but not once block 0 is left out.
    verdict, ratios = findings.halves_verdict([6.0, 0.5, 0.45, 0.4, 0.35, 0.3, 0.3, 0.3])
    assert verdict == partly
    assert ratios["ratio"] == pytest.approx(0.3125 / 1.8375)
    assert ratios["ratio_without_block0"] == pytest.approx(0.3125 / 0.45)
    assert findings.halves_verdict([1, 1, 2, 2])[0] == no
    # skip_last drops the last block (it has no later layers) before halving.
    assert findings.halves_verdict([1, 1, 0.1, 0.1, 99.0], skip_last=True)[0] == reproduced


def test_slope_and_depth_score_rule(findings: ModuleType) -> None:
    slope, low, high = findings.slope_with_interval([1, 2, 3, 4], [3, 5, 7, 9], [0.1] * 4)
    assert slope == pytest.approx(2.0) and low < 2 < high
    assert high - low == pytest.approx(2 * 1.96 * 0.1 / 5**0.5)
    assert findings.depth_score_verdict(1, -1, 1).endswith("(not testable)")
    assert findings.depth_score_verdict(3, 0.1, 0.5) == findings.NOT
    assert findings.depth_score_verdict(3, -0.2, 0.3) == findings.REPRODUCED
    assert findings.depth_score_verdict(3, -0.5, -0.1) == findings.REPRODUCED


def test_other_rules(findings: ModuleType) -> None:
    f = findings
    assert f.linmap_verdict(0.95, 0.1) == f.REPRODUCED
    assert f.linmap_verdict(0.95, 0.4) == f.PARTLY
    assert f.linmap_verdict(0.3, 0.1) == f.NOT
    assert f.submod_verdict(0.8, 0.95) == f.REPRODUCED
    assert f.submod_verdict(0.6, 0.95) == f.PARTLY
    assert f.submod_verdict(0.3, 0.99) == f.NOT
    assert f.teacher_student_verdict((1.0, 0.9, 1.1), (1.5, 1.3, 1.7)) == f.REPRODUCED
    assert f.teacher_student_verdict((0.85, 0.7, 0.95), (1.5, 1.3, 1.7)) == f.REPRODUCED
    assert f.teacher_student_verdict((0.6, 0.5, 0.7), (1.4, 1.1, 1.7)) == f.PARTLY
    assert f.teacher_student_verdict((1.0, 0.8, 1.2), (1.2, 1.1, 1.4)) == f.PARTLY  # overlap
    assert f.teacher_student_verdict((0.6, 0.5, 0.7), (0.4, 0.2, 0.6)) == f.NOT


def test_teacher_student_row_reads_the_recorded_trial(
    findings: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The full document's teacher–student row reads the bench record whose settings are the
    preset's and refits α_ℓ from its test losses (exact power laws here: α_ℓ = 1 and 2)."""
    import dataclasses

    from lensdiv.studies.teacher_student import TeacherStudentConfig

    config = TeacherStudentConfig.preset("fast")
    depths = config.depths
    record = {
        "trial": "T9",
        "date": "2026-01-01 00:00",
        "config": json.loads(json.dumps(dataclasses.asdict(config))),
        "test_loss": {
            "independent ρ=0, T=1": {str(d): 0.1 / d for d in depths},
            "tied ρ=1, T=1": {str(d): 0.1 / d**2 for d in depths},
        },
        "cpu_seconds": 12.0,
        "wall_seconds": 34.0,
    }
    other = dict(record, trial="T8", config=dict(record["config"], steps=1))
    path = tmp_path / "trials.json"
    path.write_text(json.dumps({"T8": other, "T9": record}))
    monkeypatch.setattr(findings, "ROOT", tmp_path)
    sizes = dataclasses.replace(findings.TINY, preset="fast", teacher_student={},
                                teacher_student_record="trials.json")  # fmt: skip
    row = findings.teacher_student(sizes, tmp_path)
    alphas = [f["alpha"] for f in row.values["alpha"]]
    assert alphas == pytest.approx([1.0, 2.0])
    assert row.verdict == findings.REPRODUCED and "trial T9" in row.toy
    assert (tmp_path / row.figure).is_file()
    with pytest.raises(SystemExit, match="no trial with the settings of preset 'paper'"):
        findings.teacher_student_record(path, "paper")


def test_tiny_run_writes_every_finding(
    findings: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LENSDIV_TOY_STEPS", "4")  # five toy models: the mechanics, not the science
    written = findings.main(["--tiny", "--out", str(tmp_path)])
    keys = list(findings.MEASUREMENTS)
    assert [f.key for f in written] == keys
    assert set(findings.RULES) == set(keys)
    doc = (tmp_path / "findings.md").read_text()
    record = json.loads((tmp_path / "findings.json").read_text())
    rows = [line for line in doc.splitlines() if line.startswith("| [")]
    assert len(rows) == len(keys)
    for finding, row in zip(record["findings"], rows, strict=True):
        assert f"**{finding['verdict']}**" in row
        assert f"]({finding['figure']})" in doc
        figure = tmp_path / finding["figure"]
        assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
        assert f'<a id="{finding["key"].replace("_", "-")}"></a>' in doc
    by_key = {f["key"]: f for f in record["findings"]}
    # The document quotes the measured numbers it recorded.
    r_block = by_key["contribution"]["values"]["r_block"]
    assert ", ".join(f"{v:.2f}" for v in r_block) in doc
    for fit in by_key["teacher_student"]["values"]["alpha"]:
        assert f"α_ℓ = {fit['alpha']:.2f} (95 % {fit['ci_low']:.2f}–{fit['ci_high']:.2f})" in doc
    accuracy = by_key["depth_score"]["values"]["accuracy"]
    assert f"accuracy {accuracy[0]:.0%}" in doc
    assert record["sizes"]["preset"] == "fast" and record["run"]["cpu_seconds"] > 0
    assert f"took {findings.duration(record['run']['wall_seconds'])} of wall time" in doc


def test_every_finding_links_to_its_definitions(findings: ModuleType) -> None:
    """Each finding names its analysis' section of docs/science.md, and that section exists."""
    science = (SCRIPT.parent / "science.md").read_text(encoding="utf-8")
    assert set(findings.DEFINITIONS) == set(findings.MEASUREMENTS)
    for key, anchor in findings.DEFINITIONS.items():
        assert f'<a id="{anchor}"></a>' in science, key


def test_the_document_is_what_its_record_renders(findings: ModuleType) -> None:
    """docs/findings.md is ``render`` of the findings and run recorded in docs/findings.json, so
    the generator and the committed document cannot drift apart."""
    record = json.loads((SCRIPT.parent / "findings.json").read_text(encoding="utf-8"))
    rows = [findings.Finding(**f) for f in record["findings"]]
    assert record["rules"] == findings.RULES
    document = (SCRIPT.parent / "findings.md").read_text(encoding="utf-8")
    assert findings.render(rows, record["run"]) == document


def test_surgery_rules(findings: ModuleType) -> None:
    f = findings
    assert f.combined_verdict([f.REPRODUCED, f.REPRODUCED]) == f.REPRODUCED
    assert f.combined_verdict([f.NOT, f.NOT]) == f.NOT
    assert f.combined_verdict([f.REPRODUCED, f.NOT]) == f.PARTLY
    assert f.combined_verdict([f.PARTLY, f.PARTLY]) == f.PARTLY
    assert f.ends_checks([5.0, 0.1, 0.2, 1.0]) == (True, True)
    assert f.ends_checks([5.0, 0.1, 0.2, 0.15]) == (True, False)
    assert f.ends_checks([0.1, 0.2, 0.3, 5.0]) == (False, True)
    assert f.ends_checks([0.1, 5.0, 0.2, 0.3]) == (False, False)
    assert f.middle_pairs(8) == [2, 3, 4] and f.middle_pairs(4) == [1]
    assert f._depth("toy:d8") == 8 and f._depth("toy:d4-w32") == 4


def test_outlier_rules(findings: ModuleType) -> None:
    f = findings
    assert f.sinks_verdict(0.0, 0.75) == f.REPRODUCED
    assert f.sinks_verdict(0.8, 0.75) == f.PARTLY  # layer 0 has as many sinks: some, not the rule
    assert f.sinks_verdict(0.0, 0.2) == f.PARTLY
    assert f.sinks_verdict(0.0, 0.0) == f.NOT
    assert f.massive_verdict(None, 0.0, 0.0) == f.NOT
    assert f.massive_verdict(2, 5.0, 0.01) == f.REPRODUCED
    assert f.massive_verdict(2, 0.05, 0.01) == f.PARTLY


def test_geometry_rules() -> None:
    """docs/findings_geometry.py: each rule accepts what it claims and refuses what it does not,
    on made-up matrices and curves."""
    import numpy as np

    sys.path.insert(0, str(SCRIPT.parent))
    import findings_geometry as G

    # a late block: states 4..8 of 9 alike; the early ones not
    cka = np.full((9, 9), 0.3)
    cka[4:, 4:] = 0.95
    np.fill_diagonal(cka, 1.0)
    assert G.longest_block(cka) == (4, 8)
    assert G.block_verdict(cka)[0] == G.REPRODUCED
    assert G.block_verdict(cka[::-1, ::-1].copy())[0] == G.PARTLY  # as long, but early
    short = np.full((9, 9), 0.3)
    np.fill_diagonal(short, 1.0)
    short[6:8, 6:8] = 0.95
    assert G.block_verdict(short)[0] == G.NOT  # two states are no block
    # one pair below the threshold inside the run breaks it (every pair must be alike)
    broken = cka.copy()
    broken[4, 8] = broken[8, 4] = 0.5
    assert G.longest_block(broken) in ((4, 7), (5, 8))
    # the entropy dip: in the middle and significantly below both ends
    dip = [2.0, 1.8, 1.2, 1.0, 1.3, 1.9, 2.1]
    assert G.dip_verdict(dip, [0.01] * 7)[0] == G.REPRODUCED
    assert G.dip_verdict(dip, [0.5] * 7)[0] == G.PARTLY  # within the errors of the ends
    assert G.dip_verdict([2.0, 1.8, 1.6, 1.5, 1.4, 1.2, 1.0], [0.01] * 7)[0] == G.NOT  # at h_L
    assert G.dip_verdict([0.5, 1.8, 1.6, 1.5, 1.4, 1.2, 1.0], [0.01] * 7)[0] == G.NOT  # at h_0
    # outliers: untestable without massive dimensions, graded by the largest change
    change = np.zeros((5, 5))
    assert G.outlier_verdict(change, [])[0] == G.NOT_TESTABLE
    assert G.outlier_verdict(change, [7])[0] == G.NOT
    change[1, 3] = -0.05
    assert G.outlier_verdict(change, [7])[0] == G.PARTLY
    change[2, 4] = 0.4
    assert G.outlier_verdict(change, [7])[0] == G.REPRODUCED
    assert G.combined([G.REPRODUCED, G.NOT_TESTABLE]) == G.REPRODUCED
    assert G.combined([G.NOT_TESTABLE]) == G.NOT_TESTABLE
    assert G.combined([G.REPRODUCED, G.NOT]) == G.PARTLY
