"""A model family's runs: evaluate every model on the same tokens and fit the law to the losses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from lensdiv.core.errors import DataError, OptionError, did_you_mean
from lensdiv.core.progress import progress_bar
from lensdiv.core.results import Result, Table
from lensdiv.data.sources import DataSpec, check_source, token_batches
from lensdiv.models.load import load_model, resolve_spec
from lensdiv.models.toy import ToySpec, cached_log, parse_toy
from lensdiv.studies.scaling.fit import Uncertainty
from lensdiv.studies.scaling.law import parse_terms
from lensdiv.studies.scaling.result import scaling_result
from lensdiv.studies.scaling.runs import runs_from_columns

# Model-family shortcuts for `lensdiv scaling family`: the toy zoo's depth and width families.
FAMILIES = {
    "zoo:depth": ("toy:d1", "toy:d2", "toy:d3", "toy:d4", "toy:d6", "toy:d8"),
    "zoo:width": ("toy:d4-w32", "toy:d4-w64", "toy:d4-w128"),
}


def expand_models(models: str | Sequence[str]) -> list[str]:
    """Model specs from a comma-separated list; ``zoo:depth`` / ``zoo:width`` expand to the toy
    zoo's depth family (width 64) and width family (depth 4)."""
    names = models.split(",") if isinstance(models, str) else list(models)
    out: list[str] = []
    for name in (n.strip() for n in names):
        if name.startswith("zoo:") and name not in FAMILIES:
            raise OptionError(
                f"unknown model family {name!r}{did_you_mean(name, list(FAMILIES))}",
                hint=f"use {' or '.join(FAMILIES)}, or list the models",
            )
        out += FAMILIES.get(name, (name,) if name else ())
    if len(out) < 2:
        raise OptionError(
            f"a family needs at least two models, got {len(out)}",
            hint="e.g. lensdiv scaling family toy:d2,toy:d4,toy:d6,toy:d8 (or zoo:depth)",
        )
    return out


def collect_family(
    models: str | Sequence[str],
    data: Any = None,
    *,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Table:
    """Evaluate each model on the same tokens: mean next-token cross-entropy and its sizes.

    Args:
        models: Model specs (see :func:`expand_models`), loaded one at a time.
        data: A :class:`~lensdiv.data.sources.DataSpec` (default: the built-in corpus, 16384 tokens).
        device, dtype: Where and in which precision the models run.
        trust_remote_code: Allow hub models with custom code.
        progress: Show a progress bar over the models.

    Returns:
        Table ``family``: ``model``, ``loss``, ``d_model``, ``n_layers``, ``tokens`` (trained on,
        from a toy model's training log; NaN when unknown), ``params`` and ``eval_tokens``.

    Raises:
        DataError: The models tokenize the data differently (a family shares one tokenizer).
        ModelLoadError: A spec names nothing loadable.
    """
    specs = expand_models(models)
    data = data if data is not None else DataSpec()
    check_source(data)
    rows: dict[str, list[Any]] = {
        k: [] for k in ("model", "loss", "d_model", "n_layers", "tokens", "params", "eval_tokens")
    }
    reference: tuple[str, list[Any]] | None = None
    bar = progress_bar("[bold]evaluating[/bold] {task.fields[model]}", "models", enabled=progress)
    with bar:
        task = bar.add_task("models", total=len(specs), model="")
        for spec in specs:
            bar.update(task, model=spec + _training_note(spec))
            # Nested live displays are not allowed: a toy model that must train does so quietly.
            model = load_model(
                spec,
                device=device,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                progress=False,
            )
            batches = list(token_batches(data, model.tokenizer))
            if reference is None:
                reference = (spec, batches)
            _check_same_tokens(reference, spec, batches)
            loss, count = _mean_cross_entropy(model, batches)
            rows["model"].append(spec)
            rows["loss"].append(loss)
            rows["d_model"].append(int(model.cfg.d_model))
            rows["n_layers"].append(int(model.cfg.n_layers))
            rows["tokens"].append(_tokens_trained(spec))
            rows["params"].append(sum(p.numel() for p in model.parameters()))
            rows["eval_tokens"].append(count)
            del model  # one model in memory at a time
            bar.advance(task)
    return Table("family", rows, "each model's mean next-token cross-entropy on the same tokens")


def _check_same_tokens(reference: tuple[str, list[Any]], spec: str, batches: list[Any]) -> None:
    first, expected = reference
    same = len(batches) == len(expected) and all(
        a.tokens.shape == b.tokens.shape and bool((a.tokens == b.tokens).all())
        for a, b in zip(batches, expected, strict=True)
    )
    if not same:
        raise DataError(
            f"{spec} and {first} tokenize the data differently, so their losses are not comparable",
            hint="a family must share one tokenizer",
        )


def _mean_cross_entropy(model: Any, batches: list[Any]) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over the real positions, and their number."""
    # start-up: fitting a CSV needs no torch; it loads only when a family is evaluated.
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            tokens, mask = batch.tokens.to(device), batch.mask.to(device)
            logits = model(tokens)
            valid = mask[:, 1:] & mask[:, :-1]
            targets = tokens[:, 1:][valid]
            total += float(F.cross_entropy(logits[:, :-1][valid].float(), targets, reduction="sum"))
            count += int(valid.sum())
    return total / count, count


def _toy(spec: str) -> ToySpec | None:
    """The toy model ``spec`` names, or ``None`` for any other model."""
    parsed = resolve_spec(spec)
    return parse_toy(parsed.resolved) if parsed.kind == "toy" else None


def _training_note(spec: str) -> str:
    """What the progress bar adds for a toy model that is not cached (it trains first)."""
    toy = _toy(spec)
    if toy is None or cached_log(toy):
        return ""
    return " (not cached: training it first)"


def _tokens_trained(spec: str) -> float:
    """Tokens a toy model was trained on (from its cached training log); NaN otherwise."""
    toy = _toy(spec)
    log = None if toy is None else cached_log(toy)
    if log is None:
        return math.nan
    recipe = log["recipe"]
    return float(recipe["steps"] * recipe["batch_size"] * recipe["seq_len"])


def fit_family(
    models: str | Sequence[str],
    data: Any = None,
    terms: str | Sequence[str] = "full",
    *,
    depth_offset: int = 0,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
    device: Any = None,
    dtype: Any = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Result:
    """Collect a model family's losses on the same data (:func:`collect_family`) and fit them
    (:func:`fit_family_table`).

    Example: ``fit_family("zoo:depth", terms="depth", folds=0)``.
    """
    terms = parse_terms(terms)
    Uncertainty(n_bootstrap, folds, seed, confidence)  # checked before any model is evaluated
    data = data if data is not None else DataSpec()
    family = collect_family(
        models,
        data,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        progress=progress,
    )
    return fit_family_table(
        family,
        terms,
        depth_offset=depth_offset,
        n_bootstrap=n_bootstrap,
        folds=folds,
        seed=seed,
        confidence=confidence,
        meta={"data": dataclasses.asdict(data)},
    )


def fit_family_table(
    family: Table,
    terms: str | Sequence[str] = "full",
    *,
    depth_offset: int = 0,
    n_bootstrap: int = 200,
    folds: int = 5,
    seed: int = 0,
    confidence: float = 0.95,
    meta: Mapping[str, Any] | None = None,
) -> Result:
    """Fit the law to a table from :func:`collect_family`.

    Terms whose size is unknown for some model (tokens of a non-toy model) or the same for every
    model (the width of a depth family) are dropped, with a note in the summary.

    Args:
        family: The collected table.
        terms, n_bootstrap, folds, seed, confidence: As for
            :func:`~lensdiv.studies.scaling.result.fit_runs`.
        depth_offset: Added to the layer count (ℓ = n_layers + offset).
        meta: Extra settings to record (the data the losses were measured on).
    """
    terms = parse_terms(terms)
    notes = []
    unknown = [m for m, t in zip(family["model"], family["tokens"], strict=True) if math.isnan(t)]
    if "tokens" in terms and unknown:
        notes.append(f"tokens term dropped: tokens trained unknown for {', '.join(unknown)}")
        terms = tuple(t for t in terms if t != "tokens")
        if not terms:
            raise DataError(
                f"cannot fit tokens: tokens trained unknown for {', '.join(unknown)}",
                hint="fit width or depth, e.g. --terms depth",
            )
    columns = {"loss": "loss", "width": "d_model", "depth": "n_layers", "tokens": "tokens"}
    runs = runs_from_columns(
        dict(family.columns),
        terms,
        columns=columns,
        depth_offset=depth_offset,
        labels=list(family["model"]),
        source="model",
    )
    runs = dataclasses.replace(runs, source=",".join(family["model"]))
    settings = {
        "models": list(family["model"]),
        **(meta or {}),
        "columns": columns,
        "depth_offset": depth_offset,
    }
    extra = {k: family[k] for k in ("d_model", "n_layers", "params", "eval_tokens")}
    uncertainty = Uncertainty(n_bootstrap, folds, seed, confidence)
    return scaling_result(runs, terms, uncertainty, notes=notes, meta=settings, extra=extra)
