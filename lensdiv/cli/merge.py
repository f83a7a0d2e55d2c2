"""``lensdiv merge``: combine the shards of a run made with ``--shard I/N``, finalize, write."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import default_out, out_option, show_run, show_written, user_errors


def merge(
    shards: Annotated[
        list[Path], typer.Argument(help="The --out folder of every shard (any order).")
    ],
    out: Annotated[Path | None, out_option("merged-TIME")] = None,
) -> None:
    """Merge the shards of one run (lensdiv analyze ... --shard I/N) and finalize the results.

    Every shard 0..N-1, agreeing on model, data, options, seed and versions; loads no model.

    Example: lensdiv merge run/shard-* --out run/all
    """
    # start-up: the merge imports torch; it loads only when the command runs.
    from lensdiv.run.merge import merge_runs

    out = out or default_out("merged")
    with user_errors():
        run = merge_runs(shards, out)
    show_run(run)
    show_written(
        run.written(),
        "manifest.json, one folder per analyzer",
        prefix=f"{run.manifest['merged']['shards']} shards merged; ",
    )
    if run.errors or run.problems:
        raise typer.Exit(1)
