"""Helpers shared by several test modules: comparisons, a state driver, reference computations.

Plain functions and classes, imported by name (``from tests.helpers import run_state``): they
take arguments, return values and are called in the middle of a test, which fixtures cannot do.
Fixtures (models, directories) live in ``conftest.py``.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import torch

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze
from lensdiv.testing.models import boot_native_tiny, boot_tiny

# -- comparing results -----------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Structural equality in which NaN equals NaN (and arrays compare elementwise)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and a.dtype == b.dtype and bool(
            np.array_equal(a, b, equal_nan=True))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def assert_results_equal(a: Result, b: Result) -> None:
    assert a.analyzer == b.analyzer and a.summary == b.summary
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        ta, tb = a.tables[name], b.tables[name]
        assert (ta.name, ta.description) == (tb.name, tb.description)
        assert same(dict(ta.columns), dict(tb.columns)), name
    assert list(a.arrays) == list(b.arrays)
    for name in a.arrays:
        assert same(a.arrays[name], b.arrays[name]), name
    assert a.plots == b.plots
    assert same(dict(a.meta), dict(b.meta))


def assert_tables_close(a: Result, b: Result, *, rtol: float, atol: float) -> None:
    assert list(a.tables) == list(b.tables)
    for name in a.tables:
        ta, tb = a.tables[name], b.tables[name]
        assert list(ta.columns) == list(tb.columns)
        for col in ta.columns:
            x, y = ta[col], tb[col]
            if x.dtype.kind in "fiu":
                np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"{name}.{col}")
            else:
                assert x.tolist() == y.tolist(), f"{name}.{col}"


# -- driving analyzers -----------------------------------------------------------------------------


def batches_of(model: Any, spec: DataSpec) -> list[Batch]:
    return list(token_batches(spec, model.tokenizer))


def random_step(model: Any, hooks: list[str], *, rows: int, width: int, pad: int,
                seed: int = 0) -> Step:
    """``rows`` rows of random tokens after BOS, the last one right-padded over its final ``pad``
    positions (pads are never measured), captured at ``hooks`` with the logits."""
    info = ModelInfo.from_model(model)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, min(info.d_vocab, 250), (rows, width), generator=g)
    tokens[:, 0] = model.tokenizer.bos_token_id or 0
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, width - pad :] = False
    tokens[-1, width - pad :] = model.tokenizer.pad_token_id or 0
    logits, cache = capture(model, tokens, hooks, need_logits=True)
    return Step(Batch(tokens, mask), cache, logits, model, info)


def run_state(analyzer: Analyzer, model: Any, batches: Iterable[Batch]) -> Stats:
    """Drive ``init``/``update`` directly, one ``capture`` per batch, like the runner does."""
    info = ModelInfo.from_model(model)
    state = analyzer.init(info)
    names = analyzer.hooks(info)
    for batch in batches:
        logits, cache = capture(model, batch.tokens, names, need_logits=analyzer.needs_logits)
        analyzer.update(state, Step(batch=batch, cache=cache, logits=logits, model=model,
                                    info=info))
    return state


def pip_install(source: Path, target: Path) -> None:
    """Install the package in ``source`` into the folder ``target`` with this interpreter's pip
    (a wheel build, no dependencies, offline); skip the test where pip is missing."""
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this interpreter, so the package cannot be installed")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(target),
         str(source)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"


def fresh_model(arch: str, request: pytest.FixtureRequest) -> Any:
    """A private bridge, for runs that change the model (folded numerics)."""
    if arch == "native":
        return boot_native_tiny()
    return boot_tiny(arch, request.getfixturevalue("tiny_dirs")[arch])


def sublayer_names(model: Any) -> list[str]:
    names = []
    for i in range(model.cfg.n_layers):
        names += [f"blocks.{i}.hook_resid_pre", f"blocks.{i}.hook_attn_out",
                  f"blocks.{i}.hook_mlp_out", f"blocks.{i}.hook_resid_post"]
    return names


# -- streaming and padding, for any analyzer with an ``n`` count --------------------------------------


def check_merged_halves_equal_one_pass(analyzer: Analyzer, model: Any) -> None:
    """Two shards' merged state finalizes to the one-pass result; the runner streams alike."""
    spec = DataSpec(seq_len=16, max_tokens=16 * 7 + 5, batch_size=2)
    batches = batches_of(model, spec)
    assert len(batches) == 4 and not batches[-1].mask.all()
    info = ModelInfo.from_model(model)
    whole = run_state(analyzer, model, batches)
    merged = run_state(analyzer, model, batches[:2]).merge(run_state(analyzer, model, batches[2:]))
    assert float(merged["n"]) == float(whole["n"])
    one_pass, two_halves = analyzer.finalize(whole, info), analyzer.finalize(merged, info)
    assert_tables_close(two_halves, one_pass, rtol=1e-9, atol=1e-12)
    # The runner streams the same way.
    run = analyze(model, data=spec, plugins=[analyzer], progress=False)
    assert_tables_close(run[analyzer.name], one_pass, rtol=1e-9, atol=1e-12)


def check_pads_never_enter_a_statistic(analyzer: Analyzer, model: Any, pad_fill: str) -> None:
    """A padded batch gives the state of its rows cut to their real tokens."""
    (full,) = batches_of(model, DataSpec(seq_len=16, max_tokens=48, batch_size=3))
    tokens, half = full.tokens.clone(), 8
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[-1, half:] = False
    if pad_fill == "pad":
        tokens[-1, half:] = model.tokenizer.pad_token_id
    else:  # whatever sits at a pad position must not matter
        gen = torch.Generator().manual_seed(11)
        tokens[-1, half:] = torch.randint(4, model.cfg.d_vocab, (tokens.shape[1] - half,),
                                          generator=gen)
    padded = Batch(tokens=tokens, mask=mask)
    pieces = [Batch(tokens=tokens[:-1], mask=mask[:-1]),
              Batch(tokens=tokens[-1:, :half], mask=mask[-1:, :half], index=1)]
    info = ModelInfo.from_model(model)
    with_pads = run_state(analyzer, model, [padded])
    without = run_state(analyzer, model, pieces[:1]).merge(run_state(analyzer, model, pieces[1:]))
    assert float(with_pads["n"]) == float(without["n"])
    assert_tables_close(analyzer.finalize(with_pads, info), analyzer.finalize(without, info),
                        rtol=1e-5, atol=1e-6)


# -- a tiny analyzer: option parsing, and a target of fake entry points ------------------------------


@dataclass(frozen=True)
class Alpha(Analyzer):
    """An analyzer with one option of every parseable kind."""

    name = "alpha"
    aliases = ("al", "Alfa")
    description = "test analyzer alpha"

    flag: bool = False
    count: int = 1
    scale: float = 1.0
    mode: Literal["fast", "slow"] = "fast"
    layers: tuple[int, ...] = ()
    limit: int | None = 3
    label: str = "x"

    def hooks(self, info: ModelInfo) -> list[str]:
        return []

    def update(self, state: Stats, step: Step) -> None:
        state.add("n", step.batch.n_tokens)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(analyzer=self.name)


# -- reference computations --------------------------------------------------------------------------

SKIP_EPS = 1e-6  # the skip analyzer's floor under a norm


def naive_effects(step: Step, intervals: Any, part: str, local: bool) -> tuple[Any, Any]:
    """Full re-run per (sequence, skipped block) with TL hooks; ratios by a Python loop."""
    model, info = step.model, step.info
    L = info.n_layers
    n = int(intervals.rows.numel())
    E = torch.zeros(n, L, L, dtype=torch.float64)
    O = torch.zeros(n, L, dtype=torch.float64)  # noqa: E741 - the paper's name
    for p in range(n):
        r = int(intervals.rows[p])
        tokens = step.batch.tokens[r : r + 1]
        skip = intervals.skip[p][None, :, None]
        clean = [step.resid(layer)[r : r + 1] for layer in range(L + 1)]
        clean_probs = torch.softmax(step.logits[r].double(), -1)
        for s in range(L):
            hooks = []
            if local:
                if part == "block":
                    write = clean[s + 1] - clean[s]
                else:
                    write = step.cache[f"blocks.{s}.hook_{part}_out"][r : r + 1]
                for layer in range(s + 1, L + 1):
                    site = info.resid(layer)
                    target = clean[layer] - write

                    def pin(x: Any, hook: Any, target: Any = target, skip: Any = skip) -> Any:
                        return torch.where(skip, target, x)

                    hooks.append((site, pin))
            elif part == "block":

                def skip_block(x: Any, hook: Any, keep: Any = clean[s], skip: Any = skip) -> Any:
                    return torch.where(skip, keep, x)

                hooks.append((f"blocks.{s}.hook_resid_post", skip_block))
            else:

                def zero(x: Any, hook: Any, skip: Any = skip) -> Any:
                    return torch.where(skip, torch.zeros_like(x), x)

                hooks.append((f"blocks.{s}.hook_{part}_out", zero))
            store: dict[str, Any] = {}

            def keep(x: Any, hook: Any, name: str, store: Any = store) -> Any:
                store[name] = x.detach().clone()
                return x

            names = [info.resid(layer) for layer in range(L + 1)]
            keepers = [(n, lambda x, hook, n=n: keep(x, hook, n)) for n in names]
            with torch.no_grad(), model.hooks(fwd_hooks=hooks), model.hooks(fwd_hooks=keepers):
                logits = model(tokens)
            h = [store[name][0] for name in names]
            if local:  # the pinned values are what the residual is at skipped positions
                for layer in range(s + 1, L):
                    h[layer] = torch.where(skip[0], clean[layer][0] - write[0], h[layer])
            probs = torch.softmax(logits[0].double(), -1)
            where = intervals.measure[p]
            for layer in range(L):  # the formula, dense over positions, then max over measured
                d_clean = (clean[layer + 1][0] - clean[layer][0]).double()
                d_new = (h[layer + 1] - h[layer]).double()
                floor = d_clean.norm(dim=-1).clamp_min(SKIP_EPS)
                ratio = (d_clean - d_new).norm(dim=-1) / floor
                E[p, s, layer] = ratio[where].max()
            O[p, s] = (probs - clean_probs).norm(dim=-1)[where].max()
    return E, O

