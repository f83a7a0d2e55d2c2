"""``lensdiv scaling``: fit the depth scaling law to a table of runs or to a model family."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import (
    Data,
    Progress,
    TrustRemoteCode,
    check_writable,
    default_out,
    out_option,
    run_settings,
    save_and_show,
    user_errors,
)
from lensdiv.core.errors import OptionError
from lensdiv.core.settings import DEFAULTS, RunSettings

app = typer.Typer(
    help="Depth scaling laws: fit L = c_m/m^α_m + c_ℓ/ℓ^α_ℓ + c_D/D^α_D + L0 to runs.\n\n"
    "Example: lensdiv scaling fit chinchilla --drop-highest 40 --depth-offset -2",
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
_SEED_HELP = "Seeds the bootstrap and the folds (recorded)."
Seed = Annotated[int, typer.Option(help=_SEED_HELP)]
DepthOffset = Annotated[
    int, typer.Option(help="Added to the layer count: depth ℓ = n_layers + OFFSET (e.g. -2).")
]
Out = Annotated[Path | None, out_option("scaling-NAME-TIME")]


def _parse_columns(pairs: list[str]) -> dict[str, str]:
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
    source: Annotated[
        str,
        typer.Argument(
            metavar="FILE.csv|NAME",
            help="CSV of runs, header first, or a table that ships with lensdiv: chinchilla "
            "(the Chinchilla study's 245 runs as reconstructed by Besiroglu et al. 2024).",
        ),
    ],
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

    A built-in table is read by name, which wins over a file of that name (./NAME: the file).

    Example: lensdiv scaling fit chinchilla --drop-highest 40 --depth-offset -2
    """
    # start-up: the study (numpy, scipy) loads only when the command runs.
    from lensdiv.studies.scaling import fit_csv

    out = out or default_out(f"scaling-{Path(source).stem}")
    with user_errors():
        check_writable(out)
        result = fit_csv(
            source,
            terms,
            columns=_parse_columns(column or []),
            depth_offset=depth_offset,
            drop_highest=drop_highest,
            n_bootstrap=n_bootstrap,
            folds=folds,
            seed=seed,
        )
    save_and_show(result, out)


@app.command("family")
@run_settings(
    exclude=("lens",),
    max_tokens={"help": "Evaluate every model on this many tokens."},
    seed={"help": _SEED_HELP},
)
def family(
    models: Annotated[
        str,
        typer.Argument(
            metavar="MODELS", help="Comma-separated models, or zoo:depth / zoo:width (toy zoo)."
        ),
    ],
    terms: Terms = "full",
    data: Data = None,
    settings: RunSettings = DEFAULTS,
    depth_offset: DepthOffset = 0,
    n_bootstrap: Bootstrap = 200,
    folds: Folds = 5,
    trust_remote_code: TrustRemoteCode = False,
    progress: Progress = True,
    out: Out = None,
) -> None:
    """Evaluate a family of models on the same tokens and fit the law to their losses.

    Sizes that are the same for every model (a depth family's width) are left out of the fit.

    A study of the models' loss (lensdiv study): one run folder per model under OUT/study, so
    the same command with the same --out resumes where it stopped. Toy models that are not
    cached yet are trained first.

    Example: lensdiv scaling family toy:d2,toy:d4,toy:d6,toy:d8 --folds 0
    """
    # start-up: the study (numpy, scipy) and the data sources load only when the command runs.
    from lensdiv.data.sources import DataSpec
    from lensdiv.studies.scaling import fit_family

    out = out or default_out(f"scaling-{models.split(',')[0]}")
    with user_errors():
        check_writable(out)  # before every model is evaluated
        # the API's own reading of --data ("" is an error)
        spec = DataSpec.from_data(data, **settings.data())
        result = fit_family(
            models,
            spec,
            terms,
            depth_offset=depth_offset,
            n_bootstrap=n_bootstrap,
            folds=folds,
            seed=settings.seed,
            device=settings.device,
            dtype=settings.dtype,
            trust_remote_code=trust_remote_code,
            progress=progress,
            study=out / "study",
        )
    save_and_show(result, out)
