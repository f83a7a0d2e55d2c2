"""The kinds of lens: one registry (:data:`LENS_KINDS`) of :class:`LensKind` objects, and what
reads a lens from what ``--lens`` takes (:func:`parse_lens`, :func:`read_lens`).

A kind says its name and how results name it, its file layout (a reader, a writer) or how it is
made without files, where a fit's output folder holds it, and how it is fitted (its
:class:`Fitter`, named by import path and imported when asked). The built-in kinds: ``logit``,
``last-block`` and ``patchscope`` (made without files; :mod:`lensdiv.ops.translators`,
:mod:`lensdiv.ops.blocklens`), ``tuned``, ``jacobian`` and ``affine`` (read from files). Adding
a kind is one :func:`register_lens_kind` call (ARCHITECTURE.md lists the steps).

**Files.** ``--lens KIND:PATH`` takes the output folder of ``lensdiv lenses fit --kind KIND --out
PATH`` (its ``lens.json`` says where the lens is), the lens' own file or folder, or other tools'
files: ``tuned`` and ``affine`` read a folder (or its ``config.json``) in tuned-lens's layout
(``config.json`` + ``params.pt`` with ``"{i}.weight"``, ``"{i}.bias"``), so published tuned
lenses load here and lensdiv's load in tuned-lens; ``jacobian`` reads TransformerLens'
``JacobianLens`` files (its own loader: artifacts and reference checkpoints). ``--lens PATH``
without a kind reads the kind from the files. A name that is not a path (absolute, ``./``,
``../``, ``~``, or an existing file or folder) is a published lens' name, looked up on the
Hugging Face hub (tuned-lens's lenses; ``JacobianLens.from_pretrained``); a path never is, and
``HF_HUB_OFFLINE=1`` keeps the lookup off the network.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lensdiv.core.analyzer import Analyzer
from lensdiv.core.errors import LensError
from lensdiv.ops.lens_files import (
    JACOBIAN_FILE,
    TUNED_CONFIG,
    TUNED_PARAMS,
    LensMaps,
    fetch_tuned,
    is_jacobian_file,
    is_tuned_folder,
    line_of,
    read_jacobian_maps,
    read_tuned_maps,
    tuned_config,
    write_jacobian_maps,
    write_tuned_maps,
)
from lensdiv.ops.translators import LOGIT, Lens, Translator

#: What names the lens in the output folder of ``lensdiv lenses fit``: its kind and its path.
LENS_FILE = "lens.json"


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


#: Every kind of lens by name (:func:`register_lens_kind` adds one).
LENS_KINDS: dict[str, LensKind] = {}


def register_lens_kind(kind: LensKind) -> LensKind:
    """Add (or replace) a kind of lens, with its reader, maker and fitter in one step; returns
    it."""
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


def parse_lens(spec: Any) -> Lens:
    """A lens from what ``--lens`` / ``lens=`` take: a kind without files (``"logit"``,
    ``"last-block"``, ``"patchscope"`` or ``"patchscope:OPTIONS"``), ``"KIND:PATH"`` (``tuned``,
    ``jacobian``, ``affine``: the output folder of ``lensdiv lenses fit``, the lens' own file or
    folder, another tool's file, or a published lens' name), ``PATH`` (the kind read from the
    files), or a :class:`Lens`.

    Raises:
        LensError: Not one of these, or a file that cannot be read (one line, with a hint).
    """
    if spec is None:
        return LOGIT
    if isinstance(spec, Lens):
        return spec
    if isinstance(spec, Path):
        return read_lens(spec)
    if not isinstance(spec, str):
        raise LensError(
            f"a lens is {', '.join(repr(k) for k in _made())}, 'tuned:PATH', 'jacobian:PATH', "
            f"'affine:PATH' or a lens folder, not {spec!r}"
        )
    name, sep, where = spec.strip().partition(":")
    name = name.strip().lower()
    kind = LENS_KINDS.get(name)
    if kind is not None and kind.make is not None and kind.read is None:
        return kind.build(where.strip())
    if sep and kind is not None and kind.read is not None and where.strip():
        return read_lens(where.strip(), kind.name)
    if (not sep or kind is None) and is_path(spec.strip()):
        return read_lens(spec.strip())
    fitted = ", ".join(f"{k}:PATH" for k, found in LENS_KINDS.items() if found.read is not None)
    raise LensError(
        f"unknown lens {spec!r}",
        hint=f"use {', '.join(_made())}, {fitted} or a lens folder (the --out of lensdiv "
        "lenses fit)",
    )


def _made() -> list[str]:
    """The kinds made without files (``logit``, ``last-block``, ``patchscope``)."""
    return [name for name, kind in LENS_KINDS.items() if kind.make is not None]


def is_path(where: str) -> bool:
    """Whether a lens spec names a local file or folder (never a hub name): absolute, ``./``,
    ``../``, ``~``, or an existing file or folder."""
    text = where.strip()
    if text in (".", "..") or text.startswith(("/", "./", "../", "~", os.sep)):
        return True
    return Path(text).exists()


def read_lens(where: str | Path, kind: str | None = None) -> Translator:
    """The lens at ``where`` (a fit's output folder, the lens' own file or folder, another
    tool's file, or — not a path — a published lens' name) read as ``kind``, or as the kind its
    files say when ``kind`` is ``None``.

    Raises:
        LensError: No such path (at once, naming it: a path never goes to the hub), files that
            are not a lens of ``kind``, or a published name that cannot be fetched.
    """
    wanted = None if kind is None else LENS_KINDS[kind]
    source = str(where)
    found = _locate(wanted, source)
    if found is None:  # a name, not a path
        assert wanted is not None  # a path-less spec has a kind (parse_lens)
        if wanted.hub is None:
            raise LensError(f"{source!r} is not a path, and no {wanted.phrase} is published")
        return wanted.hub(source, wanted.name)
    found_kind, path = found
    assert found_kind.read is not None
    return found_kind.read(path, found_kind.name, source)


def _locate(kind: LensKind | None, where: str) -> tuple[LensKind, Path] | None:
    """The kind and the file or folder to read for ``where``; ``None`` for a hub name."""
    path = Path(where).expanduser()
    if not path.exists():
        if kind is not None and not is_path(where):
            return None
        what = f"the {kind.phrase}" if kind is not None else "a lens at"
        raise LensError(
            f"cannot read {what} {where!r}: no such file or folder, so it is neither a lens "
            f"folder nor a published {kind.phrase if kind else 'lens'} (a path is never looked "
            "up on the hub)",
            hint="pass the --out folder of lensdiv lenses fit, or a lens' file or folder",
        )
    if path.is_dir() and (path / LENS_FILE).is_file():
        name, inner = _pointer(path)
        if kind is not None and name != kind.name:
            raise LensError(
                f"{where!r} holds a lens of kind {name!r} ({LENS_FILE}), not {kind.name!r}",
                hint=f"use --lens {name}:{where}, or --lens {where}",
            )
        return LENS_KINDS[name], inner
    if path.is_dir():
        inside = [
            k
            for k in LENS_KINDS.values()
            if k.fitted and (path / k.fitted).exists() and (kind is None or k is kind)
        ]
        if len(inside) == 1:
            return inside[0], path / str(inside[0].fitted)
        if len(inside) > 1:
            raise LensError(
                f"{where!r} holds several lenses ({', '.join(k.name for k in inside)})",
                hint=f"name one: --lens {inside[0].name}:{where}",
            )
    if kind is not None:
        return kind, path
    owners = [k for k in LENS_KINDS.values() if k.owns is not None and k.owns(path)]
    if not owners:
        raise LensError(
            f"cannot tell which kind of lens {where!r} holds",
            hint="name it: --lens tuned:PATH, jacobian:PATH or affine:PATH",
        )
    return owners[0], path


def _pointer(folder: Path) -> tuple[str, Path]:
    """The kind and path a fit's ``lens.json`` names."""
    try:
        pointer = json.loads((folder / LENS_FILE).read_text())
        name, inner = str(pointer["kind"]), folder / str(pointer["path"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LensError(f"cannot read {folder / LENS_FILE}: {line_of(err)}") from None
    if name not in LENS_KINDS or LENS_KINDS[name].read is None:
        raise LensError(f"{folder / LENS_FILE} names an unknown kind of lens {name!r}")
    return name, inner


def write_pointer(out: Path, kind: str, lens: Path) -> Path:
    """Write ``out/lens.json``: the kind and the path (inside ``out``) of the lens a fit made,
    so ``--lens KIND:OUT`` and ``--lens OUT`` read it."""
    found = LENS_KINDS[kind]
    pointer = {
        "lensdiv_lens": 1,
        "kind": kind,
        "path": lens.relative_to(out).as_posix(),
        "layout": found.layout,
        "use": f"--lens {kind}:{out}",
    }
    path = out / LENS_FILE
    tmp = path.with_name(f".{LENS_FILE}.tmp")
    tmp.write_text(json.dumps(pointer, indent=2) + "\n")
    tmp.replace(path)
    return path


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


register_lens_kind(
    LensKind(
        "logit",
        "Logit lens",
        "logit lens",
        make=_logit,
        note="Row h_l: the residual stream before block l through the final norm and "
        "unembedding; h{L} (top) is the model's output.",
    )
)
register_lens_kind(
    LensKind(
        "last-block",
        "Last-block lens",
        "last-block lens",
        make="lensdiv.ops.blocklens:last_block",
        note="Row h_l: the residual stream before block l pushed through the final block "
        "({last}), the final norm and the unembedding; the top row is the output.",
    )
)
register_lens_kind(
    LensKind(
        "patchscope",
        "Patchscope lens",
        "patchscope lens",
        make="lensdiv.ops.blocklens:patchscope",
        note="Row h_l: the residual stream before block l patched into the inspection prompt "
        "(its last position, as the input of block l), the model run on, and read at the "
        "prompt's last position; h{L} (top) is the model's output.",
    )
)
register_lens_kind(
    LensKind(
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
    )
)
register_lens_kind(
    LensKind(
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
    )
)
register_lens_kind(
    LensKind(
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
    )
)


def write_lens(path: str | Path, lens: Lens, *, n_layers: int, model_name: str) -> list[Path]:
    """Write ``lens`` in its kind's layout (``n_layers``: the model's blocks)."""
    found = LENS_KINDS[lens.kind]
    if found.write is None or not isinstance(lens, Translator):
        raise LensError(f"a {found.phrase} has no file to write")
    maps = LensMaps(dict(lens.maps), lens.d_model, dict(lens.meta))
    return found.write(Path(path), maps, n_layers, model_name)


def read_tuned(where: str | Path, *, kind: str = "tuned") -> Translator:
    """A lens in tuned-lens's layout (``kind`` ``tuned`` or ``affine``): a fit's output folder,
    the lens folder (or its ``config.json``), or a published lens' name (see
    :func:`read_lens`)."""
    return read_lens(where, kind)


def read_jacobian(where: str | Path) -> Translator:
    """A Jacobian lens: a fit's output folder, TransformerLens' ``JacobianLens`` file, or a
    published lens' name (see :func:`read_lens`)."""
    return read_lens(where, "jacobian")


__all__ = [
    "LABELS",
    "LENS_FILE",
    "LENS_KINDS",
    "PHRASES",
    "TUNED_LAYOUT",
    "FitRequest",
    "Fitter",
    "LensKind",
    "fitted_kinds",
    "is_path",
    "parse_lens",
    "read_jacobian",
    "read_lens",
    "read_tuned",
    "register_lens_kind",
    "write_lens",
    "write_pointer",
]
