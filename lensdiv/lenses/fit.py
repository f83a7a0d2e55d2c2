"""``lensdiv lenses fit`` and ``evaluate``: fit a lens of a model, and compare it with the logit
lens on data the fit never saw.

- ``affine`` and ``jacobian`` are analyzers (:class:`~lensdiv.lenses.affine.AffineFit`,
  :class:`~lensdiv.lenses.jacobian.JacobianFit`) run by :func:`lensdiv.analyze`: the run folder
  is an ordinary one (manifest, ``fit-<kind>/result.json``) whose result carries the lens file,
  and everything a run does works — ``torchrun`` ranks, ``--shard I/N`` + ``lensdiv merge``,
  Ctrl-C keeping a lens from the prompts done so far.
- ``tuned`` trains (:mod:`lensdiv.lenses.tuned`; DDP under ``torchrun``) and writes
  ``tuned_lens/`` and a manifest.

Then, unless the fit is one shard of many, the lens is evaluated on the tokens that follow the
fit's in the same data (``DataSpec.skip_tokens``): the ``lens`` analyzer through the logit lens and
through the fitted one, per layer — the fit's own quality, ``evaluation.csv`` and
``evaluation.json`` in the output folder.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensdivError, OptionError
from lensdiv.core.progress import progress_allowed, progress_bar
from lensdiv.core.provenance import versions
from lensdiv.core.results import Rendered, Table, write_json_atomic
from lensdiv.core.settings import DEFAULTS, RunSettings, settings_keywords
from lensdiv.data.sources import DataSpec, check_source, token_batches
from lensdiv.lenses.affine import AFFINE_FOLDER, AffineFit
from lensdiv.lenses.jacobian import JacobianFit
from lensdiv.lenses.tuned import (
    PRESETS,
    TUNED_FOLDER,
    TunedProgress,
    TunedRecipe,
    save_trained,
    train_tuned,
)
from lensdiv.models.load import load_model
from lensdiv.ops.translators import JACOBIAN_FILE, LABELS, PHRASES, parse_lens
from lensdiv.run.distributed import current_world, gather_objects
from lensdiv.run.interrupts import handle_signals
from lensdiv.run.runner import Run, analyze

KINDS = ("tuned", "jacobian", "affine")
EVALUATION = "evaluation"


@dataclass
class LensFit(Rendered):
    """What :func:`fit_lens` made.

    Args:
        kind: ``tuned``, ``jacobian`` or ``affine``.
        lens: The lens file or folder (what ``--lens KIND:PATH`` takes); ``None`` for a shard,
            whose states ``lensdiv merge`` turns into the lens.
        out: The output folder.
        run: The fitting run (affine, Jacobian).
        evaluation: Per residual state: KL to the output and next-token cross-entropy through
            the logit lens and through the fitted one, on held-out tokens.
        manifest: What was fitted, on what, how.
    """

    kind: str
    lens: Path | None
    out: Path
    run: Run | None = None
    evaluation: Table | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> str | None:
        """``KIND:PATH``, for ``--lens`` / ``lens=``."""
        return None if self.lens is None else f"{self.kind}:{self.lens}"

    def line(self) -> str:
        """Where the lens is and how to use it (one line)."""
        if self.lens is None:
            return f"{PHRASES[self.kind]}: a shard's states in {self.out} (lensdiv merge)"
        return f"{PHRASES[self.kind]}: {self.lens}  (use it: --lens {self.spec})"

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        if self.evaluation is not None:
            yield self.evaluation
        yield Text(self.line())


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
    preset: str = "cpu",
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
        data: As for :func:`lensdiv.analyze` (default: the built-in corpus).
        settings: The run settings (:class:`~lensdiv.core.settings.RunSettings`), or their
            names as keywords, as for :func:`lensdiv.analyze` (a Jacobian lens' prompt is one
            row of ``seq_len``); ``lens`` does not apply (a fit reads the model's own states).
            ``max_tokens``: the tokens the fit reads; its default here, ``None``, is the kind's
            budget: affine and Jacobian 16384, tuned its recipe's steps × tokens per step.
        eval_tokens: Held-out tokens the evaluation reads after the fit's (0: no evaluation).
        preset: Tuned: ``paper`` (250 steps of 2^18 tokens), ``cpu`` or ``toy``.
        options: The fit's options: ``JacobianFit``/``AffineFit`` fields, or ``TunedRecipe``
            fields for a tuned lens (they override the preset).
        init: Tuned: a lens to start from (an affine lens' spec, say); the identity otherwise.
        shard: ``"I/N"``: fit shard I of N (affine, Jacobian), merged by ``lensdiv merge``.
        progress, overwrite, load: As for :func:`lensdiv.analyze` (``load``: the run
            settings as keywords, and ``device_map``, ``max_memory``, ``trust_remote_code``, ...
            for loading the model).

    Raises:
        LensdivError: A bad kind, option or data, before any work.
        TypeError: A run setting passed both ways, or ``settings`` that is no ``RunSettings``.
    """
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
    if kind not in KINDS:
        raise OptionError(f"unknown lens kind {kind!r}", hint=f"use one of {', '.join(KINDS)}")
    out = Path(out)
    options = dict(options or {})
    if kind == "tuned":
        if shard is not None:
            raise OptionError(
                "a tuned lens trains with SGD and cannot be split into shards",
                hint="train it data parallel: torchrun --nproc-per-node N -m lensdiv lenses fit",
            )
        return _fit_tuned(
            model,
            out=out,
            data=data,
            settings=settings,
            eval_tokens=eval_tokens,
            preset=preset,
            options=options,
            init=init,
            progress=progress,
            overwrite=overwrite,
            **load,
        )
    fitter = (JacobianFit if kind == "jacobian" else AffineFit).from_options(options)
    tokens = settings.max_tokens or DataSpec.max_tokens  # the run's default
    bridge = _bridge(model, settings.device, settings.dtype, progress, **load)
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
    artifact = JACOBIAN_FILE if kind == "jacobian" else AFFINE_FOLDER
    lens = out / fitter.name / artifact if fitter.name in run.results else None
    fit = LensFit(kind, lens, out, run=run, manifest=run.manifest)
    if lens is not None and eval_tokens > 0 and run.manifest.get("status") == "complete":
        fit.evaluation = evaluate_lens(
            bridge,
            f"{kind}:{lens}",
            data=data,
            settings=dataclasses.replace(settings, max_tokens=eval_tokens),
            skip_tokens=tokens,
            out=out,
            progress=progress,
        )
    return fit


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
    spec = DataSpec.from_data(data, **settings.data())
    spec = dataclasses.replace(spec, skip_tokens=skip_tokens)
    runs = {
        name: analyze(bridge, data=spec, plugins="lens", lens=how, progress=progress)
        for name, how in (("logit", "logit"), (translator.kind, translator))
    }
    if not current_world().main:
        return Table(EVALUATION, {})
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


def _fit_tuned(
    model: Any,
    *,
    out: Path,
    data: Any,
    settings: RunSettings,
    eval_tokens: int,
    preset: str,
    options: dict[str, Any],
    init: Any,
    progress: bool,
    overwrite: bool,
    **load: Any,
) -> LensFit:
    """Train a tuned lens (see :mod:`lensdiv.lenses.tuned`), write it, evaluate it."""
    if preset not in PRESETS:
        raise OptionError(f"unknown preset {preset!r}", hint=f"use one of {', '.join(PRESETS)}")
    recipe = recipe_with(PRESETS[preset], options)
    # A step takes whole batches: budget the steps' batches, not their nominal tokens.
    batch_tokens = settings.batch_size * settings.seq_len
    tokens = settings.max_tokens or (
        recipe.steps * -(-recipe.tokens_per_step // batch_tokens) * batch_tokens
    )
    spec = DataSpec.from_data(data, **settings.data(max_tokens=tokens))
    check_source(spec)
    start = parse_lens(init) if init is not None else None
    folder = out / TUNED_FOLDER
    if folder.exists() and not overwrite:
        raise LensdivError(
            f"{folder} already holds a lens", hint="pass --overwrite, or another --out"
        )
    world = current_world()
    bridge = _bridge(model, settings.device, settings.dtype, progress and world.main, **load)
    info = ModelInfo.from_model(bridge, name=str(model) if isinstance(model, str) else None)
    if start is not None:
        start.check(info)
    started = time.time()
    lens, done = _train_with_progress(bridge, info, spec, recipe, start, world, progress)
    manifest = {
        "lensdiv_manifest": 1,
        "kind": "lens-fit",
        "lens": "tuned",
        **_status(done, recipe),
        "model": {"spec": info.name, "n_layers": info.n_layers, "d_model": info.d_model},
        "data": spec.describe(),
        "recipe": dataclasses.asdict(recipe),
        "preset": preset,
        "init": None if start is None else start.describe(),
        "steps": done.steps,
        "tokens": done.tokens,
        "world_size": world.size,
        "seed": settings.seed,
        "versions": versions(),
        "timings": {
            "total_s": round(time.time() - started, 3),
            "tokens_per_s": round(done.tokens / max(done.seconds, 1e-9), 1),
        },
        "final_kl": done.loss,
    }
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        save_trained(folder, lens, info, recipe, done)
        write_json_atomic(out / "manifest.json", manifest)
    gather_objects(world, None, "the saving of the tuned lens")  # every rank reads it next
    fit = LensFit("tuned", folder, out, manifest=manifest)
    if done.complete and eval_tokens > 0:
        fit.evaluation = evaluate_lens(
            bridge,
            f"tuned:{folder}",
            data=data,
            settings=dataclasses.replace(settings, max_tokens=eval_tokens),
            skip_tokens=tokens,
            out=out,
            progress=progress,
        )
    return fit


def _train_with_progress(
    bridge: Any,
    info: ModelInfo,
    spec: DataSpec,
    recipe: TunedRecipe,
    start: Any,
    world: Any,
    progress: bool,
) -> tuple[Any, TunedProgress]:
    """:func:`train_tuned` with a progress bar (steps, tokens/s, the summed KL) on rank 0;
    Ctrl-C and SIGTERM stop it between steps with what it has."""
    from rich.progress import TextColumn

    shown = progress and world.main
    with handle_signals(), progress_allowed(shown):
        rate = TextColumn("[cyan]{task.fields[rate]}[/cyan] · KL {task.fields[kl]}")
        with progress_bar("[bold]tuned lens[/bold]", "steps", rate, enabled=shown) as bar:
            task = bar.add_task("training", total=recipe.steps, rate="… tok/s", kl="…")

            def advance(done: TunedProgress) -> None:
                speed = done.tokens / max(done.seconds, 1e-9)
                total_kl = sum(done.loss or [0.0])
                bar.update(
                    task, completed=done.steps, rate=f"{speed:,.0f} tok/s", kl=f"{total_kl:.3g}"
                )

            return train_tuned(
                bridge,
                info,
                lambda: token_batches(spec, bridge.tokenizer),
                recipe,
                start=start,
                world=world,
                on_step=advance,
            )


def _status(done: TunedProgress, recipe: TunedRecipe) -> dict[str, Any]:
    """The manifest's status of a training: complete, interrupted, or partial (the data ran
    out before the last step, with a warning)."""
    if done.complete:
        return {"status": "complete"}
    if done.interrupted:
        return {"status": "interrupted"}
    return {
        "status": "partial",
        "warning": f"the data ran out after {done.steps} of {recipe.steps} steps",
    }


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
