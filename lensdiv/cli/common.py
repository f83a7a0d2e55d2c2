"""What every command shares: options, the console, one-line errors, option parsing, output."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from lensdiv.core.errors import LensdivError, OptionError

# Options several commands take, with the same flag, type and help everywhere.
Data = Annotated[
    str | None,
    typer.Option(
        "--data",
        "-d",
        help="Text file, .jsonl, folder of .txt, or hf:NAME[:CONFIG]. Default: built-in corpus.",
    ),
]
Field = Annotated[str, typer.Option(help="JSONL / data-set field holding the text.")]
Split = Annotated[str, typer.Option(help="Split of an hf: data set.")]
SeqLen = Annotated[int, typer.Option(help="Tokens per sequence (BOS included).")]
BatchSize = Annotated[int, typer.Option(help="Sequences per forward pass.")]
Bos = Annotated[str, typer.Option(help="BOS policy: prepend | none.")]
Device = Annotated[str | None, typer.Option(help="cpu, cuda, cuda:1 ... Default: best available.")]
Dtype = Annotated[
    str | None,
    typer.Option(help="float32 (default), bfloat16, float16, float64. Readouts are float32."),
]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help="Allow hub models that ship their own code.")
]
Progress = Annotated[bool, typer.Option(help="Show a progress bar.")]


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
    console(stderr=True).print(f"[bold red]error:[/bold red] {err}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """A :class:`~lensdiv.core.errors.LensdivError` inside becomes one line and its exit code."""
    try:
        yield
    except LensdivError as err:
        fail(err)


def save_and_show(result: Any, out: Path) -> None:
    """Write a study's result to ``out``, print it, and say which files are there."""
    written = result.save(out)
    term = console()
    term.print(result)
    names = ", ".join(sorted(p.name for p in written))
    term.print(f"results in [bold]{out}[/bold] ({names})")


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


def default_out(model: str) -> Path:
    """``lensdiv-out/<model slug>-<time>``: a fresh folder per run."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name or model).strip("-") or "model"
    return Path("lensdiv-out") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
