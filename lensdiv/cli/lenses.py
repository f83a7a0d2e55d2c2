"""``lensdiv lenses``: fit a tuned, Jacobian or affine lens; compare a lens with the logit lens."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lensdiv.cli.common import (
    BatchSize,
    Data,
    Device,
    Dtype,
    Progress,
    SeqLen,
    TrustRemoteCode,
    check_out,
    console,
    default_out,
    out_option,
    user_errors,
)
from lensdiv.core.errors import OptionError

app = typer.Typer(
    help="Fitted lenses: read every analyzer's residual states through a tuned, Jacobian or "
    "affine lens instead of the logit lens (--lens KIND:PATH).\n\n"
    "Example: lensdiv lenses fit toy --kind tuned --preset toy --out lenses/toy-tuned",
    no_args_is_help=True,
)

Model = Annotated[
    str,
    typer.Argument(help="Hub name (gpt2-medium), local HF folder, or toy model (toy, toy:d8)."),
]


@app.command("fit")
def fit(
    model: Model,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            "-k",
            help="tuned (SGD on KL to the output), jacobian (mean ∂h_L/∂h_l, TransformerLens' "
            "estimator) or affine (least squares to h_L).",
        ),
    ],
    data: Data = None,
    out: Annotated[str | None, out_option("MODEL-KIND-lens-TIME")] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            help="Tokens the fit reads. Default: 16384, or the tuned preset's budget. Tuned: "
            "the preset's steps are scaled to it (as many whole steps as fit, the schedule "
            "over them); less than one step is refused before anything loads."
        ),
    ] = None,
    eval_tokens: Annotated[
        int, typer.Option(help="Held-out tokens (after the fit's) to evaluate on; 0: none.")
    ] = 8192,
    preset: Annotated[
        str,
        typer.Option(
            help="Tuned lens: paper (250 × 2^18 tokens), cpu, toy (the published "
            "recipe), or cpu-fast, toy-fast (a closed-form start, then 15 steps at lr 4).",
        ),
    ] = "cpu",
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            "-O",
            help="Fit option NAME=VALUE (repeatable): jacobian estimator=sketch, probes, "
            "dim_batch, skip_first; affine ridge; tuned steps, tokens_per_step, lr, ...",
        ),
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(help="Tuned lens: start from this lens (e.g. affine:DIR) instead of zero."),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            metavar="I/N", help="Fit shard I of N (affine, jacobian); then lensdiv merge."
        ),
    ] = None,
    seq_len: SeqLen = 128,
    batch_size: BatchSize = 8,
    device: Device = None,
    dtype: Dtype = None,
    seed: Annotated[int, typer.Option(help="Random seed (recorded).")] = 0,
    trust_remote_code: TrustRemoteCode = False,
    progress: Progress = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a fit in --out.")] = False,
) -> None:
    """Fit a lens of MODEL, write it into --out, evaluate it on held-out tokens.

    Example: lensdiv lenses fit gpt2 --kind jacobian --data corpus.txt --out lenses/gpt2-jlens

    A node: torchrun --nproc-per-node 8 -m lensdiv lenses fit MODEL --kind tuned --preset paper --dtype bfloat16 --data corpus.jsonl --out lenses/tuned

    A job array: lensdiv lenses fit MODEL --kind jacobian --shard 3/16 --out j/shard-3, then lensdiv merge j/shard-* --out j/all

    A short tuned fit (2 steps of the cpu preset's 16384 tokens): lensdiv lenses fit toy --kind tuned --max-tokens 32768 --out lenses/toy-tuned

    Then: lensdiv analyze MODEL --plugins lens,bias --lens tuned:lenses/tuned/fit-tuned/tuned_lens
    """
    # start-up: the fit imports torch and TransformerLens; they load only when it runs.
    from lensdiv.lenses.fit import fit_lens
    from lensdiv.run.distributed import launched_world

    with user_errors(), launched_world() as world:
        folder = check_out(out) if out is not None else default_out(f"{model}-{kind}-lens")
        done = fit_lens(
            model,
            kind,
            out=folder,
            data=data,
            max_tokens=max_tokens,
            eval_tokens=eval_tokens,
            seq_len=seq_len,
            batch_size=batch_size,
            preset=preset,
            options=_options(option or []),
            init=init,
            shard=shard,
            device=device,
            dtype=dtype,
            seed=seed,
            progress=progress,
            overwrite=overwrite,
            trust_remote_code=trust_remote_code,
        )
    if not world.main:
        return
    term = console()
    if done.run is not None:
        term.print(done.run)
    if done.evaluation is not None:
        term.print(done.evaluation)
    term.print(done.line(), soft_wrap=True, markup=False)  # one line a log keeps whole
    if "warning" in done.manifest:
        term.print(f"warning: {done.manifest['warning']}", style="yellow", soft_wrap=True)
    status = done.manifest.get("status")
    if status == "interrupted":
        raise typer.Exit(143 if done.manifest.get("signal") == "SIGTERM" else 130)
    if status == "failed" or (done.run is not None and (done.run.errors or done.run.problems)):
        raise typer.Exit(1)


@app.command("evaluate")
def evaluate(
    model: Model,
    lens: Annotated[str, typer.Option("--lens", help="The lens: tuned:PATH, jacobian:PATH, ...")],
    data: Data = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens to evaluate on.")] = 8192,
    skip_tokens: Annotated[
        int, typer.Option(help="Leave out the data's first tokens (those the fit read).")
    ] = 0,
    seq_len: SeqLen = 128,
    batch_size: BatchSize = 8,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write evaluation.csv/json.")
    ] = None,
    progress: Progress = True,
) -> None:
    """Compare a lens with the logit lens: KL to the output and cross-entropy per layer.

    Example: lensdiv lenses evaluate toy --lens tuned:lenses/toy-tuned/fit-tuned/tuned_lens --skip-tokens 32768
    """
    from lensdiv.lenses.fit import evaluate_lens

    with user_errors():
        table = evaluate_lens(
            model,
            lens,
            data=data,
            skip_tokens=skip_tokens,
            max_tokens=max_tokens,
            seq_len=seq_len,
            batch_size=batch_size,
            out=out,
            progress=progress,
        )
    console().print(table)


def _options(pairs: list[str]) -> dict[str, str]:
    """``["probes=32"]`` -> ``{"probes": "32"}``."""
    options = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise OptionError(f"bad option {pair!r}", hint="write NAME=VALUE, e.g. -O probes=32")
        options[key.strip()] = value
    return options
