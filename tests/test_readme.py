"""The README's code must run as written (the offline parts of it)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_write_your_own_analyzer_example_runs() -> None:
    block = next(b for b in python_blocks() if "class ResidNorm" in b)
    module = types.ModuleType("readme_example")  # @dataclass looks its class up in sys.modules
    sys.modules[module.__name__] = module
    try:
        exec(compile(block, str(README), "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    namespace = module.__dict__
    result = namespace["run"]["resid-norm"]
    norms = result.table("norms")["norm"]
    assert len(norms) == namespace["run"].manifest["model"]["n_layers"] + 1
    assert (norms > 0).all()


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci
