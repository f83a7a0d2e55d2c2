"""What ``prune`` and ``reorder`` share: the options of every depth surgery (which positions
count; task examples measured instead of the corpus), the hooks (every residual state), the frame
of ``update``, and the task accuracy — its state, and its share per intervention."""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lensdiv.analyzers.depth_score import DepthScore
from lensdiv.analyzers.positions import FirstPosition
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.stats import Stats
from lensdiv.ops.resume import Resumer
from lensdiv.ops.surgery import answered


@dataclass(frozen=True)
class Surgery(FirstPosition):
    """A depth surgery: interventions on whole blocks (at every position, the first included),
    read at the output. Option ``exclude_bos``: see
    :class:`~lensdiv.analyzers.positions.FirstPosition`.

    Args:
        task: ``""`` (the default): measure on the run's corpus. Else measure on task examples
            instead, in ``depth-score``'s formats — ``kb`` (the toy knowledge base), ``arith``,
            ``auto`` or a JSONL file of ``prompt``/``answer``/``grade`` rows — and add each
            intervention's accuracy (the whole answer greedily decoded, teacher-forced).
        per_grade: Examples per grade of a built-in task (``kb``, ``arith``, ``auto``).
    """

    extra_forwards = True

    task: str = ""
    per_grade: int = 32

    def __post_init__(self) -> None:
        if self.per_grade < 1:
            raise ValueError(f"per_grade must be positive, got {self.per_grade}")

    def examples(self, model: Bridge, info: ModelInfo) -> list[Batch] | None:
        """With ``task``: ``depth-score``'s examples of that task (else the run's corpus)."""
        if not self.task.strip():
            return None
        tasks = DepthScore(tasks=self.task.strip(), per_grade=self.per_grade, model="self")
        return tasks.examples(model, info)

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state: Stats, step: Step) -> None:
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        if keep.any():
            self.measure(state, step, keep)

    @abc.abstractmethod
    def measure(self, state: Stats, step: Step, keep: Tensor) -> None:
        """Fold one batch with at least one position to measure (``keep``) into ``state``."""


def answer_positions(batch: Batch) -> Tensor | None:
    """Task examples: the answer's positions (``None`` on the corpus)."""
    if "split" not in batch.extra:
        return None
    pos = torch.arange(batch.tokens.shape[1], device=batch.tokens.device)
    return (pos >= batch.extra["split"].to(pos.device)[:, None]) & batch.mask


def add_answers(state: Stats, step: Step, resumer: Resumer, measure: Tensor, right: Tensor) -> None:
    """Add the examples answered whole per intervention (``right``, any shape), by the full
    model, and the examples seen (keys ``answers``, ``answers_clean``, ``answers_n``)."""
    tokens, clean = step.batch.tokens, step.resid(step.info.n_layers)
    state.add("answers", right)
    state.add("answers_clean", float(answered(resumer, tokens, clean, measure).sum()))
    state.add("answers_n", tokens.shape[0])
    state.fix("task", str(step.batch.extra.get("tasks")))


def count_answers(
    resumer: Resumer, step: Step, finals: Sequence[Tensor], measure: Tensor
) -> list[float]:
    """Examples of the batch answered whole from each intervened final residual."""
    tokens = step.batch.tokens
    return [float(answered(resumer, tokens, final, measure).sum()) for final in finals]


def accuracy(state: Stats, valid: Tensor | None = None) -> tuple[Tensor, float] | None:
    """The share of the task examples answered whole per intervention (NaN outside ``valid``)
    and by the full model (``None`` on the corpus)."""
    if "answers" not in state:
        return None
    n = max(float(state["answers_n"]), 1.0)
    shares = state["answers"].cpu().double() / n
    if valid is not None:
        shares = shares.masked_fill(~valid, math.nan)
    return shares, float(state["answers_clean"]) / n
