"""Analyzer state: named statistics, each declared with the rule by which two shards combine.

An analyzer keeps everything it learns about the data in one :class:`Stats`. Every entry has a
kind, and the kind is its merge rule, so two states computed on different shards (batches,
processes, machines) merge into the state of their union (``a.merge(b)``), like baukit's
``runningstats``:

=========  ==========================================  =========================================
kind       written with                                two shards combine by
=========  ==========================================  =========================================
sum        ``add(name, value)`` / ``zeros(...)``       elementwise sum (float64)
max, min   ``max(name, value)`` / ``min(...)``         elementwise maximum / minimum (float64)
fixed      ``put(name, value)``                        must agree (a setting, a fitted map)
set        ``include(name, *items)``                   union (of strings)
rows       ``append(name, key, row)``                  union by key; read back in key order
=========  ==========================================  =========================================

Multi-pass analyzers: at the end of every pass the runner calls :meth:`Stats.freeze`. Entries
that exist then belong to finished passes: every shard of a later pass starts from the same
merged copy of them, so merging keeps one copy instead of adding them up, and a later pass may
not add to them (it writes new names).

States serialise to safetensors (tensors) plus JSON (everything else), never pickle
(:meth:`save`, :meth:`load`). Tensors stay on the device they were made on; merging moves the
other shard's tensors to this one's device.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from lensdiv.core.errors import StateError

Kind = Literal["sum", "max", "min", "fixed", "set", "rows"]
KINDS: tuple[Kind, ...] = ("sum", "max", "min", "fixed", "set", "rows")
STATE_FILE, TENSOR_FILE = "state.json", "state.safetensors"
FORMAT = 1


def _tensor(value: Tensor | float | int) -> Tensor:
    return torch.as_tensor(value).detach().to(torch.float64)


def same_value(a: Any, b: Any) -> bool:
    """Whether two fixed values agree (tensors up to float64 round-off of the same computation)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)) or a.shape != b.shape:
            return False
        b = b.to(a.device)
        if a.is_floating_point():
            return bool(torch.allclose(a, b.to(a.dtype), rtol=1e-9, atol=1e-12, equal_nan=True))
        return bool(torch.equal(a, b.to(a.dtype)))
    # JSON data: as for tensors, NaN agrees with NaN (which ``==`` denies).
    return bool(a == b) or json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


class Stats:
    """Named statistics with merge rules (see the module docstring for the kinds).

    Shapes are fixed by the first update of a name. A name belongs to one kind.
    """

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.maxs: dict[str, Tensor] = {}
        self.mins: dict[str, Tensor] = {}
        self.fixed: dict[str, Any] = {}  # Tensor or a JSON-able value
        self.sets: dict[str, set[str]] = {}
        self.rows: dict[str, dict[int, Any]] = {}
        self.frozen: set[str] = set()

    # -- writing -------------------------------------------------------------------------------
    def add(self, name: str, value: Tensor | float | int) -> None:
        """Add ``value`` to the running sum ``name``."""
        self._writable(name, "sum")
        value = _tensor(value)
        if name in self.sums:
            self._same_shape(name, self.sums[name], value)
            self.sums[name] += value.to(self.sums[name].device)
        else:
            self.sums[name] = value.clone()

    def zeros(
        self, name: str, shape: tuple[int, ...], device: torch.device | str | None = None
    ) -> Tensor:
        """The running sum ``name`` as a float64 tensor to update in place (created as zeros).

        For large accumulators (covariances) where ``add`` would allocate a second copy.
        """
        self._writable(name, "sum")
        if name not in self.sums:
            self.sums[name] = torch.zeros(shape, dtype=torch.float64, device=device)
        elif tuple(self.sums[name].shape) != tuple(shape):
            raise StateError(
                f"statistic {name!r} has shape {tuple(self.sums[name].shape)}, not {shape}"
            )
        return self.sums[name]

    def max(self, name: str, value: Tensor | float | int) -> None:
        """Keep the elementwise maximum of ``value`` under ``name``."""
        self._writable(name, "max")
        self._extremum(self.maxs, name, value, torch.maximum)

    def min(self, name: str, value: Tensor | float | int) -> None:
        """Keep the elementwise minimum of ``value`` under ``name``."""
        self._writable(name, "min")
        self._extremum(self.mins, name, value, torch.minimum)

    def put(self, name: str, value: Any) -> None:
        """Record a value every shard must agree on: a setting read off the data, a fitted map.

        ``value`` is a tensor (kept as it is) or JSON-able data. Putting it again with an equal
        value is fine; a different one raises :class:`StateError`.
        """
        if name in self.fixed:
            if not same_value(
                self.fixed[name], value if isinstance(value, Tensor) else _json(value)
            ):
                raise StateError(f"fixed statistic {name!r} changed from one batch to the next")
            return
        self._kind_free(name, "fixed")
        if isinstance(value, Tensor):
            value = value.detach()
            # Kept without a copy (a fitted map may be large), unless it is a live statistic.
            if any(value.data_ptr() == t.data_ptr() for t in self._tensors()):
                value = value.clone()
        self.fixed[name] = value if isinstance(value, Tensor) else _json(value)

    def include(self, name: str, *items: str) -> None:
        """Add ``items`` to the set ``name`` (e.g. the difficulty grades seen)."""
        self._writable(name, "set")
        self.sets.setdefault(name, set()).update(str(i) for i in items)

    def append(self, name: str, key: int, row: Any) -> None:
        """Record the JSON-able ``row`` under an integer ``key`` that is unique across shards
        (an example's index): per-example results, merged by key, read back in key order."""
        self._writable(name, "rows")
        store = self.rows.setdefault(name, {})
        if int(key) in store:
            raise StateError(f"row {key} of {name!r} recorded twice")
        store[int(key)] = _json(row)

    def drop(self, name: str) -> None:
        """Forget ``name`` (e.g. moments no longer needed once a map is fitted)."""
        for store in self._stores().values():
            store.pop(name, None)
        self.frozen.discard(name)

    def freeze(self) -> None:
        """Mark every entry as finished (called by the runner at the end of each pass)."""
        self.frozen = set(self.names())

    # -- reading -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        for kind, store in self._stores().items():
            if name in store:
                if kind == "set":
                    return frozenset(self.sets[name])
                if kind == "rows":
                    return [self.rows[name][k] for k in sorted(self.rows[name])]
                return store[name]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return any(name in store for store in self._stores().values())

    def get(self, name: str, default: Any = None) -> Any:
        """Return the statistic ``name`` or ``default``."""
        return self[name] if name in self else default  # noqa: SIM401 - this *is* get

    def kind(self, name: str) -> Kind:
        """The kind (merge rule) of ``name``."""
        for kind, store in self._stores().items():
            if name in store:
                return kind
        raise KeyError(name)

    def names(self) -> list[str]:
        """Every name, in a fixed order (kind, then name)."""
        return [name for store in self._stores().values() for name in sorted(store)]

    @property
    def empty(self) -> bool:
        """True before the first update."""
        return not self.names()

    def signature(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(kind, name, shape)`` of every tensor entry, sorted: what shards must agree on
        before their tensors can be reduced elementwise."""
        out = []
        for kind, store in (("sum", self.sums), ("max", self.maxs), ("min", self.mins)):
            out += [(kind, name, tuple(t.shape)) for name, t in store.items()]
        return sorted(out)

    # -- combining -----------------------------------------------------------------------------
    def merge(self, other: Stats) -> Stats:
        """Return the state of both shards together (neither input is modified).

        Raises:
            StateError: The shards disagree on a name's kind or shape, on a fixed value, or on
                a row key, or on which entries earlier passes finished.
        """
        if self.frozen != other.frozen and not (self.empty or other.empty):
            raise StateError("the states come from different passes and cannot be merged")
        out = Stats()
        out.frozen = set(self.frozen or other.frozen)
        for name in dict.fromkeys(self.names() + other.names()):
            mine, theirs = name in self, name in other
            if mine and theirs and self.kind(name) != other.kind(name):
                raise StateError(
                    f"statistic {name!r} is a {self.kind(name)} in one state and a "
                    f"{other.kind(name)} in the other"
                )
            kind = self.kind(name) if mine else other.kind(name)
            if not (mine and theirs):
                out._set(kind, name, (self if mine else other)._copy(kind, name))
            elif name in out.frozen or kind == "fixed":
                a, b = self._raw(kind, name), other._raw(kind, name)
                if kind == "fixed" and not same_value(a, b):
                    raise StateError(f"the states disagree on {name!r}")
                out._set(kind, name, self._copy(kind, name))
            else:
                out._set(kind, name, self._combine(kind, name, other))
        return out

    def _combine(self, kind: Kind, name: str, other: Stats) -> Any:
        if kind in ("sum", "max", "min"):
            a, b = self._raw(kind, name), other._raw(kind, name)
            if a.shape != b.shape:
                raise StateError(
                    f"statistic {name!r} has shape {tuple(a.shape)} in one state and "
                    f"{tuple(b.shape)} in the other"
                )
            b = b.to(a.device)
            if kind == "sum":
                return a + b
            return torch.maximum(a, b) if kind == "max" else torch.minimum(a, b)
        if kind == "set":
            return self.sets[name] | other.sets[name]
        clash = self.rows[name].keys() & other.rows[name].keys()
        if clash:
            raise StateError(f"row {min(clash)} of {name!r} is in both states")
        return {**self.rows[name], **other.rows[name]}

    def to(self, device: torch.device | str) -> Stats:
        """A copy with every tensor on ``device``."""
        out = Stats()
        for kind in KINDS:
            for name in self._store(kind):
                value = self._copy(kind, name)
                out._set(kind, name, value.to(device) if isinstance(value, Tensor) else value)
        out.frozen = set(self.frozen)
        return out

    def copy(self) -> Stats:
        """An independent copy (tensors cloned)."""
        return self.merge(Stats())

    # -- serialisation -------------------------------------------------------------------------
    def save(self, directory: str | Path) -> list[Path]:
        """Write ``state.safetensors`` (tensors) and ``state.json`` (the rest) into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, Tensor] = {}
        plain: dict[str, Any] = {"lensdiv_state": FORMAT, "frozen": sorted(self.frozen)}
        for kind in ("sum", "max", "min"):
            for name, value in self._store(kind).items():
                tensors[f"{kind}/{name}"] = value.detach().cpu().contiguous()
        fixed_json = {}
        for name, value in self.fixed.items():
            if isinstance(value, Tensor):
                tensors[f"fixed/{name}"] = value.detach().cpu().contiguous()
            else:
                fixed_json[name] = value
        plain["fixed"] = fixed_json
        plain["sets"] = {k: sorted(v) for k, v in self.sets.items()}
        plain["rows"] = {
            k: [[key, rows[key]] for key in sorted(rows)] for k, rows in self.rows.items()
        }
        tmp_t, tmp_j = directory / f".{TENSOR_FILE}.tmp", directory / f".{STATE_FILE}.tmp"
        save_file(tensors, str(tmp_t))
        tmp_j.write_text(json.dumps(plain, allow_nan=True))
        tmp_t.replace(directory / TENSOR_FILE)
        tmp_j.replace(directory / STATE_FILE)
        return [directory / TENSOR_FILE, directory / STATE_FILE]

    @classmethod
    def load(cls, directory: str | Path, device: torch.device | str = "cpu") -> Stats:
        """Inverse of :meth:`save`."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            plain = json.loads((directory / STATE_FILE).read_text())
            tensors = load_file(str(directory / TENSOR_FILE), device=str(device))
        except (OSError, ValueError, SafetensorError) as err:
            raise StateError(f"cannot read the state saved in {directory}: {err}") from None
        if not isinstance(plain, dict) or plain.get("lensdiv_state") != FORMAT:
            raise StateError(f"{directory / STATE_FILE} is not a lensdiv state (format {FORMAT})")
        out = cls()
        for key, value in tensors.items():
            kind, _, name = key.partition("/")
            if kind not in ("sum", "max", "min", "fixed"):
                raise StateError(f"{directory / TENSOR_FILE}: unknown entry {key!r}")
            out._set(kind, name, value)  # type: ignore[arg-type]  # checked just above
        out.fixed.update(plain.get("fixed", {}))
        out.sets = {k: set(v) for k, v in plain.get("sets", {}).items()}
        out.rows = {k: {int(key): row for key, row in v} for k, v in plain.get("rows", {}).items()}
        out.frozen = set(plain.get("frozen", []))
        return out

    # -- legacy --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The tensor entries on the CPU by kind (``save`` writes everything)."""
        return {
            kind: {k: v.cpu() for k, v in store.items()}
            for kind, store in (("sums", self.sums), ("maxs", self.maxs), ("mins", self.mins))
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Mapping[str, Tensor]]) -> Stats:
        """Inverse of :meth:`state_dict`."""
        out = cls()
        out.sums, out.maxs, out.mins = (dict(state.get(k, {})) for k in ("sums", "maxs", "mins"))
        return out

    def __repr__(self) -> str:
        return f"Stats({', '.join(self.names())})"

    # -- internals -----------------------------------------------------------------------------
    def _stores(self) -> dict[Kind, dict[str, Any]]:
        return {
            "sum": self.sums,
            "max": self.maxs,
            "min": self.mins,
            "fixed": self.fixed,
            "set": self.sets,
            "rows": self.rows,
        }

    def _tensors(self) -> list[Tensor]:
        stores: list[dict[str, Any]] = [self.sums, self.maxs, self.mins, self.fixed]
        return [v for store in stores for v in store.values() if isinstance(v, Tensor)]

    def _store(self, kind: Kind) -> dict[str, Any]:
        return self._stores()[kind]

    def _raw(self, kind: Kind, name: str) -> Any:
        return self._store(kind)[name]

    def _copy(self, kind: Kind, name: str) -> Any:
        value = self._raw(kind, name)
        if isinstance(value, Tensor):
            return value.clone()
        return copy.deepcopy(value)  # sets, rows and JSON values: nothing shared with the input

    def _set(self, kind: Kind, name: str, value: Any) -> None:
        self._store(kind)[name] = value

    def _kind_free(self, name: str, kind: Kind) -> None:
        if name in self and self.kind(name) != kind:
            raise StateError(f"statistic {name!r} is a {self.kind(name)}, not a {kind}")

    def _writable(self, name: str, kind: Kind) -> None:
        if name in self.frozen:
            raise StateError(
                f"statistic {name!r} belongs to an earlier pass; a later pass writes new names"
            )
        self._kind_free(name, kind)

    @classmethod
    def _extremum(cls, store: dict[str, Tensor], name: str, value: Any, op: Any) -> None:
        value = _tensor(value)
        if name in store:
            cls._same_shape(name, store[name], value)
            store[name] = op(store[name], value.to(store[name].device))
        else:
            store[name] = value.clone()

    @staticmethod
    def _same_shape(name: str, old: Tensor, new: Tensor) -> None:
        if old.shape != new.shape:
            raise StateError(
                f"statistic {name!r} has shape {tuple(old.shape)}, not {tuple(new.shape)}: the "
                "first update fixes a statistic's shape"
            )


def _json(value: Any) -> Any:
    """``value`` as plain JSON data (tuples become lists, numpy/torch scalars numbers)."""
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return value.tolist()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # NaN and infinities are written as JSON's NaN/Infinity
    raise StateError(f"{type(value).__name__} is not JSON data; put a tensor or plain values")


def merge_all(states: Iterable[Stats]) -> Stats:
    """Merge any number of shard states (an empty iterable gives an empty state)."""
    out = Stats()
    for state in states:
        out = out.merge(state)
    return out
