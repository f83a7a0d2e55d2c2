"""Depth surgery (docs/science.md E1, E2): remove a range of blocks, or run a range of blocks in
another order, and read what the model then outputs; and the cheap signals that are meant to
predict the effect from the clean pass alone.

Removing blocks ``ℓ..ℓ+n−1`` sets ``h_{ℓ+n} := h_ℓ`` at every position (BOS included) and runs
the later blocks as usual. Blocks before ``ℓ`` are unchanged, so the intervened pass resumes
from the clean residual at block ``ℓ+n`` (:func:`lensdiv.ops.subsets.removal_finals`): the
``(ℓ, n)`` grid costs its floor ``Σ (L − ℓ − n)`` block evaluations per token, and removing the
last ``n`` blocks runs nothing (its output is the clean ``h_{L−n}``). Interventions that resume
at the same block are stacked along the batch axis.

A reordered range ``[a, b)`` runs a *program*: a list of blocks applied in turn to ``h_a``
(a permutation, copies of one block, a block looped ``k`` times), or the blocks run in parallel
on ``h_a`` with their mean update added. Each block is applied alone by resuming at it and
stopping after it; then the pass resumes at ``b`` from the program's result.

Every output is compared with the clean output by :func:`lensdiv.ops.rowstats.lens_statistics`
(the ``lens`` analyzer's readout): ``KL(p_intervened ‖ p_out)`` — the same direction as
``lens`` —, the next-token cross-entropy and the top-1 agreement with the clean output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Step
from lensdiv.ops.capture import halt_keeping, stopping
from lensdiv.ops.readout import final_readout, workspace
from lensdiv.ops.resume import Resumer
from lensdiv.ops.rowstats import lens_statistics
from lensdiv.ops.subsets import removal_finals

# Residual values :func:`read_together` gathers before one readout (float32: 256 MB).
READ_ELEMENTS = 1 << 26

# The per-intervention sums :func:`output_sums` returns (all float64).
SUMS = ("n", "kl", "kl_sq", "n_target", "ce", "ce_sq", "dce", "dce_sq", "agree", "top1")


# -- removal ---------------------------------------------------------------------------------------
def range_mask(n_layers: int, start: int, n: int) -> int:
    """Bit mask of the blocks KEPT when blocks ``start..start+n−1`` are removed."""
    if n < 0 or start < 0 or start + n > n_layers:
        raise ValueError(f"blocks {start}..{start + n - 1} are not within 0..{n_layers - 1}")
    full = (1 << n_layers) - 1
    return full & ~(((1 << n) - 1) << start)


def set_mask(n_layers: int, removed: Sequence[int]) -> int:
    """Bit mask of the blocks kept when the blocks in ``removed`` are removed."""
    mask = (1 << n_layers) - 1
    for layer in removed:
        mask &= ~(1 << int(layer))
    return mask


def grid_cells(n_layers: int, max_n: int) -> list[tuple[int, int]]:
    """Every ``(ℓ, n)`` with ``1 ≤ n ≤ max_n`` and ``ℓ + n ≤ L``, ordered by resume block
    ``ℓ + n`` (so that cells resuming together are neighbours)."""
    cells = [(s, n) for n in range(1, max_n + 1) for s in range(n_layers - n + 1)]
    return sorted(cells, key=lambda c: (c[0] + c[1], c[0]))


def removed_finals(
    step: Step, masks: Sequence[int], resumer: Resumer, *, chunk: int = 0
) -> list[tuple[list[int], Float[Tensor, "k batch pos d_model"]]]:
    """Final residuals with only the blocks of each mask kept, in groups that share a resume
    block (each group one or more passes of at most ``chunk`` masks; ``0``: the whole group).

    Removing a contiguous range resumes exactly at its end, so a group runs only the blocks
    after the range: the floor of the grid."""
    L = step.info.n_layers
    groups: dict[int, list[int]] = {}
    for index, mask in enumerate(masks):
        groups.setdefault(_resume_block(mask, L), []).append(index)
    out = []
    for resume in sorted(groups):
        indices = groups[resume]
        per = chunk or len(indices)
        for lo in range(0, len(indices), per):
            part = indices[lo : lo + per]
            for which, finals in removal_finals(
                step, [masks[i] for i in part], resumer, chunk=len(part)
            ):
                out.append(([part[i] for i in which], finals))
    return out


def _resume_block(mask: int, n_layers: int) -> int:
    """The first kept block after the first removed one (``L`` when none)."""
    first = next((b for b in range(n_layers) if not mask >> b & 1), n_layers)
    return next((b for b in range(first, n_layers) if mask >> b & 1), n_layers)


@dataclass(frozen=True)
class SurgeryCost:
    """What a list of interventions costs per sequence: how many (each one readout of every
    position) and the block evaluations per token they run (each resumed from the clean pass).

    Args:
        interventions: Interventions per sequence.
        blocks: Block evaluations per token, summed over the interventions.
        bound: ``blocks`` is an upper bound (the blocks removed depend on the data).
    """

    interventions: int
    blocks: int
    bound: bool = False

    def forwards(self, n_layers: int) -> float:
        """``blocks`` in forward passes of the whole model."""
        return self.blocks / max(n_layers, 1)

    def __add__(self, other: SurgeryCost) -> SurgeryCost:
        return SurgeryCost(
            self.interventions + other.interventions,
            self.blocks + other.blocks,
            self.bound or other.bound,
        )


def removal_cost(n_layers: int, masks: Sequence[int]) -> SurgeryCost:
    """The cost of :func:`removed_finals` over ``masks``: each removal runs every block from its
    resume block on (removing the last blocks runs none)."""
    blocks = sum(n_layers - _resume_block(mask, n_layers) for mask in masks)
    return SurgeryCost(len(masks), blocks)


# -- reordering ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Program:
    """What replaces blocks ``start..stop−1``.

    Args:
        start, stop: The range replaced (``h_start`` in, ``h_stop`` out).
        blocks: Blocks applied in turn (``mode="sequence"``) or side by side (``"parallel"``).
        mode: ``sequence``: ``x ← B_j(x)`` for ``j`` in ``blocks``; ``parallel``:
            ``h_stop = h_start + mean_j (B_j(h_start) − h_start)``.
    """

    start: int
    stop: int
    blocks: tuple[int, ...]
    mode: str = "sequence"


def apply_block(
    resumer: Resumer, tokens: Int[Tensor, "batch pos"], block: int, x: Tensor
) -> Float[Tensor, "batch pos d_model"]:
    """``B_block(x)``: block ``block`` run alone on the residual ``x`` (the model's own code:
    masks, positions and rotary tables as in a normal pass)."""
    seen: dict[str, Tensor] = {}
    stop = halt_keeping(seen)  # the pass ends once the block has written its output
    with stopping():
        resumer.run(tokens, block, x, [(f"blocks.{block}.hook_resid_post", stop)], logits=False)
    return seen["h"].to(x.device)


def program_final(
    step: Step, program: Program, resumer: Resumer, rows: Int[Tensor, " row"] | None = None
) -> Float[Tensor, "batch pos d_model"]:
    """The final residual ``h_L`` when ``program`` replaces its range (clean elsewhere)."""
    L = step.info.n_layers
    tokens = step.batch.tokens if rows is None else step.batch.tokens[rows]
    h_in = step.resid(program.start).to(tokens.device)
    h_in = h_in if rows is None else h_in[rows]
    if program.mode == "parallel":
        updates = [apply_block(resumer, tokens, j, h_in) - h_in for j in program.blocks]
        x = h_in + torch.stack(updates).mean(0)
    else:
        x = h_in
        for j in program.blocks:
            x = apply_block(resumer, tokens, j, x)
    if program.stop == L:
        return x
    final: dict[str, Tensor] = {}

    def keep(tensor: Tensor, *, hook: Any) -> Tensor:
        final["h"] = tensor
        return tensor

    resumer.run(tokens, program.stop, x, [(f"blocks.{L - 1}.hook_resid_post", keep)], logits=False)
    return final["h"].to(tokens.device)


# -- what the output then is ---------------------------------------------------------------------
def output_sums(
    step: Step,
    finals: Sequence[Float[Tensor, "batch pos d_model"]],
    keep: Bool[Tensor, "batch pos"],
) -> dict[str, Float[Tensor, " k"]]:
    """Sums over the kept positions, per intervened final residual, of ``KL(p ‖ p_out)`` (the
    ``lens`` direction), its square, the next-token CE and its change from the clean CE (and
    squares) where a next token exists, top-1 agreement with the clean output, and top-1
    accuracy on the next token (keys :data:`SUMS`, float64, on the batch's device)."""
    L = step.info.n_layers
    targets, has_target = step.batch.next_tokens()
    rows = keep.reshape(-1).nonzero()[:, 0]
    device = keep.device
    k = len(finals)
    if rows.numel() == 0 or k == 0:
        return {key: torch.zeros(k, dtype=torch.float64, device=device) for key in SUMS}
    stats = lens_statistics(
        final_readout(step.model),
        [*finals, step.resid(L)],
        rows,
        targets.reshape(-1)[rows],
        k=1,
        workspace=workspace(step),
    )
    w = has_target.reshape(-1)[rows].double()
    ce = -stats.target_logp[:k]
    dce = ce - (-stats.target_logp[k])
    kl = stats.kl[:k]
    return {
        "n": torch.full((k,), float(rows.numel()), dtype=torch.float64, device=device),
        "kl": kl.sum(1),
        "kl_sq": (kl**2).sum(1),
        "n_target": torch.full((k,), float(w.sum()), dtype=torch.float64, device=device),
        "ce": (ce * w).sum(1),
        "ce_sq": (ce**2 * w).sum(1),
        "dce": (dce * w).sum(1),
        "dce_sq": (dce**2 * w).sum(1),
        "agree": stats.overlap[:k].sum(1),
        "top1": ((stats.rank[:k] == 0) * w).sum(1),
    }


def read_together(
    step: Step,
    chunks: Iterable[tuple[list[int], Tensor]],
    keep: Bool[Tensor, "batch pos"],
    *,
    elements: int = READ_ELEMENTS,
) -> Iterator[tuple[list[int], list[Tensor], dict[str, Tensor]]]:
    """``(indices, finals, output_sums)`` of the chunks :func:`removed_finals` yields (each
    ``[k, batch, pos, d_model]``, ``k`` varying from chunk to chunk), read out
    together until at least ``elements`` residual values wait: one readout of the clean output
    (the reference every statistic needs) serves many resume groups instead of one each. The
    memory held is ``elements`` values plus one chunk, whatever the number of tokens."""
    indices: list[int] = []
    finals: list[Tensor] = []
    waiting = 0
    for part, stacked in chunks:
        indices += part
        finals += list(stacked)
        waiting += stacked.numel()
        if waiting >= elements:
            yield indices, finals, output_sums(step, finals, keep)
            indices, finals, waiting = [], [], 0
    if indices:
        yield indices, finals, output_sums(step, finals, keep)


def answered(
    resumer: Resumer,
    tokens: Int[Tensor, "batch pos"],
    final: Float[Tensor, "batch pos d_model"],
    measure: Bool[Tensor, "batch pos"],
) -> Bool[Tensor, " batch"]:
    """Per row, whether greedy decoding of ``final`` gives the whole answer at the ``measure``
    positions (teacher-forced: the logits at the position before each answer token, read by the
    model's final norm and unembedding) — ``depth-score``'s accuracy of an example."""
    before = torch.zeros_like(measure)
    before[:, :-1] = measure[:, 1:]  # the position that predicts each answer token
    logits = resumer.readout(final.to(tokens.device)[before])
    hit = logits.argmax(-1) == tokens[measure]
    per_position = torch.ones_like(measure)
    per_position[measure] = hit
    return per_position.all(dim=1)


def clean_sums(step: Step, keep: Bool[Tensor, "batch pos"]) -> dict[str, float]:
    """The clean model's CE and top-1 accuracy sums over the kept positions with a next token."""
    sums = output_sums(step, [step.resid(step.info.n_layers)], keep)
    return {"ce": float(sums["ce"][0]), "top1": float(sums["top1"][0])}


def mean_sem(total: Tensor, squares: Tensor, count: Tensor | float) -> tuple[Tensor, Tensor]:
    """Mean and standard error of the mean from a sum, a sum of squares and a count."""
    n = torch.as_tensor(count, dtype=torch.float64).clamp_min(1.0)
    mean = total / n
    var = (squares / n - mean**2).clamp_min(0.0)
    return mean, var.sqrt() / (n - 1).clamp_min(1.0).sqrt()


# -- the cheap signals -----------------------------------------------------------------------------
def cosines(a: Float[Tensor, "... d"], b: Float[Tensor, "... d"]) -> Float[Tensor, ...]:
    """``cos(a, b)`` per vector, in float64 (clamped to [−1, 1]; 1 for two zero vectors)."""
    a, b = a.double(), b.double()
    norms = a.norm(dim=-1) * b.norm(dim=-1)
    dot = (a * b).sum(-1)
    return torch.where(norms > 0, dot / norms.clamp_min(1e-300), torch.ones_like(dot)).clamp(-1, 1)


def last_positions(mask: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos"]:
    """True at the last real token of each row."""
    last = mask.sum(1) - 1
    out = torch.zeros_like(mask)
    ok = last >= 0
    out[ok.nonzero()[:, 0], last[ok]] = True
    return out


def signal_sums(
    h: Sequence[Float[Tensor, "batch pos d_model"]],
    keep: Bool[Tensor, "batch pos"],
    last: Bool[Tensor, "batch pos"],
    max_n: int,
) -> dict[str, Tensor]:
    """Sums of the cheap signals of one batch (float64): block influence ``1 − cos(h_ℓ,
    h_{ℓ+1})`` over ``keep`` (``[L]``), and the angular distance ``arccos(cos(h_ℓ, h_{ℓ+n}))/π``
    over ``keep`` and over the ``last`` positions (``[L, max_n]``, 0 where ``ℓ + n > L``)."""
    L = len(h) - 1
    device = keep.device
    bi = torch.zeros(L, dtype=torch.float64, device=device)
    ang_all = torch.zeros(L, max_n, dtype=torch.float64, device=device)
    ang_last = torch.zeros(L, max_n, dtype=torch.float64, device=device)
    for s in range(L):
        a = h[s].to(device)
        for n in range(1, min(max_n, L - s) + 1):
            c = cosines(a, h[s + n].to(device))
            if n == 1:
                bi[s] = (1 - c)[keep].sum()
            angle = torch.arccos(c) / math.pi
            ang_all[s, n - 1] = angle[keep].sum()
            ang_last[s, n - 1] = angle[last].sum()
    return {"bi": bi, "ang_all": ang_all, "ang_last": ang_last}


def moment_update(
    state_add: Callable[[str, Tensor], None],
    h: Sequence[Float[Tensor, "batch pos d_model"]],
    keep: Bool[Tensor, "batch pos"],
) -> None:
    """Add the moments the linearity score needs (``Σx``, ``Σxxᵀ`` per state; ``Σ h_ℓ h_{ℓ+1}ᵀ``
    per block) over the kept positions, in float64, through ``state_add(name, value)``."""
    xs = [x.to(keep.device)[keep].double() for x in h]
    state_add("lin_n", torch.tensor(float(keep.sum()), dtype=torch.float64))
    state_add("lin_sx", torch.stack([x.sum(0) for x in xs]))
    state_add("lin_sxx", torch.stack([x.T @ x for x in xs]))
    state_add("lin_sxy", torch.stack([xs[i].T @ xs[i + 1] for i in range(len(xs) - 1)]))


def linearity(
    n: float, sx: Float[Tensor, "state d"], sxx: Float[Tensor, "state d d"], sxy: Tensor
) -> Float[Tensor, " block"]:
    """``R²`` of each block (Razzhigaev et al. 2024): the share of the centred ``h_{ℓ+1}``'s
    variance that the best linear map of the centred ``h_ℓ`` explains,
    ``R² = 1 − min_A ‖X̃A − Ỹ‖²_F / ‖Ỹ‖²_F``, exactly (no ridge), in float64 from the moments.

    ``A`` is the least-squares map of the covariances, ``C_xx A = C_xy``, solved by the
    pseudo-inverse of ``C_xx`` scaled to unit diagonal (a state with a few huge coordinates is
    then as well conditioned as its correlations); the residual ``‖X̃A − Ỹ‖²/n = tr C_yy −
    2⟨A, C_xy⟩ + ⟨A, C_xx A⟩`` is that map's own. With fewer tokens than dimensions ``Ỹ`` lies in
    the span of ``X̃`` and ``R² = 1``."""
    n = max(float(n), 1.0)
    sx, sxx, sxy = sx.cpu().double(), sxx.cpu().double(), sxy.cpu().double()
    mean = sx / n
    cov = sxx / n - mean[:, :, None] * mean[:, None, :]
    scores = []
    for s in range(sxy.shape[0]):
        cxx, cyy = cov[s], cov[s + 1]
        cxy = sxy[s] / n - mean[s][:, None] * mean[s + 1][None, :]
        total = float(cyy.diagonal().sum())
        if total <= 0:
            scores.append(1.0)
            continue
        # A coordinate whose variance is rounding of its raw moment is constant: it drops out.
        floor = 64 * torch.finfo(cxx.dtype).eps * (sxx[s].diagonal() / n)
        a = least_squares_map(cxx, cxy, floor)
        resid = total - 2.0 * float((a * cxy).sum()) + float((a * (cxx @ a)).sum())
        scores.append(1.0 - max(resid, 0.0) / total)
    return torch.tensor(scores, dtype=torch.float64)


def least_squares_map(
    cxx: Float[Tensor, "d d"], cxy: Float[Tensor, "d e"], floor: Float[Tensor, " d"] | None = None
) -> Float[Tensor, "d e"]:
    """A minimiser ``A`` of ``‖X̃A − Ỹ‖²`` from the covariances (``C_xx A = C_xy``, float64), by
    the pseudo-inverse of ``C_xx`` scaled to unit diagonal: coordinates whose variance is at most
    ``floor`` (default 0) drop out, and eigenvalues below ``d·ε`` of the largest count as zero."""
    var = cxx.diagonal()
    keep = var > (0.0 if floor is None else floor)
    scale = torch.where(keep, var.clamp_min(1e-300).rsqrt(), torch.zeros_like(var))
    corr = cxx * scale[:, None] * scale[None, :]
    w, v = torch.linalg.eigh(corr)
    cutoff = float(w.max().clamp_min(0.0)) * corr.shape[0] * torch.finfo(corr.dtype).eps
    inv = torch.where(w > cutoff, 1.0 / w.clamp_min(1e-300), torch.zeros_like(w))
    b = v @ (inv[:, None] * (v.T @ (scale[:, None] * cxy)))
    return scale[:, None] * b
