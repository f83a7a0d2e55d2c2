"""A data source of this package, to show the second kind of entry point: ``--data "lines:A|B"``
reads each ``|``-separated part as one document (handy for a handful of prompts typed inline).
Declared under ``lensdiv.data_sources`` in pyproject.toml, as lensdiv declares its own."""

from __future__ import annotations

from collections.abc import Iterator

from lensdiv import DataError, DataSpec, Source

PREFIX = "lines:"


class Lines(Source):
    """``lines:A|B``: each part one document."""

    kind = "lines"
    syntax = "lines:A|B"
    summary = "each |-separated part one document"

    @classmethod
    def claims(cls, spec: DataSpec) -> bool:
        return isinstance(spec.source, str) and spec.source.startswith(PREFIX)

    def check(self) -> None:
        if not self.parts():
            raise DataError("'lines:' holds no text", hint='write --data "lines:first|second"')

    def parts(self) -> list[str]:
        """The non-empty parts after ``lines:``."""
        text = str(self.spec.source)[len(PREFIX) :]
        return [part for part in text.split("|") if part.strip()]

    def documents(self) -> Iterator[str]:
        return iter(self.parts())
