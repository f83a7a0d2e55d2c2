"""A model family's runs: evaluate every model on the same tokens (a study of one analyzer, the
mean loss) and fit the law to the losses."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lensdiv.core.errors import DataError, OptionError, StudyError
from lensdiv.core.results import Result, Table
from lensdiv.data.sources import DataSpec
from lensdiv.models.load import resolve_spec
from lensdiv.models.toy import ToySpec, parse_toy, trained_log
from lensdiv.studies.crossmodel.models import resolve_models
from lensdiv.studies.scaling.fit import Uncertainty
from lensdiv.studies.scaling.law import parse_terms
from lensdiv.studies.scaling.result import scaling_result
from lensdiv.studies.scaling.runs import runs_from_columns


def expand_models(models: str | Sequence[str]) -> list[str]:
    """Model specs of a family: what :func:`~lensdiv.studies.crossmodel.resolve_models` reads
    (comma lists, ``zoo:depth`` / ``zoo:width``, files of specs, folders), at least two."""
    out = resolve_models(models)
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
    study: str | Path | None = None,
) -> Table:
    """Evaluate each model on the same tokens: mean next-token cross-entropy and its sizes.

    A study (:func:`~lensdiv.studies.crossmodel.run_study`) of one analyzer,
    :class:`~lensdiv.studies.scaling.loss.FamilyLoss`: one run per model, loaded one at a time.

    Args:
        models: Model specs (see :func:`expand_models`).
        data: A :class:`~lensdiv.data.sources.DataSpec` (default: the built-in corpus, 16384 tokens).
        device, dtype: Where and in which precision the models run.
        trust_remote_code: Allow hub models with custom code.
        progress: Show each model's progress.
        study: A folder for the study (one run folder per model; a rerun keeps the models that
            finished); ``None``: in memory.

    Returns:
        Table ``family``: ``model``, ``loss``, ``d_model``, ``n_layers``, ``tokens`` (trained on,
        from a toy model's training log; NaN when unknown), ``params`` and ``eval_tokens``.

    Raises:
        DataError: The models tokenize the data differently (a family shares one tokenizer).
        StudyError: A model could not be evaluated (its one-line reason; the others' runs are
            kept in ``study``).
    """
    # start-up: a CSV fit needs no torch; the study (the runner) loads with a family.
    from lensdiv.studies.crossmodel import run_study  # start-up: as above
    from lensdiv.studies.scaling.loss import FamilyLoss  # start-up: torch, as above

    specs = expand_models(models)
    data = data if data is not None else DataSpec()
    done = run_study(
        specs,
        data,
        [FamilyLoss()],
        out=study,
        progress=progress,
        report=study is not None,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
    )
    failed = [m for m in done.models if m.status != "complete"]
    if failed:
        raise StudyError(
            f"{failed[0].model} could not be evaluated: {failed[0].reason}",
            hint="fix it and run again"
            + (" (the models that finished are kept)" if study is not None else ""),
        )
    rows: dict[str, list[Any]] = {
        k: [] for k in ("model", "loss", "d_model", "n_layers", "tokens", "params", "eval_tokens")
    }
    reference: tuple[str, str] | None = None
    for entry in done.models:
        result = done[entry.model]["loss"]
        fingerprint = str(result.meta["tokens_sha256"])
        reference = reference or (entry.model, fingerprint)
        _check_same_tokens(reference, entry.model, fingerprint)
        rows["model"].append(entry.model)
        rows["loss"].append(float(result.table()["loss"][0]))
        rows["d_model"].append(entry.size["d_model"])
        rows["n_layers"].append(entry.size["n_layers"])
        rows["tokens"].append(_tokens_trained(entry.model))
        rows["params"].append(entry.size["params"])
        rows["eval_tokens"].append(int(result.table()["count"][0]))
    return Table("family", rows, "each model's mean next-token cross-entropy on the same tokens")


def _check_same_tokens(reference: tuple[str, Any], spec: str, batches: Any) -> None:
    """``spec`` read the tokens the reference model read (batches, or their fingerprint)."""
    first, expected = reference
    same = _as_fingerprint(expected) == _as_fingerprint(batches)
    if not same:
        raise DataError(
            f"{spec} and {first} tokenize the data differently, so their losses are not comparable",
            hint="a family must share one tokenizer",
        )


def _as_fingerprint(batches: Any) -> str:
    # start-up: batches are torch tensors; a fingerprint of them needs the loss module.
    from lensdiv.studies.scaling.loss import fingerprint

    return batches if isinstance(batches, str) else fingerprint(batches)


def _toy(spec: str) -> ToySpec | None:
    """The toy model ``spec`` names, or ``None`` for any other model."""
    parsed = resolve_spec(spec)
    return parse_toy(parsed.resolved) if parsed.kind == "toy" else None


def _tokens_trained(spec: str) -> float:
    """Tokens a toy model was trained on (from its training log, cached or shipped); NaN
    otherwise."""
    toy = _toy(spec)
    found = None if toy is None else trained_log(toy)
    if found is None:
        return math.nan
    recipe = found[1]["recipe"]
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
    study: str | Path | None = None,
) -> Result:
    """Collect a model family's losses on the same data (:func:`collect_family`, a study whose
    folder is ``study``) and fit them (:func:`fit_family_table`).

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
        study=study,
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
