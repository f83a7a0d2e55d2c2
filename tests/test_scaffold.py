"""``lensdiv plugins new``: the generated package installs, registers and passes its own tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.testing.scaffold import plugin_names
from tests.helpers import pip_install


def test_generated_package_installs_and_passes_its_tests(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plugins", "new", "resid-norm", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    package = tmp_path / "lensdiv-resid-norm"
    assert (package / "lensdiv_resid_norm" / "__init__.py").is_file()
    site = tmp_path / "site"
    pip_install(package, site)
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "COLUMNS": "250"}
    # Its own tests, run from outside the source folder so the installed copy is what runs.
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "2 passed" in tests.stdout
    listed = subprocess.run([sys.executable, "-m", "lensdiv", "plugins", "list"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert "resid-norm" in listed.stdout and "lensdiv-resid-norm 0.1.0" in listed.stdout


@pytest.mark.parametrize(
    ("name", "message"),
    [("lens", "already exists (from lensdiv"), ("Bad_Name", "is not a plugin name"),
     ("x--y", "is not a plugin name")],
)
def test_bad_names_are_one_line(name: str, message: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["plugins", "new", name, "--dir", str(tmp_path)])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_existing_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "lensdiv-foo").mkdir()
    result = CliRunner().invoke(app, ["plugins", "new", "foo", "--dir", str(tmp_path)])
    assert result.exit_code == 2 and "already exists" in result.output


def test_names() -> None:
    assert plugin_names("resid-norm") == ("resid-norm", "lensdiv_resid_norm", "ResidNorm")
