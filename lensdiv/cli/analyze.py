"""``lensdiv analyze``, ``compare`` and ``report``: run analyzers over a model, re-render a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import console, default_out, fail, parse_options


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
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            "-d",
            help="Text file, .jsonl, folder of .txt, or hf:NAME[:CONFIG]. Default: built-in corpus.",
        ),
    ] = None,
    field: Annotated[str, typer.Option(help="JSONL / data-set field holding the text.")] = "text",
    split: Annotated[str, typer.Option(help="Split of an hf: data set.")] = "train",
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence (BOS included).")] = 128,
    max_tokens: Annotated[int, typer.Option(help="Stop after this many tokens.")] = 16384,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
    bos: Annotated[str, typer.Option(help="BOS policy: prepend | none.")] = "prepend",
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-O", help="Analyzer option, ANALYZER.OPTION=VALUE (repeatable)."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder. Default: lensdiv-out/MODEL-TIME."),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="cpu, cuda, cuda:1 ... Default: best available.")
    ] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 (default), bfloat16, float16.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed (recorded in every result).")] = 0,
    trust_remote_code: Annotated[
        bool, typer.Option("--trust-remote-code", help="Allow hub models that ship their own code.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
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
) -> None:
    """Analyze MODEL with the chosen analyzers: one fused pass, a summary here, files in --out.

    Example: lensdiv analyze gpt2-medium --plugins lens,contrib --data corpus.txt --max-tokens 20000

    More: lensdiv analyze toy --plugins skip,depth-score -O skip.mode=current;
    lensdiv analyze toy:d4 --plugins linmap --ref toy:d8;
    lensdiv analyze toy:d8 --plugins lens,dynamics -O dynamics.final_state=post;
    lensdiv plugins show patch
    """
    from lensdiv.core.errors import LensdivError

    out = out or default_out(model)
    try:
        from lensdiv.run.runner import analyze as run_analyze

        options = parse_options(option or [])
        if ref is not None:
            plugins = _add_ref(plugins, options, ref)
        run = run_analyze(
            model,
            data,
            plugins,
            out=out,
            options=options,
            seq_len=seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            field=field,
            split=split,
            bos=bos,
            device=device,
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            progress=progress,
        )
    except LensdivError as err:
        fail(err)
    term = console()
    term.print(run)
    term.print(f"results in [bold]{out}[/bold] (manifest.json, one folder per analyzer)")
    if run.manifest.get("status") == "interrupted":
        raise typer.Exit(130)
    if run.errors:
        raise typer.Exit(1)


def _add_ref(plugins: str, options: dict[str, dict[str, str]], ref: str) -> str:
    """Make ``--ref DEEP`` mean ``-O linmap.target=DEEP``, with linmap among the plugins."""
    from lensdiv.core.errors import OptionError
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


def compare(
    shallow: Annotated[str, typer.Argument(help="The model whose layers are mapped (source).")],
    deep: Annotated[str, typer.Argument(help="The deeper model with the same tokenizer (target).")],
    data: Annotated[
        str | None,
        typer.Option("--data", "-d", help="Text, .jsonl, folder or hf:NAME. Default: built-in."),
    ] = None,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence (BOS included).")] = 128,
    max_tokens: Annotated[int, typer.Option(help="Stop after this many tokens.")] = 16384,
    batch_size: Annotated[int, typer.Option(help="Sequences per forward pass.")] = 8,
    option: Annotated[
        list[str] | None,
        typer.Option("--option", "-O", help="linmap option, e.g. -O linmap.ridge=1e-3."),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Output folder. Default: lensdiv-out/SHALLOW-TIME."),
    ] = None,
    device: Annotated[str | None, typer.Option(help="cpu, cuda ... Default: best.")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32 (default), bfloat16, float16.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed (recorded in every result).")] = 0,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Map every layer of SHALLOW onto every layer of DEEP (cross-model linear maps, R²).

    Short for `lensdiv analyze SHALLOW --plugins linmap --ref DEEP`.

    Example: lensdiv compare toy:d4 toy:d8 --max-tokens 8192
    """
    analyze(
        model=shallow,
        plugins="linmap",
        data=data,
        seq_len=seq_len,
        max_tokens=max_tokens,
        batch_size=batch_size,
        option=option,
        out=out,
        device=device,
        dtype=dtype,
        seed=seed,
        progress=progress,
        ref=deep,
    )


def report(
    out: Annotated[Path, typer.Argument(help="A folder written by `lensdiv analyze`.")],
    plots: Annotated[bool, typer.Option(help="Redraw the PNG plots.")] = False,
) -> None:
    """Re-render a saved run: summaries and tables (and, with --plots, the PNGs).

    Example: lensdiv report lensdiv-out/toy-20261121-120000 --plots
    """
    from lensdiv.core.errors import LensdivError
    from lensdiv.run.runner import load_run

    try:
        run = load_run(out)
    except LensdivError as err:
        fail(err)
    if plots:
        for name, result in run.results.items():
            result.save_plots(out / name)
    term = console()
    meta = run.manifest.get("model", {})
    term.print(
        f"[bold]{meta.get('spec', '?')}[/bold] ({meta.get('resolved', '?')}), "
        f"{run.manifest.get('timings', {}).get('tokens', '?')} tokens, "
        f"status {run.manifest.get('status', '?')}"
    )
    term.print(run)
    missing = [
        n
        for n, e in run.manifest.get("analyzers", {}).items()
        if n not in run.results and n not in run.errors
    ]
    if missing:
        term.print(f"[yellow]missing (not finished):[/yellow] {', '.join(missing)}")
