"""Streaming statistics that merge: per-batch sums and extrema, so memory never grows with data.

Each analyzer keeps its dataset-level state in a :class:`Stats`. Batches add to it, and two states
computed on different shards merge into the state of their union (``a.merge(b)``), like baukit's
``runningstats``. Everything is accumulated in float64 on the device the activations live on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class Stats:
    """Named running sums, maxima and minima.

    ``add`` sums, ``max``/``min`` keep elementwise extrema. Shapes are fixed by the first update.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.maxs: dict[str, torch.Tensor] = {}
        self.mins: dict[str, torch.Tensor] = {}

    def add(self, name: str, value: torch.Tensor | float | int) -> None:
        """Add ``value`` to the running sum ``name``."""
        value = torch.as_tensor(value).detach().to(torch.float64)
        if name in self.sums:
            self.sums[name] += value.to(self.sums[name].device)
        else:
            self.sums[name] = value.clone()

    def max(self, name: str, value: torch.Tensor | float | int) -> None:
        """Keep the elementwise maximum of ``value`` under ``name``."""
        self._extremum(self.maxs, name, value, torch.maximum)

    def min(self, name: str, value: torch.Tensor | float | int) -> None:
        """Keep the elementwise minimum of ``value`` under ``name``."""
        self._extremum(self.mins, name, value, torch.minimum)

    @staticmethod
    def _extremum(store: dict[str, torch.Tensor], name: str, value: Any, op: Any) -> None:
        value = torch.as_tensor(value).detach().to(torch.float64)
        store[name] = (
            op(store[name], value.to(store[name].device)) if name in store else value.clone()
        )

    def __getitem__(self, name: str) -> torch.Tensor:
        for store in (self.sums, self.maxs, self.mins):
            if name in store:
                return store[name]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self.sums or name in self.maxs or name in self.mins

    def get(self, name: str, default: Any = None) -> Any:
        """Return the statistic ``name`` or ``default``."""
        return self[name] if name in self else default  # noqa: SIM401 - this *is* get

    @property
    def empty(self) -> bool:
        """True before the first update."""
        return not (self.sums or self.maxs or self.mins)

    def merge(self, other: Stats) -> Stats:
        """Return the state of both shards together (neither input is modified)."""
        out = Stats()
        for mine, theirs, dest, op in (
            (self.sums, other.sums, out.sums, torch.add),
            (self.maxs, other.maxs, out.maxs, torch.maximum),
            (self.mins, other.mins, out.mins, torch.minimum),
        ):
            for key in mine.keys() | theirs.keys():
                if key in mine and key in theirs:
                    dest[key] = op(mine[key], theirs[key].to(mine[key].device))
                else:
                    dest[key] = (mine.get(key) if key in mine else theirs[key]).clone()
        return out

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors on the CPU, for ``torch.save`` of a shard."""
        return {
            kind: {k: v.cpu() for k, v in store.items()}
            for kind, store in (("sums", self.sums), ("maxs", self.maxs), ("mins", self.mins))
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Mapping[str, torch.Tensor]]) -> Stats:
        """Inverse of :meth:`state_dict`."""
        out = cls()
        out.sums, out.maxs, out.mins = (dict(state.get(k, {})) for k in ("sums", "maxs", "mins"))
        return out

    def __repr__(self) -> str:
        names = sorted(self.sums) + sorted(self.maxs) + sorted(self.mins)
        return f"Stats({', '.join(names)})"
