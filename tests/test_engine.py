"""The engine loop: failure isolation, passes (freeze, start_pass), hook checks, token counts.

Driven with small analyzers that count real tokens, on the TL-native tiny model and batches built
by hand, so every expected count comes from the batches themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.errors import HookError
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.tokenizer import BOS_ID, PAD_ID
from lensdiv.run.engine import Engine, check_hooks, describe, input_device


@dataclass(frozen=True)
class TwoPassCount(Analyzer):
    """Counts real tokens in both passes; ``start_pass`` puts what pass 0 counted."""

    name = "count"
    passes = 2

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Step) -> None:
        assert step.cache[self.hooks(step.info)[0]].shape[:2] == step.batch.tokens.shape
        state.add(f"n{step.pass_index}", step.batch.n_tokens)

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        state.fix(f"seen_before_{index}", float(state[f"n{index - 1}"]))

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        counts = [float(state["n0"]), float(state["n1"])]
        return Result(self.name, "", tables={"n": Table("n", {"n": counts})})


@dataclass(frozen=True)
class OnePassCount(TwoPassCount):
    """Takes part in pass 0 only."""

    name = "once"
    passes = 1

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "", tables={"n": Table("n", {"n": [float(state["n0"])]})})


@dataclass(frozen=True)
class Broken(TwoPassCount):
    """Raises (a two-line message) in the step named by ``where``."""

    name = "broken"

    where: str = "update"

    def _fail(self, where: str) -> None:
        if where == self.where:
            raise RuntimeError(f"{where} broke\nsecond line of the message")

    def init(self, info: ModelInfo) -> Stats:
        self._fail("init")
        return super().init(info)

    def update(self, state: Stats, step: Step) -> None:
        if step.batch.index == 1:
            self._fail("update")
        super().update(state, step)

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        self._fail("start_pass")
        super().start_pass(state, info, index)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        self._fail("finalize")
        return super().finalize(state, info)


def _batches() -> list[Batch]:
    """Three batches of random tokens after BOS, the last row of each right-padded."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for index in range(3):
        tokens = torch.randint(4, 200, (2, 6), generator=gen)
        tokens[:, 0] = BOS_ID
        mask = torch.ones_like(tokens, dtype=torch.bool)
        mask[-1, 4 - index :] = False
        tokens[~mask] = PAD_ID
        out.append(Batch(tokens, mask, index=index))
    return out


@pytest.fixture
def info(native_model: Any) -> ModelInfo:
    return ModelInfo.from_model(native_model)


# -- failure isolation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where, line",
    [
        ("init", "RuntimeError: init broke (init)"),
        ("update", "RuntimeError: update broke (batch 1)"),
        ("start_pass", "RuntimeError: start_pass broke (start of pass)"),
        ("finalize", "RuntimeError: finalize broke (finalize)"),
    ],
)
def test_a_failing_analyzer_is_dropped_and_the_others_finish(
    native_model: Any, info: ModelInfo, where: str, line: str
) -> None:
    batches = _batches()
    engine = Engine(native_model, info, [TwoPassCount(), Broken(where=where), OnePassCount()])
    results = engine.run(lambda: batches)
    assert engine.failures == {"broken": line}  # one line, naming where
    assert [a.name for a in engine.active] == ["count", "once"]
    assert set(results) == {"count", "once"}
    n_tokens = sum(b.n_tokens for b in batches)
    assert results["count"].table()["n"].tolist() == [n_tokens, n_tokens]
    assert results["once"].table()["n"].tolist() == [n_tokens]


def test_describe_is_one_short_line() -> None:
    assert describe(ValueError("first\nsecond")) == "ValueError: first"
    assert describe(KeyError("k")) == "KeyError: 'k'"
    assert len(describe(RuntimeError("x" * 1000))) == 300


# -- passes ------------------------------------------------------------------------------------------


def test_begin_pass_freezes_then_starts_the_pass(native_model: Any, info: ModelInfo) -> None:
    batches = _batches()
    engine = Engine(native_model, info, [TwoPassCount(), OnePassCount()])
    assert engine.n_passes == 2
    states = engine.init()
    assert set(states) == {"count", "once"} and all(s.empty for s in states.values())
    assert [a.name for a in engine.begin_pass(0, states)] == ["count", "once"]
    assert all(s.frozen == set() for s in states.values())  # nothing to freeze in pass 0
    engine.feed(0, batches, states)
    assert [a.name for a in engine.begin_pass(1, states)] == ["count"]
    count = states["count"]
    # What pass 0 wrote and what start_pass put are both finished.
    assert count.frozen == {"n0", "seen_before_1"} == set(count.names())
    assert count["seen_before_1"] == float(count["n0"])
    assert states["once"].frozen == set()  # not in pass 1: left alone
    engine.feed(1, batches, states)
    assert float(count["n1"]) == float(count["n0"]) and "n1" not in count.frozen
    assert not engine.failures, engine.failures


def test_tokens_are_counted_in_pass_zero_only(native_model: Any, info: ModelInfo) -> None:
    batches = _batches()
    engine = Engine(native_model, info, [TwoPassCount()])
    engine.run(lambda: batches)
    assert engine.tokens == sum(b.n_tokens for b in batches)
    assert engine.forward_s > 0 and engine.spent["count"] > 0


# -- hooks and devices ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NeedsHooks(Analyzer):
    """Declares the hooks it is given."""

    name = "needs"

    wanted: tuple[str, ...] = ()

    def hooks(self, info: ModelInfo) -> list[str]:
        return list(self.wanted)

    def update(self, state: Stats, step: Step) -> None:
        pass

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name)


def _facts(n_layers: int) -> ModelInfo:
    hooks = {f"blocks.{i}.hook_resid_{p}" for i in range(n_layers) for p in ("pre", "post")}
    return ModelInfo(name="tiny-model", n_layers=n_layers, d_model=8, d_vocab=16, n_heads=2,
                     normalization="LN", parallel_residual=False, hook_names=frozenset(hooks))


def test_check_hooks_returns_each_analyzers_hooks_once() -> None:
    wanted = ("blocks.1.hook_resid_post", "blocks.0.hook_resid_pre", "blocks.1.hook_resid_post")
    assert check_hooks([NeedsHooks(wanted=wanted)], _facts(2)) == {
        "needs": ["blocks.1.hook_resid_post", "blocks.0.hook_resid_pre"]}


def test_check_hooks_names_the_hook_and_the_block_range() -> None:
    with pytest.raises(HookError) as err:
        check_hooks([NeedsHooks(wanted=("blocks.0.hook_resid_pre", "blocks.24.hook_resid_post"))],
                     _facts(24))
    message = str(err.value)
    assert "'needs'" in message and "'blocks.24.hook_resid_post'" in message
    assert "tiny-model" in message and "24 blocks: 0-23" in message
    assert err.value.hint
    with pytest.raises(HookError) as err:
        check_hooks([NeedsHooks(wanted=("hook_nowhere",))], _facts(2))
    assert "'hook_nowhere'" in str(err.value) and "blocks:" not in str(err.value)


def test_engine_checks_hooks_before_anything_runs(native_model: Any, info: ModelInfo) -> None:
    missing = f"blocks.{info.n_layers}.hook_resid_post"
    with pytest.raises(HookError, match=f"{info.n_layers} blocks: 0-{info.n_layers - 1}"):
        Engine(native_model, info, [TwoPassCount(), NeedsHooks(wanted=(missing,))])


class _Parts(torch.nn.Module):
    """A first parameter and an embedding, each on a device of its own."""

    def __init__(self, first: str, embedding: str | None) -> None:
        super().__init__()
        self.first = torch.nn.Parameter(torch.zeros(1, device=first))
        if embedding is not None:
            self.embed = torch.nn.Module()
            self.embed.W_E = torch.nn.Parameter(torch.zeros(4, 2, device=embedding))


def test_input_device_is_the_embeddings(native_model: Any) -> None:
    assert input_device(native_model) == native_model.embed.W_E.device
    assert input_device(_Parts(first="meta", embedding="cpu")) == torch.device("cpu")
    # No embedding, or one not materialised: the first parameter's device.
    assert input_device(_Parts(first="cpu", embedding="meta")) == torch.device("cpu")
    assert input_device(_Parts(first="meta", embedding=None)) == torch.device("meta")
