"""Toy teacher–student residual networks (docs/science.md C3): how test loss falls with depth.

A deep random residual MLP (the *teacher*, 128 blocks) defines the target; *students* of several
depths, with the same block form, learn it from fresh Gaussian inputs. When the teacher's blocks are
independent (``ρ = 0``) its update is a sum of many unrelated small steps, which a shallow student
can only average, and the loss falls as ``1/ℓ`` (``α_ℓ ≈ 1``). When every block shares block 0's
weights (``ρ = 1``) the teacher integrates a smooth flow that a student discretises, and the loss
falls faster. ``α_ℓ`` is the least-squares slope of log test loss against log depth.

The architecture, initialisation and losses follow the source's toy experiments (Liu et al.,
``exp/exp-9-*.py``): ``x ← rmsnorm(x)``; blocks ``x ← x + W_proj relu(W_fc rmsnorm(x) + b)²``;
logits ``head(rmsnorm(x))``, divided by the temperature ``T`` for the teacher only. Weights start as
PyTorch's ``nn.Linear`` default; the teacher's ``W_proj`` is scaled by ``1/√depth``, the students'
``W_proj`` and head start at zero. Students of all depths (and of every teacher) are trained in one
loop with batched matrix products and a per-student Adam, which gives each student exactly the
updates it would get trained alone on the same inputs.

Modules: ``config`` (the settings and presets), ``networks`` (stacked residual networks, targets
and losses), ``training`` (the per-student Adam and the training loop), ``fit`` (``α_ℓ`` with a
t-interval) and ``experiment`` (the whole run as a Result).

Example:
    >>> from lensdiv.studies.teacher_student import TeacherStudentConfig, run_teacher_student
    >>> result = run_teacher_student(TeacherStudentConfig.preset("fast"))  # doctest: +SKIP
    >>> result.table("alpha").rows  # doctest: +SKIP
"""

from __future__ import annotations

from lensdiv.studies.teacher_student.config import PRESETS, TeacherStudentConfig
from lensdiv.studies.teacher_student.experiment import run_teacher_student, teacher_label
from lensdiv.studies.teacher_student.fit import DepthFit, fit_depth_exponent
from lensdiv.studies.teacher_student.networks import (
    ResidualNets,
    make_students,
    make_teacher,
    student_losses,
    teacher_targets,
)
from lensdiv.studies.teacher_student.training import StudentAdam, lr_scale

__all__ = [
    "PRESETS",
    "DepthFit",
    "ResidualNets",
    "StudentAdam",
    "TeacherStudentConfig",
    "fit_depth_exponent",
    "lr_scale",
    "make_students",
    "make_teacher",
    "run_teacher_student",
    "student_losses",
    "teacher_label",
    "teacher_targets",
]
