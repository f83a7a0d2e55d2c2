"""The analyzer contract as a check any plugin author can run, like scikit-learn's
``check_estimator``: ``check_analyzer(MyAnalyzer)`` in a test.

On tiny random models of several architectures (built locally, no download) it checks:

- **options**: the defaults build an instance; every option's default, written as a string,
  parses back to itself (what ``-O NAME.OPTION=VALUE`` does); every option is documented;
- **hooks** exist on the model (an architecture the analyzer declines with an
  :class:`~lensdiv.core.errors.UnsupportedModelError` is reported as skipped; any other error
  fails the check);
- **merge**: pass by pass, the states of two halves of the batches merged equal the state of
  one run over all of them (counts exact, floats within ``rtol``), in either order; merging with
  an empty state changes nothing; the all-reduce of a data-parallel run (two ranks, computed
  here in one process) gives exactly the merged state; and the merged state finalizes to the
  same result;
- **padding**: for an analyzer that reads the corpus, what sits at a padded position does not
  change the state, and a padded batch finalizes to the result of its rows cut to their real
  tokens (pad positions never enter a statistic);
- **serialisation**: the state survives ``save``/``load`` (safetensors + JSON) unchanged;
- **results**: the result round-trips through JSON and renders in a terminal of fixed width;
- **depth profiles**: every column ``depth_profiles`` declares is a numeric column of a
  per-layer table of the result (what a study draws over relative depth).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import LensdivError, StateError, UnsupportedModelError
from lensdiv.core.results import Result
from lensdiv.core.stats import COLLECTIVES, Stats, plan_reduce
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.run.engine import Engine
from lensdiv.testing.models import boot_native_tiny, boot_tiny, save_tiny_model

DEFAULT_ARCHITECTURES = ("gpt2", "llama", "neox", "native")
# 3 batches of 2 rows of 24 tokens, the last one short and padded: halves of unequal size.
DEFAULT_DATA = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)


@dataclass
class ContractReport:
    """What :func:`check_analyzer` checked.

    Args:
        analyzer: The plugin name.
        checked: Architectures on which every check passed.
        skipped: ``{architecture: reason}`` where the analyzer declined the model.
        passes: Passes run per architecture.
    """

    analyzer: str
    checked: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)


def check_analyzer(
    analyzer: type[Analyzer] | Analyzer,
    *,
    architectures: Sequence[str] = DEFAULT_ARCHITECTURES,
    data: DataSpec = DEFAULT_DATA,
    models: dict[str, Any] | None = None,
    rtol: float = 1e-6,
) -> ContractReport:
    """Check that ``analyzer`` obeys lensdiv's analyzer contract; raise ``AssertionError`` if not.

    Args:
        analyzer: The class (checked with its default options) or a configured instance.
        architectures: Tiny architectures to run on (``gpt2``, ``llama``, ``neox``, ``qwen2``,
            ``olmo``, ``olmo2``, ``native``).
        data: How the built-in corpus is packed; needs at least two batches.
        models: Ready bridges by architecture name, to reuse across checks (built otherwise).
        rtol: Relative tolerance for floats of merged vs one-run states and results.

    Returns:
        A :class:`ContractReport`.
    """
    instance = analyzer if isinstance(analyzer, Analyzer) else analyzer()
    check_options(type(instance))
    report = ContractReport(instance.name)
    models = dict(models or {})
    with tempfile.TemporaryDirectory(prefix="lensdiv-contract-") as tmp:
        for arch in architectures:
            if arch not in models:
                models[arch] = _tiny(arch, Path(tmp))
            try:
                passes = check_merge(instance, models[arch], data=data, rtol=rtol)
                check_padding(instance, models[arch], data=data)
            except StateError as err:
                raise AssertionError(f"{instance.name} on {arch}: {err}") from None
            except UnsupportedModelError as err:  # the analyzer declines this architecture
                report.skipped[arch] = str(err)
                continue
            except LensdivError as err:  # a run would stop with exit 2 on this model
                raise AssertionError(
                    f"{instance.name} on {arch} raised {type(err).__name__}: {err} (to decline "
                    "an architecture, raise UnsupportedModelError)"
                ) from None
            report.checked.append(arch)
            report.passes[arch] = passes
    assert report.checked, f"{instance.name}: no architecture could run it: {report.skipped}"
    return report


def _tiny(arch: str, root: Path) -> Any:
    if arch == "native":
        return boot_native_tiny()
    return boot_tiny(arch, save_tiny_model(arch, root / arch))


def check_options(cls: type[Analyzer]) -> None:
    """Defaults build an instance; each default written as text parses back to itself."""
    name = getattr(cls, "name", None)
    assert isinstance(name, str) and name, f"{cls.__name__} has no plugin name"
    assert name == name.strip().lower(), f"plugin name {name!r} must be lower case"
    assert dataclasses.is_dataclass(cls), f"{name}: analyzers are dataclasses (options = fields)"
    params = getattr(cls, "__dataclass_params__", None)
    assert params is not None and params.frozen, f"{name}: use @dataclass(frozen=True)"
    default = cls.from_options({})
    docs = {row["name"]: row for row in cls.option_docs()}
    for f in cls.option_fields():
        value = getattr(default, f.name)
        assert docs[f.name]["help"], f"{name}.{f.name} has no line in the docstring's Args:"
        text = _as_text(value)
        if text is None:
            continue
        parsed = getattr(cls.from_options({f.name: text}), f.name)
        assert parsed == value, f"{name}.{f.name}: {text!r} parses to {parsed!r}, not {value!r}"


def _as_text(value: Any) -> str | None:
    """How a user writes ``value`` on the command line (``None`` where it cannot be)."""
    if value is None:
        return "none"
    if isinstance(value, bool | int | float | str):
        return str(value) if not isinstance(value, float) else repr(value)
    if isinstance(value, tuple) and value and all(isinstance(v, str | int | float) for v in value):
        return ",".join(map(str, value))
    return None


def check_merge(
    analyzer: Analyzer, model: Bridge, *, data: DataSpec = DEFAULT_DATA, rtol: float = 1e-6
) -> int:
    """Run ``analyzer`` on all batches and on two halves, pass by pass; compare. Returns the
    number of passes."""
    info = ModelInfo.from_model(model)
    own = analyzer.examples(model, info)
    batches = list(own) if own is not None else list(token_batches(data, model.tokenizer))
    assert len(batches) >= 2, f"{analyzer.name}: the check needs at least two batches"
    cut = (len(batches) + 1) // 2
    first, second = batches[:cut], batches[cut:]
    before = dict(vars(analyzer))
    engine = Engine(model, info, [analyzer])
    name = analyzer.name
    whole = engine.init()[name]
    merged = engine.init()[name]
    for index in range(engine.n_passes):
        engine.begin_pass(index, {name: whole})
        if index > 0:
            engine.begin_pass(index, {name: merged})
        engine.feed(index, batches, {name: whole})
        halves = []
        for part in (first, second):
            state = merged.copy()
            engine.feed(index, part, {name: state})
            halves.append(state)
        _no_failure(engine)
        merged = halves[0].merge(halves[1])
        assert_states_close(merged, whole, rtol=rtol, what=f"{name}, pass {index}: halves merged")
        assert_states_close(
            halves[1].merge(halves[0]), merged, rtol=0.0, what=f"{name}: merge order"
        )
        assert_states_close(merged.merge(Stats()), merged, rtol=0.0, what=f"{name}: merge ∅")
        assert_states_close(Stats().merge(merged), merged, rtol=0.0, what=f"{name}: ∅ merge")
        for rank, reduced in enumerate(reduce_like_ranks(halves)):
            assert_states_close(
                reduced, merged, rtol=0.0, what=f"{name}, pass {index}: all-reduce on rank {rank}"
            )
    with tempfile.TemporaryDirectory(prefix="lensdiv-state-") as tmp:
        whole.save(tmp)
        assert_states_close(Stats.load(tmp), whole, rtol=0.0, what=f"{name}: saved state")
    results = [engine.finalize({name: s}) for s in (whole, merged)]
    _no_failure(engine)
    assert dict(vars(analyzer)) == before, (
        f"{name} changed itself during the run (keep run-time "
        "objects in step.cached / setup, data in the state)"
    )
    one, two = results[0][name], results[1][name]
    assert_results_close(two, one, rtol=rtol, what=f"{name}: result of merged halves")
    check_result(one)
    check_depth_profiles(type(analyzer), one, info.n_layers)
    return engine.n_passes


def reduce_like_ranks(states: Sequence[Stats]) -> list[Stats]:
    """The state every rank holds after a data-parallel run's reduction of ``states`` (rank
    ``r`` holding ``states[r]``), computed in this process: the same summaries, plan and
    :meth:`Stats.reduce` as under ``torchrun``, with each all-reduce done here (the ``i``-th
    collective of every rank combined element by element, as the backend does)."""
    ranks = [state.copy() for state in states]
    plan = plan_reduce([state.summary() for state in ranks])
    calls: list[list[tuple[torch.Tensor, str]]] = [[] for _ in ranks]
    for rank, state in enumerate(ranks):

        def record(tensor: torch.Tensor, op: str, rank: int = rank) -> None:
            calls[rank].append((tensor, op))

        state.reduce(plan, record, "cpu")
    for column in zip(*calls, strict=True):  # the same collective, on every rank
        ops = {op for _, op in column}
        assert len(ops) == 1, f"ranks disagree on the collective: {ops}"
        total = functools.reduce(COLLECTIVES[ops.pop()], [t.clone() for t, _ in column])
        for tensor, _ in column:
            tensor.copy_(total)
    return ranks


def check_padding(analyzer: Analyzer, model: Bridge, *, data: DataSpec = DEFAULT_DATA) -> None:
    """Pad positions never enter a statistic: for an analyzer that reads the corpus, a batch
    whose last row is padded gives the same state whatever sits at its pad positions, and the
    result of its rows cut to their real tokens (fed as separate batches)."""
    info = ModelInfo.from_model(model)
    if analyzer.examples(model, info) is not None:  # its own examples: it pads them itself
        return
    full = next(
        iter(
            token_batches(
                dataclasses.replace(data, max_tokens=3 * data.seq_len, batch_size=3),
                model.tokenizer,
            )
        )
    )
    width = full.tokens.shape[1]
    real = width // 2
    mask = torch.ones_like(full.tokens, dtype=torch.bool)
    mask[-1, real:] = False
    filled = []
    for fill in ("pad", "noise"):
        tokens = full.tokens.clone()
        if fill == "pad":
            tokens[-1, real:] = model.tokenizer.pad_token_id or 0
        else:  # whatever sits at a pad position must not matter
            gen = torch.Generator().manual_seed(11)
            tokens[-1, real:] = torch.randint(4, info.d_vocab, (width - real,), generator=gen)
        filled.append(dataclasses.replace(full, tokens=tokens, mask=mask))
    pieces = [
        dataclasses.replace(
            full,
            tokens=full.tokens[:-1],
            mask=mask[:-1],
            doc=None if full.doc is None else full.doc[:-1],
        ),
        dataclasses.replace(
            full,
            tokens=full.tokens[-1:, :real],
            mask=mask[-1:, :real],
            index=full.index + 1,
            doc=None if full.doc is None else full.doc[-1:, :real],
        ),
    ]
    states = [
        _states_after_every_pass(analyzer, model, batches)
        for batches in ([filled[0]], [filled[1]], pieces)
    ]
    what = f"{analyzer.name}: pad positions"
    assert_states_close(states[1], states[0], rtol=1e-6, what=f"{what} (their content)")
    results = [_finalize(analyzer, state, model, info) for state in (states[0], states[2])]
    # Batched differently, float32 readouts sum in another order: they agree to round-off.
    assert_results_close(
        results[0],
        results[1],
        rtol=1e-5,
        atol=1e-6,
        what=f"{what} (a padded batch vs its rows cut to their real tokens)",
    )


def _states_after_every_pass(analyzer: Analyzer, model: Bridge, batches: list[Batch]) -> Stats:
    engine = Engine(model, ModelInfo.from_model(model), [analyzer])
    states = engine.init()
    for index in range(engine.n_passes):
        engine.begin_pass(index, states)
        engine.feed(index, batches, states)
    _no_failure(engine)
    return states[analyzer.name]


def _finalize(analyzer: Analyzer, state: Stats, model: Bridge, info: ModelInfo) -> Result:
    engine = Engine(model, info, [analyzer])
    result = engine.finalize({analyzer.name: state})
    _no_failure(engine)
    return result[analyzer.name]


def _no_failure(engine: Engine) -> None:
    assert not engine.failures, f"analyzer failed: {engine.failures}"


def check_result(result: Result, width: int = 100) -> None:
    """The result round-trips through JSON and renders in a terminal and as plain text."""
    back = Result.from_json(result.to_json())
    assert_results_close(back, result, rtol=0.0, what=f"{result.analyzer}: JSON round trip")
    console = Console(file=io.StringIO(), width=width, record=True, color_system=None)
    console.print(result)
    text = console.export_text()
    assert result.analyzer in text, f"{result.analyzer}: the rendering does not name it"


def check_depth_profiles(cls: type[Analyzer], result: Result, n_layers: int) -> None:
    """Each declared depth profile is a numeric column of a per-layer table of ``result``."""
    if cls.depth_profiles is None:
        return
    found = {f"{table}.{column}" for table, column in cls.profiles(result, n_layers)}
    missing = [name for name in cls.depth_profiles if name not in found]
    assert not missing, (
        f"{cls.name}: depth_profiles names {', '.join(missing)}, which the result has not as a "
        f"numeric column of a per-layer table (a column holding 0..{n_layers} or "
        f"0..{n_layers - 1}, see lensdiv.core.depth)"
    )


def assert_states_close(a: Stats, b: Stats, *, rtol: float, what: str) -> None:
    """Same names, kinds and shapes; tensors within ``rtol``; everything else equal."""
    assert sorted(a.names()) == sorted(b.names()), (
        f"{what}: names differ: {sorted(set(a.names()) ^ set(b.names()))}"
    )
    assert a.frozen == b.frozen, f"{what}: finished passes differ"
    for name in a.names():
        assert a.kind(name) == b.kind(name), f"{what}: {name!r} changed kind"
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape, f"{what}: {name!r} shape"
            _close(
                x.detach().cpu().double().numpy(),
                y.detach().cpu().double().numpy(),
                rtol,
                f"{what}: {name!r}",
            )
        else:
            _close_values(x, y, rtol, f"{what}: {name!r}")


def assert_results_close(
    a: Result, b: Result, *, rtol: float, what: str, atol: float | None = None
) -> None:
    """Same tables, arrays and plots; numbers within ``rtol`` (or ``atol``, by default
    ``rtol / 1000`` — of the largest value, for an array; strings and integers exact)."""
    given, atol = atol, rtol * 1e-3 if atol is None else atol
    assert a.analyzer == b.analyzer, what
    assert list(a.tables) == list(b.tables), f"{what}: tables {list(a.tables)} vs {list(b.tables)}"
    for key, table in a.tables.items():
        other = b.tables[key]
        assert list(table.columns) == list(other.columns), f"{what}: columns of {key!r}"
        for col in table.columns:
            _close_values(
                table.columns[col], other.columns[col], rtol, f"{what}: {key}.{col}", atol
            )
    assert list(a.arrays) == list(b.arrays), f"{what}: arrays"
    for key, array in a.arrays.items():
        _close(array, b.arrays[key], rtol, f"{what}: array {key!r}", given)
    assert a.plots == b.plots, f"{what}: plots differ"
    assert set(a.meta) == set(b.meta), f"{what}: meta keys {set(a.meta) ^ set(b.meta)}"
    for key in a.meta:
        _close_values(a.meta[key], b.meta[key], rtol, f"{what}: meta {key!r}", atol)


def _close_values(x: Any, y: Any, rtol: float, what: str, atol: float | None = None) -> None:
    atol = rtol * 1e-3 if atol is None else atol
    if isinstance(x, dict) and isinstance(y, dict):
        assert set(x) == set(y), f"{what}: keys differ"
        for k in x:
            _close_values(x[k], y[k], rtol, f"{what}.{k}", atol)
    elif isinstance(x, list | tuple) and isinstance(y, list | tuple):
        assert len(x) == len(y), f"{what}: lengths {len(x)} and {len(y)}"
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _close_values(u, v, rtol, f"{what}[{i}]", atol)
    elif isinstance(x, float) or isinstance(y, float):
        both = isinstance(x, int | float) and isinstance(y, int | float)
        assert both, f"{what}: {x!r} vs {y!r}"
        if not (math.isnan(x) and math.isnan(y)):
            assert x == y or math.isclose(x, y, rel_tol=rtol, abs_tol=atol), (
                f"{what}: {x!r} vs {y!r}"
            )
    else:
        assert x == y, f"{what}: {x!r} vs {y!r}"


def _close(x: Any, y: Any, rtol: float, what: str, atol: float | None = None) -> None:
    """Arrays within ``rtol``, or ``atol`` (by default ``rtol / 1000`` of the largest value)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    assert x.shape == y.shape, f"{what}: shapes {x.shape} and {y.shape}"
    if atol is None:
        atol = rtol * max(float(np.nanmax(np.abs(y), initial=0.0)), 1e-30) * 1e-3
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, equal_nan=True, err_msg=what)
