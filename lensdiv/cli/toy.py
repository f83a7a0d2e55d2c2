"""``lensdiv toy``: the built-in toy zoo (list, train and cache models)."""

from __future__ import annotations

from typing import Annotated

import typer

from lensdiv.cli.common import console, user_errors
from lensdiv.core.errors import ModelLoadError

app = typer.Typer(
    help="Built-in toy models: list the zoo, train and cache models.", no_args_is_help=True
)


@app.command("list")
def toy_list() -> None:
    """List the toy zoo: size, whether it is cached (or shipped trained with lensdiv), and its
    training results.

    Example: lensdiv toy list
    """
    # start-up: rich and the toy zoo (5% of `lensdiv --help`) load only when the command runs.
    from rich.table import Table

    from lensdiv.models.toy import cache_root, trained_log, zoo

    table = Table(
        title=f"toy models (cache: {cache_root() / 'toy'})",
        title_justify="left",
        caption="`toy` is toy:d4-w64; toy:kb is the multi-hop model depth-score uses. cached: "
        "yes, no (trained on first use) or shipped (trained, read from the package). loss: "
        "cross-entropy on held-out text. Accuracy on knowledge-base queries: 1-hop (the facts); "
        "2-hop on chains of the training split (seen: what depth-score asks) / on held-out "
        "chains (unseen: composition)",
        caption_justify="left",
    )
    for col in ("name", "depth", "width", "cached", "loss", "1-hop", "2-hop", "train s"):
        table.add_column(col, justify="left" if col == "name" else "right", no_wrap=True)
    for spec in zoo():
        found = trained_log(spec)
        row = [spec.name, str(spec.depth), str(spec.width)]
        if found is None:
            table.add_row(*row, "no", "", "", "", "")
        else:
            where, log = found
            table.add_row(
                *row,
                "yes" if where == "cached" else where,
                f"{log['heldout_loss']:.4f}",
                f"{log['multihop']['1']:.2f}",
                (f"{log['multihop_seen']['2']:.2f}/" if "multihop_seen" in log else "")
                + f"{log['multihop']['2']:.2f}",
                f"{log['train_seconds']:.0f}",
            )
    console().print(table)


@app.command("train")
def toy_train(
    name: Annotated[str | None, typer.Argument(help="toy, toy:d4, toy:d8-w128, toy:kb ...")] = None,
    all_: Annotated[bool, typer.Option("--all", help="Train the whole zoo.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Retrain even if cached.")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Train toy models and cache them (weights, training log, loss curve PNG).

    The default toy ships trained with lensdiv; training it here says whether the weights are
    the shipped ones, bit for bit.

    Example: lensdiv toy train --all
    """
    # start-up: the toy zoo (5% of `lensdiv --help`) loads only when the command runs.
    from lensdiv.models.toy import (
        cached_log,
        check_cache,
        entry_dir,
        parse_toy,
        shipped_match,
        train_toy,
        zoo,
    )

    with user_errors():
        if all_ == (name is not None):
            raise ModelLoadError(
                "name one toy model or pass --all", hint="e.g. lensdiv toy train toy:d8"
            )
        specs = zoo() if all_ else [parse_toy(name or "toy")]
        for spec in specs:  # before any training: the cache must take the result
            if force or cached_log(spec) is None:
                check_cache(entry_dir(spec))
    term = console()
    for spec in specs:
        log = None if force else cached_log(spec)
        cached, shipped = log is not None, ""
        if log is None:
            model, log = train_toy(spec, progress=progress)
            same = shipped_match(spec, model)
            if same is not None:
                shipped = "; the weights shipped with lensdiv: " + (
                    "the same, bit for bit" if same else "different"
                )
        hop = log["multihop"]
        seen = log.get("multihop_seen", {})  # logs cached before it existed lack it
        baseline = hop.get("baseline", {})
        hops = [f"1 hop {hop['1']:.2f}"]
        for h in ("2", "3", "4"):
            text = f"{h} hop " + (f"{seen[h]:.2f} training chains / " if h in seen else "")
            text += f"{hop[h]:.2f} held-out"
            hops.append(text + (f" (baseline {baseline[h]:.2f})" if h in baseline else ""))
        term.print(
            f"{spec.name}: held-out loss {log['heldout_loss']:.4f}, accuracy {', '.join(hops)} "
            f"(chance {hop['chance']:.2f}), "
            f"{'cached; it trained' if cached else 'trained'} in {log['train_seconds']:.0f} s "
            f"-> {entry_dir(spec)}{shipped}"
        )
