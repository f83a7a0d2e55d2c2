"""``lensdiv lenses fit`` and ``evaluate``: fit a lens of a model, and compare it with the logit
lens on data the fit never saw.

Every kind is an analyzer (:class:`~lensdiv.lenses.affine.AffineFit`,
:class:`~lensdiv.lenses.jacobian.JacobianFit`, :class:`~lensdiv.lenses.tuned.TunedFit`) run by
:func:`lensdiv.analyze`: the run folder is an ordinary one (manifest, ``fit-<kind>/result.json``)
whose result carries the lens, and everything a run does works alike — ``torchrun`` ranks,
``--overwrite``, Ctrl-C keeping a lens from the prompts (or training steps) done so far; the
affine and Jacobian fits also split into ``--shard I/N`` + ``lensdiv merge``. A tuned lens
trains by SGD, one pass of the run per step (its passes read the data onward), so it cannot be
sharded, and under ``torchrun`` its gradient is all-reduced by the run's data-parallel feed.

Every kind's ``--out`` folder has one layout: ``manifest.json``, ``lens.json`` (the kind, and
where the lens is: ``fit-tuned/tuned_lens/``, ``fit-affine/affine_lens/``, ``fit-jacobian/jacobian_lens.pt``),
``evaluation.csv``/``.json``; ``--lens KIND:OUT`` and ``--lens OUT`` read it. How each kind is
fitted is named by its entry in the registry of lens kinds (:data:`~lensdiv.ops.translators.LENS_KINDS`,
``fitter="lensdiv.lenses.fit:TUNED_FITTER"``, imported when asked): :class:`AnalyzerFitter`,
:class:`TunedFitter` (each a :class:`~lensdiv.ops.translators.Fitter` of a
:class:`~lensdiv.ops.translators.FitRequest`).

Then, unless the fit is one shard of many, the lens is evaluated on the tokens that follow the
fit's in the same data (``DataSpec.skip_tokens``): the ``lens`` analyzer through the logit lens and
through the fitted one, per layer — the fit's own quality, ``evaluation.csv`` and
``evaluation.json`` in the output folder.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer, ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import DataError, DataWarning, LensdivError, OptionError
from lensdiv.core.progress import progress_allowed
from lensdiv.core.results import Rendered, Table, write_json_atomic
from lensdiv.core.settings import DEFAULTS, RunSettings, settings_keywords
from lensdiv.data.sources import DataSpec, known_tokens
from lensdiv.lenses.affine import AFFINE_FOLDER, AffineFit
from lensdiv.lenses.jacobian import JacobianFit
from lensdiv.lenses.tuned import DEFAULT_PRESET, PRESETS, TUNED_FOLDER, TunedFit, TunedRecipe
from lensdiv.models.load import load_model
from lensdiv.ops.lens_files import JACOBIAN_FILE
from lensdiv.ops.lens_specs import parse_lens, write_pointer
from lensdiv.ops.translators import (
    LABELS,
    LENS_KINDS,
    PHRASES,
    FitRequest,
    Fitter,
    Translator,
    fitted_kinds,
)
from lensdiv.run.defaults import default_data
from lensdiv.run.distributed import current_world, gather_objects
from lensdiv.run.runner import Run, analyze

EVALUATION = "evaluation"


@dataclass
class LensFit(Rendered):
    """What :func:`fit_lens` made.

    Args:
        kind: ``tuned``, ``jacobian`` or ``affine``.
        lens: The lens file or folder (what ``--lens KIND:PATH`` takes); ``None`` for a shard,
            whose states ``lensdiv merge`` turns into the lens.
        out: The output folder.
        run: The fitting run.
        evaluation: Per residual state: KL to the output and next-token cross-entropy through
            the logit lens and through the fitted one, on held-out tokens.
        manifest: What was fitted, on what, how.
        warnings: What the data could not hold (a shortened fit, no or a short evaluation),
            each also warned (:class:`~lensdiv.core.errors.DataWarning`) when it was found.
    """

    kind: str
    lens: Path | None
    out: Path
    run: Run | None = None
    evaluation: Table | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str | None:
        """``KIND:PATH``, for ``--lens`` / ``lens=``."""
        return None if self.lens is None else f"{self.kind}:{self.lens}"

    def line(self) -> str:
        """Where the lens is and how to use it (one line)."""
        if self.lens is None:
            return f"{PHRASES[self.kind]}: a shard's states in {self.out} (lensdiv merge)"
        return (
            f"{PHRASES[self.kind]}: {self.lens}  (use it: --lens {self.kind}:{self.out}, "
            f"or --lens {self.spec})"
        )

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        if self.evaluation is not None:
            yield self.evaluation
        yield Text(self.line())
        for line in self.warnings:
            yield Text(f"warning: {line}", style="yellow")


# The fits' own defaults of the run settings: a fit's tokens are its kind's budget (affine and
# Jacobian: the run's default; tuned: its recipe's), an evaluation's 8192 held-out tokens.
_FIT_DEFAULTS: dict[str, Any] = {"max_tokens": None}
_EVALUATE_DEFAULTS: dict[str, Any] = {"max_tokens": 8192}


@settings_keywords(keep_rest=True, hide=("lens",), **_FIT_DEFAULTS)
def fit_lens(
    model: Any,
    kind: str,
    *,
    out: str | Path,
    data: Any = None,
    settings: RunSettings | None = None,
    eval_tokens: int = 8192,
    preset: str | None = None,
    options: dict[str, Any] | None = None,
    init: Any = None,
    shard: str | tuple[int, int] | None = None,
    progress: bool = True,
    overwrite: bool = False,
    **load: Any,
) -> LensFit:
    """Fit a lens of ``model`` and evaluate it on held-out tokens of the same data.

    Args:
        model: A model spec or a ``TransformerBridge``.
        kind: ``tuned`` (SGD on KL(p_L ‖ p_l)), ``jacobian`` (mean Jacobian) or ``affine``
            (least squares to ``h_L``).
        out: The output folder (the lens is written inside it).
        data: As for :func:`lensdiv.analyze` (default: the model's, ``pydoc`` for a real model,
            else the built-in corpus).
        settings: The run settings (:class:`~lensdiv.core.settings.RunSettings`), or their
            names as keywords, as for :func:`lensdiv.analyze` (a Jacobian lens' prompt is one
            row of ``seq_len``); ``lens`` does not apply (a fit reads the model's own states).
            ``max_tokens``: the tokens the fit reads; its default here, ``None``, is the kind's
            budget: affine and Jacobian 16384, tuned its recipe's passes × tokens per step.
            Tuned: the passes are scaled to a ``max_tokens`` given (as many whole steps as fit,
            the closed-form pass of a ``-fast`` preset among them; less than that pass and one
            SGD step is refused before anything loads), unless ``options`` set ``steps`` (then
            it must hold them).
        eval_tokens: Held-out tokens the evaluation reads after the fit's (0: no evaluation).
        preset: Tuned (:data:`~lensdiv.lenses.tuned.PRESETS`): ``paper`` (250 steps of 2^18
            tokens), ``cpu`` or ``toy``, the published recipe from the identity; ``cpu-fast``
            (the default, :data:`~lensdiv.lenses.tuned.DEFAULT_PRESET`) or ``toy-fast``, the
            fast path: a closed-form pass (the affine lens) then 15 SGD steps at lr 4.
        options: The fit's options: ``JacobianFit``/``AffineFit`` fields, or ``TunedRecipe``
            fields for a tuned lens (they override the preset).
        init: Tuned: a lens to start from (an affine lens' spec, say), in place of a ``-fast``
            preset's closed-form pass (its SGD steps kept); the identity otherwise.
        shard: ``"I/N"``: fit shard I of N (affine, Jacobian), merged by ``lensdiv merge``.
        progress, overwrite, load: As for :func:`lensdiv.analyze` (``load``: the run
            settings as keywords, and ``device_map``, ``max_memory``, ``trust_remote_code``, ...
            for loading the model).

    Raises:
        LensdivError: A bad kind, option or data, before any work.
        TypeError: A run setting passed both ways, or ``settings`` that is no ``RunSettings``.
    """
    settings = _fit_settings(settings, load)
    how = _fitting(kind)
    out = Path(out)
    options = dict(options or {})
    fitter, tokens, start = how.plan(
        FitRequest(
            preset, options, init, settings.max_tokens, settings.seq_len, settings.batch_size, shard
        )
    )
    bridge = _bridge(
        model, settings.device, settings.dtype, progress and current_world().main, **load
    )
    if start is not None:  # a start of another model: one line before any pass
        start.check(ModelInfo.from_model(bridge))
    data = default_data(bridge) if data is None else data
    said: list[str] = []  # a shard reads its share: the data's size says nothing of it
    held = (
        None
        if shard is not None
        else _held_tokens(data, settings, tokens, eval_tokens, bridge, said)
    )
    run = analyze(
        bridge,
        data=data,
        plugins=[fitter],
        out=out,
        # the bridge is loaded where and how the settings say
        settings=dataclasses.replace(settings, max_tokens=tokens, device=None, dtype=None),
        progress=progress,
        overwrite=overwrite,
        shard=shard,
    )
    fit, complete, read = _fitted(run, kind, out, fitter.name, how.artifact, tokens, said)
    if fit.lens is None or eval_tokens <= 0 or not complete:
        return fit
    # the data ran out (steps done of those planned), or holds nothing after the fit's tokens:
    # the lens stays, without its evaluation
    short = read < tokens or (held is not None and held <= tokens)
    why = f"the fit read all {read:,} tokens of the data ({tokens:,} planned)" if short else None
    _evaluate_fit(fit, model, bridge, data, settings, tokens, eval_tokens, why, progress)
    return fit


def _fit_settings(settings: RunSettings | None, load: dict[str, Any]) -> RunSettings:
    """The fit's run settings from ``settings`` and those of ``load``'s keywords (taken out of
    it: what stays is for ``load_model``, a keyword of neither a TypeError); no lens."""
    given = {n: load.pop(n) for n in RunSettings.names() if n in load}
    loading = set(inspect.signature(load_model).parameters) - {
        "spec",
        "device",
        "dtype",
        "progress",
    }
    unknown = sorted(set(load) - loading)
    if unknown:
        raise TypeError(
            f"fit_lens() got an unexpected keyword argument {unknown[0]!r} (its run settings: "
            f"{', '.join(RunSettings.names())}; load_model's: {', '.join(sorted(loading))})"
        )
    settings = RunSettings.of(settings, given, caller="fit_lens", defaults=_FIT_DEFAULTS)
    _no_lens(settings, "a fit reads the model's own residual states", "tuned: init=LENS")
    return settings


def _fitting(kind: str) -> Fitter:
    """How a lens of ``kind`` is fitted (its entry in the registry of lens kinds)."""
    found = LENS_KINDS.get(kind)
    how = None if found is None else found.fitting()
    if found is None or how is None:
        raise OptionError(
            f"unknown lens kind {kind!r}", hint=f"use one of {', '.join(fitted_kinds())}"
        )
    return how


def _fitted(
    run: Run, kind: str, out: Path, name: str, artifact: str, tokens: int, said: list[str]
) -> tuple[LensFit, bool, int]:
    """The fit's outcome on every rank (the lens, ``out/name/artifact``, if the analyzer
    ``name`` wrote it; ``lens.json`` pointing at it), whether the run was complete, and the
    tokens it read.

    Rank 0 alone finalizes and writes: its word decides, on every rank, whether the lens is
    there and complete (every rank takes part in the evaluation's runs).
    """
    written, complete, read = gather_objects(
        current_world(),
        (
            name in run.results,
            run.manifest.get("status") == "complete",
            int(run.manifest.get("timings", {}).get("tokens", tokens)),
        ),
        "the end of the fit",
    )[0]
    lens = out / name / artifact if written else None
    fit = LensFit(kind, lens, out, run=run, manifest=run.manifest, warnings=said)
    if lens is not None and current_world().main:
        write_pointer(out, kind, lens)  # --lens KIND:OUT and --lens OUT read it
    return fit, complete, read


def _evaluate_fit(
    fit: LensFit,
    model: Bridge,
    bridge: Any,
    data: Any,
    settings: RunSettings,
    tokens: int,
    eval_tokens: int,
    why: str | None,
    progress: bool,
) -> None:
    """The fitted lens evaluated on ``eval_tokens`` after the fit's ``tokens`` of the data
    (``fit.evaluation``), or one warning why it is not (``why``, or data that holds too few),
    naming the command that evaluates it on other data."""
    if why is None:
        try:
            fit.evaluation = evaluate_lens(
                bridge,
                f"{fit.kind}:{fit.lens}",
                data=data,
                settings=dataclasses.replace(settings, max_tokens=eval_tokens),
                skip_tokens=tokens,
                out=fit.out,
                progress=progress,
            )
        except DataError as err:
            why = err.message
    if why is not None:
        _say(
            f"no evaluation: {why}; none are left to evaluate the lens on — evaluate it on "
            f"other data: lensdiv lenses evaluate {_named(model)} --lens {fit.kind}:{fit.out} "
            "--data OTHER",
            fit.warnings,
        )


def _named(model: Any) -> str:
    """The model as the command line names it (``MODEL`` for a model object)."""
    return str(model) if isinstance(model, (str, Path)) else "MODEL"


def _held_tokens(
    data: Any, settings: RunSettings, tokens: int, eval_tokens: int, bridge: Any, said: list[str]
) -> int | None:
    """The tokens the data holds (up to the fit's and the evaluation's), when that is cheap to
    know before the fit (:func:`~lensdiv.data.sources.known_tokens`); says so, before the fit,
    when they cannot hold both."""
    spec = DataSpec.from_data(data, **settings.data(max_tokens=tokens + eval_tokens))
    held = known_tokens(spec, bridge.tokenizer)
    if held is None or held >= tokens + eval_tokens:
        return held
    fewer = f"the data holds {held:,} tokens, fewer than the fit's {tokens:,}"
    if held <= tokens:
        least = held - eval_tokens
        line = f"{fewer}: the fit reads all of it"
        if eval_tokens:
            line = f"{fewer} and the evaluation's {eval_tokens:,}: the fit reads all of it and "
            line += "leaves nothing to evaluate on"
            if least > 1:
                line += f" (a fit that leaves {eval_tokens:,}: --max-tokens {least})"
        _say(line, said)
    else:
        _say(
            f"{fewer} and the evaluation's {eval_tokens:,}: the evaluation gets the "
            f"{held - tokens:,} after the fit's",
            said,
        )
    return held


def _say(line: str, said: list[str]) -> None:
    """Warn ``line`` (:class:`~lensdiv.core.errors.DataWarning`; the CLI prints one line) on the
    main process, and keep it in ``said``."""
    if current_world().main:
        said.append(line)
        warnings.warn(line, DataWarning, stacklevel=3)


# -- how each kind is fitted (named by the kinds of lens: lensdiv.ops.translators) -----------------


@dataclass(frozen=True)
class AnalyzerFitter:
    """A lens that one pass of an analyzer sums over prompts (affine, Jacobian): shards merge;
    the lens is the result's artifact ``artifact``."""

    analyzer: type[AffineFit] | type[JacobianFit]
    artifact: str

    def plan(self, request: FitRequest) -> tuple[Analyzer, int, Translator | None]:
        """The fitting analyzer and the tokens it reads (the run's default unless given); the
        request's ``preset`` and ``init`` are a tuned lens'."""
        analyzer = self.analyzer.from_options(request.options)
        return analyzer, request.max_tokens or DataSpec.max_tokens, None


@dataclass(frozen=True)
class TunedFitter:
    """A tuned lens: trained by SGD, one pass of the run per step (:class:`TunedFit`)."""

    artifact: str = TUNED_FOLDER

    def plan(self, request: FitRequest) -> tuple[Analyzer, int, Translator | None]:
        """:func:`tuned_fit`, refusing shards (SGD steps do not split into shards)."""
        if request.shard is not None:
            raise OptionError(
                "a tuned lens trains with SGD and cannot be split into shards",
                hint="train it data parallel: torchrun --nproc-per-node N -m lensdiv lenses fit",
            )
        return tuned_fit(
            request.preset,
            request.options,
            request.init,
            max_tokens=request.max_tokens,
            seq_len=request.seq_len,
            batch_size=request.batch_size,
        )


# What the kinds of lens name as their fitters (LensKind.fitter, imported when first asked).
TUNED_FITTER: Fitter = TunedFitter()
JACOBIAN_FITTER: Fitter = AnalyzerFitter(JacobianFit, JACOBIAN_FILE)
AFFINE_FITTER: Fitter = AnalyzerFitter(AffineFit, AFFINE_FOLDER)


@settings_keywords(**_EVALUATE_DEFAULTS)
def evaluate_lens(
    model: Any,
    lens: Any,
    *,
    data: Any = None,
    settings: RunSettings | None = None,
    skip_tokens: int = 0,
    out: str | Path | None = None,
    progress: bool = True,
    **given: Any,
) -> Table:
    """The ``lens`` analyzer through the logit lens and through ``lens``, side by side.

    Args:
        model: A model spec or a ``TransformerBridge``.
        lens: A fitted lens (``KIND:PATH`` or a :class:`Translator`).
        data: As for :func:`lensdiv.analyze`.
        settings: The run settings (:class:`~lensdiv.core.settings.RunSettings`), or their
            names as keywords, as for :func:`lensdiv.analyze` (``lens`` is the argument above);
            ``max_tokens``: the tokens to evaluate on (default here 8192).
        skip_tokens: Tokens of the data to leave out first (those the fit read).
        out: Write ``evaluation.csv`` and ``evaluation.json`` there.

    Returns:
        A table per residual state: KL to the output and next-token cross-entropy through each.

    Raises:
        TypeError: A keyword that is neither an argument nor a run setting.
    """
    settings = RunSettings.of(settings, given, caller="evaluate_lens", defaults=_EVALUATE_DEFAULTS)
    _no_lens(settings, "evaluate_lens reads through its lens argument", "pass the lens as lens")
    translator = parse_lens(lens)
    bridge = _bridge(model, settings.device, settings.dtype, progress)
    spec = DataSpec.from_data(data, default=default_data(bridge), **settings.data())
    spec = dataclasses.replace(spec, skip_tokens=skip_tokens)
    runs = {
        name: analyze(bridge, data=spec, plugins="lens", lens=how, progress=progress)
        for name, how in (("logit", "logit"), (translator.kind, translator))
    }
    if not current_world().main:
        return Table(EVALUATION, {})
    for run in runs.values():
        if "lens" not in run.results:
            raise _not_evaluated(run, skip_tokens)
    tables = {name: run["lens"].table() for name, run in runs.items()}
    base = tables["logit"]
    columns: dict[str, Any] = {"layer": base["layer"], "state": base["state"]}
    for name, table in tables.items():
        columns[f"kl_{name}"] = table["kl"]
    for name, table in tables.items():
        columns[f"ce_{name}"] = table["ce"]
    label = LABELS[translator.kind]
    result = Table(
        EVALUATION,
        columns,
        f"{label} vs logit lens on {runs['logit'].manifest['timings'].get('tokens', 0)} "
        f"held-out tokens: KL(p_l ‖ p_out) and next-token cross-entropy per residual state",
    )
    if out is not None:
        folder = Path(out)
        result.to_csv(folder / f"{EVALUATION}.csv")
        write_json_atomic(
            folder / f"{EVALUATION}.json",
            {"lens": translator.describe(), "data": spec.describe(), "columns": columns},
        )
    return result


def _not_evaluated(run: Run, skip_tokens: int) -> LensdivError:
    """Why ``run`` of the ``lens`` analyzer has no result: the data ended before it read a token
    (within the ``skip_tokens`` left out), or the analyzer's own error."""
    if not run.manifest.get("timings", {}).get("tokens"):
        where = f"after the first {skip_tokens:,} tokens left out" if skip_tokens else ""
        return DataError(
            f"the data holds no tokens {where}".rstrip(),
            hint="pass more data (--data), or leave out fewer tokens (--skip-tokens)",
        )
    why = run.errors.get("lens") or "; ".join(run.problems) or "no result"
    return LensdivError(f"the evaluation's lens analyzer failed: {why}")


def _no_lens(settings: RunSettings, why: str, hint: str) -> None:
    """Refuse a ``lens`` setting where it does not apply (rather than ignore it)."""
    if settings.lens != DEFAULTS.lens:
        raise OptionError(f"{why}: the lens setting {settings.lens!r} does not apply", hint=hint)


def _bridge(model: Any, device: Any, dtype: Any, progress: bool, **load: Any) -> Any:
    """The model, loaded once for the fit and its evaluation."""
    if not isinstance(model, (str, Path)):
        return model
    with progress_allowed(progress):
        return load_model(str(model), device=device, dtype=dtype, progress=progress, **load)


def tuned_fit(
    preset: str | None,
    options: dict[str, Any],
    init: Any,
    *,
    max_tokens: int | None,
    seq_len: int,
    batch_size: int,
) -> tuple[TunedFit, int, Translator | None]:
    """The tuned fit of ``preset`` (``None``: :data:`~lensdiv.lenses.tuned.DEFAULT_PRESET`) with
    ``options``, the tokens it reads, and the lens it starts from — checked before anything is
    loaded.

    A pass (a step, or a closed-form pass of the fast path) takes whole batches, so it reads
    ``tokens_per_step`` rounded up to whole batches of ``batch_size × seq_len``. Without
    ``max_tokens`` the fit reads the recipe's passes of those. With ``max_tokens`` the passes
    are scaled to it: as many whole passes as fit (the closed-form ones first, the learning
    rate decaying to 0 over the SGD steps after them), unless ``steps`` is an option, whose
    passes must then fit in ``max_tokens``. ``init`` replaces a ``-fast`` preset's closed-form
    passes (its SGD steps are kept), unless ``affine_passes`` is an option.

    Raises:
        OptionError: An unknown preset or option, or ``max_tokens`` below the closed-form
            passes and one SGD step (or below the ``steps`` asked for).
    """
    preset = DEFAULT_PRESET if preset is None else preset
    if preset not in PRESETS:
        raise OptionError(f"unknown preset {preset!r}", hint=f"use one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    if init is not None and base.affine_passes and "affine_passes" not in options:
        # a lens to start from takes the closed-form start's place
        base = dataclasses.replace(base, steps=base.sgd_steps, affine_passes=0)
    recipe = recipe_with(base, options)
    batch_tokens = batch_size * seq_len
    step = -(-recipe.tokens_per_step // batch_tokens) * batch_tokens
    if max_tokens is not None:
        least = recipe.affine_passes + 1
        fits = max_tokens // step
        steps = recipe.steps if "steps" in options else fits
        if steps < least or fits < steps:
            if "steps" in options:
                asked = f"the {steps} steps asked for"
            elif recipe.affine_passes:
                asked = f"the closed-form pass{'es' * (least > 2)} and one SGD step"
            else:
                asked = "one step"
            raise OptionError(
                f"--max-tokens {max_tokens} is less than {asked} of the tuned lens' recipe "
                f"({step} tokens a step: tokens_per_step {recipe.tokens_per_step} in whole "
                f"batches of {batch_tokens})",
                hint=f"use --max-tokens {max(steps, least) * step} or more, or smaller steps "
                f"(-O tokens_per_step=N, or --preset {'toy-fast' if least > 1 else 'toy'})",
            )
        recipe = dataclasses.replace(recipe, steps=steps)
    start = parse_lens(init) if init is not None else None
    if start is not None and not isinstance(start, Translator):
        raise OptionError(
            f"a tuned lens starts from an affine map of h_l, which the {start.lens_kind.phrase} "
            "is not",
            hint="start from a fitted lens: init=tuned:PATH, affine:PATH or jacobian:PATH",
        )
    spec = None if start is None else start.spec
    return TunedFit.from_recipe(recipe, start=spec), recipe.steps * step, start


def recipe_with(recipe: TunedRecipe, options: dict[str, Any]) -> TunedRecipe:
    """``recipe`` with ``options`` (values as Python objects, or text from ``-O name=value``).

    Raises:
        OptionError: An unknown option, or a value that is not of the option's type.
    """
    fields = {f.name: f for f in dataclasses.fields(TunedRecipe)}
    changes: dict[str, Any] = {}
    for name, value in options.items():
        if name not in fields:
            raise OptionError(
                f"a tuned lens has no option {name!r}", hint=f"its options: {', '.join(fields)}"
            )
        kind = type(getattr(recipe, name))
        try:
            if isinstance(value, str) and kind is bool:
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                value = value.lower() in ("true", "1", "yes")
            changes[name] = kind(value)
        except (TypeError, ValueError):
            raise OptionError(
                f"option {name} of a tuned lens expects {kind.__name__}, got {value!r}"
            ) from None
    return dataclasses.replace(recipe, **changes)
