"""``lensdiv lenses``: fit a tuned, Jacobian or affine lens; compare a lens with the logit lens."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lensdiv.cli.common import (
    Data,
    Progress,
    TrustRemoteCode,
    check_out,
    console,
    default_out,
    out_option,
    plugin_warnings,
    run_settings,
    show_run,
    user_errors,
)
from lensdiv.core.errors import OptionError
from lensdiv.core.settings import DEFAULTS, RunSettings

app = typer.Typer(
    help="Fitted lenses: read every analyzer's residual states through a tuned, Jacobian or "
    "affine lens instead of the logit lens (--lens KIND:PATH).\n\n"
    "Example: lensdiv lenses fit toy --kind tuned --preset toy-fast --out lenses/toy-tuned",
    no_args_is_help=True,
)

Model = Annotated[
    str,
    typer.Argument(help="Hub name (gpt2-medium), local HF folder, or toy model (toy, toy:d8)."),
]


@app.command("fit")
@run_settings(
    exclude=("lens",),
    max_tokens={
        "type": int | None,
        "default": None,
        "help": f"Tokens the fit reads. Default: {DEFAULTS.max_tokens}, or the tuned preset's "
        "budget. Tuned: the preset's passes are scaled to it (as many whole steps as fit, the "
        "closed-form pass of the fast path among them, the schedule over the rest); less than "
        "one step (fast path: the closed-form pass and one SGD step, 32768 tokens by default) "
        "is refused before anything loads.",
    },
)
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
    settings: RunSettings = DEFAULTS,
    eval_tokens: Annotated[
        int, typer.Option(help="Held-out tokens (after the fit's) to evaluate on; 0: none.")
    ] = 8192,
    preset: Annotated[
        str | None,
        typer.Option(
            help="Tuned lens: cpu-fast (the default), toy-fast: the fast path, a closed-form "
            "start (the affine lens) then 15 steps at lr 4, 16 passes of 16384 / 2048 tokens; "
            "paper (250 × 2^18 tokens), cpu (120 × 2^14), toy (60 × 2^11): tuned-lens's "
            "published recipe exactly, from the identity.",
            show_default=False,
        ),
    ] = None,
    option: Annotated[
        list[str] | None,
        typer.Option(
            "--option",
            "-O",
            help="Fit option NAME=VALUE (repeatable): jacobian estimator=sketch, probes, "
            "dim_batch, skip_first; affine ridge; tuned steps, tokens_per_step, lr, bf16, ...",
        ),
    ] = None,
    init: Annotated[
        str | None,
        typer.Option(
            help="Tuned lens: start from this lens (e.g. affine:DIR) instead of the fast "
            "path's closed-form pass (or the identity of a recipe preset)."
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option(
            metavar="I/N", help="Fit shard I of N (affine, jacobian); then lensdiv merge."
        ),
    ] = None,
    trust_remote_code: TrustRemoteCode = False,
    progress: Progress = True,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a fit in --out.")] = False,
) -> None:
    """Fit a lens of MODEL, write it into --out, evaluate it on held-out tokens.

    Every kind leaves the same layout: --out/lens.json names the kind and where the lens is
    (fit-tuned/tuned_lens/, fit-affine/affine_lens/, fit-jacobian/jacobian_lens.pt), beside manifest.json
    and evaluation.csv; --lens KIND:OUT or --lens OUT reads it.

    Example: lensdiv lenses fit gpt2 --kind jacobian --data corpus.txt --out lenses/gpt2-jlens

    A node: torchrun --nproc-per-node 8 -m lensdiv lenses fit MODEL --kind tuned --preset paper --dtype bfloat16 --data corpus.jsonl --out lenses/tuned

    A job array: lensdiv lenses fit MODEL --kind jacobian --shard 3/16 --out j/shard-3, then lensdiv merge j/shard-* --out j/all

    A short tuned fit (4 passes of 16384 tokens: the closed-form start, then 3 SGD steps): lensdiv lenses fit toy --kind tuned --max-tokens 65536 --out lenses/toy-tuned

    The published recipe, to compare with tuned-lens's lenses: lensdiv lenses fit toy --kind tuned --preset cpu --out lenses/toy-recipe

    Then: lensdiv analyze MODEL --plugins lens,bias --lens tuned:lenses/tuned
    """
    # start-up: the fit imports torch and TransformerLens; they load only when it runs.
    from lensdiv.lenses.fit import fit_lens
    from lensdiv.run.distributed import launched_world

    # a DataWarning (data too short for the fit and its evaluation) is one line on stderr
    with user_errors(), plugin_warnings(), launched_world() as world:
        folder = check_out(out) if out is not None else default_out(f"{model}-{kind}-lens")
        done = fit_lens(
            model,
            kind,
            out=folder,
            data=data,
            settings=settings,
            eval_tokens=eval_tokens,
            preset=preset,
            options=_options(option or []),
            init=init,
            shard=shard,
            progress=progress,
            overwrite=overwrite,
            trust_remote_code=trust_remote_code,
        )
    if world.main:
        _show_fit(done)


def _show_fit(done: Any) -> None:
    """Print a fit (its run's notes, the evaluation, where the lens is, a warning of the
    manifest) and exit as a run does: 130 or 143 interrupted, 1 when anything failed."""
    term = console()
    if done.run is not None:
        show_run(done.run)  # a failed analyzer and an error on standard error
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
@run_settings(exclude=("lens",), max_tokens={"default": 8192, "help": "Tokens to evaluate on."})
def evaluate(
    model: Model,
    lens: Annotated[str, typer.Option("--lens", help="The lens: tuned:PATH, jacobian:PATH, ...")],
    data: Data = None,
    settings: RunSettings = DEFAULTS,
    skip_tokens: Annotated[
        int, typer.Option(help="Leave out the data's first tokens (those the fit read).")
    ] = 0,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write evaluation.csv/json.")
    ] = None,
    progress: Progress = True,
) -> None:
    """Compare a lens with the logit lens: KL to the output and cross-entropy per layer.

    Example: lensdiv lenses evaluate toy --lens lenses/toy-tuned --skip-tokens 32768
    """
    # start-up: the evaluation imports torch and TransformerLens; they load only when it runs.
    from lensdiv.lenses.fit import evaluate_lens

    with user_errors():
        table = evaluate_lens(
            model,
            lens,
            data=data,
            settings=settings,
            skip_tokens=skip_tokens,
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
