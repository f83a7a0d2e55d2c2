"""Translators: what a lens does to a residual state before the final norm and unembedding.

A lens reads residual state ``h_l`` as ``p_l = softmax(W_U N(T_l(h_l)) + b_U)``; the translator
``T_l`` is what tells lenses apart (docs/science.md, D1–D3):

==============  =================================  ============================================
lens            ``T_l(h)``                         fitted to / file
==============  =================================  ============================================
``logit``       ``h``                              nothing (the logit lens)
``tuned``       ``h + A_l h + b_l``                ``KL(p_L ‖ p_l)`` by SGD; tuned-lens's layout
``jacobian``    ``J_l h``                          the average Jacobian ∂h_L/∂h_l; TL's file
``affine``      ``W_l h + c_l``                    least squares to ``h_L``; tuned-lens's layout
==============  =================================  ============================================

Every translator is affine, so one class holds them all: per residual index ``l`` (``h_0`` the
embedding, ``h_L`` the final residual, as everywhere in lensdiv) a weight and an optional bias,
applied either as ``h Wᵀ + b`` or residually as ``h + h Wᵀ + b`` (the tuned lens' own form, so a
zero-initialised lens is the logit lens to the last bit). Indices without a map read ``h`` as it
is: the last (``h_L``) always, and ``h_0`` for a Jacobian lens.

Index conventions of the files: a tuned lens' translator ``i`` reads Hugging Face's
``hidden_states[i]`` = ``h_i`` (``i = 0..L-1``); a TransformerLens Jacobian lens' layer ``k``
reads the output of block ``k`` = ``h_{k+1}`` (``k = 0..L-2``).

**Precision.** A translator is applied in the readout dtype (float32, or float64 for a float64
model) on the readout's device, to a state already converted to that dtype: the policy of
:mod:`lensdiv.ops.readout` holds, and the cost is one ``d_model × d_model`` matmul per state.

**Kinds of lens** are objects in one registry (:data:`LENS_KINDS`, :class:`LensKind`): a kind's
name and how results name it, its file layout (a reader, a writer) or how it is made without
files, where a fit's output folder holds it, and how it is fitted (its :class:`Fitter`, named by
import path and imported when asked). Every lens is a :class:`Lens`: affine translators here,
readouts that run model blocks (``last-block``, ``patchscope``) in :mod:`lensdiv.ops.blocklens`.
Adding a kind is one ``lensdiv.lens_kinds`` entry point naming a :class:`LensKind` (ARCHITECTURE.md
lists the steps), as lensdiv's own kinds, defined at the end of this module, are declared in its
pyproject.toml; :func:`register_lens_kind` adds one in a running session.

**Reading a lens from what ``--lens`` takes** (``parse_lens``, the files, the hub) is
:mod:`lensdiv.ops.lens_specs`.
"""

from __future__ import annotations

import hashlib
import importlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import Analyzer, ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.entrypoints import LENS_KINDS_GROUP, load_group
from lensdiv.core.errors import LensError, PluginWarning
from lensdiv.ops.lens_files import (
    JACOBIAN_FILE,
    TUNED_CONFIG,
    TUNED_PARAMS,
    LensMaps,
    Map,
    fetch_tuned,
    is_jacobian_file,
    is_tuned_folder,
    read_jacobian_maps,
    read_tuned_maps,
    tuned_config,
    write_jacobian_maps,
    write_tuned_maps,
)

#: What a lens' reader does: ``read(states, index, rows)`` → the state the final norm reads for
#: the given flat rows of residual state ``h_index`` (``states``: every ``h_l`` of one batch,
#: flattened to ``[rows, d_model]``).
Reader = Callable[[Sequence[Tensor], int, Tensor], Tensor]


class Lens(ABC):
    """A lens: reads residual states ``h_l`` (any ``l``, any positions) into next-token logits,
    as ``readout(R_l(h_l))`` with the model's final norm and unembedding (:mod:`lensdiv.ops.readout`).

    Two families: affine translators (:class:`Translator`: logit, tuned, Jacobian, affine), whose
    ``R_l`` is an affine map of the state alone, and readouts that run model blocks
    (:mod:`lensdiv.ops.blocklens`: ``last-block``, ``patchscope``). Every lens reads ``h_L`` (the
    final residual) as it is, so the model's output is every lens' reference.

    Attributes:
        kind: The name of its kind in :data:`LENS_KINDS`.
        affine: Whether ``R_l`` is an affine map of ``h_l`` alone (what a decomposition into
            members needs: ``bias``).
    """

    kind: str
    affine: ClassVar[bool] = False

    @property
    def lens_kind(self) -> LensKind:
        """Its kind, from the registry."""
        return LENS_KINDS[self.kind]

    @property
    def label(self) -> str:
        """``"Tuned lens"``: how results name it."""
        return self.lens_kind.label

    @property
    def identity(self) -> bool:
        """The logit lens: every state read as it is."""
        return False

    @property
    def source(self) -> str | None:
        """Where its files came from (``None``: it has none)."""
        return None

    @property
    @abstractmethod
    def spec(self) -> str:
        """What ``--lens`` takes to make this lens again."""

    def translates(self, index: int) -> bool:
        """Whether residual state ``h_index`` is changed before the readout."""
        return False

    def shown(self, n_layers: int) -> range:
        """The residual indices the prompt view shows (``h_0..h_L``; fewer where two coincide)."""
        return range(n_layers + 1)

    def check(self, info: ModelInfo, model: Bridge | None = None) -> None:  # noqa: B027 - most fit any
        """Refuse a model this lens cannot read (raises :class:`LensError`), before any work:
        ``model``, where given, for what needs its tokenizer."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the manifest and every result record of the lens (the same on every shard)."""

    @abstractmethod
    def reader(
        self,
        model: Bridge | None,
        tokens: Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Reader:
        """The reader of one batch: ``tokens`` ``[batch, pos]`` are the batch's (what a lens
        that runs blocks over the sequence needs); ``dtype`` and ``device`` are the readout's."""


@dataclass(frozen=True, eq=False)
class Translator(Lens):
    """A lens' per-layer affine translators (see the module docstring).

    Args:
        kind: ``logit``, ``tuned``, ``jacobian`` or ``affine``.
        maps: ``{residual index l: Map}``; an index without one reads ``h_l`` as it is.
        source: Where it was read from (a path or a hub name; ``None`` for the logit lens).
        d_model: Width the maps were fitted for (0 for the logit lens).
        meta: Provenance recorded with the file (prompts, tokens, fit settings).
    """

    kind: str = "logit"
    maps: Mapping[int, Map] = field(default_factory=dict)
    source: str | None = None
    d_model: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    _placed: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor | None]] = field(
        default_factory=dict, repr=False
    )
    affine: ClassVar[bool] = True

    @property
    def identity(self) -> bool:
        """The logit lens: every state read as it is."""
        return not self.maps

    @property
    def spec(self) -> str:
        """``kind`` or ``kind:source``, as ``--lens`` takes it."""
        return self.kind if self.source is None else f"{self.kind}:{self.source}"

    def translates(self, index: int) -> bool:
        """Whether residual state ``h_index`` is changed before the readout."""
        return index in self.maps

    def reader(
        self,
        model: Bridge | None,
        tokens: Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Reader:
        """The rows of ``h_index``, through ``T_index`` where it has one."""

        def read(states: Sequence[Tensor], index: int, rows: Tensor) -> Tensor:
            h = states[index].index_select(0, rows.to(states[index].device))
            if self.translates(index):
                h = self.apply(h, index, dtype=dtype, device=device)
            return h

        return read

    def apply(
        self,
        h: Float[Tensor, "n d_model"],
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Float[Tensor, "n d_model"]:
        """``T_index(h)`` in ``dtype`` on ``device`` (``h`` as it is where no map applies)."""
        found = self.maps.get(index)
        if found is None:
            return h
        key = (index, dtype, device)
        if key not in self._placed:
            bias = found.bias.to(device, dtype) if found.bias is not None else None
            self._placed[key] = (found.weight.to(device, dtype).T.contiguous(), bias)
        weight_t, bias = self._placed[key]
        x = h.to(device=device, dtype=dtype)
        out = torch.addmm(x, x, weight_t) if found.residual else x @ weight_t
        return out if bias is None else out.add_(bias)

    def check(self, info: ModelInfo, model: Bridge | None = None) -> None:
        """Refuse a lens fitted for another shape of model.

        Raises:
            LensError: Another width, or a map for a residual index the model lacks.
        """
        if self.identity:
            return
        if self.d_model != info.d_model:
            raise LensError(
                f"the {PHRASES[self.kind]} {self.source!r} was fitted for d_model {self.d_model}, "
                f"but {info.name} has d_model {info.d_model}",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )
        bad = [i for i in self.maps if not 0 <= i < info.n_layers]
        if bad:
            raise LensError(
                f"the {PHRASES[self.kind]} {self.source!r} has a translator for residual state "
                f"h{max(bad)}, but {info.name} has {info.n_layers} blocks (h0..h{info.n_layers - 1} "
                "can be translated)",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )

    def describe(self) -> dict[str, Any]:
        """What the manifest and every result record of the lens."""
        if self.identity:
            return {"kind": self.kind, "label": self.label}
        return {
            "kind": self.kind,
            "label": self.label,
            "source": self.source,
            "states": sorted(self.maps),
            "d_model": self.d_model,
            "sha256": self.fingerprint(),
            **({"meta": dict(self.meta)} if self.meta else {}),
        }

    def fingerprint(self) -> str:
        """A hash of the maps' values (shards and merges check they used the same lens)."""
        digest = hashlib.sha256()
        for index in sorted(self.maps):
            found = self.maps[index]
            digest.update(f"{index}:{found.residual}".encode())
            digest.update(found.weight.detach().float().cpu().numpy().tobytes())
            if found.bias is not None:
                digest.update(found.bias.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


LOGIT = Translator()


# -- the kinds of lens -----------------------------------------------------------------------------


@dataclass(frozen=True)
class FitRequest:
    """What a fit was asked for, as every :class:`Fitter` reads it: the tuned lens' ``preset``
    and ``init`` (a start lens), the kind's ``options`` (``-O``), the run's ``max_tokens``
    (``None``: the default), ``seq_len`` and ``batch_size``, and the ``shard`` (``None``: all)."""

    preset: str | None
    options: dict[str, Any]
    init: Any
    max_tokens: int | None
    seq_len: int
    batch_size: int
    shard: Any


@runtime_checkable
class Fitter(Protocol):
    """How a lens kind is fitted (:attr:`LensKind.fitter`): ``plan`` gives the fitting analyzer,
    the tokens it reads and a start lens (or ``None``); ``artifact`` is where the result leaves
    the lens, under the analyzer's folder."""

    @property
    def artifact(self) -> str: ...

    def plan(self, request: FitRequest) -> tuple[Analyzer, int, Translator | None]: ...


def _resolve(where: str) -> Any:
    """The object at ``"package.module:attribute"`` (imported now)."""
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class LensKind:
    """One kind of lens: what reads its files or makes it, what the fit's output folder holds,
    how results name it, and how it is fitted.

    Args:
        name: What ``--lens NAME:PATH`` and ``lenses fit --kind NAME`` call it.
        label: How results name it (``"Tuned lens"``).
        phrase: The same in the middle of a sentence (``"tuned lens"``).
        layout: Its file layout in words (``"tuned-lens's layout"``).
        read: ``read(path, kind, source)``: the translator in a local file or folder of this
            layout (``None``: nothing to read).
        write: ``write(path, maps, n_layers, model_name)``: write a lens' maps in this layout
            (the fits write through the same writers, as their results' artifacts).
        owns: Whether a file or folder is a lens of this kind (``--lens PATH`` without a kind).
        hub: ``hub(name, kind)``: a published lens by name (``None``: none is published).
        fitted: Where ``lensdiv lenses fit --kind NAME --out D`` leaves the lens, relative to
            ``D`` (found there when ``D`` has no ``lens.json``: merged shards).
        fitter: How it is fitted: a :class:`Fitter`, or where one is (``"module:attribute"``,
            imported when first asked, so that the answer never depends on what was imported
            before); ``None``: it is not fitted.
        make: ``make(options)``: the lens of a kind with no files (``logit``, ``last-block``,
            ``patchscope``) from what follows ``NAME:`` in ``--lens`` (``""`` for nothing);
            a callable or where one is (``"module:attribute"``).
        note: What a row ``h_l`` of its prompt view shows (``{L}``: the blocks, ``{last}``:
            ``L − 1``); empty: an affine translator's ``T_l`` then the readout.
        order: Where listings put it among the entry points (lowest first; a package's kind
            keeps the default, after lensdiv's).
    """

    name: str
    label: str
    phrase: str
    layout: str = ""
    read: Callable[[Path, str, str], Translator] | None = None
    write: Callable[[Path, LensMaps, int, str], list[Path]] | None = None
    owns: Callable[[Path], bool] | None = None
    hub: Callable[[str, str], Translator] | None = None
    fitted: str | None = None
    fitter: Fitter | str | None = None
    make: Callable[[str], Lens] | str | None = None
    note: str = ""
    order: int = 1000

    def explain(self, n_layers: int) -> str:
        """What a row ``h_l`` of its prompt view shows, in a sentence or two."""
        if self.note:
            return self.note.format(L=n_layers, last=n_layers - 1)
        return (
            f"Row h_l: the residual stream before block l through the {self.phrase}' translator "
            f"T_l, then the final norm and unembedding; h{n_layers} (top) is the model's output."
        )

    def fitting(self) -> Fitter | None:
        """Its :class:`Fitter` (imported from where :attr:`fitter` says, on first use)."""
        found: Fitter | None = (
            _resolve(self.fitter) if isinstance(self.fitter, str) else self.fitter
        )
        return found

    def build(self, options: str = "") -> Lens:
        """The lens of a kind without files from ``options`` (what follows ``NAME:``).

        Raises:
            LensError: The kind is read from files, or the options are not its own.
        """
        if self.make is None:
            raise LensError(f"a {self.phrase} is read from files: --lens {self.name}:PATH")
        make = _resolve(self.make) if isinstance(self.make, str) else self.make
        lens: Lens = make(options)
        return lens


class _LensKinds(MutableMapping[str, LensKind]):
    """The kinds of lens by name, read from the ``lensdiv.lens_kinds`` entry points on first use
    (lensdiv's own first, then other packages'): each entry names a :class:`LensKind` whose
    ``name`` is the entry's. An entry that fails to import, is not a ``LensKind``, or claims the
    name of a kind already there is left out with one :class:`PluginWarning` line; the others
    keep working."""

    def __init__(self) -> None:
        self._kinds: dict[str, LensKind] = {}
        self._loaded = False

    def _table(self) -> dict[str, LensKind]:
        if not self._loaded:
            self._loaded = True
            loaded, problems = load_group(LENS_KINDS_GROUP)
            loaded.sort(key=lambda entry: getattr(entry.value, "order", 1000))
            for entry in loaded:
                problem = self._refusal(entry.name, entry.value, entry.provider)
                if problem:
                    problems.append(problem)
                else:
                    self._kinds.setdefault(entry.name, entry.value)
            for line in problems:
                warnings.warn(line, PluginWarning, stacklevel=3)
        return self._kinds

    def _refusal(self, name: str, kind: object, provider: str) -> str:
        if not isinstance(kind, LensKind):
            return f"lens kind {name!r} from {provider} is {type(kind).__name__}, not a LensKind"
        if kind.name != name:
            return f"lens kind {name!r} from {provider} is named {kind.name!r}; refused"
        if name in self._kinds:
            return (
                f"lens kind {name!r} from {provider} is a kind lensdiv has already; refused "
                "(rename it)"
            )
        return ""

    def __getitem__(self, name: str) -> LensKind:
        return self._table()[name]

    def __setitem__(self, name: str, kind: LensKind) -> None:
        self._table()[name] = kind

    def __delitem__(self, name: str) -> None:
        del self._table()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


#: Every kind of lens by name, from the ``lensdiv.lens_kinds`` entry points (lensdiv's own are
#: declared in its pyproject.toml; :func:`register_lens_kind` adds one in a running session).
LENS_KINDS: MutableMapping[str, LensKind] = _LensKinds()


def register_lens_kind(kind: LensKind) -> LensKind:
    """Add (or replace) a kind of lens in this session (a notebook, a test); a package declares
    its kinds as ``lensdiv.lens_kinds`` entry points instead. Returns ``kind``."""
    LENS_KINDS[kind.name] = kind
    return kind


def fitted_kinds() -> list[str]:
    """The kinds ``lensdiv lenses fit`` can fit."""
    return [name for name, kind in LENS_KINDS.items() if kind.fitter is not None]


class _Names(Mapping[str, str]):
    """A kind's label or phrase by its name, read from the registry as it is now."""

    def __init__(self, attribute: str) -> None:
        self._attribute = attribute

    def __getitem__(self, name: str) -> str:
        return str(getattr(LENS_KINDS[name], self._attribute))

    def __iter__(self) -> Iterator[str]:
        return iter(LENS_KINDS)

    def __len__(self) -> int:
        return len(LENS_KINDS)


#: How results name each lens ("Tuned lens: KL to the output").
LABELS: Mapping[str, str] = _Names("label")
#: The same in the middle of a sentence ("the Jacobian lens' translator").
PHRASES: Mapping[str, str] = _Names("phrase")


# -- the built-in kinds ----------------------------------------------------------------------------


def _translator(found: LensMaps, kind: str, source: str) -> Translator:
    return Translator(kind, found.maps, source=source, d_model=found.d_model, meta=found.meta)


def _read_tuned_layout(path: Path, kind: str, source: str) -> Translator:
    return _translator(read_tuned_maps(path, PHRASES[kind]), kind, source)


def _tuned_hub(name: str, kind: str) -> Translator:
    return _translator(read_tuned_maps(fetch_tuned(name), PHRASES[kind]), kind, name)


def _read_jacobian_file(path: Path, kind: str, source: str) -> Translator:
    return _translator(read_jacobian_maps(path), kind, source)


def _jacobian_hub(name: str, kind: str) -> Translator:
    return _translator(read_jacobian_maps(name, published=True), kind, name)


def _fitted_by(kind: str) -> Callable[[Path], bool]:
    """A folder in tuned-lens's layout whose ``config.json`` says lensdiv fitted it as ``kind``
    (a tuned lens: any other tool's folder in that layout too)."""

    def owns(path: Path) -> bool:
        if not is_tuned_folder(path):
            return False
        said = tuned_config(path).get("lensdiv_lens", "tuned")
        return said == kind or (kind == "tuned" and said not in LENS_KINDS)

    return owns


TUNED_LAYOUT = f"tuned-lens's layout ({TUNED_CONFIG} + {TUNED_PARAMS})"


def _logit(options: str) -> Translator:
    if options:
        raise LensError(
            f"the logit lens takes no options, not {options!r}", hint="use --lens logit"
        )
    return LOGIT


LOGIT_KIND = LensKind(
    "logit",
    "Logit lens",
    "logit lens",
    make=_logit,
    note="Row h_l: the residual stream before block l through the final norm and "
    "unembedding; h{L} (top) is the model's output.",
    order=10,
)
LAST_BLOCK_KIND = LensKind(
    "last-block",
    "Last-block lens",
    "last-block lens",
    make="lensdiv.ops.blocklens:last_block",
    note="Row h_l: the residual stream before block l pushed through the final block "
    "({last}), the final norm and the unembedding; the top row is the output.",
    order=20,
)
PATCHSCOPE_KIND = LensKind(
    "patchscope",
    "Patchscope lens",
    "patchscope lens",
    make="lensdiv.ops.blocklens:patchscope",
    note="Row h_l: the residual stream before block l patched into the inspection prompt "
    "(its last position, as the input of block l), the model run on, and read at the "
    "prompt's last position; h{L} (top) is the model's output.",
    order=30,
)
TUNED_KIND = LensKind(
    "tuned",
    "Tuned lens",
    "tuned lens",
    layout=TUNED_LAYOUT,
    read=_read_tuned_layout,
    write=write_tuned_maps,
    owns=_fitted_by("tuned"),
    hub=_tuned_hub,
    fitted="fit-tuned/tuned_lens",
    fitter="lensdiv.lenses.fit:TUNED_FITTER",
    order=40,
)
JACOBIAN_KIND = LensKind(
    "jacobian",
    "Jacobian lens",
    "Jacobian lens",
    layout=f"TransformerLens' JacobianLens file ({JACOBIAN_FILE})",
    read=_read_jacobian_file,
    write=write_jacobian_maps,
    owns=is_jacobian_file,
    hub=_jacobian_hub,
    fitted=f"fit-jacobian/{JACOBIAN_FILE}",
    fitter="lensdiv.lenses.fit:JACOBIAN_FITTER",
    order=50,
)
AFFINE_KIND = LensKind(
    "affine",
    "Affine lens",
    "affine lens",
    layout=TUNED_LAYOUT,
    read=_read_tuned_layout,
    write=write_tuned_maps,
    owns=_fitted_by("affine"),
    hub=_tuned_hub,
    fitted="fit-affine/affine_lens",
    fitter="lensdiv.lenses.fit:AFFINE_FITTER",
    order=60,
)


def split_unquoted(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside single or double quotes (``prompt="a, b & c"``
    keeps its comma and ampersand); the parts stripped, empty ones dropped."""
    parts: list[str] = []
    current: list[str] = []
    quote = ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char == sep:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def unquoted(value: str) -> str:
    """``value`` without one pair of surrounding quotes (``"a, b"`` -> ``a, b``)."""
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


__all__ = [
    "LABELS",
    "LENS_KINDS",
    "AFFINE_KIND",
    "JACOBIAN_KIND",
    "LAST_BLOCK_KIND",
    "LOGIT",
    "LOGIT_KIND",
    "PATCHSCOPE_KIND",
    "TUNED_KIND",
    "PHRASES",
    "TUNED_LAYOUT",
    "FitRequest",
    "Fitter",
    "Lens",
    "LensKind",
    "Reader",
    "Translator",
    "fitted_kinds",
    "register_lens_kind",
]
