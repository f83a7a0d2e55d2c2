"""``lensdiv analyze``, ``compare`` and ``report``: run analyzers over a model, re-render a run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from lensdiv.cli.common import (
    Data,
    Progress,
    TokenCacheFlag,
    TrustRemoteCode,
    check_out,
    console,
    default_out,
    error_line,
    interrupted,
    out_option,
    parse_options,
    plugin_warnings,
    run_settings,
    show_run,
    show_written,
    user_errors,
)
from lensdiv.core.errors import OptionError, SaveError
from lensdiv.core.settings import DEFAULTS, RunSettings

# Options of `analyze` and `compare` alone.
Threads = Annotated[
    int | None,
    typer.Option(help="Torch threads for this run (recorded in the manifest). Default: torch's."),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        "--overwrite",
        help="Replace an earlier run in --out (its manifest and analyzer folders are removed); "
        "without it such an --out is refused.",
    ),
]
# Scaling out: models split across devices, shards, process groups.
DeviceMap = Annotated[
    str | None,
    typer.Option(
        help="Split a Hugging Face model across devices: auto, balanced, balanced_low_0, "
        "sequential, or FILE.json of {module: device} (GPU index, cpu, disk).",
        rich_help_panel="Scaling out",
    ),
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        help="Most each device may hold with --device-map, e.g. 0=70GiB,1=70GiB,cpu=200GiB.",
        rich_help_panel="Scaling out",
    ),
]
OffloadFolder = Annotated[
    Path | None,
    typer.Option(
        help="Folder for weights a --device-map puts on disk.", rich_help_panel="Scaling out"
    ),
]
Shard = Annotated[
    str | None,
    typer.Option(
        metavar="I/N",
        help="Run shard I of N (from 0) and save mergeable states; then `lensdiv merge`. "
        "Single-pass analyzers only.",
        rich_help_panel="Scaling out",
    ),
]
DistTimeout = Annotated[
    float,
    typer.Option(
        help="Under torchrun: seconds a rank waits for the others before giving up.",
        rich_help_panel="Scaling out",
    ),
]


@run_settings()
def analyze(
    model: Annotated[
        str,
        typer.Argument(help="Hub name (gpt2-medium), local HF folder, or toy model (toy, toy:d8)."),
    ] = "toy",
    plugins: Annotated[
        str,
        typer.Option(
            "--plugins", "-p", help="Comma-separated analyzers (see `lensdiv plugins list`)."
        ),
    ] = "lens,contrib",
    data: Data = None,
    settings: RunSettings = DEFAULTS,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-O", help="Analyzer option, ANALYZER.OPTION=VALUE (repeatable)."),
    ] = None,
    out: Annotated[str | None, out_option("MODEL-TIME")] = None,
    threads: Threads = None,
    trust_remote_code: TrustRemoteCode = False,
    progress: Progress = True,
    overwrite: Overwrite = False,
    ref: Annotated[
        str | None,
        typer.Option(
            "--ref",
            metavar="DEEP",
            help="Deeper model with the same tokenizer for the `linmap` analyzer (sets "
            "linmap.target; adds linmap to --plugins if missing). "
            "Example: lensdiv analyze toy:d4 --plugins linmap --ref toy:d8",
        ),
    ] = None,
    device_map: DeviceMap = None,
    max_memory: MaxMemory = None,
    offload_folder: OffloadFolder = None,
    shard: Shard = None,
    dist_timeout: DistTimeout = 1800.0,
    token_cache: TokenCacheFlag = True,
) -> None:
    """Analyze MODEL with the chosen analyzers: one fused pass, a summary here, files in --out.

    Example: lensdiv analyze gpt2-medium --plugins lens,contrib --data corpus.txt --max-tokens 20000

    Exit codes: 0 done (an analyzer that cannot support the model is skipped with its reason);
    1 an analyzer failed (the others finished); 2 a mistake in the input, found before any work;
    130 / 143 stopped by Ctrl-C / SIGTERM (what was finished is kept).

    More: lensdiv analyze toy --plugins skip,depth-score -O skip.mode=current;
    lensdiv analyze toy:d4 --plugins linmap --ref toy:d8;
    lensdiv analyze toy:d8 --plugins lens,dynamics -O dynamics.final_state=post;
    lensdiv analyze MODEL --dtype bfloat16 --plugins lens -O lens.every=4 --threads 8;
    lensdiv analyze MODEL --plugins lens,bias --lens tuned:lenses/MODEL-tuned (a fitted lens);
    lensdiv plugins show patch

    Scaling out: torchrun --nproc-per-node 8 -m lensdiv analyze MODEL ... (every GPU of a node);
    lensdiv analyze MODEL ... --shard 3/16 --out run/shard-3, then lensdiv merge run/shard-*;
    lensdiv analyze MODEL --device-map auto --dtype bfloat16 (a model bigger than one GPU)
    """
    # start-up: the runner (and the process group's code) import torch; they load only when
    # the command runs.
    from lensdiv.run.distributed import launched_world
    from lensdiv.run.runner import analyze as run_analyze

    if not token_cache:  # the environment reaches every reader: threads, shards, subprocesses
        # start-up: the token cache imports numpy; it loads only when the command runs.
        from lensdiv.data.cache import ENV

        os.environ[ENV] = "off"
    with user_errors(), interrupted(), plugin_warnings(), launched_world(dist_timeout) as world:
        folder = default_out(model) if out is None else check_out(out)
        options = parse_options(option or [])
        if ref is not None:
            plugins = _add_ref(plugins, options, ref)
        run = run_analyze(
            model,
            data,
            plugins,
            out=folder,
            options=options,
            settings=settings,
            threads=threads,
            trust_remote_code=trust_remote_code,
            progress=progress,
            overwrite=overwrite,
            device_map=device_map,
            max_memory=max_memory,
            offload_folder=offload_folder,
            shard=shard,
        )
    if world.main:
        _show(run, folder)
    if run.manifest.get("status") == "interrupted":
        raise typer.Exit(143 if run.manifest.get("signal") == "SIGTERM" else 130)
    if run.errors or run.problems:
        raise typer.Exit(1)


def _show(run: Any, out: Path) -> None:
    """Print a run's results (a shard's: where its states are)."""
    show_run(run)
    term = console()
    shard = run.manifest.get("shard")
    if shard:
        term.print(
            f"shard {shard['index']}/{shard['count']}: states in [bold]{out}[/bold]; merge every "
            "shard with `lensdiv merge`"
        )
    else:
        show_written(run.written(), "report.html, manifest.json, one folder per analyzer")


def _add_ref(plugins: str, options: dict[str, dict[str, str]], ref: str) -> str:
    """Make ``--ref DEEP`` mean ``-O linmap.target=DEEP``, with linmap among the plugins."""
    # start-up: the registry imports importlib.metadata (8% of `lensdiv --help`).
    from lensdiv.core.registry import get_analyzer

    cls = get_analyzer("linmap")
    for key in (cls.name, *cls.aliases):
        given = options.get(key, {}).get("target")
        if given is not None and given != ref:
            raise OptionError(
                f"--ref {ref} and -O {key}.target={given} disagree", hint="pass only one of them"
            )
        options.get(key, {}).pop("target", None)
    options.setdefault(cls.name, {})["target"] = ref
    names = [p for p in plugins.split(",") if p.strip()]
    if not any(get_analyzer(p) is cls for p in names):
        names.append(cls.name)
    return ",".join(names)


@run_settings(exclude=("lens",))
def compare(
    shallow: Annotated[str, typer.Argument(help="The model whose layers are mapped (source).")],
    deep: Annotated[str, typer.Argument(help="The deeper model with the same tokenizer (target).")],
    data: Data = None,
    settings: RunSettings = DEFAULTS,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-O", help="linmap option, e.g. -O linmap.ridge=1e-3."),
    ] = None,
    out: Annotated[str | None, out_option("SHALLOW-TIME")] = None,
    progress: Progress = True,
    overwrite: Overwrite = False,
) -> None:
    """Map every layer of SHALLOW onto every layer of DEEP (cross-model linear maps, R²).

    Short for `lensdiv analyze SHALLOW --plugins linmap --ref DEEP`.

    Example: lensdiv compare toy:d4 toy:d8 --max-tokens 8192
    """
    analyze(
        model=shallow,
        plugins="linmap",
        data=data,
        settings=settings,
        option=option,
        out=out,
        progress=progress,
        overwrite=overwrite,
        ref=deep,
    )


def report(
    out: Annotated[Path, typer.Argument(help="A folder written by `lensdiv analyze`.")],
    plots: Annotated[bool, typer.Option(help="Redraw the PNG plots.")] = False,
    html: Annotated[
        bool, typer.Option(help="Rebuild DIR/report.html (summary, tables, plots, warnings).")
    ] = False,
) -> None:
    """Re-render a saved run: summaries and tables (and, with --plots, the PNGs; with --html,
    the self-contained report.html).

    Example: lensdiv report lensdiv-out/toy-20261121-120000 --html
    """
    # start-up: the runner imports torch; it loads only when the command runs.
    from lensdiv.run.report import write_report
    from lensdiv.run.runner import load_run

    with user_errors():
        run = load_run(out)
    not_drawn = []
    if plots:
        for name, result in run.results.items():
            try:
                result.redraw(out / name)
            except SaveError as err:
                not_drawn.append(str(err))
    if html:
        written = write_report(run)
    term = console()
    meta = run.manifest.get("model", {})
    term.print(
        f"[bold]{meta.get('spec', '?')}[/bold] ({meta.get('resolved', '?')}), "
        f"{run.manifest.get('timings', {}).get('tokens', '?')} tokens, "
        f"status {run.manifest.get('status', '?')}"
    )
    show_run(run)
    missing = [
        n
        for n, e in run.manifest.get("analyzers", {}).items()
        if n not in run.results and n not in run.errors and n not in run.skipped
    ]
    if missing:
        term.print(f"[yellow]missing (not finished):[/yellow] {', '.join(missing)}")
    if html:
        term.print(f"wrote [bold]{written}[/bold]")
    damaged = [
        f"{name}/result.json is damaged: {line}"
        for name, result in run.results.items()
        for line in result.missing()
    ]
    for line in damaged if not plots else not_drawn:  # --plots: the files not drawn say it
        error_line(line)
    if damaged or not_drawn:
        raise typer.Exit(2)
