"""Training every student at once, and its held-out test loss.

A per-student Adam, the learning-rate schedule and fresh Gaussian inputs at every step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.progress import progress_bar
from lensdiv.studies.teacher_student.config import TeacherStudentConfig
from lensdiv.studies.teacher_student.networks import ResidualNets, student_losses, teacher_targets

_CHUNK_INPUTS = 16_384  # teacher targets are computed this many inputs at a time


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
        grads = [p.grad for p in self.params]
        assert all(g is not None for g in grads), "step() before backward()"
        torch.cat([g.reshape(-1) for g in grads if g is not None], out=self.grad)
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


def train_students(
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
    bar = progress_bar(
        "[bold]training students[/bold]",
        "steps  mean loss {task.fields[loss]:.4g}",
        enabled=progress,
    )
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


def held_out_set(
    config: TeacherStudentConfig, teachers: list[ResidualNets], device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """The held-out inputs of the test seed and the teachers' targets, in batches."""
    gen = torch.Generator().manual_seed(config.seeds["test"])
    x = torch.randn(config.test_size, config.width, generator=gen).to(device)
    return [(rows, teacher_targets(config, teachers, rows)) for rows in x.split(4096)]


def held_out_losses(
    config: TeacherStudentConfig, students: ResidualNets, held_out: list[tuple[Tensor, Tensor]]
) -> Float[Tensor, " student"]:
    """Mean loss of every student on the held-out set."""
    with torch.no_grad():
        total = torch.stack([student_losses(config, students, x, t) * len(x) for x, t in held_out])
    return total.sum(0) / config.test_size
