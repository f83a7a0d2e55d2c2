"""The explore page's requests, parsed into frozen dataclasses (no HTTP here).

Each ``POST /api/...`` body is a JSON object; :func:`parse` reads it into one of the classes
below by their fields' declared types — a string (text that encodes as UTF-8), an integer (not
``true``), ``true``/``false``, a number — and a field's ``metadata`` (a prompt: at most
:data:`MAX_CHARS` characters, not blank). A field left out, or ``null``, takes its default; one
without a default must be there. Every mistake is one :class:`RequestError` line (the server's
400); fields the class does not name are ignored. What depends on the model (a block's range, a
position's) is checked by the panel that serves the request.
"""

from __future__ import annotations

import json
import math
import types
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from lensdiv.core.errors import DataError, OptionError
from lensdiv.ops.prompt import PARTS

TOP_K = 5
MAX_TOP_K = 20
SAYS_TOKENS = 8  # what the model says about a state: tokens of the greedy continuation
MAX_SAYS_TOKENS = 32
MAX_CHARS = 20_000  # a prompt's characters, checked before tokenising
#: The smallest clean − corrupt gap in the target's probability (absolute, 0-1) whose share the
#: patch tab colours: under it the share of the gap recovered is mostly noise (37 % against
#: 37 %), so a map is refused and a patched cell has no share.
MIN_GAP = 0.05

PROMPT = {"prompt": True}  # a field's metadata: a prompt (length and blank checked)


class RequestError(OptionError):
    """A request the session cannot serve (a field missing, of the wrong type or out of range)."""


@dataclass(frozen=True)
class GridAsk:
    """``POST /api/grid``: the prompt view of ``text`` with ``lens``, or block ``skip`` skipped."""

    text: str = field(metadata=PROMPT)
    lens: str = "logit"
    skip: int | None = None
    part: str = "block"
    top_k: int = TOP_K

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be 1-{MAX_TOP_K}, got {self.top_k}")
        if self.part not in PARTS:
            raise RequestError(f"unknown part {self.part!r}", hint=f"use one of {', '.join(PARTS)}")


@dataclass(frozen=True)
class AttentionAsk:
    """``POST /api/attention``: the query at ``position`` of ``text`` in block ``block``."""

    text: str = field(metadata=PROMPT)
    block: int | None = None
    position: int | None = None
    first: int = 1

    def __post_init__(self) -> None:
        if self.block is None or self.position is None:
            raise RequestError("give block and position")
        if self.first < 1:
            raise RequestError(f"first must be at least 1, got {self.first}")


@dataclass(frozen=True)
class SaysAsk:
    """``POST /api/says``: a patchscope's continuation from ``h_row`` of ``text`` at
    ``position``."""

    text: str = field(metadata=PROMPT)
    row: int | None = None
    position: int | None = None
    tokens: int = SAYS_TOKENS
    lens: str = "patchscope"

    def __post_init__(self) -> None:
        if self.row is None or self.position is None:
            raise RequestError("give row and position")
        if not 1 <= self.tokens <= MAX_SAYS_TOKENS:
            raise RequestError(f"tokens must be 1-{MAX_SAYS_TOKENS}, got {self.tokens}")


@dataclass(frozen=True)
class PatchAsk:
    """``POST /api/patch``: ``corrupt`` with the clean ``h_layer`` at ``position``, or (``map``)
    a piece of the map from ``(layer, start)``; ``min_gap``: the smallest clean − corrupt gap
    whose recovered share is coloured (default :data:`MIN_GAP`; 0 draws any map)."""

    clean: str = field(metadata=PROMPT)
    corrupt: str = field(metadata=PROMPT)
    target: str = ""
    map: bool = False
    layer: int | None = None
    position: int | None = None
    start: int = 0
    min_gap: float = MIN_GAP

    def __post_init__(self) -> None:
        if not 0 <= self.min_gap <= 1:
            raise RequestError(f"min_gap must be 0-1, got {self.min_gap:g}")


_NAMES = {str: "a string", int: "an integer", bool: "true or false", float: "a number"}
Ask = TypeVar("Ask")


def parse(kind: type[Ask], request: dict[str, Any]) -> Ask:
    """``request`` read into the dataclass ``kind`` (see the module's description).

    Raises:
        RequestError: A field missing, of the wrong type, or (by ``kind``'s own checks) out of
            range.
        DataError: A prompt too long or blank.
    """
    hints = get_type_hints(kind)
    given: dict[str, Any] = {}
    for one in fields(kind):  # type: ignore[arg-type]  # kind is a dataclass type (every Ask is)
        value = request.get(one.name)
        if value is None:
            if one.default is MISSING:
                raise RequestError(f"the request has no {one.name!r}")
            continue
        value = _typed(one.name, value, hints[one.name])
        if one.metadata.get("prompt"):
            _prompt(one.name, value)
        given[one.name] = value
    return kind(**given)


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` when it is of the type ``hint`` (``X | None`` reads as ``X``), else one line."""
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    wrong = isinstance(value, bool) and hint is not bool or not isinstance(value, hint)
    if wrong or hint is float and not math.isfinite(value):
        raise RequestError(f"{name} must be {_NAMES[hint]}, got {json.dumps(value)[:40]}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # JSON's "\ud800" escapes decode to lone surrogates
        except UnicodeEncodeError as err:
            raise RequestError(
                f"{name} is not valid text: {err.reason} at character {err.start}"
            ) from None
    return value


def _prompt(name: str, text: str) -> None:
    if len(text) > MAX_CHARS:
        raise DataError(
            f"the {name} prompt has {len(text)} characters (at most {MAX_CHARS})", hint="shorten it"
        )
    if not text.strip():
        raise DataError(f"the {name} prompt is empty", hint="type some text")


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value
