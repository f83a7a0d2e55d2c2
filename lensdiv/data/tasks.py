"""Task files: JSONL rows an analyzer reads beside the data (patching pairs, graded prompts),
each checked line by line with one clear error naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lensdiv.core.errors import DataError


def read_task_jsonl(
    path: str | Path,
    required: tuple[str, ...],
    *,
    what: str,
    option: str,
    numbers: tuple[str, ...] = (),
) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each row of a task file (patching pairs, graded prompts).

    Every required key must hold a string; those in ``numbers`` may hold a number instead (a
    grade, a token id) — never null, a boolean, a list or an object.

    Raises:
        DataError: Missing, non-UTF-8 or empty file, bad JSON, a non-object, a missing key or a
            value of the wrong kind — one line naming the file and line, with a hint showing the
            expected row.
    """
    path = Path(path)
    example = "{" + ", ".join(f'"{key}": ...' for key in required) + "}"
    if not path.is_file():
        raise DataError(
            f"{what} file {str(path)!r} does not exist",
            hint=f"pass a JSONL file of {example} rows with -O {option}=FILE",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{what} file {str(path)!r} is not UTF-8 text") from None
    rows = []
    for number, raw in enumerate(text.split("\n"), start=1):  # not splitlines: JSON allows U+2028
        if not raw.strip():
            continue
        where = f"{path.name} line {number}"
        try:
            row = json.loads(raw)
        except json.JSONDecodeError as err:
            raise DataError(
                f"{where}: not valid JSON ({err.msg})", hint=f"each line must be one {example}"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in required:
            if key not in row:
                raise DataError(
                    f"{where}: missing key {key!r} (it has: {', '.join(row) or 'none'})",
                    hint=f"each line needs {example}",
                )
            value = row[key]
            number_ok = key in numbers and isinstance(value, (int, float))
            if not isinstance(value, str) and (isinstance(value, bool) or not number_ok):
                kind = "text or a number" if key in numbers else "text"
                raise DataError(
                    f"{where}: {key!r} holds {json_kind(value)}, not {kind}",
                    hint=f"each line needs {example} with {kind} in {key!r}",
                )
        rows.append((number, row))
    if not rows:
        raise DataError(f"{what} file {str(path)!r} is empty", hint=f"add {example} rows")
    return rows


def json_kind(value: Any) -> str:
    """``null``, ``a number (12345)``, ``an object``... as a JSON reader would say it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__
