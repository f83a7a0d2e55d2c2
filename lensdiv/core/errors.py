"""The one error hierarchy: mistakes a user can fix, each with what was wrong and what to do."""

from __future__ import annotations

from pathlib import Path


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


class PluginWarning(UserWarning):
    """Something about the installed plugins the user should know when selecting analyzers
    (a plugin refused for claiming a built-in's name: the built-in runs). The CLI prints it as
    one ``warning:`` line."""


class LensWarning(PluginWarning):
    """A fitted lens (``--lens``) that none of the selected analyzers reads: the run is the
    same as without it. The CLI prints it as one ``warning:`` line."""


class DataWarning(PluginWarning):
    """Data that cannot hold all that was asked of it (a lens fit and its evaluation): the work
    goes on with what there is, and the warning says what is missing and what to do. The CLI
    prints it as one ``warning:`` line."""


class ModelLoadError(LensdivError):
    """A model spec that names nothing loadable."""


class DataError(LensdivError):
    """Data that is missing, empty, binary or malformed."""


class PluginError(LensdivError):
    """An unknown, duplicate or broken analyzer plugin."""


class OptionError(LensdivError):
    """An analyzer option that does not exist or does not parse."""


class UnsupportedModelError(LensdivError):
    """An analyzer cannot handle this model (its architecture, not the user's input).

    Raised from an analyzer's ``hooks``, ``examples`` or ``setup``; the run then skips that
    analyzer, says why in the terminal and the manifest, and the other analyzers go on.
    """


class HookError(UnsupportedModelError):
    """An analyzer needs a hook the model does not have (so it is skipped on this model)."""


class ResultError(LensdivError):
    """A saved run or result that cannot be read."""


class SaveError(LensdivError):
    """Files that could not be written (disk full, no permission) or plots that could not be
    drawn; the files that could be written are on disk.

    Args:
        message: Which files, and why.
        hint: What to do about it.
        written: The files that were written.
        failed: ``{file: reason}`` for each file that was not.
    """

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        written: list[Path] | None = None,
        failed: dict[Path, str] | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.written = list(written or [])
        self.failed = dict(failed or {})


class LensError(LensdivError):
    """A lens (``--lens tuned:PATH``, ``jacobian:PATH``, ...) that cannot be read or does not
    fit the model."""


class StudyError(LensdivError):
    """A study folder that holds another study (other models, analyzers or data), or whose
    ``study.json`` cannot be read."""


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
