"""``lensdiv explore``: the model, live in a browser (a local web app over one loaded model)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import TrustRemoteCode, console, run_settings, user_errors
from lensdiv.core.settings import DEFAULTS, RunSettings


@run_settings("device", "dtype")
def explore(
    model: Annotated[
        str, typer.Argument(help="Hub name (gpt2), local HF folder, or toy model (toy, toy:d8).")
    ] = "toy",
    lens: Annotated[
        list[str] | None,
        typer.Option(
            "--lens",
            metavar="SPEC",
            help="A fitted lens to offer beside the logit and last-block lenses "
            "(tuned:PATH, jacobian:PATH, affine:PATH); repeat for several.",
        ),
    ] = None,
    runs: Annotated[
        Path | None,
        typer.Option("--runs", metavar="DIR", help="List the runs and studies under DIR."),
    ] = None,
    port: Annotated[int, typer.Option(help="Port to listen on (0: a free one).")] = 8765,
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on (0.0.0.0: every interface; the URL names this machine)."
        ),
    ] = "127.0.0.1",
    token: Annotated[
        bool,
        typer.Option(
            "--token/--no-token",
            help="Require the secret token the printed URL carries (as Jupyter does: on a "
            "shared machine every user can reach 127.0.0.1); --no-token: none, loopback only.",
        ),
    ] = True,
    products: Annotated[
        str,
        typer.Option(
            metavar="KIND",
            help="The grid's unembedding products: auto (bf16 for the vocabulary-wide sums "
            "where the CPU/GPU has fast bf16 and the unembedding is large, every number shown "
            "re-read in float32), float32 (all exact) or bf16.",
        ),
    ] = "auto",
    browser: Annotated[
        bool, typer.Option("--browser/--no-browser", help="Open the page in a web browser.")
    ] = True,
    settings: RunSettings = DEFAULTS,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    r"""Explore MODEL in a browser: type a prompt and watch every layer's guess, switch lenses,
    skip a block, patch a corrupt prompt, open saved runs.

    Loads the model once and serves a page on 127.0.0.1 (offline: nothing is fetched from
    elsewhere) at the printed URL, which carries a secret token. Needs the explore extra:
    pip install 'lensdiv\[explore]'. Ctrl-C stops it.

    Example: lensdiv explore toy --lens tuned:lenses/toy --runs runs
    """
    # start-up: the web stack and torch load only when the command runs.
    from lensdiv.web.serve import prepare

    with user_errors():
        server, sock, url = prepare(
            model,
            lens or (),
            runs,
            host=host,
            port=port,
            device=settings.device,
            dtype=settings.dtype,
            trust_remote_code=trust_remote_code,
            products=products,
            token=token,
        )
    term = console()
    term.print(f"lensdiv explore: [bold]{url}[/bold]  (Ctrl-C stops it)", soft_wrap=True)
    if browser:
        import webbrowser

        # No browser here (a server, a container): the URL is printed above.
        with contextlib.suppress(Exception):
            webbrowser.open(url)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    term.print("lensdiv explore: stopped")
