"""``lensdiv scaling``: fit the depth scaling law to a table of runs or to a model family."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Depth scaling laws: fit L = c_m/m^α_m + c_ℓ/ℓ^α_ℓ + c_D/D^α_D + L0 to runs.\n\n"
    "Example: lensdiv scaling fit runs.csv --drop-highest 40 --depth-offset -2",
    no_args_is_help=True,
)

Terms = Annotated[
    str,
    typer.Option(
        "--terms", "-t", help="'full', or some of width, depth, tokens (e.g. depth,tokens)."
    ),
]
Bootstrap = Annotated[int, typer.Option("--bootstrap", help="Bootstrap resamples (0: none).")]
Folds = Annotated[int, typer.Option(help="Folds of the held-out check (0: none).")]
Seed = Annotated[int, typer.Option(help="Seeds the bootstrap and the folds (recorded).")]
DepthOffset = Annotated[
    int, typer.Option(help="Added to the layer count: depth ℓ = n_layers + OFFSET (e.g. -2).")
]
Out = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="Output folder. Default: lensdiv-out/scaling-NAME-TIME."),
]


def _parse_columns(pairs: list[str]) -> dict[str, str]:
    from lensdiv.core.errors import OptionError

    columns = {}
    for pair in pairs:
        role, eq, name = pair.partition("=")
        if not eq or not role.strip() or not name.strip():
            raise OptionError(
                f"bad column mapping {pair!r}", hint="write ROLE=NAME, e.g. --column depth=layers"
            )
        columns[role.strip().lower()] = name.strip()
    return columns


@app.command("fit")
def fit(
    path: Annotated[Path, typer.Argument(metavar="FILE.csv", help="CSV of runs, header first.")],
    terms: Terms = "full",
    drop_highest: Annotated[
        int, typer.Option(help="Drop the N highest-loss runs (the source drops 40).")
    ] = 0,
    depth_offset: DepthOffset = 0,
    column: Annotated[
        list[str] | None,
        typer.Option(
            "--column",
            "-c",
            help="ROLE=NAME: the column of loss, width, depth or tokens (repeatable). "
            "Defaults: loss, d_model, n_layers, num_tokens.",
        ),
    ] = None,
    n_bootstrap: Bootstrap = 200,
    folds: Folds = 5,
    seed: Seed = 0,
    out: Out = None,
) -> None:
    """Fit the law to a CSV of training runs: parameters, Jacobian stderr, bootstrap, held-out.

    Example: lensdiv scaling fit ../shared/data/chinchilla_runs.csv --drop-highest 40 --depth-offset -2
    """
    from lensdiv.cli.common import default_out, fail, save_and_show
    from lensdiv.core.errors import LensdivError
    from lensdiv.studies.scaling import fit_csv

    try:
        result = fit_csv(
            path,
            terms,
            columns=_parse_columns(column or []),
            depth_offset=depth_offset,
            drop_highest=drop_highest,
            n_bootstrap=n_bootstrap,
            folds=folds,
            seed=seed,
        )
    except LensdivError as err:
        fail(err)
    save_and_show(result, out or default_out(f"scaling-{path.stem}"))


@app.command("family")
def family(
    models: Annotated[
        str,
        typer.Argument(
            metavar="MODELS", help="Comma-separated models, or zoo:depth / zoo:width (toy zoo)."
        ),
    ],
    terms: Terms = "full",
    data: Annotated[
        str | None,
        typer.Option(
            "--data", "-d", help="Text file, .jsonl, folder or hf:NAME. Default: built-in corpus."
        ),
    ] = None,
    field: Annotated[str, typer.Option(help="JSONL / data-set field holding the text.")] = "text",
    split: Annotated[str, typer.Option(help="Split of an hf: data set.")] = "train",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence (BOS included).")] = 128,
    max_tokens: Annotated[
        int, typer.Option(help="Evaluate every model on this many tokens.")
    ] = 16384,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
    bos: Annotated[str, typer.Option(help="BOS policy: prepend | none.")] = "prepend",
    depth_offset: DepthOffset = 0,
    n_bootstrap: Bootstrap = 200,
    folds: Folds = 5,
    seed: Seed = 0,
    device: Annotated[str | None, typer.Option(help="cpu, cuda ... Default: best.")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 (default), bfloat16, float16.")] = None,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow hub models that ship their own code.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    out: Out = None,
) -> None:
    """Evaluate a family of models on the same tokens and fit the law to their losses.

    Sizes that are the same for every model (a depth family's width) are left out of the fit.

    Toy models that are not cached yet are trained first.

    Example: lensdiv scaling family toy:d2,toy:d4,toy:d6,toy:d8 --folds 0
    """
    from lensdiv.cli.common import default_out, fail, save_and_show
    from lensdiv.core.errors import LensdivError
    from lensdiv.data.sources import DataSpec
    from lensdiv.studies.scaling import fit_family

    try:
        spec = DataSpec(
            source=data or "builtin",
            field=field,
            split=split,
            seq_len=seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            bos=bos,
            seed=seed,
        )
        result = fit_family(
            models,
            spec,
            terms,
            depth_offset=depth_offset,
            n_bootstrap=n_bootstrap,
            folds=folds,
            seed=seed,
            device=device,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            progress=progress,
        )
    except LensdivError as err:
        fail(err)
    save_and_show(result, out or default_out(f"scaling-{models.split(',')[0]}"))
