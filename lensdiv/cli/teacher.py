"""``lensdiv teacher-student``: the toy teacher–student residual networks (docs/science.md C3)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from lensdiv.cli.common import (
    Progress,
    check_writable,
    default_out,
    out_option,
    save_and_show,
    user_errors,
)
from lensdiv.core.errors import OptionError


def _preset_default(text: str) -> Any:
    """An option whose default, ``None``, keeps the preset's value; ``text`` says what it sets."""
    return typer.Option(help=f"{text} Default: the preset's.")


def teacher_student(
    preset: Annotated[
        str,
        typer.Option(
            help="fast (4 minutes on one CPU core: a smoke run, students not converged), cpu "
            "(about 12 minutes on one free core; students of depth 4-24, the best found within "
            "15 minutes, see bench/README.md) or paper (the source's 40k steps of 1024: hours, a "
            "GPU)."
        ),
    ] = "fast",
    rho: Annotated[
        str, typer.Option(help="Teacher types, comma-separated: 0 independent, 1 tied blocks.")
    ] = "0,1",
    temperature: Annotated[
        str, typer.Option(help="Teacher temperatures T, comma-separated (kl only).")
    ] = "1",
    depths: Annotated[
        str | None,
        _preset_default("Student depths, comma-separated (the source's: 6,12,16,24,32,48)."),
    ] = None,
    steps: Annotated[int | None, _preset_default("Training steps.")] = None,
    batch_size: Annotated[int | None, _preset_default("Fresh inputs per step.")] = None,
    test_size: Annotated[int | None, _preset_default("Held-out inputs for the test loss.")] = None,
    lr: Annotated[float | None, _preset_default("Peak Adam learning rate.")] = None,
    objective: Annotated[
        str, typer.Option(help="kl: KL(teacher ‖ student); mse: error of the final states.")
    ] = "kl",
    seed: Annotated[int, typer.Option(help="Seed of teacher, students and data (recorded).")] = 0,
    out: Annotated[Path | None, out_option("teacher-student-TIME")] = None,
    device: Annotated[str | None, typer.Option(help="cpu (default), cuda ...")] = None,
    threads: Annotated[
        int,
        typer.Option(
            help="CPU threads for torch. The matrices are small: more threads gain little, and "
            "on a busy machine can make training many times slower."
        ),
    ] = 1,
    progress: Progress = True,
) -> None:
    """Train students of several depths on deep random teachers and fit the depth exponent α_ℓ.

    An independent teacher (rho 0) should give α_ℓ ≈ 1, a tied one (rho 1) a steeper slope.

    Example: lensdiv teacher-student --preset cpu --rho 0,1 --temperature 1 --out ts-out
    """
    # start-up: torch and the study (which imports torch) load only when the command runs.
    import torch

    from lensdiv.studies.teacher_student import TeacherStudentConfig, run_teacher_student

    out = out or default_out("teacher-student")
    with user_errors():
        check_writable(out)  # before minutes of training
        given = {
            "steps": steps,
            "batch_size": batch_size,
            "lr": lr,
            "test_size": test_size,
            "depths": None if depths is None else tuple(_numbers(depths, "--depths", int)),
        }
        config = TeacherStudentConfig.preset(
            preset,
            rhos=tuple(_numbers(rho, "--rho", float)),
            temperatures=tuple(_numbers(temperature, "--temperature", float)),
            objective=objective,
            seed=seed,
            **{k: v for k, v in given.items() if v is not None},
        )
        if threads < 1:
            raise OptionError(f"--threads must be ≥ 1, got {threads}")
        torch.set_num_threads(threads)
        result = run_teacher_student(config, progress=progress, device=device)
    save_and_show(result, out)


def _numbers(text: str, option: str, kind: type) -> list[Any]:
    """``"0,1"`` → ``[0.0, 1.0]``; anything else is a one-line error naming ``option``."""
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise OptionError(
            f"{option} {text!r} is not a comma-separated list of {kind.__name__} values",
            hint=f"e.g. {option} {'6,12,24' if kind is int else '0,1'}",
        ) from None
