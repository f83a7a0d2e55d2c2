"""Training a tuned lens (docs/science.md D1; Belrose et al. 2023), data parallel under torchrun.

Translators ``T_l(h) = h + A_l h + b_l`` for ``l = 0..L-1`` (zero at the start: the logit lens, or
an affine lens to start from), trained with the model frozen to minimise
``Σ_l E[KL(p_L ‖ p_l)]`` over the positions of the data, where ``p_l`` reads ``T_l(h_l)`` through
the model's final norm and unembedding (:mod:`lensdiv.ops.readout`, in float32 whatever the
model's dtype) and ``p_L`` is the model's own output. The recipe is tuned-lens's
(``scripts/train_loop.py``): SGD with Nesterov momentum 0.9, learning rate ``lr × (1 − momentum)``
(``lr`` = 1), weight decay 1e-3, gradient norm clipped at 1, a linear decay to 0 without
warm-up, 250 steps of 2^18 tokens (:data:`PRESETS`; smaller presets for a CPU and the toy zoo).

**Data parallel.** Under ``torchrun`` the translators are wrapped in
``torch.nn.parallel.DistributedDataParallel``; the batches of every step are split between the
ranks (batch ``i`` on rank ``i mod world``) and the gradients all-reduced once per step (the
other backward passes of the step run under ``no_sync``). The loss of a step is the sum of the
KL over its positions divided by the step's nominal positions, so the gradient is the same
however the step is split. Rank 0 writes the lens.

The lens is written in tuned-lens's layout (``tuned_lens/config.json`` + ``params.pt``), with
how it was trained in ``config.json``; an interrupted training writes what it has (marked
``"complete": false``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lensdiv.core.analyzer import Batch, ModelInfo
from lensdiv.core.devices import input_device
from lensdiv.core.errors import OptionError
from lensdiv.ops.capture import capture
from lensdiv.ops.readout import final_readout
from lensdiv.ops.translators import Translator, save_tuned

TUNED_FOLDER = "tuned_lens"


@dataclass(frozen=True)
class TunedRecipe:
    """How a tuned lens is trained.

    Args:
        steps: Optimiser steps.
        tokens_per_step: Real tokens per step (whole batches: rounded up).
        lr: Learning-rate scale; the step size is ``lr × (1 − momentum)`` (tuned-lens's).
        momentum: Nesterov momentum.
        weight_decay: Decoupled from nothing: SGD's L2 penalty, pulling ``A_l`` and ``b_l`` to
            zero (the logit lens).
        clip: Gradient-norm clip per step.
        exclude_bos: Leave the BOS position out of the loss.
    """

    steps: int = 250
    tokens_per_step: int = 2**18
    lr: float = 1.0
    momentum: float = 0.9
    weight_decay: float = 1e-3
    clip: float = 1.0
    exclude_bos: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1 or self.tokens_per_step < 1:
            raise OptionError("a tuned lens needs at least 1 step of at least 1 token")
        if not (self.lr > 0 and 0 <= self.momentum < 1 and self.weight_decay >= 0):
            raise OptionError("lr must be > 0, momentum in [0, 1), weight_decay >= 0")


#: The reference recipe, and smaller ones (fewer, smaller steps) for a CPU and the toy zoo.
PRESETS = {
    "paper": TunedRecipe(),
    "cpu": TunedRecipe(steps=120, tokens_per_step=2**14),
    "toy": TunedRecipe(steps=60, tokens_per_step=2**11),
}


class Translators(nn.Module):
    """``h + A_l h + b_l`` for every layer at once (``A``: ``[L, d, d]``, ``b``: ``[L, d]``)."""

    def __init__(self, n_layers: int, d_model: int, start: Translator | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_layers, d_model, d_model))
        self.bias = nn.Parameter(torch.zeros(n_layers, d_model))
        if start is not None and not start.identity:
            with torch.no_grad():
                for layer, found in start.maps.items():
                    if not found.residual:  # h W^T + c = h + h (W - I)^T + c
                        self.weight[layer] = found.weight - torch.eye(d_model)
                    else:
                        self.weight[layer] = found.weight
                    if found.bias is not None:
                        self.bias[layer] = found.bias

    def forward(self, h: Tensor, layer: int) -> Tensor:
        return h + h @ self.weight[layer].T + self.bias[layer]


@dataclass
class TunedProgress:
    """What training did: steps, tokens and the mean KL per layer of the last step; whether it
    ran every step (``complete``) or was stopped (``interrupted``; else the data ran out)."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    forward_s: float = 0.0
    loss: list[float] | None = None
    complete: bool = False
    interrupted: bool = False


def train_tuned(
    model: Any,
    info: ModelInfo,
    batches: Callable[[], Iterable[Batch]],
    recipe: TunedRecipe,
    *,
    start: Translator | None = None,
    world: Any = None,
    on_step: Callable[[TunedProgress], None] | None = None,
) -> tuple[Translators, TunedProgress]:
    """Train translators on ``batches()`` (read once, in order) by ``recipe``.

    Args:
        model: The frozen ``TransformerBridge``.
        info: Its facts.
        batches: The data stream; it is cut into steps of ``recipe.tokens_per_step``.
        recipe: The training recipe.
        start: A lens to start from (an affine lens, say); the identity otherwise.
        world: A :class:`~lensdiv.run.distributed.World` (``None``: one process).
        on_step: Called after every step (progress).

    Returns:
        The translators (on the readout's device, float32) and what the training did. A
        ``KeyboardInterrupt`` stops it between steps with what it has (``complete`` false).
    """
    readout = final_readout(model)
    lens = Translators(info.n_layers, info.d_model, start).to(readout.device)
    trained: nn.Module = lens
    parallel = world is not None and world.parallel
    if parallel:
        trained = DistributedDataParallel(lens)
    optimizer = torch.optim.SGD(
        lens.parameters(),
        lr=recipe.lr * (1 - recipe.momentum),
        momentum=recipe.momentum,
        nesterov=recipe.momentum > 0,
        weight_decay=recipe.weight_decay,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, 1.0 - step / recipe.steps)
    )
    progress = TunedProgress()
    started = time.perf_counter()
    rank, size = (world.rank, world.size) if parallel else (0, 1)
    try:
        for group in _steps(batches(), recipe):
            nominal = sum(int(b.mask.sum()) for b in group)
            mine = group[rank::size]
            per_layer = torch.zeros(info.n_layers, dtype=torch.float64)
            for i, batch in enumerate(mine):
                last = i == len(mine) - 1
                t0 = time.perf_counter()
                per_layer += _accumulate(
                    model, info, readout, trained, batch, recipe, nominal, size, sync=last
                )
                progress.forward_s += time.perf_counter() - t0
            if not mine and parallel:
                _join(trained, info.d_model, readout.device)
            torch.nn.utils.clip_grad_norm_(lens.parameters(), recipe.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            schedule.step()
            progress.steps += 1
            progress.tokens += nominal
            progress.loss = (per_layer * size / max(nominal, 1)).tolist()
            progress.seconds = time.perf_counter() - started
            if on_step is not None:
                on_step(progress)
            if progress.steps >= recipe.steps:
                break
        progress.complete = progress.steps >= recipe.steps
    except KeyboardInterrupt:
        progress.complete, progress.interrupted = False, True
    return lens, progress


def _steps(stream: Iterable[Batch], recipe: TunedRecipe) -> Iterator[list[Batch]]:
    """Whole batches, ``tokens_per_step`` real tokens (at least) a step."""
    group: list[Batch] = []
    tokens = 0
    for batch in stream:
        group.append(batch)
        tokens += batch.n_tokens
        if tokens >= recipe.tokens_per_step:
            yield group
            group, tokens = [], 0
    if group:
        yield group


def _accumulate(
    model: Any,
    info: ModelInfo,
    readout: Any,
    trained: nn.Module,
    batch: Batch,
    recipe: TunedRecipe,
    nominal: int,
    world_size: int,
    *,
    sync: bool,
) -> Tensor:
    """One batch's gradient (scaled so the step's gradient is the mean over its positions,
    however it is split); returns the KL summed over positions, per layer."""
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    device = input_device(model)
    with torch.no_grad():
        _, cache = capture(model, batch.tokens.to(device), names, need_logits=False)
        keep = batch.positions(exclude_bos=recipe.exclude_bos).to(device)
        states = [cache[name][keep] for name in names]
        target = readout.logits(states[-1]).log_softmax(-1)  # log p_L
        p_target = target.exp()
    sums = torch.zeros(info.n_layers, dtype=torch.float64)
    scale = world_size / max(nominal, 1)  # DDP averages over ranks
    for layer in range(info.n_layers):
        # One backward per layer (the logits of one layer at a time); the gradients are
        # all-reduced by the last backward of the step only.
        last = sync and layer == info.n_layers - 1
        quiet = isinstance(trained, DistributedDataParallel) and not last
        with trained.no_sync() if quiet else nullcontext():  # type: ignore[operator]
            h = states[layer].to(readout.device, readout.dtype)
            logq = readout.logits(trained(h, layer)).log_softmax(-1)
            kl = (p_target * (target - logq)).sum(-1)
            (kl.sum() * scale).backward()
        sums[layer] = float(kl.detach().double().sum())
    return sums


def _join(trained: nn.Module, d_model: int, device: torch.device) -> None:
    """A rank without a batch in a step still joins the step's all-reduce: a forward and
    backward of nothing through DDP (its gradient contribution is zero)."""
    empty = torch.zeros(0, d_model, device=device)
    (trained(empty, 0).sum() * 0.0).backward()


def save_trained(
    folder: str | Path,
    lens: Translators,
    info: ModelInfo,
    recipe: TunedRecipe,
    progress: TunedProgress,
) -> list[Path]:
    """Write the translators in tuned-lens's layout, with the recipe and progress in its config."""
    weights = {layer: lens.weight[layer].detach() for layer in range(info.n_layers)}
    biases = {layer: lens.bias[layer].detach() for layer in range(info.n_layers)}
    return save_tuned(
        folder,
        weights,
        biases,
        d_model=info.d_model,
        n_layers=info.n_layers,
        model_name=info.name,
        extra={
            "fitted_by": "lensdiv",
            "lensdiv_lens": "tuned",
            "recipe": asdict(recipe),
            "steps_done": progress.steps,
            "tokens": progress.tokens,
            "complete": progress.complete,
            "final_kl": progress.loss,
        },
    )
