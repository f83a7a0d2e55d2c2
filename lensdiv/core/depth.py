"""Where a result's rows sit in depth: per-layer tables, relative depth ℓ/L and depth profiles.

Models of different depth are compared at the same *relative* depth. A table is per-layer when
one of its columns indexes the model's layers: ``0 … L`` for the residual states ``h_0 … h_L``
(state ``h_ℓ`` sits at ``ℓ/L``: the embedding at 0, the last block's output at 1) or
``0 … L−1`` for the blocks (block ``ℓ`` is centred at ``(ℓ + ½)/L``, between the states it reads
and writes). A *depth profile* is a numeric column of such a table: one value per layer, drawn
as a curve over ``ℓ/L`` to set models of different depth side by side. Each analyzer names its
profiles (:attr:`lensdiv.core.analyzer.Analyzer.depth_profiles`); without a declaration, every
numeric column of every per-layer table is one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from lensdiv.core.results import Result, Table

# Columns that index layers, looked for first (then a table's first column).
INDEX_NAMES = ("layer", "block")


@dataclass(frozen=True)
class DepthIndex:
    """How a per-layer table's rows map onto depth.

    Args:
        column: The column holding the layer (or block) index.
        kind: ``"state"`` (rows ``h_0 … h_L``) or ``"block"`` (rows of blocks ``0 … L−1``).
        n_layers: The model's number of blocks ``L``.
    """

    column: str
    kind: Literal["state", "block"]
    n_layers: int

    def relative(self, layer: int) -> float:
        """Relative depth of row ``layer``: ``ℓ/L`` for a state, ``(ℓ + ½)/L`` for a block."""
        offset = 0.5 if self.kind == "block" else 0.0
        return (layer + offset) / self.n_layers


def depth_index(table: Table, n_layers: int) -> DepthIndex | None:
    """The column of ``table`` that indexes the model's layers, if any.

    A column named ``layer`` or ``block`` (else the table's first column) qualifies when its
    values are the whole numbers ``0 … L`` (states) or ``0 … L−1`` (blocks), each once.

    Args:
        table: Any result table.
        n_layers: The model's number of blocks ``L`` (at least 1).
    """
    if n_layers < 1 or not table.columns:
        return None
    names = [n for n in INDEX_NAMES if n in table.columns]
    first = next(iter(table.columns))
    for name in [*names, first] if first not in names else names:
        values = table.columns[name]
        if not all(_whole(v) for v in values):
            continue
        found = sorted(int(v) for v in values)
        if found == list(range(n_layers + 1)):
            return DepthIndex(name, "state", n_layers)
        if found == list(range(n_layers)):
            return DepthIndex(name, "block", n_layers)
    return None


def numeric_columns(table: Table, skip: Sequence[str] = ()) -> list[str]:
    """Columns whose every value is a number (booleans and NaN included), in table order."""
    return [
        name
        for name, values in table.columns.items()
        if name not in skip and len(values) and all(is_number(v) for v in values)
    ]


def depth_profiles(
    result: Result, n_layers: int, declared: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """``(table, column)`` of every depth profile of ``result``.

    Args:
        result: An analyzer's result.
        n_layers: The model's number of blocks.
        declared: ``"table.column"`` names (an analyzer's :attr:`depth_profiles`); ``None``:
            every numeric column of every per-layer table. Names the result lacks, or that are
            not numeric columns of a per-layer table on this model, are left out.
    """
    profiles = []
    for name, table in result.tables.items():
        index = depth_index(table, n_layers)
        if index is None:
            continue
        for column in numeric_columns(table, skip=(index.column,)):
            if declared is None or f"{name}.{column}" in declared:
                profiles.append((name, column))
    return profiles


def is_number(value: Any) -> bool:
    """A real number (``bool`` included), not a string or ``None``."""
    return isinstance(value, numbers.Real)


def _whole(value: Any) -> bool:
    return (
        is_number(value)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and float(value).is_integer()
    )
