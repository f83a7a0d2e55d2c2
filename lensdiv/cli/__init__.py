"""The ``lensdiv`` command line: each command parses, calls the Python API and prints.

One module per command group; heavy imports stay inside the commands so ``lensdiv --help``
answers at once.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from lensdiv import __version__
from lensdiv.cli import analyze as _analyze
from lensdiv.cli import explore as _explore
from lensdiv.cli import lens as _lens
from lensdiv.cli import lenses as _lenses
from lensdiv.cli import merge as _merge
from lensdiv.cli import models as _models
from lensdiv.cli import plugins as _plugins
from lensdiv.cli import scaling as _scaling
from lensdiv.cli import study as _study
from lensdiv.cli import teacher as _teacher
from lensdiv.cli import toy as _toy
from lensdiv.cli.common import Group

app = typer.Typer(
    name="lensdiv",
    help="How does a transformer use its depth? Run depth analyses on any TransformerLens model.\n\n"
    "Example: lensdiv analyze gpt2-medium --plugins lens,contrib --data text.txt",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    cls=Group,
)
app.command()(_analyze.analyze)
app.command()(_analyze.compare)
app.command()(_analyze.report)
app.command()(_lens.lens)
app.command()(_explore.explore)
app.command()(_merge.merge)
app.add_typer(_plugins.app, name="plugins")
app.add_typer(_lenses.app, name="lenses")
app.add_typer(_toy.app, name="toy")
app.add_typer(_models.app, name="models")
# Whole studies rather than analyzers of one model: fits over many runs, toy experiments.
app.add_typer(_scaling.app, name="scaling")
app.add_typer(_study.app, name="study")
app.command("teacher-student")(_teacher.teacher_student)


def _version(value: bool | None) -> None:
    if value:
        typer.echo(f"lensdiv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = None,
) -> None:
    """How does a transformer use its depth?"""


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt as err:  # before a run could keep anything (SIGTERM: exit 143)
        signum = int(getattr(err, "signum", 2))
        sys.stderr.write("interrupted\n")
        sys.exit(128 + signum)


if __name__ == "__main__":
    main()
