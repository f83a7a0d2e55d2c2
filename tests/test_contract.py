"""The analyzer contract (lensdiv.testing.check_analyzer) over every built-in analyzer, and
proof that the check catches the mistakes it exists for."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.errors import LensdivError
from lensdiv.core.registry import PluginEntry, get_analyzer, list_plugins
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec
from lensdiv.run.runner import analyze
from lensdiv.testing import check_analyzer
from lensdiv.testing.models import boot_tiny
from tests.helpers import assert_results_equal, batches_of, fresh_model

ARCHS = ("gpt2", "llama", "neox", "native")
BUILTIN = sorted(e.name for e in list_plugins() if e.provider.startswith("lensdiv "))
# Cheaper options where the defaults do more work than the check needs (same code paths).
CHEAP = {
    "patch": {"ig_steps": 4},
    "depth-score": {"per_grade": 2, "batch_size": 4},
    "submod": {"samples": 4, "greedy": 3},
    "fit-jacobian": {"skip_first": 4},
}


@pytest.fixture(scope="module")
def contract_models(tiny_dirs: dict[str, Path], native_model: Any) -> dict[str, Any]:
    """Private bridges (an analyzer with folded numerics changes its model)."""
    models = {arch: boot_tiny(arch, tiny_dirs[arch]) for arch in ARCHS if arch != "native"}
    return {**models, "native": native_model}


def test_every_builtin_is_checked() -> None:
    assert sorted(
        ["bias", "contrib", "depth-score", "dynamics", "lens", "linmap", "patch", "skip", "submod",
         "fit-affine", "fit-jacobian", "prune", "reorder", "sinks", "massive", "patchscope",
         "similarity", "spectrum"]
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
            state.fix("first", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "", {"n": Table("n", {"n": [float(state["first"])]})})


@dataclass(frozen=True)
class _CountsPads(_Counting):
    """Counts every position of a batch, pads included."""

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.mask.numel())


@dataclass(frozen=True)
class _ReadsPads(_Counting):
    """Sums the embedding over every position, pads included."""

    def update(self, state: Stats, step: Step) -> None:
        super().update(state, step)
        state.add("sum", step.resid(0).double().sum())


@dataclass(frozen=True)
class _DeclinesWithTheWrongError(_Counting):
    """Refuses the model with a plain LensdivError: a run would stop, not skip it."""

    def hooks(self, info: ModelInfo) -> list[str]:
        raise LensdivError("not for this model")


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        (_CountsPads, r"pad positions \(a padded batch vs its rows cut"),
        (_ReadsPads, r"pad positions \(their content\)"),
        (_DeclinesWithTheWrongError, "raised LensdivError: not for this model .*raise "
         "UnsupportedModelError"),
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


# -- every registered analyzer (third-party ones too) runs end to end on every architecture ------


def _plugin_params() -> list[Any]:
    params = []
    for entry in list_plugins():
        marks = []
        if entry.cls is None and entry.provider.split()[0] != "lensdiv":
            marks = [pytest.mark.skip(reason=f"third-party plugin failed to load: {entry.error}")]
        params.append(pytest.param(entry, id=entry.name, marks=marks))
    return params


@pytest.mark.parametrize("entry", _plugin_params())
def test_runs_end_to_end(entry: PluginEntry, model: Any, arch: str,
                         request: pytest.FixtureRequest) -> None:
    assert entry.cls is not None, f"lensdiv's own plugin {entry.name!r} failed: {entry.error}"
    cls = entry.cls
    analyzer = cls.from_options({})
    assert analyzer.name == entry.name and cls.description
    info = ModelInfo.from_model(model)
    hooks = analyzer.hooks(info)
    missing = [h for h in hooks if h not in model.hook_dict]
    assert not missing, f"{entry.name} declares hooks {arch} lacks: {missing}"

    target = fresh_model(arch, request) if cls.numerics == "folded" else model
    spec = DataSpec(max_tokens=256, seq_len=32, batch_size=4)
    run = analyze(target, data=spec, plugins=[entry.name], progress=False, seed=3)
    assert run.ok, run.errors
    result = run[entry.name]
    assert result.analyzer == entry.name

    text = result.to_json()
    back = Result.from_json(text)
    assert_results_equal(back, result)
    assert back.to_json() == text

    console = Console(file=io.StringIO(), width=100)
    console.print(result)
    rendered = console.file.getvalue()
    assert entry.name in rendered
    assert max(len(line) for line in rendered.splitlines()) <= 100

    meta = result.meta
    options = json.loads(json.dumps({k: list(v) if isinstance(v, tuple) else v
                                     for k, v in analyzer.options().items()}))
    assert meta["options"] == options
    assert meta["seed"] == 3
    for dist in ("lensdiv", "torch", "transformer-lens"):
        assert meta["versions"][dist] not in ("", "not installed"), dist
    assert meta["model"]["n_layers"] == model.cfg.n_layers
    assert meta["model"]["d_model"] == model.cfg.d_model
    if meta["data"] == "own examples":  # task analyzers measure on their own examples
        info = ModelInfo.from_model(model)
        own = analyzer.examples(model, info)
        assert meta["tokens"] == sum(b.n_tokens for b in own)
    else:
        assert meta["tokens"] == sum(b.n_tokens for b in batches_of(model, spec))
