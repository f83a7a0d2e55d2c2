"""What a run reads when it is given no data, declared once for every command and the API.

A real model (a catalog name such as ``smollm2-135m``, a ``.gguf`` file) reads real English
text: Python's own documentation (``pydoc``, :mod:`lensdiv.data.pydocs`). Every other model
(the toys, hub ids, local folders, bridges) reads the built-in synthetic corpus, on which the
toys were trained. The data layer knows nothing of models: :meth:`DataSpec.from_data` is handed
the default from here. Importing this module does not import torch (``--data``'s help reads it).
"""

from __future__ import annotations

import os
from typing import Any

from lensdiv.core.errors import LensdivError
from lensdiv.data.pydocs import PYDOC
from lensdiv.data.spec import BUILTIN

#: The model kinds (:func:`lensdiv.models.load.resolve_spec`) that read ``pydoc`` by default.
REAL_KINDS = ("real", "gguf")

#: The default in words, for ``--data``'s help.
HELP = f"{PYDOC} for a real model (a catalog name, a .gguf file), else the built-in corpus"


def default_data(*models: Any) -> str:
    """The data source a run of ``models`` reads when none is given: ``pydoc`` when every one
    is a real model, else ``builtin`` (a study of toys and real models reads one corpus, the
    toys'). A spec that names nothing loadable gets ``builtin``; its load says why."""
    if not models:
        return BUILTIN
    return PYDOC if all(_kind(model) in REAL_KINDS for model in models) else BUILTIN


def _kind(model: Any) -> str | None:
    # start-up: models.load imports the toy zoo (torch); --data's help needs only HELP.
    from lensdiv.models.load import resolve_spec

    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str):
        return getattr(getattr(model, "lensdiv_spec", None), "kind", None)
    try:
        return resolve_spec(model).kind
    except LensdivError:
        return None
