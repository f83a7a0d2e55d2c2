"""An experiment's settings: teachers, student depths, the training recipe, and the presets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lensdiv.core.errors import OptionError, did_you_mean

#: Settings of each preset; everything else is a :class:`TeacherStudentConfig` default.
PRESETS: dict[str, dict[str, Any]] = {
    # The source's exp-9-1 (KL): 40k steps of 1024 fresh inputs, constant Adam 6e-4, 10 test
    # batches.
    "paper": {"steps": 40_000, "batch_size": 1024, "lr": 6e-4, "decay": 0.0, "test_size": 10_240},
    # About four minutes on one busy CPU core for two teachers and six depths: 1/180 of the
    # source's inputs, so the students are still improving (most of all the deep ones). A full
    # linear decay and a lower rate than 3e-3 gave the largest α_ℓ at this budget.
    "fast": {"steps": 1800, "batch_size": 128, "lr": 2e-3, "decay": 1.0, "test_size": 4096},
    # The best of the trials of bench/teacher_student_cpu.py within about 15 minutes of wall time
    # on 2 cores (trial T9: 690 CPU seconds, 12 minutes alone on a quiet machine): 3.1 M inputs
    # to students of depth 4-24. The independent teacher's α_ℓ comes out at 0.84 (95 % 0.70-0.98)
    # and the tied teacher's steeper, 1.45 (0.95-1.94), but the two intervals still touch; the
    # deep students are still improving (up to 52 % over the last quarter). With depths 2-16
    # (T2) the intervals separate but the independent α_ℓ falls to 0.58; with 6-48 the tied
    # teacher's deep students stall. bench/README.md has every trial.
    "cpu": {
        "steps": 12_000,
        "batch_size": 256,
        "lr": 2e-3,
        "decay": 1.0,
        "test_size": 4096,
        "depths": (4, 6, 8, 12, 16, 24),
    },
}
# The source's MSE runs (exp-9-2): learning rate 6e-4 · 2/√ℓ, linear decay over the last 20 %.
_PAPER_MSE = {"depth_scaled_lr": True, "decay": 0.2}


@dataclass(frozen=True)
class TeacherStudentConfig:
    """One teacher–student experiment: the teachers, the student depths and the training recipe.

    Args:
        rhos: Teacher types: ``0.0`` independent blocks, ``1.0`` all blocks share block 0's.
        temperatures: Teacher temperatures ``T`` (``kl`` only; one teacher per (ρ, T)).
        depths: Student depths (at least three distinct ones, for a slope with an interval).
        objective: ``"kl"``: ``KL(teacher ‖ student)`` of the output distributions; ``"mse"``: mean
            squared error of the final normalised states (no heads; temperatures unused).
        steps: Optimiser steps, each on a fresh batch.
        batch_size: Inputs per step.
        lr: Peak Adam learning rate.
        decay: Final fraction of the steps over which the learning rate falls linearly to 10 %
            (``0``: constant, as in the source's KL runs).
        depth_scaled_lr: Multiply each student's learning rate by ``2/√ℓ`` (the source's MSE runs).
        test_size: Held-out inputs for the test loss (fixed by the seed).
        seed: Base seed; teacher, student initialisation, training data and test data use
            ``seed``, ``seed + 1``, ``seed + 2`` and ``seed + 3``.
        teacher_depth: Teacher blocks.
        width: Residual width ``d_model``.
        hidden: MLP width of each block.
        vocab: Output vocabulary (``kl``).
    """

    rhos: tuple[float, ...] = (0.0, 1.0)
    temperatures: tuple[float, ...] = (1.0,)
    depths: tuple[int, ...] = (6, 12, 16, 24, 32, 48)
    objective: str = "kl"
    steps: int = PRESETS["fast"]["steps"]
    batch_size: int = PRESETS["fast"]["batch_size"]
    lr: float = PRESETS["fast"]["lr"]
    decay: float = PRESETS["fast"]["decay"]
    depth_scaled_lr: bool = False
    test_size: int = PRESETS["fast"]["test_size"]
    seed: int = 0
    teacher_depth: int = 128
    width: int = 32
    hidden: int = 128
    vocab: int = 128

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise OptionError(f"teacher-student: {'; '.join(problems)}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> TeacherStudentConfig:
        """The ``fast``, ``cpu`` or ``paper`` settings, with ``overrides`` applied on top.

        ``paper`` is the source's KL run (exp-9-1), or with ``objective="mse"`` its MSE run
        (exp-9-2: depth-scaled learning rate, decayed over the last 20 % of the steps).
        """
        if name not in PRESETS:
            raise OptionError(
                f"unknown teacher-student preset {name!r}{did_you_mean(name, list(PRESETS))}",
                hint=f"use one of {', '.join(PRESETS)}",
            )
        settings = dict(PRESETS[name])
        if name == "paper" and overrides.get("objective") == "mse":
            settings.update(_PAPER_MSE)
        return cls(**{**settings, **overrides})

    @property
    def teachers(self) -> list[tuple[float, float]]:
        """The (ρ, T) of every teacher (``mse``: T is unused and recorded as NaN)."""
        temperatures = self.temperatures if self.objective == "kl" else (math.nan,)
        return [(rho, t) for rho in self.rhos for t in temperatures]

    @property
    def seeds(self) -> dict[str, int]:
        """The seed of every random stream."""
        return {
            "teacher": self.seed,
            "students": self.seed + 1,
            "data": self.seed + 2,
            "test": self.seed + 3,
        }


def _problems(config: TeacherStudentConfig) -> list[str]:
    """Every setting that is out of range, as a sentence naming the value."""
    out = []
    if not config.rhos or any(rho not in (0.0, 1.0) for rho in config.rhos):
        out.append(f"rho must be 0 (independent) or 1 (tied), got {list(config.rhos)}")
    if len(set(config.rhos)) != len(config.rhos):
        out.append(f"rho values repeat: {list(config.rhos)}")
    if not config.temperatures or any(not t > 0 for t in config.temperatures):
        out.append(f"temperatures must be > 0, got {list(config.temperatures)}")
    if len(set(config.depths)) != len(config.depths) or len(config.depths) < 3:
        out.append(f"need at least three distinct student depths, got {list(config.depths)}")
    if any(d < 1 for d in config.depths):
        out.append(f"student depths must be ≥ 1, got {list(config.depths)}")
    if config.objective not in ("kl", "mse"):
        out.append(f"objective must be 'kl' or 'mse', got {config.objective!r}")
    for name in ("steps", "batch_size", "test_size", "teacher_depth", "width", "hidden", "vocab"):
        if getattr(config, name) < 1:
            out.append(f"{name} must be ≥ 1, got {getattr(config, name)}")
    if not config.lr > 0:
        out.append(f"lr must be > 0, got {config.lr}")
    if not 0 <= config.decay <= 1:
        out.append(f"decay must be in [0, 1], got {config.decay}")
    return out
