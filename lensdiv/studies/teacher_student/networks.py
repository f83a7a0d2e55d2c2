"""The residual MLP networks: teachers and students, their targets and the students' losses.

Networks of one width are stacked so that a layer of all of them is one batched matrix product.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from lensdiv.studies.teacher_student.config import TeacherStudentConfig


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
