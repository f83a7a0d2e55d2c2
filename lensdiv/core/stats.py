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
fixed      ``fix(name, value)``                        must agree (a setting, a fitted map)
set        ``include(name, *items)``                   union (of strings)
rows       ``append(name, key, row)``                  union by key; read back in key order
=========  ==========================================  =========================================

**One merge algebra.** Each kind is a :class:`Rule` object (:data:`RULES`), the one place that
says how the kind combines: its identity (what a shard that never wrote the name holds), how two
values combine (:meth:`Rule.combine`), and how the values of many processes reduce (the
all-reduce operation of a tensor kind, :attr:`Rule.collective`; the other kinds gather their
values and fold them with ``combine``). Both ways of splitting a run go through it:

- shards saved to disk merge with :meth:`Stats.merge` (``lensdiv merge``);
- the processes of a ``torch.distributed`` group reduce in place at the end of every pass:
  each rank describes its state (:meth:`Stats.summary`), every rank derives the same
  :class:`ReducePlan` from all the descriptions (:func:`plan_reduce`: kinds, shapes and passes
  checked, non-tensor values folded), and :meth:`Stats.reduce` creates what this rank lacks
  from the rule's identity and all-reduces each tensor with the rule's collective (the caller
  supplies the collective; :mod:`lensdiv.run.distributed` passes ``torch.distributed``'s).

Multi-pass analyzers: at the end of every pass the runner calls :meth:`Stats.freeze`. Entries
that exist then belong to finished passes: every shard of a later pass starts from the same
merged copy of them, so merging keeps one copy instead of adding them up, and a later pass may
not add to them (it writes new names).

States serialise to safetensors (tensors) plus JSON (everything else), never pickle
(:meth:`save`, :meth:`load`). Tensors stay on the device they were made on; merging moves the
other shard's tensors to this one's device.
"""

from __future__ import annotations

import abc
import copy
import json
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from lensdiv.core.errors import StateError

Kind = Literal["sum", "max", "min", "fixed", "set", "rows"]
#: The kinds of a state's values, by how they merge (each kind's rule: RULES).
MERGE_KINDS: tuple[Kind, ...] = ("sum", "max", "min", "fixed", "set", "rows")
STATE_FILE, TENSOR_FILE = "state.json", "state.safetensors"
FORMAT = 1
#: The element-wise operation of each all-reduce a tensor kind declares, as torch computes it
#: (what ``torch.distributed.ReduceOp`` SUM, MAX and MIN do across processes).
COLLECTIVES: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}
#: ``all_reduce(tensor, op)``: reduce ``tensor`` in place across processes with a
#: :data:`COLLECTIVES` operation.
AllReduce = Callable[[Tensor, str], None]
# The tensor kinds in the dictionary of :meth:`Stats.state_dict`.
_LEGACY: tuple[tuple[str, Kind], ...] = (("sums", "sum"), ("maxs", "max"), ("mins", "min"))


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


@dataclass(frozen=True)
class Parties:
    """How an error names the two sides of a combination: two states, or two ranks."""

    one: str = "in one state"
    other: str = "in the other"
    both: str = "in both states"
    together: str = "the states"

    @classmethod
    def ranks(cls, first: int, rank: int) -> Parties:
        """Rank ``rank`` against what ranks ``first..rank-1`` held."""
        return cls(
            one=f"on rank {first}",
            other=f"on rank {rank}",
            both=f"on two ranks ({first}..{rank})",
            together=f"ranks {first} and {rank}",
        )


#: The two sides of :meth:`Stats.merge`.
STATES = Parties()


class Rule(abc.ABC):
    """The merge rule of one kind of entry: the single definition both merges follow.

    Attributes:
        kind: The kind's name.
        verb: The :class:`Stats` method that writes it.
        collective: For tensor kinds, the all-reduce operation (a key of :data:`COLLECTIVES`)
            that combines the values of many processes; ``None`` for kinds whose values are
            gathered and folded with :meth:`combine`.
    """

    kind: ClassVar[Kind]
    verb: ClassVar[str]
    collective: ClassVar[str | None] = None

    @abc.abstractmethod
    def combine(self, name: str, a: Any, b: Any, parties: Parties = STATES) -> Any:
        """The value of two shards together (new; neither input is modified).

        Raises:
            StateError: The values cannot combine (fixed values that differ, a row in both).
        """

    def identity(self, shape: tuple[int, ...], device: torch.device | str) -> Any:
        """What a shard that never wrote the entry holds (``combine(identity, v) == v``)."""
        raise StateError(f"a {self.kind} statistic has no identity")

    def read(self, value: Any) -> Any:
        """The value as ``state[name]`` gives it."""
        return value

    def settle(self, own: Any, combined: Any) -> Any:
        """What a process keeps after a reduction: the combined value (a copy), given its own
        (``None`` if it had none)."""
        return self.copy(combined)

    def copy(self, value: Any) -> Any:
        """An independent copy of a stored value."""
        return value.clone() if isinstance(value, Tensor) else copy.deepcopy(value)


class TensorRule(Rule):
    """Sums, maxima and minima: float64 tensors combined element by element."""

    fill: ClassVar[float]

    def combine(self, name: str, a: Tensor, b: Tensor, parties: Parties = STATES) -> Tensor:
        if a.shape != b.shape:
            raise StateError(
                f"statistic {name!r} has shape {tuple(a.shape)} {parties.one} and "
                f"{tuple(b.shape)} {parties.other}"
            )
        assert self.collective is not None
        return COLLECTIVES[self.collective](a, b.to(a.device))

    def identity(self, shape: tuple[int, ...], device: torch.device | str) -> Tensor:
        return torch.full(shape, self.fill, dtype=torch.float64, device=device)


class SumRule(TensorRule):
    kind, verb, collective, fill = "sum", "add", "sum", 0.0


class MaxRule(TensorRule):
    kind, verb, collective, fill = "max", "max", "max", float("-inf")


class MinRule(TensorRule):
    kind, verb, collective, fill = "min", "min", "min", float("inf")


class FixedRule(Rule):
    """A value every shard must agree on; it has no identity (a shard lacks it or agrees)."""

    kind, verb = "fixed", "fix"

    def combine(self, name: str, a: Any, b: Any, parties: Parties = STATES) -> Any:
        if not same_value(a, b):
            raise StateError(f"{parties.together} disagree on {name!r}")
        return self.copy(a)

    def settle(self, own: Any, combined: Any) -> Any:
        """A process that has the value keeps its own (on its device): all agree."""
        return combined if own is None else own


class SetRule(Rule):
    kind, verb = "set", "include"

    def combine(self, name: str, a: set[str], b: set[str], parties: Parties = STATES) -> set[str]:
        return a | b

    def identity(self, shape: tuple[int, ...], device: torch.device | str) -> set[str]:
        return set()

    def read(self, value: set[str]) -> frozenset[str]:
        return frozenset(value)


class RowsRule(Rule):
    kind, verb = "rows", "append"

    def combine(
        self, name: str, a: dict[int, Any], b: dict[int, Any], parties: Parties = STATES
    ) -> dict[int, Any]:
        clash = a.keys() & b.keys()
        if clash:
            raise StateError(f"row {min(clash)} of {name!r} is {parties.both}")
        return copy.deepcopy({**a, **b})

    def identity(self, shape: tuple[int, ...], device: torch.device | str) -> dict[int, Any]:
        return {}

    def read(self, value: dict[int, Any]) -> list[Any]:
        return [value[k] for k in sorted(value)]


#: Every kind's rule, in the order :meth:`Stats.names` lists kinds.
RULES: dict[Kind, Rule] = {
    rule.kind: rule
    for rule in (SumRule(), MaxRule(), MinRule(), FixedRule(), SetRule(), RowsRule())
}
assert tuple(RULES) == MERGE_KINDS


class Stats:
    """Named statistics with merge rules (see the module docstring for the kinds).

    Shapes are fixed by the first update of a name. A name belongs to one kind.
    """

    def __init__(self) -> None:
        self._kinds: dict[str, Kind] = {}
        self._values: dict[str, Any] = {}
        self._frozen: set[str] = set()

    # -- writing -------------------------------------------------------------------------------
    def add(self, name: str, value: Tensor | float | int) -> None:
        """Add ``value`` to the running sum ``name``."""
        self._writable(name, "sum")
        value = _tensor(value)
        if name in self._values:
            old = self._values[name]
            self._same_shape(name, old, value)
            old += value.to(old.device)
        else:
            self._store(name, "sum", value.clone())

    def zeros(
        self, name: str, shape: tuple[int, ...], device: torch.device | str | None = None
    ) -> Tensor:
        """The running sum ``name`` as a float64 tensor to update in place (created as zeros).

        For large accumulators (covariances) where ``add`` would allocate a second copy.
        """
        self._writable(name, "sum")
        if name not in self._values:
            self._store(name, "sum", torch.zeros(shape, dtype=torch.float64, device=device))
        elif tuple(self._values[name].shape) != tuple(shape):
            raise StateError(
                f"statistic {name!r} has shape {tuple(self._values[name].shape)}, not {shape}"
            )
        value: Tensor = self._values[name]
        return value

    def max(self, name: str, value: Tensor | float | int) -> None:
        """Keep the elementwise maximum of ``value`` under ``name``."""
        self._extremum(name, "max", value)

    def min(self, name: str, value: Tensor | float | int) -> None:
        """Keep the elementwise minimum of ``value`` under ``name``."""
        self._extremum(name, "min", value)

    def fix(self, name: str, value: Any) -> None:
        """Record a value every shard must agree on: a setting read off the data, a fitted map.

        ``value`` is a tensor (kept as it is) or JSON-able data. Fixing it again with an equal
        value is fine; a different one raises :class:`StateError`.
        """
        if name in self._values and self._kinds[name] == "fixed":
            new = value if isinstance(value, Tensor) else _json(value)
            if not same_value(self._values[name], new):
                raise StateError(f"fixed statistic {name!r} changed from one batch to the next")
            return
        self._kind_free(name, "fixed")
        if isinstance(value, Tensor):
            value = value.detach()
            # Kept without a copy (a fitted map may be large), unless it is a live statistic.
            if any(value.data_ptr() == t.data_ptr() for t in self._tensors()):
                value = value.clone()
        self._store(name, "fixed", value if isinstance(value, Tensor) else _json(value))

    def put(self, name: str, value: Any) -> None:
        """Deprecated name of :meth:`fix` (the kind is ``fixed``)."""
        warnings.warn(
            "Stats.put is deprecated: call Stats.fix (same arguments)",
            DeprecationWarning,
            stacklevel=2,
        )
        self.fix(name, value)

    def include(self, name: str, *items: str) -> None:
        """Add ``items`` to the set ``name`` (e.g. the difficulty grades seen)."""
        self._writable(name, "set")
        if name not in self._values:
            self._store(name, "set", set())
        self._values[name].update(str(i) for i in items)

    def append(self, name: str, key: int, row: Any) -> None:
        """Record the JSON-able ``row`` under an integer ``key`` that is unique across shards
        (an example's index): per-example results, merged by key, read back in key order."""
        self._writable(name, "rows")
        if name not in self._values:
            self._store(name, "rows", {})
        store = self._values[name]
        if int(key) in store:
            raise StateError(f"row {key} of {name!r} recorded twice")
        store[int(key)] = _json(row)

    def drop(self, name: str) -> None:
        """Forget ``name`` (e.g. moments no longer needed once a map is fitted)."""
        self._kinds.pop(name, None)
        self._values.pop(name, None)
        self._frozen.discard(name)

    def freeze(self) -> None:
        """Mark every entry as finished (called by the runner at the end of each pass)."""
        self._frozen = set(self._values)

    # -- reading -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        return RULES[self._kinds[name]].read(self._values[name])

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def get(self, name: str, default: Any = None) -> Any:
        """Return the statistic ``name`` or ``default``."""
        return self[name] if name in self else default  # noqa: SIM401 - this *is* get

    def kind(self, name: str) -> Kind:
        """The kind (merge rule) of ``name``."""
        return self._kinds[name]

    def names(self) -> list[str]:
        """Every name, in a fixed order (kind, then name)."""
        return sorted(self._values, key=lambda n: (MERGE_KINDS.index(self._kinds[n]), n))

    @property
    def frozen(self) -> frozenset[str]:
        """The names that earlier passes finished (see :meth:`freeze`)."""
        return frozenset(self._frozen)

    @property
    def empty(self) -> bool:
        """True before the first update."""
        return not self._values

    def signature(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(kind, name, shape)`` of every tensor entry, sorted: what shards must agree on
        before their tensors can be reduced elementwise."""
        return sorted(
            (kind, name, tuple(self._values[name].shape))
            for name, kind in self._kinds.items()
            if RULES[kind].collective is not None
        )

    # -- combining -----------------------------------------------------------------------------
    def merge(self, other: Stats) -> Stats:
        """Return the state of both shards together (neither input is modified).

        Raises:
            StateError: The shards disagree on a name's kind or shape, on a fixed value, or on
                a row key, or on which entries earlier passes finished.
        """
        if self._frozen != other._frozen and not (self.empty or other.empty):
            raise StateError("the states come from different passes and cannot be merged")
        out = Stats()
        out._frozen = set(self._frozen or other._frozen)
        for name in dict.fromkeys(self.names() + other.names()):
            mine, theirs = name in self, name in other
            if not (mine and theirs):
                source = self if mine else other
                out._store(name, source._kinds[name], source._copy(name))
                continue
            kind = self._kinds[name]
            if other._kinds[name] != kind:
                raise StateError(
                    f"statistic {name!r} is a {kind} in one state and a "
                    f"{other._kinds[name]} in the other"
                )
            if name in out._frozen and kind != "fixed":  # finished: one copy, not two
                out._store(name, kind, self._copy(name))
            else:
                out._store(
                    name, kind, RULES[kind].combine(name, self._values[name], other._values[name])
                )
        return out

    def summary(self) -> dict[str, Any]:
        """What a process tells the others about its state before they reduce it: whether it
        is empty, which names earlier passes finished, and every other entry's kind with its
        shape (tensor kinds, all-reduced) or its value (the others, gathered and folded)."""
        live = [n for n in self.names() if n not in self._frozen]
        return {
            "empty": self.empty,
            "frozen": sorted(self._frozen),
            "entries": {
                n: (
                    self._kinds[n],
                    tuple(self._values[n].shape),
                    None,
                )
                if RULES[self._kinds[n]].collective is not None
                else (self._kinds[n], None, _portable(self._values[n]))
                for n in live
            },
        }

    def reduce(self, plan: ReducePlan, all_reduce: AllReduce, device: torch.device | str) -> None:
        """Make this process's state the state of every process together, following ``plan``
        (the same on every process): tensor entries this process lacks are created as their
        rule's identity on ``device``, then each is all-reduced with its rule's collective, in
        the plan's order; the other entries take the plan's folded values."""
        for kind, name, shape in plan.tensors:
            rule = RULES[kind]
            if name not in self._values:
                self._store(name, kind, rule.identity(shape, device))
            assert rule.collective is not None
            all_reduce(self._values[name], rule.collective)
        for name, (kind, value) in plan.values.items():
            self._store(name, kind, RULES[kind].settle(self._values.get(name), value))

    def to(self, device: torch.device | str) -> Stats:
        """A copy with every tensor on ``device``."""
        out = Stats()
        for name in self.names():
            value = self._copy(name)
            out._store(
                name, self._kinds[name], value.to(device) if isinstance(value, Tensor) else value
            )
        out._frozen = set(self._frozen)
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
        plain: dict[str, Any] = {"lensdiv_state": FORMAT, "frozen": sorted(self._frozen)}
        fixed_json: dict[str, Any] = {}
        sets: dict[str, list[str]] = {}
        rows: dict[str, list[list[Any]]] = {}
        for name in self.names():
            kind, value = self._kinds[name], self._values[name]
            if isinstance(value, Tensor):
                tensors[f"{kind}/{name}"] = value.detach().cpu().contiguous()
            elif kind == "fixed":
                fixed_json[name] = value
            elif kind == "set":
                sets[name] = sorted(value)
            else:
                rows[name] = [[key, value[key]] for key in sorted(value)]
        plain.update(fixed=fixed_json, sets=sets, rows=rows)
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
            out._store(name, kind, value)  # type: ignore[arg-type]  # checked just above
        for name, value in plain.get("fixed", {}).items():
            out._store(name, "fixed", value)
        for name, items in plain.get("sets", {}).items():
            out._store(name, "set", set(items))
        for name, pairs in plain.get("rows", {}).items():
            out._store(name, "rows", {int(key): row for key, row in pairs})
        out._frozen = set(plain.get("frozen", []))
        return out

    # -- legacy --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        """The sums, maxima and minima on the CPU by kind (``save`` writes everything)."""
        return {
            plural: {n: self._values[n].cpu() for n in self.names() if self._kinds[n] == kind}
            for plural, kind in _LEGACY
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Mapping[str, Tensor]]) -> Stats:
        """Inverse of :meth:`state_dict`."""
        out = cls()
        for plural, kind in _LEGACY:
            for name, value in state.get(plural, {}).items():
                out._store(name, kind, value)
        return out

    def __repr__(self) -> str:
        return f"Stats({', '.join(self.names())})"

    # -- internals -----------------------------------------------------------------------------
    def _store(self, name: str, kind: Kind, value: Any) -> None:
        self._kinds[name] = kind
        self._values[name] = value

    def _tensors(self) -> list[Tensor]:
        return [v for v in self._values.values() if isinstance(v, Tensor)]

    def _copy(self, name: str) -> Any:
        return RULES[self._kinds[name]].copy(self._values[name])

    def _kind_free(self, name: str, kind: Kind) -> None:
        if name in self._values and self._kinds[name] != kind:
            raise StateError(f"statistic {name!r} is a {self._kinds[name]}, not a {kind}")

    def _writable(self, name: str, kind: Kind) -> None:
        if name in self._frozen:
            raise StateError(
                f"statistic {name!r} belongs to an earlier pass; a later pass writes new names"
            )
        self._kind_free(name, kind)

    def _extremum(self, name: str, kind: Literal["max", "min"], value: Any) -> None:
        self._writable(name, kind)
        value = _tensor(value)
        if name in self._values:
            old = self._values[name]
            self._same_shape(name, old, value)
            self._values[name] = COLLECTIVES[kind](old, value.to(old.device))
        else:
            self._store(name, kind, value.clone())

    @staticmethod
    def _same_shape(name: str, old: Tensor, new: Tensor) -> None:
        if old.shape != new.shape:
            raise StateError(
                f"statistic {name!r} has shape {tuple(old.shape)}, not {tuple(new.shape)}: the "
                "first update fixes a statistic's shape"
            )


@dataclass
class ReducePlan:
    """How the processes' states of one analyzer combine, derived identically on every process
    from their :meth:`Stats.summary` (see :func:`plan_reduce`).

    Args:
        tensors: ``(kind, name, shape)`` of every entry to all-reduce, in a fixed order.
        values: The other entries as ``{name: (kind, value)}``, folded over the processes
            with their rule's :meth:`Rule.combine`.
    """

    tensors: list[tuple[Kind, str, tuple[int, ...]]] = field(default_factory=list)
    values: dict[str, tuple[Kind, Any]] = field(default_factory=dict)


def plan_reduce(summaries: Sequence[Mapping[str, Any]]) -> ReducePlan:
    """Check that the processes' state summaries (in rank order) agree and say how they
    combine, by each kind's :class:`Rule`.

    Raises:
        StateError: Different finished passes, a name of two kinds or two shapes, fixed values
            that differ, a row recorded on two ranks — naming the name and the ranks.
    """
    full = [(r, s) for r, s in enumerate(summaries) if not s["empty"]]
    if full and any(s["frozen"] != full[0][1]["frozen"] for _, s in full):
        ranks = [r for r, s in full if s["frozen"] != full[0][1]["frozen"]]
        raise StateError(
            f"ranks {full[0][0]} and {ranks[0]} finished different passes (states cannot merge)"
        )
    first: dict[str, tuple[int, Kind, tuple[int, ...] | None]] = {}
    values: dict[str, tuple[Kind, Any]] = {}
    for rank, summary in enumerate(summaries):
        for name, (kind, shape, value) in summary["entries"].items():
            shape = None if shape is None else tuple(shape)
            if name not in first:
                first[name] = (rank, kind, shape)
                if shape is None:
                    values[name] = (kind, value)
                continue
            origin, known, known_shape = first[name]
            parties = Parties.ranks(origin, rank)
            if kind != known:
                raise StateError(
                    f"statistic {name!r} is a {known} {parties.one} and a {kind} {parties.other}"
                )
            if shape is not None:
                assert known_shape is not None
                if shape != known_shape:
                    raise StateError(
                        f"statistic {name!r} has shape {known_shape} {parties.one} and {shape} "
                        f"{parties.other}"
                    )
                continue
            values[name] = (kind, RULES[kind].combine(name, values[name][1], value, parties))
    tensors = sorted(
        (kind, name, shape) for name, (_, kind, shape) in first.items() if shape is not None
    )
    return ReducePlan(tensors=tensors, values=values)


def _portable(value: Any) -> Any:
    """A non-tensor-kind value as another process receives it (fixed tensors on the CPU)."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    return copy.deepcopy(value)


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
    raise StateError(f"{type(value).__name__} is not JSON data; fix a tensor or plain values")


def merge_all(states: Iterable[Stats]) -> Stats:
    """Merge any number of shard states (an empty iterable gives an empty state)."""
    out = Stats()
    for state in states:
        out = out.merge(state)
    return out
