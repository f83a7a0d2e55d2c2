"""Training runs: each run's loss and sizes, from a CSV, a built-in table or columns, validated."""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float

from lensdiv.core.errors import DataError, OptionError, did_you_mean
from lensdiv.studies.scaling.datasets import DATASETS, builtin_dataset
from lensdiv.studies.scaling.law import TERMS, parse_terms

ROLES = ("loss", *TERMS)
DEFAULT_COLUMNS = {"loss": "loss", "width": "d_model", "depth": "n_layers", "tokens": "num_tokens"}


@dataclass(frozen=True)
class Runs:
    """Training runs: each run's loss and sizes.

    Args:
        loss: Final loss of each run (positive).
        sizes: Term name to the value per run (width m, depth ℓ after any offset, tokens D).
        labels: A name per run (``line 7`` of a CSV, or a model spec).
        columns: Role (``loss``, a term) to the column the values came from.
        source: Where the runs came from (a file or a model list).
    """

    loss: Float[np.ndarray, " n"]
    sizes: Mapping[str, np.ndarray]
    labels: tuple[str, ...]
    columns: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_COLUMNS))
    source: str = ""

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, index: np.ndarray) -> Runs:
        """The runs at ``index`` (an integer array; repeats allowed, as in a bootstrap)."""
        return Runs(
            loss=self.loss[index],
            sizes={t: v[index] for t, v in self.sizes.items()},
            labels=tuple(self.labels[i] for i in index),
            columns=self.columns,
            source=self.source,
        )

    def drop_highest(self, n: int) -> Runs:
        """Without the ``n`` highest-loss runs (the least-trained, off the law's asymptote).

        Runs tied with the ``n``-th highest loss go too, as in the source's fit (ties have no
        order); the Chinchilla table has three runs at its 40th-highest loss.
        """
        if n < 0:
            raise OptionError(f"drop-highest must be 0 or more, got {n}")
        if n == 0:
            return self
        keep = np.flatnonzero(self.loss < np.sort(self.loss)[-min(n, len(self))])
        if not len(keep):
            raise DataError(
                f"cannot drop the {n} highest-loss runs of {len(self)}: none would be left",
                hint="use a smaller --drop-highest",
            )
        return self.subset(keep)


def resolve_columns(columns: Mapping[str, str] | None) -> dict[str, str]:
    """The role → column mapping: the defaults overridden by ``columns``."""
    merged = dict(DEFAULT_COLUMNS)
    for role, name in (columns or {}).items():
        if role not in ROLES:
            raise OptionError(
                f"unknown column role {role!r}{did_you_mean(role, ROLES)}",
                hint=f"roles are {', '.join(ROLES)}, e.g. --column depth=n_layers",
            )
        merged[role] = name
    return merged


def runs_from_columns(
    table: Mapping[str, Sequence[Any]],
    terms: Sequence[str],
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    labels: Sequence[str],
    source: str,
) -> Runs:
    """Validate named columns of raw values (strings or numbers) and turn them into :class:`Runs`.

    Args:
        table: Column name to one raw value per run.
        terms: The terms to be fitted; only their columns (and the loss) are required.
        columns: Role → column name overrides of :data:`DEFAULT_COLUMNS`.
        depth_offset: Added to the depth column (``-2``: ℓ = n_layers − 2).
        labels: Where each run is, for error messages (``line 7``).
        source: File or model list, for error messages.

    Raises:
        DataError: A needed column is missing, or a value is not a positive finite number.
    """
    mapping = resolve_columns(columns)
    roles = ["loss", *terms]
    missing = [mapping[r] for r in roles if mapping[r] not in table]
    if missing:
        names = ", ".join(repr(m) for m in missing)
        raise DataError(
            f"{source} has no column {names} (it has: {', '.join(table) or 'none'})",
            hint="name the columns with --column ROLE=NAME, e.g. --column depth=layers",
        )
    values = {
        r: _positive_column(
            table[mapping[r]],
            r,
            mapping[r],
            labels,
            source,
            float(depth_offset if r == "depth" else 0),
        )
        for r in roles
    }
    return Runs(
        loss=values["loss"],
        sizes={t: values[t] for t in terms},
        labels=tuple(labels),
        columns={r: mapping[r] for r in roles},
        source=source,
    )


def _positive_column(
    raw: Sequence[Any], role: str, name: str, labels: Sequence[str], source: str, offset: float
) -> np.ndarray:
    out = np.empty(len(raw))
    shown = f"{name} {offset:+g}" if offset else f"column {name!r}"
    for i, value in enumerate(raw):
        where = f"{source} {labels[i]}"
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise DataError(
                f"{where}: column {name!r} is {str(value)!r}, not a number",
                hint="every run needs a number there (remove or fix the run)",
            ) from None
        if not math.isfinite(number):
            raise DataError(f"{where}: column {name!r} is {value}, not a finite number")
        number += offset
        if number <= 0:
            raise DataError(
                f"{where}: {role} is {number:g} ({shown}), but the fit takes its log",
                hint="drop the run"
                + (" or change --depth-offset" if offset else "")
                + " (every loss and size must be positive)",
            )
        out[i] = number
    return out


def read_runs(
    source: str | Path,
    terms: str | Sequence[str] = "full",
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    drop_highest: int = 0,
) -> Runs:
    """Read training runs from a CSV with a header row, or from a built-in table by name.

    Args:
        source: A built-in table's name (a ``str`` in
            :data:`~lensdiv.studies.scaling.datasets.DATASETS`, e.g. ``"chinchilla"``; the name
            wins over a file of that name, which ``./chinchilla`` reads) or a CSV file (e.g.
            ``model_size,FLOP,loss,num_tokens,d_model,n_layers``).
        terms: Terms to fit (see :func:`~lensdiv.studies.scaling.law.parse_terms`); only their
            columns are required.
        columns: Role → column overrides, e.g. ``{"depth": "layers"}``.
        depth_offset: Added to the depth column (the source fit Chinchilla with ``-2``).
        drop_highest: Drop this many highest-loss runs.

    Raises:
        DataError: Neither a built-in name nor an existing file; an unreadable or empty file, a
            missing column, a bad value (naming its line), or ``drop_highest`` not below the
            number of runs.
    """
    terms = parse_terms(terms)
    text, where = _runs_text(source)
    rows = [(n, row) for n, row in enumerate(csv.reader(text.splitlines()), 1) if any(row)]
    if not rows:
        raise DataError(f"runs file {where!r} is empty", hint="it needs a header and runs")
    header = [h.strip() for h in rows[0][1]]
    body = rows[1:]
    if not body:
        raise DataError(f"runs file {where!r} has a header but no runs")
    table = {
        name: [row[j].strip() if j < len(row) else "" for _, row in body]
        for j, name in enumerate(header)
    }
    runs = runs_from_columns(
        table,
        terms,
        columns=columns,
        depth_offset=depth_offset,
        labels=[f"line {n}" for n, _ in body],
        source=Path(where).name,
    )
    runs = dataclasses.replace(runs, source=where)
    return runs.drop_highest(drop_highest)


def chinchilla_runs(
    terms: str | Sequence[str] = "full",
    *,
    columns: Mapping[str, str] | None = None,
    depth_offset: int = 0,
    drop_highest: int = 0,
) -> Runs:
    """The built-in Chinchilla table's runs (:func:`read_runs` of ``"chinchilla"``).

    The source's fit is ``chinchilla_runs(drop_highest=40, depth_offset=-2)``: 203 runs (three
    tie at the 40th-highest loss), depth ``n_layers − 2``.
    """
    return read_runs(
        "chinchilla",
        terms,
        columns=columns,
        depth_offset=depth_offset,
        drop_highest=drop_highest,
    )


def _runs_text(source: str | Path) -> tuple[str, str]:
    """The CSV text of a built-in table (a ``str`` naming one) or of a file, and where it is (the
    name, or the path as given)."""
    dataset = builtin_dataset(source)
    if dataset is not None:
        return dataset.read_text(), dataset.name
    where = str(source)
    try:
        return Path(source).read_text(encoding="utf-8-sig"), where
    except FileNotFoundError:
        raise DataError(
            f"runs file {where!r} does not exist and is not a built-in table"
            + did_you_mean(where, tuple(DATASETS)),
            hint=f"check the path, or name a built-in table: {', '.join(DATASETS)}",
        ) from None
    except UnicodeDecodeError:
        raise DataError(f"runs file {where!r} is not UTF-8 text") from None
    except OSError as err:
        raise DataError(f"cannot read {where!r}: {err.strerror}") from None


def varying_terms(runs: Runs, terms: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """The terms whose column varies, and a note for each constant one (it cannot be fitted)."""
    kept, notes = [], []
    for t in terms:
        values = runs.sizes[t]
        if np.all(values == values[0]):
            column = runs.columns.get(t, t)
            notes.append(f"{t} term dropped: {column} is {values[0]:g} in every run")
        else:
            kept.append(t)
    if not kept:
        raise DataError(
            f"no size varies across the {len(runs)} runs ({', '.join(notes)})",
            hint="fit runs that differ in width, depth or tokens",
        )
    return tuple(kept), notes
