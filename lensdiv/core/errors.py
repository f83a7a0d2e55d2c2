"""The one error hierarchy: mistakes a user can fix, each with what was wrong and what to do."""

from __future__ import annotations


class LensdivError(Exception):
    """A problem with the user's input. The CLI prints ``str(err)`` on one line and exits 2.

    Args:
        message: What was wrong, naming the offending value.
        hint: What to do about it.
    """

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} — {self.hint}" if self.hint else self.message


class ModelLoadError(LensdivError):
    """A model spec that names nothing loadable."""


class DataError(LensdivError):
    """Data that is missing, empty, binary or malformed."""


class PluginError(LensdivError):
    """An unknown, duplicate or broken analyzer plugin."""


class OptionError(LensdivError):
    """An analyzer option that does not exist or does not parse."""


class HookError(LensdivError):
    """An analyzer needs a hook the model does not have."""


class ResultError(LensdivError):
    """A saved run or result that cannot be read."""


class StateError(LensdivError):
    """Analyzer states that cannot be combined or read (different runs, passes or shapes)."""


class RankError(LensdivError):
    """A process of a data-parallel run failed or stopped answering: every process stops with
    this one line naming the rank and its error. Exit code 1 (not a mistake in the input)."""

    exit_code = 1


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
    import difflib

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""
