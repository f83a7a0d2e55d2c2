"""Toy teacher–student residual networks (SCIENCE.md C3): how test loss falls with student depth.

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

Example:
    >>> from lensdiv.studies.teacher_student import TeacherStudentConfig, run_teacher_student
    >>> result = run_teacher_student(TeacherStudentConfig.preset("fast"))  # doctest: +SKIP
    >>> result.table("alpha").rows  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.errors import OptionError
from lensdiv.core.provenance import versions
from lensdiv.core.results import Plot, Result, Table

#: Settings of each preset; everything else is a :class:`TeacherStudentConfig` default.
PRESETS: dict[str, dict[str, Any]] = {
    # The source's exp-9-1 (KL): 40k steps of 1024 fresh inputs, constant Adam 6e-4, 10 test
    # batches.
    "paper": {"steps": 40_000, "batch_size": 1024, "lr": 6e-4, "decay": 0.0, "test_size": 10_240},
    # About four minutes on one busy CPU core for two teachers and six depths: 1/180 of the
    # source's inputs, so the students are still improving (most of all the deep ones). A full
    # linear decay and a lower rate than 3e-3 gave the largest α_ℓ at this budget.
    "fast": {"steps": 1800, "batch_size": 128, "lr": 2e-3, "decay": 1.0, "test_size": 4096},
}
# The source's MSE runs (exp-9-2): learning rate 6e-4 · 2/√ℓ, linear decay over the last 20 %.
_PAPER_MSE = {"depth_scaled_lr": True, "decay": 0.2}
_CHUNK_INPUTS = 16_384  # teacher targets are computed this many inputs at a time


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
        """The ``fast`` or ``paper`` settings, with ``overrides`` applied on top.

        ``paper`` is the source's KL run (exp-9-1), or with ``objective="mse"`` its MSE run
        (exp-9-2: depth-scaled learning rate, decayed over the last 20 % of the steps).
        """
        if name not in PRESETS:
            from lensdiv.core.errors import did_you_mean

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


# -- networks ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ResidualNets:
    """Several residual MLP networks of one width, stacked so a layer of all of them is one matmul.

    Networks are ordered by depth, ascending, so the networks that still have a block ``i`` are
    the last ones; ``w_fc[i]`` (and ``b_fc[i]``, ``w_proj[i]``) holds block ``i`` of just those,
    stacked along the first axis. No network carries padding for blocks it does not have.

    Args:
        w_fc: Per layer, the input weights of the block's MLP, ``(networks, d_model, d_mlp)``.
        b_fc: Per layer, the MLP biases, ``(networks, 1, d_mlp)``.
        w_proj: Per layer, the output weights of the MLP, ``(networks, d_mlp, d_model)``.
        head: Unembedding of each network.
        depths: Depth of each network, ascending.
    """

    w_fc: tuple[Float[Tensor, "_ d_model d_mlp"], ...]
    b_fc: tuple[Float[Tensor, "_ 1 d_mlp"], ...]
    w_proj: tuple[Float[Tensor, "_ d_mlp d_model"], ...]
    head: Float[Tensor, "net d_model d_vocab"]
    depths: tuple[int, ...]

    def parameters(self, head: bool = True) -> list[Tensor]:
        """The weight tensors (with the head or not), each with the networks on its first axis."""
        return [*self.w_fc, *self.b_fc, *self.w_proj, *([self.head] if head else [])]

    def final_state(self, x: Float[Tensor, "batch d_model"]) -> Float[Tensor, "net batch d_model"]:
        """Run every network on the same inputs; the residual state after its last block."""
        n = len(self.depths)
        state = _rmsnorm(x).expand(n, *x.shape)
        for w_fc, b_fc, w_proj in zip(self.w_fc, self.b_fc, self.w_proj, strict=True):
            first = n - w_fc.shape[0]  # the networks before `first` have no block here
            running = state[first:]
            hidden = torch.baddbmm(b_fc, _rmsnorm(running), w_fc)
            active = F.relu(hidden)
            # `a * a`, not `a.square()`: on CPU the backward of square is pow's, ~3× slower.
            update = torch.bmm(active * active, w_proj)
            state = running + update if first == 0 else torch.cat([state[:first], running + update])
        return state

    def logits(self, x: Float[Tensor, "batch d_model"]) -> Float[Tensor, "net batch d_vocab"]:
        """Output logits (before any temperature)."""
        return torch.bmm(_rmsnorm(self.final_state(x)), self.head)


def _rmsnorm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def _uniform(
    shape: tuple[int, ...], fan_in: int, generator: torch.Generator, device: torch.device | None
) -> Tensor:
    """``nn.Linear``'s default initialisation: uniform in ``±1/√fan_in`` (drawn on the CPU)."""
    bound = 1 / math.sqrt(fan_in)
    return ((torch.rand(shape, generator=generator) * 2 - 1) * bound).to(device)


def make_teacher(
    config: TeacherStudentConfig, rho: float, device: torch.device | None = None
) -> ResidualNets:
    """The teacher of type ``rho``, from the teacher seed.

    Both types draw the same weights: the tied teacher (``rho = 1``) is the independent one with
    every block replaced by block 0 — the very same tensors, not copies.
    """
    gen = torch.Generator().manual_seed(config.seeds["teacher"])
    n, d, h = config.teacher_depth, config.width, config.hidden
    w_fc = [_uniform((1, d, h), d, gen, device) for _ in range(n)]
    b_fc = [_uniform((1, 1, h), d, gen, device) for _ in range(n)]
    w_proj = [_uniform((1, h, d), h, gen, device) / math.sqrt(n) for _ in range(n)]
    head = _uniform((1, d, config.vocab), d, gen, device)
    if rho == 1.0:
        w_fc, b_fc, w_proj = ([w[0]] * n for w in (w_fc, b_fc, w_proj))
    return ResidualNets(tuple(w_fc), tuple(b_fc), tuple(w_proj), head, (n,))


def make_students(
    config: TeacherStudentConfig, device: torch.device | None = None
) -> tuple[ResidualNets, list[tuple[int, int]]]:
    """Students of every depth for every teacher, stacked; and each one's (teacher index, depth).

    ``W_proj`` and the head start at zero, so every student starts as the identity map followed
    by a uniform output; ``W_fc`` and the biases start as in ``nn.Linear``.
    """
    gen = torch.Generator().manual_seed(config.seeds["students"])
    order = [(t, depth) for depth in sorted(config.depths) for t in range(len(config.teachers))]
    depths = [depth for _, depth in order]
    d, h = config.width, config.hidden
    with_block = [len(order) - bisect.bisect_right(depths, i) for i in range(depths[-1])]
    nets = ResidualNets(
        w_fc=tuple(_uniform((k, d, h), d, gen, device) for k in with_block),
        b_fc=tuple(_uniform((k, 1, h), d, gen, device) for k in with_block),
        w_proj=tuple(torch.zeros(k, h, d, device=device) for k in with_block),
        head=torch.zeros(len(order), d, config.vocab, device=device),
        depths=tuple(depths),
    )
    for p in nets.parameters():
        p.requires_grad_(True)
    return nets, order


# -- targets and losses ------------------------------------------------------------------------
def teacher_targets(
    config: TeacherStudentConfig, teachers: Sequence[ResidualNets], x: Float[Tensor, "batch d_in"]
) -> Float[Tensor, "teacher batch target"]:
    """What the students match, per teacher of :attr:`TeacherStudentConfig.teachers`.

    ``kl``: the teacher's log-probabilities at its temperature. ``mse``: its normalised final
    state. ``teachers`` holds one network per ρ, in the order of ``config.rhos``.
    """
    out = []
    with torch.no_grad():
        for net in teachers:
            if config.objective == "mse":
                out.append(_rmsnorm(net.final_state(x))[0])
            else:
                logits = net.logits(x)[0]
                out += [F.log_softmax(logits / t, dim=-1) for t in config.temperatures]
    return torch.stack(out)


def student_losses(
    config: TeacherStudentConfig,
    students: ResidualNets,
    x: Float[Tensor, "batch d_in"],
    targets: Float[Tensor, "teacher batch target"],
) -> Float[Tensor, " student"]:
    """Mean loss of every student on a batch (students in the order of :func:`make_students`)."""
    n_teachers = targets.shape[0]
    if config.objective == "mse":
        outputs = _rmsnorm(students.final_state(x))
        error = outputs.unflatten(0, (-1, n_teachers)) - targets
        per_sample = (error * error).mean(-1)
    else:
        log_q = F.log_softmax(students.logits(x), dim=-1).unflatten(0, (-1, n_teachers))
        per_sample = (targets.exp() * (targets - log_q)).sum(-1)
    return per_sample.mean(-1).flatten()


# -- training ----------------------------------------------------------------------------------
class StudentAdam:
    """Adam (PyTorch's defaults) with one learning rate per student, on one flat state.

    Every student gets exactly the update ``torch.optim.Adam`` would give it alone. The moments
    of all the small per-layer tensors live in flat vectors updated in place: a step is a few
    passes over memory, not a few operations per tensor, and allocates nothing (fresh large
    buffers cost page faults on every step).

    Args:
        params: Weight tensors, each with the students on its first axis (the last students).
        lrs: Peak learning rate of each student.
    """

    def __init__(self, params: Sequence[Tensor], lrs: Float[Tensor, " student"]) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.lr = torch.cat([_per_element(lrs[-p.shape[0] :], p) for p in self.params])
        self.m, self.v, self.grad, self.work = (torch.zeros_like(self.lr) for _ in range(4))
        self.t = 0

    @torch.no_grad()
    def step(
        self, scale: float = 1.0, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        """One update with every learning rate multiplied by ``scale``; clears the gradients."""
        self.t += 1
        torch.cat([p.grad.reshape(-1) for p in self.params], out=self.grad)
        self.m.lerp_(self.grad, 1 - beta1)
        self.v.mul_(beta2).addcmul_(self.grad, self.grad, value=1 - beta2)
        # The gradient is in the moments now: its buffer holds the denominator.
        denom = torch.div(self.v, 1 - beta2**self.t, out=self.grad).sqrt_().add_(eps)
        update = torch.mul(self.m, self.lr, out=self.work).div_(denom)
        update.mul_(scale / (1 - beta1**self.t))
        for p, u in zip(self.params, update.split(self.sizes), strict=True):
            p.sub_(u.view_as(p))
            p.grad = None


def _per_element(values: Float[Tensor, " net"], like: Tensor) -> Float[Tensor, " element"]:
    """``values[n]`` for every element of network ``n`` in ``like`` (networks on axis 0), flat."""
    return values.view(-1, *[1] * (like.ndim - 1)).expand_as(like).reshape(-1)


def lr_scale(step: int, config: TeacherStudentConfig) -> float:
    """Learning-rate multiplier: 1, then a linear fall to 0.1 over the last ``decay`` of steps."""
    start = config.steps * (1 - config.decay)
    if step < start:
        return 1.0
    return 1.0 - 0.9 * (step - start) / (config.steps - start)


def _train(
    config: TeacherStudentConfig,
    teachers: list[ResidualNets],
    students: ResidualNets,
    progress: bool,
    device: torch.device,
) -> tuple[np.ndarray, np.ndarray]:
    """Train every student.

    Returns:
        The mean training loss per window of steps (window × student) and each window's last
        step.
    """
    depths = torch.tensor(students.depths, dtype=torch.float32, device=device)
    lrs = config.lr * (2 / depths.sqrt() if config.depth_scaled_lr else torch.ones_like(depths))
    adam = StudentAdam(students.parameters(head=config.objective == "kl"), lrs)
    gen = torch.Generator().manual_seed(config.seeds["data"])
    steps_per_chunk = max(1, min(config.steps, _CHUNK_INPUTS // config.batch_size))
    windows = min(config.steps, 20)
    curve = torch.zeros(windows, len(students.depths), device=device)
    bar = _progress(progress)
    with bar:
        task = bar.add_task("train", total=config.steps, loss=math.nan)
        for step in range(config.steps):
            j = step % steps_per_chunk
            if j == 0:
                inputs = torch.randn(
                    steps_per_chunk * config.batch_size, config.width, generator=gen
                ).to(device)
                targets = teacher_targets(config, teachers, inputs)
            rows = slice(j * config.batch_size, (j + 1) * config.batch_size)
            losses = student_losses(config, students, inputs[rows], targets[:, rows])
            losses.sum().backward()
            adam.step(lr_scale(step, config))
            curve[step * windows // config.steps] += losses.detach()
            # Reading the loss waits for the step to finish: only once per chunk.
            shown = {"loss": float(losses.detach().mean())} if j == 0 else {}
            bar.update(task, advance=1, **shown)
    counts = np.bincount(np.arange(config.steps) * windows // config.steps, minlength=windows)
    return curve.cpu().numpy().astype(float) / counts[:, None], np.cumsum(counts)


def _progress(enabled: bool) -> Any:
    from lensdiv.core.progress import progress_bar

    return progress_bar(
        "[bold]training students[/bold]",
        "steps  mean loss {task.fields[loss]:.4g}",
        enabled=enabled,
    )


def _test_set(
    config: TeacherStudentConfig, teachers: list[ResidualNets], device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """The held-out inputs of the test seed and the teachers' targets, in batches."""
    gen = torch.Generator().manual_seed(config.seeds["test"])
    x = torch.randn(config.test_size, config.width, generator=gen).to(device)
    return [(rows, teacher_targets(config, teachers, rows)) for rows in x.split(4096)]


def _test_losses(
    config: TeacherStudentConfig, students: ResidualNets, test_set: list[tuple[Tensor, Tensor]]
) -> Float[Tensor, " student"]:
    """Mean loss of every student on the held-out set."""
    with torch.no_grad():
        total = sum(student_losses(config, students, x, t) * len(x) for x, t in test_set)
    return total / config.test_size


# -- fit ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DepthFit:
    """Least-squares fit ``log loss = c − α log depth``.

    Args:
        alpha: The depth exponent ``α_ℓ`` (minus the slope).
        stderr: Standard error of ``α_ℓ``.
        ci_low: Lower end of the two-sided t-interval.
        ci_high: Upper end of the two-sided t-interval.
        r2: Coefficient of determination of the log–log line.
        intercept: ``c``, the fitted log loss at depth 1.
    """

    alpha: float
    stderr: float
    ci_low: float
    ci_high: float
    r2: float
    intercept: float


def fit_depth_exponent(
    depths: Sequence[int] | np.ndarray, losses: Sequence[float] | np.ndarray, level: float = 0.95
) -> DepthFit:
    """Fit ``α_ℓ`` by ordinary least squares of log loss on log depth, with a t-interval.

    Args:
        depths: Student depths (at least three distinct).
        losses: Positive test losses, one per depth.
        level: Coverage of the confidence interval.
    """
    from scipy import stats

    x, y = np.log(np.asarray(depths, float)), np.log(np.asarray(losses, float))
    n = len(x)
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    sxx = float(((x - x.mean()) ** 2).sum())
    stderr = math.sqrt(float(residuals @ residuals) / (n - 2) / sxx)
    half = float(stats.t.ppf(0.5 + level / 2, n - 2)) * stderr
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1 - float(residuals @ residuals) / total if total > 0 else math.nan
    alpha = -float(slope)
    return DepthFit(alpha, stderr, alpha - half, alpha + half, r2, float(intercept))


# -- the experiment ----------------------------------------------------------------------------
def teacher_label(rho: float, temperature: float) -> str:
    """A teacher's name in tables and legends, e.g. ``independent ρ=0, T=1``."""
    kind = "tied" if rho == 1.0 else "independent"
    return f"{kind} ρ={rho:g}" + ("" if math.isnan(temperature) else f", T={temperature:g}")


def run_teacher_student(
    config: TeacherStudentConfig | None = None,
    *,
    progress: bool = True,
    device: str | None = None,
) -> Result:
    """Train students of every depth on every teacher; fit ``α_ℓ`` per teacher.

    Args:
        config: The experiment (default: the ``fast`` preset).
        progress: Show a progress bar over training steps.
        device: ``cpu`` (default), ``cuda`` ... Random draws happen on the CPU, so a seed gives
            the same inputs and initial weights on every device.

    Returns:
        A result with tables ``losses`` (per teacher and depth), ``alpha`` (per teacher) and
        ``curve`` (training loss over steps), and a log–log plot of test loss against depth.
    """
    config = config or TeacherStudentConfig()
    started = time.time()
    where = _device(device)
    teachers = [make_teacher(config, rho, where) for rho in config.rhos]
    students, order = make_students(config, where)
    test_set = _test_set(config, teachers, where)
    init = _test_losses(config, students, test_set).cpu()
    curve, ends = _train(config, teachers, students, progress, where)
    final = _test_losses(config, students, test_set).cpu()
    labels = [teacher_label(*config.teachers[t]) for t, _ in order]
    losses = Table(
        "losses",
        {
            "teacher": labels,
            "rho": [config.teachers[t][0] for t, _ in order],
            "temperature": [config.teachers[t][1] for t, _ in order],
            "depth": [depth for _, depth in order],
            "test_loss": final.tolist(),
            "init_loss": init.tolist(),
            "late_drop": _late_drop(curve).tolist(),
        },
        "test loss per teacher and student depth (init_loss: before training; late_drop: "
        "relative fall of the training loss over the last quarter of the steps)",
    )
    training = Table(
        "curve",
        {
            "student": [
                f"{labels[s]}, ℓ={depth}" for _ in ends for s, (_, depth) in enumerate(order)
            ],
            "step": [int(end) for end in ends for _ in order],
            "train_loss": curve.reshape(-1).tolist(),
        },
        "mean training loss over each window of steps, per student",
    )
    fits = _fits(config, losses)
    return Result(
        analyzer="teacher-student",
        summary=_summary(config, fits, float(losses["late_drop"].max())),
        tables={"alpha": _alpha_table(config, fits), "losses": losses, "curve": training},
        plots=_PLOTS,
        meta={
            "config": dataclasses.asdict(config),
            "seeds": config.seeds,
            "device": str(where),
            "wall_seconds": round(time.time() - started, 2),
            "versions": versions(),
        },
    )


_PLOTS = (
    Plot(
        kind="line",
        name="loss_vs_depth",
        title="test loss against student depth",
        source="losses",
        x="depth",
        y=("test_loss",),
        xlabel="student depth ℓ",
        ylabel="test loss",
        logx=True,
        logy=True,
        group="teacher",
    ),
    Plot(
        kind="line",
        name="training",
        title="training loss of every student",
        source="curve",
        x="step",
        y=("train_loss",),
        ylabel="training loss (window mean)",
        logy=True,
        group="student",
    ),
)


def _device(name: str | None) -> torch.device:
    """The torch device called ``name`` (default CPU), checked to be usable."""
    try:
        device = torch.device(name or "cpu")
        torch.zeros(1, device=device)
    except (RuntimeError, AssertionError) as err:
        raise OptionError(
            f"device {name!r} is not usable: {str(err).splitlines()[0]}", hint="try --device cpu"
        ) from None
    return device


def _late_drop(curve: np.ndarray) -> np.ndarray:
    """Per student, ``1 - loss(end) / loss(three quarters in)`` from the windowed training loss."""
    back = max(1, curve.shape[0] // 4)
    if curve.shape[0] <= back:
        return np.full(curve.shape[1], math.nan)
    return 1 - curve[-1] / curve[-1 - back]


def _fits(config: TeacherStudentConfig, losses: Table) -> list[DepthFit]:
    """The depth fit of every teacher, in the order of :attr:`TeacherStudentConfig.teachers`."""
    fits = []
    for rho, temperature in config.teachers:
        rows = losses["teacher"] == teacher_label(rho, temperature)
        fits.append(fit_depth_exponent(losses["depth"][rows], losses["test_loss"][rows]))
    return fits


def _alpha_table(config: TeacherStudentConfig, fits: list[DepthFit]) -> Table:
    fields = ("alpha", "stderr", "ci_low", "ci_high", "r2")
    return Table(
        "alpha",
        {
            "teacher": [teacher_label(*teacher) for teacher in config.teachers],
            "rho": [rho for rho, _ in config.teachers],
            "temperature": [temperature for _, temperature in config.teachers],
            **{name: [getattr(fit, name) for fit in fits] for name in fields},
        },
        "α_ℓ: slope of log test loss against log student depth (95 % t-interval)",
    )


def _summary(config: TeacherStudentConfig, fits: list[DepthFit], late_drop: float) -> str:
    parts = [
        f"{teacher_label(*teacher)}: α_ℓ = {fit.alpha:.2f} "
        f"(95 % CI {fit.ci_low:.2f} to {fit.ci_high:.2f}, R² {fit.r2:.3f})"
        for teacher, fit in zip(config.teachers, fits, strict=True)
    ]
    depths = sorted(config.depths)
    text = (
        f"Test {config.objective} loss against student depth {depths[0]}–{depths[-1]} "
        f"({config.steps} steps of {config.batch_size} inputs): " + "; ".join(parts) + ". "
        "The source finds α_ℓ ≈ 1 for the independent teacher and a steeper fall for the tied one."
    )
    if late_drop > 0.1:
        text += (
            f" Training losses were still falling (up to {late_drop:.0%} over the last quarter of "
            "the steps), so these slopes are limited by training as well as by depth; the deep "
            "students gain most from more steps (the paper preset has the source's budget)."
        )
    return text
