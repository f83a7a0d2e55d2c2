"""Lesson 7, an analyzer plugin: the mean norm ``‖h_l‖`` of every residual state, written as an
analyzer (state, update, merge, finalize), checked by its numbers and by ``check_analyzer``.

References: :class:`ResidNorms` below (the reference plugin), :func:`lensdiv.testing.check_analyzer`
(the contract, ARCHITECTURE.md "The analyzer contract"), tutorial 05.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.course import toy
from lensdiv.course.checker import (
    ERROR,
    NOT_DONE,
    PASSED,
    WRONG,
    Case,
    Exercise,
    Mistake,
    TimeLimit,
    Unusable,
    Verdict,
    abstract_methods,
)
from lensdiv.run.runner import analyze
from lensdiv.testing.contract import check_analyzer

NAME = "resid-norms"


@dataclass(frozen=True)
class ResidNorms(Analyzer):
    """Mean norm of every residual state h_0 .. h_L over the real tokens.

    Args:
        exclude_bos: Leave the BOS position out.
    """

    name = NAME
    description = "Mean norm of every residual state"
    exclude_bos: bool = True

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        for layer in range(step.info.n_layers + 1):
            state.add(f"sum{layer}", step.resid(layer)[keep].double().norm(dim=-1).sum())
        state.add("n", keep.sum())

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        layers = list(range(info.n_layers + 1))
        mean = [float(state[f"sum{layer}"] / state["n"]) for layer in layers]
        table = Table("resid_norms", {"layer": layers, "mean_norm": mean})
        return Result(self.name, tables={"resid_norms": table}, summary=f"‖h_L‖ = {mean[-1]:.2f}")


# -- the mistakes: plugins a student might write ---------------------------------------------------


@dataclass(frozen=True)
class _PadsCounted(ResidNorms):
    def update(self, state: Stats, step: Step) -> None:
        keep = torch.ones_like(step.batch.mask)
        if self.exclude_bos:
            keep[:, 0] = False
        for layer in range(step.info.n_layers + 1):
            state.add(f"sum{layer}", step.resid(layer)[keep].double().norm(dim=-1).sum())
        state.add("n", keep.sum())


@dataclass(frozen=True)
class _BosCounted(ResidNorms):
    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.positions()
        for layer in range(step.info.n_layers + 1):
            state.add(f"sum{layer}", step.resid(layer)[keep].double().norm(dim=-1).sum())
        state.add("n", keep.sum())


@dataclass(frozen=True)
class _BatchMean(ResidNorms):
    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        for layer in range(step.info.n_layers + 1):
            state.add(f"sum{layer}", step.resid(layer)[keep].double().norm(dim=-1).mean())
        state.add("n", torch.tensor(1))


# -- the inputs ----------------------------------------------------------------------------------------

SEQ_LEN, MAX_TOKENS = 32, 32 * 5 + 9  # 3 batches of 2 rows, the last row padded


def _recording(analyzer: Any, errors: list[BaseException]) -> Any:
    """``analyzer`` with each method its author wrote (not lensdiv's) keeping what it raises:
    a run reports a failing analyzer in one line; the check shows the error at its line."""

    def record(method: Any) -> Any:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except BaseException as err:
                errors.append(err)
                raise

        return call

    if not isinstance(analyzer, Analyzer):
        return analyzer
    for klass in type(analyzer).__mro__:
        if klass is object or str(klass.__module__).startswith("lensdiv."):
            continue
        for name, value in vars(klass).items():
            if (
                inspect.isfunction(value)
                and not name.startswith("__")
                and name not in vars(analyzer)
            ):
                object.__setattr__(analyzer, name, record(getattr(analyzer, name)))
    return analyzer


def _measure(analyzer: Any, case: Case) -> Any:
    errors: list[BaseException] = []
    run = analyze(
        toy.toy(),
        plugins=[_recording(analyzer, errors)],
        seq_len=SEQ_LEN,
        max_tokens=MAX_TOKENS,
        batch_size=2,
        progress=False,
    )
    if errors:  # the real error, raised where the analyzer's own code raised it
        raise errors[0]
    if not run.results:
        why = "; ".join(run.errors.values()) or "no result"
        if "TimeLimit" in why:
            raise TimeLimit(why)
        raise Unusable(f"the run gave no result ({why})")
    result = run[NAME] if NAME in run.results else next(iter(run.results.values()))
    if "resid_norms" not in result.tables:
        raise Unusable(f"its result has no table 'resid_norms' (it has {sorted(result.tables)})")
    columns = result.tables["resid_norms"].columns
    if "mean_norm" not in columns:
        raise Unusable(
            f"its table 'resid_norms' has no column 'mean_norm' (it has {sorted(columns)})"
        )
    return torch.as_tensor(columns["mean_norm"])


def _cases() -> list[Case]:
    toy.toy()  # loaded here, not in the reference's timed run (the time limit scales with it)
    return [
        Case(
            f"the toy on {MAX_TOKENS} tokens of the built-in corpus (the last row padded)",
            (),
            1,
            True,
        ),
        Case("the same, exclude_bos=False", (False,), 2),
    ]


PLUGIN = Exercise(
    "ResidNorms",
    ResidNorms,
    _cases,
    [
        Mistake(
            "pads_counted",
            "pad positions are counted: keep = step.batch.positions(exclude_bos=...) is True only at real tokens.",
            _PadsCounted,
        ),
        Mistake(
            "bos_counted",
            "BOS is counted although exclude_bos=True: pass exclude_bos=self.exclude_bos to step.batch.positions.",
            _BosCounted,
        ),
        Mistake(
            "batch_mean",
            "a mean of the batches' means: add sums and a count to the state, divide once in finalize (batches of different sizes then weigh right, and shards merge).",
            _BatchMean,
        ),
    ],
    describe=lambda out: "mean ‖h_l‖ " + ", ".join(f"{float(v):.2f}" for v in out),
    shape_hint="the table 'resid_norms' with one row per state h_0 .. h_L and a column 'mean_norm'",
    # The exercise's "function" is the class: called with a case's options it is the analyzer,
    # which a run on the toy turns into numbers.
    measure=_measure,
)

CONTRACT_DIAGNOSES = (
    (
        r"rows cut",
        "the numbers depend on how rows are batched: a padded batch must give what its rows cut to their real tokens give. Add sums and counts per token (never a mean per batch), over real tokens only.",
    ),
    (
        r"pad positions \(their content\)",
        "pad positions enter a statistic: select positions with step.batch.positions(...), True at real tokens only.",
    ),
    (
        r"fixed statistic",
        "state.fix holds a value every batch and shard must agree on (a setting, a shape); what accumulates over the data goes in state.add (sums, counts) or state.max / state.min.",
    ),
    (
        r"frozen|dataclass",
        "an analyzer is a @dataclass(frozen=True): its fields are its options.",
    ),
    (
        r"docstring",
        "every option needs its line under Args: in the class docstring (what lensdiv plugins show prints).",
    ),
)


def contract_verdict(cls: Any, architectures: tuple[str, ...] = ("gpt2",)) -> Verdict:
    """``check_analyzer`` on tiny models, its failure said in one line."""
    name = getattr(cls, "__name__", "the analyzer")
    try:
        report = check_analyzer(cls, architectures=architectures)
    except NotImplementedError:
        return Verdict(name, NOT_DONE, f"… {name}: not done yet.")
    except AssertionError as err:
        text = str(err)
        if "NotImplementedError" in text:
            return Verdict(name, NOT_DONE, f"… {name}: not done yet.")
        for pattern, diagnosis in CONTRACT_DIAGNOSES:
            if re.search(pattern, text):
                return Verdict(
                    name,
                    WRONG,
                    f"✘ {name} breaks the contract: {diagnosis}\n  check_analyzer said: {text[:300]}",
                    pattern,
                )
        return Verdict(name, WRONG, f"✘ {name} breaks the contract: {text[:400]}")
    except Exception as err:  # raised by the student's class outside a run
        if abstract_methods(err):
            return Verdict(
                name, NOT_DONE, f"… {name}: not done yet ({abstract_methods(err)} still to write)."
            )
        return Verdict(name, ERROR, f"✘ {name} raised {type(err).__name__}: {err}")
    return Verdict(
        name,
        PASSED,
        f"✔ {name} passes check_analyzer on {', '.join(report.checked)}: merge, padding, state on disk, result.",
    )


def check_contract(cls: Any) -> bool:
    """Print :func:`contract_verdict`; True when the contract holds."""
    verdict = contract_verdict(cls)
    print(verdict.text)
    return verdict.passed


check_plugin = PLUGIN.check
EXERCISES = (PLUGIN,)
