"""What reads a lens from what ``--lens`` / ``lens=`` take (:func:`parse_lens`): a kind made
without files, a fit's output folder, a lens' own file or folder, another tool's file, or a
published lens' name, each through its kind in the registry (:data:`~lensdiv.ops.translators.LENS_KINDS`).

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

import json
import os
from pathlib import Path
from typing import Any

from lensdiv.core.errors import LensError
from lensdiv.ops.lens_files import LensMaps, line_of
from lensdiv.ops.translators import LENS_KINDS, LOGIT, Lens, LensKind, Translator

#: What names the lens in the output folder of ``lensdiv lenses fit``: its kind and its path.
LENS_FILE = "lens.json"


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
    "LENS_FILE",
    "is_path",
    "parse_lens",
    "read_jacobian",
    "read_lens",
    "read_tuned",
    "write_lens",
    "write_pointer",
]
