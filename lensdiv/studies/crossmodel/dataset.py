"""The tidy dataset of a study: one long table of every number of every finished run.

One row per value: which model (with its size facts), which analyzer, table and row, where the
row sits in depth (when the table is per-layer, :mod:`lensdiv.core.depth`), which metric (the
column) and the value. Written as Parquet (what pandas, polars and DuckDB read as it is) and as
CSV next to it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lensdiv.core.depth import DepthIndex, depth_index, is_number
from lensdiv.core.results import Result

#: The columns of the dataset, in order, with their Arrow types and meaning (the README and
#: docs/science.md#study list them too).
COLUMNS: dict[str, tuple[str, str]] = {
    "model": ("string", "the model spec as the study names it"),
    "run": ("string", "the model's run folder, under the study's runs/"),
    "params": ("int64", "parameters of the model (null: unknown)"),
    "n_layers": ("int64", "blocks L"),
    "d_model": ("int64", "residual width"),
    "d_vocab": ("int64", "vocabulary size"),
    "analyzer": ("string", "the analyzer"),
    "table": ("string", "the analyzer's table"),
    "row": ("int64", "the row's number in that table, from 0"),
    "layer": ("int64", "the row's layer (state h_ℓ) or block index ℓ; null: not per-layer"),
    "rel_depth": ("double", "relative depth: ℓ/L for a state, (ℓ + ½)/L for a block"),
    "key": ("string", "the row's text columns, 'name=value; ...' (e.g. grade=2-hop); null: none"),
    "metric": ("string", "the column the value is from"),
    "value": ("double", "the number (booleans as 0 and 1; NaN where the result has none)"),
    "profile": ("bool", "the column is one of the analyzer's declared depth profiles"),
}
SIZE_FACTS = ("params", "n_layers", "d_model", "d_vocab")


def size_facts(manifest: Mapping[str, Any]) -> dict[str, int | None]:
    """A run's size facts from its manifest (``None`` where it does not say)."""
    model = manifest.get("model", {})
    keys = {"params": "parameters", "n_layers": "n_layers", "d_model": "d_model"}
    keys["d_vocab"] = "d_vocab"
    return {
        fact: int(model[key]) if isinstance(model.get(key), (int, float)) else None
        for fact, key in keys.items()
    }


def tidy_columns(
    runs: Iterable[tuple[str, str, Mapping[str, Any], Mapping[str, Result]]],
    profiles: Callable[[str, Result, int], list[tuple[str, str]]],
) -> dict[str, list[Any]]:
    """The dataset as columns (see :data:`COLUMNS`).

    Args:
        runs: ``(model, run folder, manifest, results)`` of each finished run.
        profiles: ``(analyzer, result, n_layers) -> [(table, column)]``, its depth profiles.
    """
    out: dict[str, list[Any]] = {name: [] for name in COLUMNS}
    for model, folder, manifest, results in runs:
        facts = size_facts(manifest)
        n_layers = facts["n_layers"] or 0
        for analyzer, result in results.items():
            declared = set(profiles(analyzer, result, n_layers)) if n_layers else set()
            for name, table in result.tables.items():
                index = depth_index(table, n_layers)
                _melt(out, (model, folder, facts, analyzer, name), table, index, declared)
    return out


def _melt(
    out: dict[str, list[Any]],
    where: tuple[str, str, dict[str, int | None], str, str],
    table: Any,
    index: DepthIndex | None,
    declared: set[tuple[str, str]],
) -> None:
    model, folder, facts, analyzer, name = where
    columns = table.columns
    numeric = [
        c
        for c, values in columns.items()
        if (index is None or c != index.column) and all(is_number(v) for v in values)
    ]
    labels = [c for c in columns if c not in numeric and (index is None or c != index.column)]
    for row in range(len(table)):
        layer = int(columns[index.column][row]) if index is not None else None
        depth = index.relative(layer) if index is not None and layer is not None else math.nan
        key = "; ".join(f"{c}={columns[c][row]}" for c in labels) or None
        for metric in numeric:
            value = columns[metric][row]
            out["model"].append(model)
            out["run"].append(folder)
            for fact in SIZE_FACTS:
                out[fact].append(facts[fact])
            out["analyzer"].append(analyzer)
            out["table"].append(name)
            out["row"].append(row)
            out["layer"].append(layer)
            out["rel_depth"].append(depth)
            out["key"].append(key)
            out["metric"].append(metric)
            out["value"].append(float(value))
            out["profile"].append((name, metric) in declared)


def arrow_table(columns: Mapping[str, Sequence[Any]]) -> Any:
    """The dataset as a ``pyarrow.Table`` with the types of :data:`COLUMNS`."""
    import pyarrow as pa

    schema = pa.schema([(name, pa.type_for_alias(kind)) for name, (kind, _) in COLUMNS.items()])
    return pa.table({name: list(columns[name]) for name in COLUMNS}, schema=schema)


def write_dataset(columns: Mapping[str, Sequence[Any]], parquet: Path, csv: Path) -> list[Path]:
    """Write the dataset as Parquet and as CSV, each atomically; return both paths."""
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    table = arrow_table(columns)
    for path, write in ((parquet, pq.write_table), (csv, pcsv.write_csv)):
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            write(table, str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return [parquet, csv]


def to_pandas(table: Any) -> Any:
    """A ``pyarrow.Table`` of the dataset as a pandas ``DataFrame`` (integer columns nullable,
    ``Int64``, so a missing layer stays missing rather than becoming a float)."""
    import pandas as pd
    import pyarrow as pa

    frame = table.to_pandas(types_mapper={pa.int64(): pd.Int64Dtype()}.get)
    return frame
