"""``lensdiv study``: one analysis over a family of models, compared at relative depth."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lensdiv.cli.analyze import (
    DeviceMap,
    DistTimeout,
    MaxMemory,
    OffloadFolder,
    Threads,
)
from lensdiv.cli.common import (
    Data,
    Progress,
    TrustRemoteCode,
    check_out,
    console,
    default_out,
    interrupted,
    out_option,
    parse_options,
    run_settings,
    show_notes,
    show_written,
    user_errors,
)
from lensdiv.core.settings import DEFAULTS, RunSettings

app = typer.Typer(
    help="Studies: the same analysis over a family of models, compared at relative depth ℓ/L.\n\n"
    "Example: lensdiv study run zoo:depth --plugins contrib,lens,skip --out study/",
    no_args_is_help=True,
)

Models = Annotated[
    list[str],
    typer.Argument(
        metavar="MODELS",
        help="Comma lists of models: hub names (EleutherAI/pythia-{70m,160m}: braces expand), "
        "toy models, a zoo family (zoo:depth, zoo:width), a text file of specs one per line, "
        "a model folder or a folder of model folders.",
    ),
]
Task = Annotated[
    str | None,
    typer.Option(
        metavar="I/N",
        help="Run only task I of N (every N-th model from the I-th), e.g. in a job array; "
        "default: SLURM_ARRAY_TASK_ID / SLURM_ARRAY_TASK_COUNT when set, else every model.",
        rich_help_panel="Scaling out",
    ),
]


@app.command("run")
@run_settings()
def run(
    models: Models,
    plugins: Annotated[
        str, typer.Option("--plugins", "-p", help="Comma-separated analyzers, run on every model.")
    ] = "lens,contrib",
    data: Data = None,
    settings: RunSettings = DEFAULTS,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-O", help="Analyzer option, ANALYZER.OPTION=VALUE (repeatable)."),
    ] = None,
    out: Annotated[str | None, out_option("study-TIME")] = None,
    threads: Threads = None,
    trust_remote_code: TrustRemoteCode = False,
    progress: Progress = True,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    offload_folder: OffloadFolder = None,
    task: Task = None,
    dist_timeout: DistTimeout = 1800.0,
) -> None:
    """Run the analyzers on every model (one ordinary run each, one model in memory at a time),
    then write the study's dataset, figures at relative depth and study.html.

    Example: lensdiv study run zoo:depth --plugins contrib,lens,skip --out study/

    Rerun the same command to resume: finished models are kept, the others redone. A model that
    cannot be loaded is listed with its reason and the others go on. --lens tuned:lenses/{run}
    reads a lens fitted per model ({model}: its spec, {run}: its folder name).

    Exit codes: 0 every model complete; 1 some model failed (the others finished, nothing is
    lost); 2 a mistake in the input, found before any model; 130 / 143 Ctrl-C / SIGTERM.

    A job array: lensdiv study run models.txt ... --out study/ in every task (the task comes
    from SLURM_ARRAY_TASK_ID, or --task I/N), then lensdiv study report study/
    """
    # start-up: the study imports the runner (torch); it loads only when the command runs.
    from lensdiv.run.distributed import launched_world
    from lensdiv.studies.crossmodel import run_study

    with user_errors(), interrupted(), launched_world(dist_timeout) as world:
        folder = default_out(f"study-{models[0].split(',')[0]}") if out is None else check_out(out)
        study = run_study(
            models,
            data,
            plugins,
            out=folder,
            options=parse_options(option or []),
            settings=settings,
            task=task,
            progress=progress,
            device=settings.device,  # recorded in study.json as before
            dtype=settings.dtype,
            threads=threads,
            trust_remote_code=trust_remote_code,
            device_map=device_map,
            max_memory=max_memory,
            offload_folder=offload_folder,
        )
    if world.main:
        _show(study)
    _exit(study)


@app.command("report")
def report(
    out: Annotated[Path, typer.Argument(help="A folder written by `lensdiv study run`.")],
    progress: Progress = True,
) -> None:
    """Gather a study: every model's status, the dataset (study.parquet, study.csv), the figures
    (summary/) and study.html over every finished run, e.g. after the tasks of a job array.

    Example: lensdiv study report study/
    """
    # start-up: the study imports the runner (torch); it loads only when the command runs.
    from lensdiv.studies.crossmodel import report_study

    with user_errors():
        study = report_study(out, progress=progress)
    _show(study)
    if study.problems:
        raise typer.Exit(1)


def _show(study: Any) -> None:
    """The study's table and numbers, its notes (failures and errors on standard error), and
    a last line: where it is or, when the disk refused some files, which are there and which
    are not."""
    # start-up: loaded only when a study ran (the runner's outcome imports the report's view).
    from lensdiv.run.outcome import Written
    from lensdiv.studies.crossmodel.folder import CSV, HTML, PARQUET, STUDY, SUMMARY

    term = console()
    for part in study.overview():
        term.print(part)
    show_notes(study.notes())
    if study.out is None or study.summary is None:
        return
    if not study.problems:
        term.print(
            f"study in [bold]{study.out}[/bold] (study.html, study.parquet, study.csv, summary/, "
            "runs/ with one run folder per model)"
        )
        return
    out, lost = Path(study.out), study.unwritten
    there = [n for n in (HTML, PARQUET, CSV, STUDY) if n not in lost and (out / n).is_file()]
    if (out / SUMMARY).is_dir():
        there.append(
            f"{SUMMARY}/" + (" (in part)" if any(n.startswith(SUMMARY) for n in lost) else "")
        )
    show_written(Written(out, tuple(there), tuple(lost)))


def _exit(study: Any) -> None:
    if study.interrupted:
        raise typer.Exit(143 if study.interrupted == "SIGTERM" else 130)
    if not study.ok:
        raise typer.Exit(1)
