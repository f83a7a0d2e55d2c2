"""``lensdiv plugins``: inspect the analyzer plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import console, user_errors

app = typer.Typer(help="Inspect the analyzer plugins.", no_args_is_help=True)


@app.command("list")
def plugins_list() -> None:
    """List the installed analyzers: name, aliases, description and providing package.

    Example: lensdiv plugins list
    """
    # start-up: rich and the registry (importlib.metadata) load only when the command runs.
    from rich.markup import escape
    from rich.table import Table

    from lensdiv.core.registry import default_registry

    registry = default_registry()
    table = Table(title="lensdiv analyzers", title_justify="left")
    for col in ("name", "aliases", "description", "provided by"):
        table.add_column(col, no_wrap=col in ("name", "provided by"))
    for entry in registry.entries.values():
        style = "red" if entry.cls is None else None
        table.add_row(
            entry.name, ", ".join(entry.aliases), entry.description, entry.provider, style=style
        )
    term = console()
    term.print(table)
    for problem in registry.problems:  # one unbroken line each, read as text (no markup)
        console(stderr=True).print("[yellow]warning:[/yellow]", escape(problem), soft_wrap=True)


@app.command("show")
def plugins_show(name: Annotated[str, typer.Argument(help="Analyzer name or alias.")]) -> None:
    """Show one analyzer's description, needs, options and where its analysis is defined.

    Example: lensdiv plugins show lens
    """
    # start-up: rich and the registry (importlib.metadata) load only when the command runs.
    from rich.table import Table

    from lensdiv.core.registry import definitions, get_analyzer

    with user_errors():
        cls = get_analyzer(name)
    term = console()
    term.print(
        f"[bold]{cls.name}[/bold] ({', '.join(cls.aliases) or 'no aliases'}): {cls.description}"
    )
    term.print(
        f"needs logits: {cls.needs_logits}, extra forwards: {cls.extra_forwards}, "
        f"gradients: {cls.needs_grad}, numerics: {cls.numerics}"
    )
    link = definitions(cls)
    if link:
        term.print(f"definitions: {link}", soft_wrap=True)
    table = Table("option", "default", "values", "meaning", box=None, pad_edge=False)
    for row in cls.option_docs():
        table.add_row(
            f"-O {cls.name}.{row['name']}",
            row["default"],
            row["type"],
            row["help"].replace("``", "`"),
        )
    if table.row_count:
        term.print(table)
    else:
        term.print("no options")


@app.command("new")
def plugins_new(
    name: Annotated[str, typer.Argument(help="Plugin name: lower case, digits, hyphens.")],
    directory: Annotated[
        Path, typer.Option("--dir", help="Where to create the package folder lensdiv-NAME.")
    ] = Path("."),
) -> None:
    """Create a plugin package: pyproject with the entry point, an analyzer skeleton, a test.

    It installs and passes its tests as generated; then replace the science.

    Example: lensdiv plugins new resid-norm && pip install -e lensdiv-resid-norm
    """
    from lensdiv.testing.scaffold import new_plugin  # start-up: the registry loads every analyzer

    with user_errors():
        root = new_plugin(name, directory)
    term = console()
    term.print(f"created [bold]{root}[/bold]")
    term.print(f"next: pip install -e {root} && pytest {root / 'tests'}")
