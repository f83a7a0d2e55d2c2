"""What every command shares: the console, one-line errors, option parsing, output folders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def console(stderr: bool = False) -> Any:
    """A rich console (stdout, or stderr for errors), without syntax highlighting."""
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def fail(err: Exception) -> None:
    """Print one line for a user error and exit 2."""
    from lensdiv.core.errors import LensdivError

    code = err.exit_code if isinstance(err, LensdivError) else 2
    console(stderr=True).print(f"[bold red]error:[/bold red] {err}", markup=True, soft_wrap=True)
    raise typer.Exit(code)


def save_and_show(result: Any, out: Path) -> None:
    """Write a study's result to ``out``, print it, and say which files are there."""
    written = result.save(out)
    term = console()
    term.print(result)
    names = ", ".join(sorted(p.name for p in written))
    term.print(f"results in [bold]{out}[/bold] ({names})")


def parse_options(pairs: list[str]) -> dict[str, dict[str, str]]:
    """``["lens.top_k=10"]`` -> ``{"lens": {"top_k": "10"}}``."""
    from lensdiv.core.errors import OptionError

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
    import re
    import time

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).name or model).strip("-") or "model"
    return Path("lensdiv-out") / f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
