"""The analyzer contract (lensdiv.testing.check_analyzer) over every built-in analyzer, and
proof that the check catches the mistakes it exists for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.registry import get_analyzer, list_plugins
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.testing import check_analyzer
from lensdiv.testing.models import boot_tiny

ARCHS = ("gpt2", "llama", "neox", "native")
BUILTIN = sorted(e.name for e in list_plugins() if e.provider.startswith("lensdiv "))
# Cheaper options where the defaults do more work than the check needs (same code paths).
CHEAP = {
    "patch": {"ig_steps": 4},
    "depth-score": {"per_grade": 2, "batch_size": 4},
    "submod": {"samples": 4, "greedy": 3},
}


@pytest.fixture(scope="module")
def contract_models(tiny_dirs: dict[str, Path], native_model: Any) -> dict[str, Any]:
    """Private bridges (an analyzer with folded numerics changes its model)."""
    models = {arch: boot_tiny(arch, tiny_dirs[arch]) for arch in ARCHS if arch != "native"}
    return {**models, "native": native_model}


def test_every_builtin_is_checked() -> None:
    assert sorted(
        ["bias", "contrib", "depth-score", "dynamics", "lens", "linmap", "patch", "skip", "submod"]
    ) == BUILTIN


@pytest.mark.parametrize("name", BUILTIN)
def test_builtin_obeys_the_contract(name: str, contract_models: dict[str, Any]) -> None:
    cls = get_analyzer(name)
    report = check_analyzer(
        cls.from_options(CHEAP.get(name, {})), architectures=ARCHS, models=contract_models
    )
    assert report.checked == list(ARCHS), report.skipped


# -- the check fails where it should ---------------------------------------------------------------


@dataclass(frozen=True)
class _Counting(Analyzer):
    """Counts tokens (a well-behaved base for the broken variants below)."""

    name = "counting"

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "n tokens", {"n": Table("n", {"n": [float(state["n"])]})})


@dataclass(frozen=True)
class _AttributeOnState(_Counting):
    """Keeps the grades seen as an attribute of the state: lost when shards merge (the bug
    depth-score had)."""

    def update(self, state: Stats, step: Step) -> None:
        super().update(state, step)
        state.__dict__.setdefault("seen", set()).add(step.batch.index)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        if not state.__dict__.get("seen"):
            raise ValueError("no examples were processed")
        return super().finalize(state, info)


@dataclass(frozen=True)
class _RecountsInPassTwo(_Counting):
    """Adds to a pass-0 statistic again in pass 1: shards of pass 1 would count it twice."""

    passes = 2

    def update(self, state: Stats, step: Step) -> None:
        super().update(state, step)


@dataclass(frozen=True)
class _ChangesItself(_Counting):
    """Caches something on itself during the run."""

    def update(self, state: Stats, step: Step) -> None:
        super().update(state, step)
        object.__setattr__(self, "_last", step.batch.index)


@dataclass(frozen=True)
class _DependsOnBatching(_Counting):
    """A statistic that depends on how the data was split (the first batch's size)."""

    def update(self, state: Stats, step: Step) -> None:
        super().update(state, step)
        if "first" not in state:
            state.put("first", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "", {"n": Table("n", {"n": [float(state["first"])]})})


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_AttributeOnState, "no examples were processed"),
        (_RecountsInPassTwo, "earlier pass"),
        (_ChangesItself, "changed itself"),
        (_DependsOnBatching, "disagree on 'first'"),
    ],
)
def test_check_catches(broken: type[Analyzer], message: str, contract_models: Any) -> None:
    check_analyzer(_Counting, architectures=("gpt2",), models=contract_models)
    with pytest.raises(AssertionError, match=message):
        check_analyzer(broken, architectures=("gpt2",), models=contract_models)
