"""``lensdiv lens``: the prompt view of one prompt (terminal table, heatmap PNG, interactive HTML)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import (
    TrustRemoteCode,
    check_writable,
    console,
    run_settings,
    user_errors,
)
from lensdiv.core.settings import DEFAULTS, RunSettings


@run_settings("device", "dtype")
def lens(
    model: Annotated[
        str, typer.Argument(help="Hub name (gpt2), local HF folder, or toy model (toy, toy:d8).")
    ],
    text: Annotated[str, typer.Argument(help="The prompt, in quotes.")],
    top_k: Annotated[int, typer.Option("--top-k", "-k", help="Tokens per cell (on hover).")] = 3,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write the interactive HTML page here.")
    ] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the heatmap PNG here.")] = None,
    kind: Annotated[
        str,
        typer.Option(
            "--lens",
            help="logit (h_l → final norm → unembedding), last-block, patchscope (h_l patched "
            "into an inspection prompt; patchscope:target=last&position=-1&prompt_file=P for "
            "options), or a fitted lens (tuned:PATH, jacobian:PATH, affine:PATH; PATH the --out "
            "folder of lensdiv lenses fit); several, comma-separated, side by side.",
        ),
    ] = "logit",
    skip: Annotated[
        int | None,
        typer.Option("--skip", metavar="BLOCK", help="Skip this block (positions ≥ 1) first."),
    ] = None,
    part: Annotated[str, typer.Option(help="What --skip removes: block, attn or mlp.")] = "block",
    bos: Annotated[bool, typer.Option(help="Prepend the BOS token.")] = True,
    settings: RunSettings = DEFAULTS,
    trust_remote_code: TrustRemoteCode = False,
) -> None:
    """What every layer predicts at every position of TEXT: top tokens and their probabilities.

    Prints a layer × position table (colour = probability); --html writes a page whose cells
    show the top-k tokens, the KL divergence to the output and the entropy on hover, and --png
    a heatmap (with --html alone the PNG goes next to it). Read out in float32.

    Example: lensdiv lens gpt2 "The capital of France is" --top-k 3 --html france.html

    More: lensdiv lens toy "The happy dog" --lens last-block;
    lensdiv lens toy "The happy dog" --lens logit,patchscope;
    lensdiv lens toy "The happy dog" --skip 2;
    lensdiv lens toy "The happy dog" --lens logit,tuned:lenses/toy --html cmp.html
    """
    # start-up: torch and TransformerLens load only when the command runs.
    from lensdiv.models.load import load_model
    from lensdiv.ops.prompt import prompt_view

    with user_errors():
        for flag, path in (("--html", html), ("--png", png)):  # before the model loads
            if path is not None:
                check_writable(path.parent, flag)
        bridge = load_model(
            model,
            device=settings.device,
            dtype=settings.dtype,
            trust_remote_code=trust_remote_code,
        )
        view = prompt_view(
            bridge, text, top_k=top_k, lens=kind, skip=skip, part=part, prepend_bos=bos
        )
    term = console()
    term.print(view)
    if html is not None and png is None:
        png = html.with_suffix(".png")
    for path in (html, png):
        if path is not None:
            view.save(path)
            term.print(f"wrote [bold]{path}[/bold]")
