"""The engine: a group of analyzers fed by one fused forward pass per batch, pass by pass.

:class:`Engine` is the loop every run goes through — the runner, the merge-contract checks of
:mod:`lensdiv.testing` and the benchmarks use it alike::

    engine = Engine(model, info, analyzers)
    states = engine.init()
    for index in range(engine.n_passes):
        engine.begin_pass(index, states)      # freeze finished passes, start_pass
        engine.feed(index, batches, states)   # one forward per batch, every member updates
        (merge or all-reduce the states of all shards here)
    results = engine.finalize(states)

A failing analyzer is isolated: it is dropped from the group with one line in
:attr:`Engine.failures` and the others go on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, RunContext, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import input_device
from lensdiv.core.errors import HookError
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.ops.capture import capture
from lensdiv.ops.translators import Lens


def check_hooks(analyzers: Iterable[Analyzer], info: ModelInfo) -> dict[str, list[str]]:
    """Every analyzer's hooks, after checking each exists on the model."""
    needed = {}
    for analyzer in analyzers:
        declared = analyzer.hooks(info)
        if not isinstance(declared, (list, tuple)) or not all(isinstance(h, str) for h in declared):
            raise TypeError(f"hooks returned {shown(declared)}, expected a list of hook names")
        hooks = list(dict.fromkeys(declared))
        for hook in hooks:
            if hook not in info.hook_names:
                parts = hook.split(".")
                extra = ""
                if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
                    extra = f" ({info.n_layers} blocks: 0-{info.n_layers - 1})"
                raise HookError(
                    f"analyzer {analyzer.name!r} needs hook {hook!r} but {info.name} has no such "
                    f"hook{extra}",
                    hint="this analyzer does not support this architecture",
                )
        needed[analyzer.name] = hooks
    return needed


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with its tensors on ``device`` (a new batch: the caller's stays as it is)."""
    doc = batch.doc.to(device) if batch.doc is not None else None
    return dataclasses.replace(
        batch, tokens=batch.tokens.to(device), mask=batch.mask.to(device), doc=doc
    )


def describe(err: BaseException) -> str:
    """``"Type: first line of the message"`` (at most 300 characters)."""
    line = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    return line.splitlines()[0][:300]


def shown(value: Any) -> str:
    """A returned value as a line names it: ``None``, ``a dict ({'n': 1})``."""
    if value is None:
        return "None"
    text = " ".join(repr(value).split())
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = type(value).__name__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind} ({text})"


def broken_return(method: str, value: Any, expected: type | None) -> str | None:
    """The line for ``method`` of an analyzer having returned ``value`` where the contract
    wants an instance of ``expected`` (``None``: nothing), or ``None`` when it did."""
    if expected is None and value is None or expected is not None and isinstance(value, expected):
        return None
    wanted = "None (it works on the state it is given)" if expected is None else expected.__name__
    return f"{method} returned {shown(value)}, expected {'a ' if expected else ''}{wanted}"


class Engine:
    """Feed ``analyzers`` together: one fused forward pass per batch.

    Args:
        model: The ``TransformerBridge``.
        info: Its facts.
        analyzers: The group (same numerics, same data).
        hooks: ``{analyzer: hook names}`` (checked with :func:`check_hooks` when omitted).
        resources: What each analyzer's ``setup`` returned (called here when omitted).
        lens: The lens residual states are read through (``None``: the logit lens).
    """

    def __init__(
        self,
        model: Bridge,
        info: ModelInfo,
        analyzers: Sequence[Analyzer],
        *,
        hooks: Mapping[str, list[str]] | None = None,
        resources: Mapping[str, Any] | None = None,
        lens: Lens | None = None,
    ) -> None:
        self.model = model
        self.info = info
        self.analyzers = list(analyzers)
        self.hooks = dict(hooks) if hooks is not None else check_hooks(analyzers, info)
        if resources is None:
            resources = {a.name: a.setup(model, info) for a in self.analyzers}
        self.context = RunContext(model, info, dict(resources), lens=lens)
        self._active = list(self.analyzers)
        self._failures: dict[str, str] = {}
        self.spent = {a.name: 0.0 for a in self.analyzers}
        self._tokens = 0
        self.forward_s = 0.0

    # -- what feeds and the runner read and report ----------------------------------------------
    @property
    def active(self) -> list[Analyzer]:
        """The analyzers still running (a copy)."""
        return list(self._active)

    @property
    def failures(self) -> dict[str, str]:
        """``{analyzer: one line}`` of the analyzers that failed (a copy)."""
        return dict(self._failures)

    @property
    def tokens(self) -> int:
        """Real tokens fed so far (by every process, once a feed counted theirs): pass 0's, or
        every pass's when the passes read the data onward (:meth:`counts`)."""
        return self._tokens

    def count_tokens(self, n: int) -> None:
        """Count ``n`` more real tokens (of a pass that :meth:`counts`): a data-parallel feed
        adds those that the other processes fed."""
        self._tokens += int(n)

    @property
    def pass_tokens(self) -> int | None:
        """Real tokens a pass reads when the group's passes read the data onward (a training
        alone in its group: :meth:`Analyzer.pass_tokens`); ``None``: every pass reads it all."""
        if len(self.analyzers) != 1:
            return None
        return self.analyzers[0].pass_tokens(self.info)

    def counts(self, index: int) -> bool:
        """Whether the tokens of pass ``index`` count towards :attr:`tokens`: pass 0's, or
        every pass's when the passes read the data onward."""
        return index == 0 or self.pass_tokens is not None

    @property
    def n_passes(self) -> int:
        """Passes the group needs (the most any member asks for)."""
        return max((a.n_passes(self.info) for a in self.analyzers), default=1)

    def members(self, index: int) -> list[Analyzer]:
        """The analyzers still running that take part in pass ``index``."""
        return [a for a in self._active if a.n_passes(self.info) > index]

    def fail(self, analyzer: Analyzer, why: BaseException | str, where: str | None = None) -> None:
        """Drop ``analyzer`` from the group, remembering why: an exception (described in one
        line) or a line, and where it happened (``"batch 3"``, ``"saving the state"``)."""
        line = describe(why) if isinstance(why, BaseException) else why
        self._failures[analyzer.name] = f"{line} ({where})" if where else line
        if analyzer in self._active:
            self._active.remove(analyzer)

    def fail_pass(self, index: int, why: str) -> None:
        """Drop every analyzer still taking part in pass ``index`` (those finished in earlier
        passes keep their results)."""
        for analyzer in self.members(index):
            self.fail(analyzer, why)

    def _timed(
        self,
        analyzer: Analyzer,
        where: str,
        call: Callable[[], Any],
        returns: tuple[str, type | None] | None = None,
    ) -> Any:
        """``call()`` of one analyzer's method, timed; what it raises (``sys.exit`` included;
        only Ctrl-C goes through), or a return value of the wrong kind (``returns``: the
        method's name and the type it must return, ``None`` for nothing), fails that analyzer
        with one line and gives ``None``."""
        t0 = time.perf_counter()
        try:
            value = call()
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # one analyzer failing must not stop the others
            self.fail(analyzer, err, where)
            return None
        finally:
            self.spent[analyzer.name] += time.perf_counter() - t0
        problem = broken_return(returns[0], value, returns[1]) if returns else None
        if problem is not None:
            self.fail(analyzer, problem)
            return None
        return value

    def init(self) -> dict[str, Stats]:
        """A fresh state per analyzer."""
        states: dict[str, Stats] = {}
        for a in self.active:
            state = self._timed(a, "init", partial(a.init, self.info), ("init", Stats))
            if state is not None:
                states[a.name] = state
        return states

    def begin_pass(self, index: int, states: Mapping[str, Stats]) -> list[Analyzer]:
        """Prepare pass ``index``: from the second pass on, freeze what earlier passes wrote and
        call ``start_pass`` on the (merged) states. Returns the pass's members."""
        self.context.pass_index = index
        if index > 0:
            for a in self.members(index):
                state = states[a.name]

                def start(a: Analyzer = a, state: Stats = state) -> Any:
                    state.freeze()
                    try:
                        return a.start_pass(state, self.info, index)
                    finally:
                        state.freeze()

                self._timed(a, "start of pass", start, ("start_pass", None))
        return self.members(index)

    def feed(
        self,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        """Pass ``index`` over ``batches``: one forward per batch, every member updates.

        The clean forward's seconds (and the real tokens of a pass that :meth:`counts`) are
        counted as they go,
        so an interrupted pass still reports them.
        """
        members = self.members(index)
        if not members:
            return
        self.context.pass_index = index
        names = list(dict.fromkeys(h for a in members for h in self.hooks[a.name]))
        need_logits = any(a.needs_logits for a in members)
        grad = any(a.needs_grad for a in members)
        device = input_device(self.model)
        for given in batches:
            batch = on_device(given, device)
            t0 = time.perf_counter()
            logits, cache = capture(
                self.model, batch.tokens, names, need_logits=need_logits, grad=grad
            )
            self.forward_s += time.perf_counter() - t0
            step = Step(batch, cache, logits, context=self.context)
            for a in self.members(index):

                def update(a: Analyzer = a, step: Step = step) -> Any:
                    with torch.set_grad_enabled(a.needs_grad):
                        return a.update(states[a.name], step)

                self._timed(a, f"batch {batch.index}", update, ("update", None))
            if self.counts(index):
                self.count_tokens(batch.n_tokens)
            if on_batch is not None:
                on_batch(given)
            if not self.members(index):
                break

    def finalize(self, states: Mapping[str, Stats]) -> dict[str, Result]:
        """Each running analyzer's result (those that fail here are dropped)."""
        results = {}
        for a in self.active:
            finalize = partial(a.finalize, states[a.name], self.info)
            result = self._timed(a, "finalize", finalize, ("finalize", Result))
            if result is not None:
                results[a.name] = result
        return results

    def run(self, batches: Callable[[], Iterable[Batch]]) -> dict[str, Result]:
        """Every pass over ``batches()`` in this process, then the results."""
        states = self.init()
        for index in range(self.n_passes):
            self.begin_pass(index, states)
            self.feed(index, batches(), states)
        return self.finalize(states)
