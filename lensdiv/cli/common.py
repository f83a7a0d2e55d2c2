"""What every command shares: options, the console, one-line errors, option parsing, output."""

from __future__ import annotations

import functools
import inspect
import re
import sys
import time
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer import _click as click  # typer ships its own click; its exceptions live here
from typer.core import TyperGroup

from lensdiv.core.errors import LensdivError, OptionError, PluginWarning, SaveError
from lensdiv.core.files import folder_problem
from lensdiv.core.settings import RunSettings
from lensdiv.data.sources import registered_sources
from lensdiv.run.defaults import HELP as DEFAULT_DATA


def _data_help() -> str:
    """``--data``'s help: ``SYNTAX (summary)`` of every source the command line can name, in
    registration order, then the default (the sources live in ``lensdiv/data/sources.py``)."""
    forms = [f"{s.syntax} ({s.summary})" for s in registered_sources() if s.command_line]
    return f"{', '.join(forms[:-1])} or {forms[-1]}. Default: {DEFAULT_DATA}."


F = TypeVar("F", bound=Callable[..., Any])


def run_settings(
    *only: str, exclude: tuple[str, ...] = (), **changed: Mapping[str, Any]
) -> Callable[[F], F]:
    """Give a command the run settings as options, made from their one declaration
    (:class:`~lensdiv.core.settings.RunSettings`: flag ``--seq-len``, type, default, help): every
    setting, or those named in ``only``, less ``exclude``; ``changed`` gives a setting another
    ``default``, ``help`` or ``type`` in this command (``max_tokens={"default": 8192}``).

    The command declares ``settings: RunSettings = DEFAULTS`` where the options go (the order
    of ``--help``) and receives them there as one :class:`RunSettings`.
    """
    names = [n for n in (only or RunSettings.names()) if n not in exclude]
    defaults = {n: c["default"] for n, c in changed.items() if "default" in c}

    def wrap(func: F) -> F:
        hints = typing.get_type_hints(func, include_extras=True)
        signature = inspect.signature(func)
        params: list[inspect.Parameter] = []
        for param in signature.parameters.values():
            if param.name == "settings":
                params += [_setting_option(n, changed.get(n, {})) for n in names]
            else:
                params.append(param.replace(annotation=hints.get(param.name, param.annotation)))

        @functools.wraps(func)
        def command(*args: Any, settings: RunSettings | None = None, **kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names if n in kwargs}
            chosen = RunSettings.of(settings, given, caller=func.__name__, defaults=defaults)
            return func(*args, settings=chosen, **kwargs)

        # typer reads the options from the signature and the annotations
        # (a function's __signature__ is read by inspect but not declared on its type)
        command.__signature__ = signature.replace(  # type: ignore[attr-defined]  # see above
            parameters=params, return_annotation=None
        )
        command.__annotations__ = {p.name: p.annotation for p in params}
        return typing.cast(F, command)

    return wrap


def _setting_option(name: str, changed: Mapping[str, Any]) -> inspect.Parameter:
    """The command-line option of run setting ``name``: ``--name`` with its type, default and
    help from the declaration (or from ``changed``)."""
    declared = RunSettings.declared(name)
    kind = changed.get("type", declared.metadata["cli"] or typing.get_type_hints(RunSettings)[name])
    option = typer.Option(help=changed.get("help", declared.metadata["help"]))
    return inspect.Parameter(
        name,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        default=changed.get("default", declared.default),
        annotation=Annotated[kind, option],
    )


# Options several commands take, with the same flag, type and help everywhere (the run
# settings' options come from their declaration: `run_settings`).
Data = Annotated[str | None, typer.Option("--data", "-d", help=_data_help())]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow hub models that ship their own code.")
]
Progress = Annotated[bool, typer.Option(help="Show a progress bar.")]
TokenCacheFlag = Annotated[
    bool,
    typer.Option(
        "--token-cache/--no-token-cache",
        help="Read the data's ids from the token cache, tokenising only what it lacks (the "
        "same batches either way; LENSDIV_TOKEN_CACHE=off or DIR).",
    ),
]


def out_option(default: str) -> Any:
    """``--out/-o FOLDER``; ``default`` names the folder written without it (``MODEL-TIME``)."""
    return typer.Option("--out", "-o", help=f"Output folder. Default: lensdiv-out/{default}.")


def console(stderr: bool = False) -> Any:
    """A rich console (stdout, or stderr for errors), without syntax highlighting."""
    # start-up: rich loads only when a command prints (`lensdiv --version` never does).
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def fail(err: Exception) -> NoReturn:
    """Print one line for a user error and exit 2."""
    code = err.exit_code if isinstance(err, LensdivError) else 2
    error_line(str(err))
    raise typer.Exit(code)


def error_line(text: str) -> None:
    """``error: TEXT`` on standard error, as one logical line (no markup read from ``text``)."""
    from rich.text import Text

    line = Text.assemble(("error:", "bold red"), " ", " ".join(text.split()))
    console(stderr=True).print(line, soft_wrap=True)


class Group(TyperGroup):
    """The root command. A usage mistake (an unknown flag, a value of the wrong type, a missing
    argument) prints ``error: WHAT WAS WRONG`` first, then typer's usage and help lines, and
    exits 2 — instead of a usage line first and the reason in a panel below it."""

    def main(  # type: ignore[override]  # same call as click's, with standalone_mode handled here
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as err:  # the help is already printed
            sys.exit(err.exit_code)
        except click.exceptions.UsageError as err:
            error_line(err.format_message())
            if err.ctx is not None:
                help_hint = f"Try '{err.ctx.command_path} --help' for help."
                typer.echo(f"{err.ctx.get_usage()}\n{help_hint}", err=True)
            sys.exit(err.exit_code)
        except click.exceptions.ClickException as err:
            error_line(err.format_message())
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@contextmanager
def plugin_warnings() -> Iterator[None]:
    """A :class:`~lensdiv.core.errors.PluginWarning` inside is printed at once as one
    ``warning:`` line on standard error (other warnings as Python prints them)."""
    import warnings

    from rich.text import Text

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if not issubclass(category, PluginWarning):
                shown(message, category, *args, **kwargs)
                return
            line = Text.assemble(("warning:", "yellow"), " ", " ".join(str(message).split()))
            console(stderr=True).print(line, soft_wrap=True)

        warnings.simplefilter("always", PluginWarning)
        warnings.showwarning = show
        yield


@contextmanager
def user_errors() -> Iterator[None]:
    """A :class:`~lensdiv.core.errors.LensdivError` inside becomes one line and its exit code."""
    try:
        yield
    except LensdivError as err:
        fail(err)


@contextmanager
def interrupted() -> Iterator[None]:
    """Ctrl-C or SIGTERM before a run could keep anything: one line, exit 130 or 143."""
    try:
        yield
    except KeyboardInterrupt as err:
        signum = int(getattr(err, "signum", 2))
        error_line(f"interrupted ({'SIGTERM' if signum == 15 else 'Ctrl-C'}) before any result")
        raise typer.Exit(128 + signum) from None


def show_run(run: Any) -> None:
    """Print a run's results, then one unbroken line per skipped or failed analyzer (so a log
    keeps each on one line): a failed analyzer and an ``error:`` line on standard error."""
    term = console()
    model = run.manifest.get("model", {}) if run.manifest else {}
    if model.get("source"):  # weights converted from a GGUF file: say what was measured
        source = model["source"]
        term.print(
            f"{model.get('spec')}: {source.get('file')}, {source.get('dequantized')}",
            highlight=False,
            soft_wrap=True,
        )
    for result in run.results.values():
        term.print(result)
    show_notes(run.notes())


# How a note of each kind is printed, and which go to standard error.
_NOTE_STYLES = {
    "skipped": "yellow",
    "pending": "yellow",
    "interrupted": "yellow",
    "failed": "red",
    "error": "red",
}
_ERRORS = ("failed", "error")


def show_notes(notes: Sequence[tuple[str, str]]) -> None:
    """``(kind, line)`` notes of a run or a study, each an unbroken line: ``failed`` and
    ``error`` on standard error, the others (skipped, pending, interrupted) on standard output."""
    from rich.text import Text

    term, errors = console(), console(stderr=True)
    for kind, line in notes:
        where = errors if kind in _ERRORS else term
        where.print(Text(line, style=_NOTE_STYLES[kind]), soft_wrap=True)


def show_written(written: Any, complete: str | None = None, prefix: str = "") -> None:
    """The last line of a command that wrote results: where they are or, when the disk refused
    some (full, a file-size limit), what was and was not written
    (:class:`~lensdiv.run.outcome.Written`; ``complete`` describes a complete folder)."""
    from rich.text import Text

    style = "" if written.complete else "red"
    console().print(Text(prefix + written.line(complete), style=style), soft_wrap=True)


def check_writable(out: Path, flag: str = "--out") -> None:
    """A folder ``flag`` names can be written (checked before the work, not after)."""
    problem = folder_problem(out)
    if problem is not None:
        raise OptionError(
            f"cannot write to {flag} {out}: {problem}", hint="choose a folder you can write to"
        )


def save_and_show(result: Any, out: Path) -> None:
    """Print a study's result, write it to ``out`` and say which files are there (or, if the
    disk refused some, which ones are missing: exit code 1)."""
    from lensdiv.run.outcome import Written  # start-up: only a command that wrote loads it

    console().print(result)
    try:
        written, missing = result.save(out), []
    except SaveError as err:
        error_line(str(err))
        written, missing = err.written, list(err.failed)
    show_written(Written(out, _names(written, out), _names(missing, out)))
    if missing:
        raise typer.Exit(1)


def _names(paths: Sequence[Path], out: Path) -> tuple[str, ...]:
    """``paths`` relative to ``out``, sorted."""
    return tuple(
        sorted(p.relative_to(out).as_posix() if p.is_relative_to(out) else str(p) for p in paths)
    )


def parse_options(pairs: list[str]) -> dict[str, dict[str, str]]:
    """``["lens.top_k=10"]`` -> ``{"lens": {"top_k": "10"}}``."""
    options: dict[str, dict[str, str]] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        analyzer, dot, option = key.partition(".")
        if not eq or not dot or not analyzer or not option:
            raise OptionError(
                f"bad option {pair!r}", hint="write ANALYZER.OPTION=VALUE, e.g. -O lens.top_k=10"
            )
        options.setdefault(analyzer.strip().lower(), {})[option.strip()] = value
    return options


def check_out(out: str) -> Path:
    """``--out`` as a path; an empty one is refused (it would mean the current folder)."""
    if not out.strip():
        raise OptionError("--out is empty", hint="name a folder, e.g. --out runs/toy")
    return Path(out)


def default_out(model: str) -> Path:
    """``lensdiv-out/<model slug>-<time>``: a fresh folder per run (``-2``, ``-3``, ... when two
    runs start within the same second)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name or model).strip("-") or "model"
    base = Path("lensdiv-out") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out
