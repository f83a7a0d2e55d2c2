"""A real corpus in every Python: the documentation of the Python language itself.

``--data pydoc`` reads the topics of :mod:`pydoc_data.topics` (what ``help("assert")`` shows:
the language reference's sections on statements, expressions, types and special methods,
about 460 KB of English prose and code in Python 3.11), one document per topic, in the sorted order of the
topics' keys. It needs no download and no network, so a real model (a catalog name, a
``.gguf`` file) reads it by default.

A fitted lens is evaluated on text it never saw: ``pydoc:heldout`` is every tenth topic (the
0th, 10th, 20th, ... by sorted key) and ``pydoc`` (``pydoc:train``) the others, so the two
never share a document. The text is the one shipped with the running Python, so it can differ
between Python versions: the manifest records the version and the text's sha256.

The text is the Python documentation, copyright Python Software Foundation, under the PSF
licence (https://docs.python.org/3/license.html).
"""

from __future__ import annotations

import hashlib
import platform
from collections.abc import Iterator
from typing import Any

from lensdiv.core.errors import DataError
from lensdiv.data.spec import DataSpec, Source

#: ``--data`` names of the corpus: the whole training part, and the held-out part.
PYDOC = "pydoc"
PARTS = {PYDOC: "train", f"{PYDOC}:train": "train", f"{PYDOC}:heldout": "heldout"}
#: Every ``HELDOUT_EVERY``-th topic (by sorted key, from the first) is held out.
HELDOUT_EVERY = 10


def pydoc_topics(part: str = "train") -> list[tuple[str, str]]:
    """The ``(key, text)`` topics of one part (``"train"`` or ``"heldout"``), in sorted-key order.

    Raises:
        DataError: This Python has no ``pydoc_data`` (some distributions leave it out).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            "this Python has no pydoc_data (its documentation topics), which --data pydoc reads",
            hint="install your distribution's Python documentation package, or pass other data",
        ) from None
    keys = sorted(topics)
    held = part == "heldout"
    return [(k, topics[k]) for i, k in enumerate(keys) if (i % HELDOUT_EVERY == 0) == held]


class PythonDocs(Source):
    """Python's own documentation (:mod:`pydoc_data.topics`): ``pydoc`` the training part,
    ``pydoc:heldout`` every tenth topic (see :mod:`lensdiv.data.pydocs`)."""

    kind = "pydoc"
    order = 90
    syntax = "pydoc[:heldout]"
    summary = "Python's documentation, 430 KB of English; :heldout, 32 KB apart"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return spec.texts is None and spec.tokens is None and spec.source in PARTS

    @property
    def part(self) -> str:
        return PARTS[self.spec.source]

    def check(self) -> None:
        if not any(text.strip() for _, text in pydoc_topics(self.part)):
            raise DataError(f"{self.spec.source}: this Python's documentation topics are empty")

    def documents(self) -> Iterator[str]:
        for _, text in pydoc_topics(self.part):
            yield text

    def _digest(self) -> str:
        digest = hashlib.sha256()
        for key, text in pydoc_topics(self.part):
            digest.update(key.encode() + b"\x00" + text.encode() + b"\x00")
        return digest.hexdigest()

    def cache_identity(self) -> dict[str, Any] | None:
        return {"kind": self.kind, "part": self.part, "sha256": self._digest()}

    def text_bytes(self) -> int | None:
        try:
            return sum(len(text.encode()) for _, text in pydoc_topics(self.part))
        except DataError:  # the run's own check says why
            return None

    def describe(self) -> dict[str, Any]:
        topics = pydoc_topics(self.part)
        return super().describe() | {
            "corpus": "Python documentation (pydoc_data.topics), (c) Python Software "
            "Foundation, PSF licence",
            "part": self.part,
            "topics": len(topics),
            "python": platform.python_version(),
            "sha256": self._digest(),
        }
