"""Lesson 5, remove a range of blocks: hooks that set ``h_{ℓ+n} := h_ℓ`` at every position, and
the cheap signals that claim to predict its cost — block influence and angular distance.

References: docs/science.md#prune; :func:`lensdiv.ops.surgery.cosines` and
:func:`~lensdiv.ops.surgery.last_positions` (what ``prune``'s signals are summed from).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lensdiv.course import toy
from lensdiv.course.checker import Case, Exercise, Mistake, randn
from lensdiv.ops.surgery import cosines, last_positions

Hook = tuple[str, Any]

# -- the references ---------------------------------------------------------------------------------


def _hooks(start: int, end: int, keep_bos: bool = False) -> list[Hook]:
    saved: dict[str, Tensor] = {}

    def save(resid: Tensor, hook: Any) -> Tensor:
        saved["h"] = resid.clone()
        return resid

    def replace(resid: Tensor, hook: Any) -> Tensor:
        out = saved["h"].clone()
        if keep_bos:
            out[:, 0] = resid[:, 0]
        return out

    if end <= start:
        return []
    return [
        (f"blocks.{start}.hook_resid_pre", save),
        (f"blocks.{end - 1}.hook_resid_post", replace),
    ]


def remove_hooks(start: int, n: int) -> list[Hook]:
    return _hooks(start, start + n)


def block_influence(states: Tensor, mask: Tensor) -> Tensor:
    c = cosines(states[:-1], states[1:])  # [L, batch, pos]
    return (1 - c)[:, mask].mean(-1)


def angular_distance(states: Tensor, mask: Tensor, start: int, n: int) -> Tensor:
    c = cosines(states[start], states[start + n])
    return (torch.arccos(c) / math.pi)[last_positions(mask)].mean()


# -- the mistakes --------------------------------------------------------------------------------------


def _n_layers() -> int:
    return int(toy.toy().cfg.n_layers)


def _bi_cos(states: Tensor, mask: Tensor) -> Tensor:
    return 1 - block_influence(states, mask)


def _bi_pads(states: Tensor, mask: Tensor) -> Tensor:
    return block_influence(states, torch.ones_like(mask))


def _bi_batch(states: Tensor, mask: Tensor) -> Tensor:
    c = 1 - cosines(states[:-1], states[1:])
    return ((c * mask).sum(-1) / mask.sum(-1)).mean(-1)


def _ang_no_pi(states: Tensor, mask: Tensor, start: int, n: int) -> Tensor:
    return angular_distance(states, mask, start, n) * math.pi


def _ang_padded_last(states: Tensor, mask: Tensor, start: int, n: int) -> Tensor:
    c = cosines(states[start][:, -1], states[start + n][:, -1])
    return (torch.arccos(c) / math.pi).mean()


def _ang_all(states: Tensor, mask: Tensor, start: int, n: int) -> Tensor:
    c = cosines(states[start], states[start + n])
    return (torch.arccos(c) / math.pi)[mask].mean()


def _ang_cos(states: Tensor, mask: Tensor, start: int, n: int) -> Tensor:
    return cosines(states[start], states[start + n])[last_positions(mask)].mean()


# -- the inputs ----------------------------------------------------------------------------------------


def _run_hooks(hooks: Any, case: Case) -> Tensor:
    """The states the exercise defines: ``h_0 .. h_ℓ`` and ``h_{ℓ+n} .. h_L`` (those inside the
    removed range are whatever the hooks leave there: identity blocks, the blocks' own
    outputs)."""
    start, n = case.args
    states = toy.residual_states(toy.toy(), case.context, list(hooks))[1]
    return torch.cat([states[: start + 1], states[start + n :]])


def _hook_cases() -> list[Case]:
    model = toy.toy()
    one, _ = toy.tokens(model, "")
    two, _ = toy.tokens(model, toy.PROMPTS[:2])
    L = model.cfg.n_layers
    return [
        Case("a one-token prompt (BOS only), ℓ = 1, n = 1", (1, 1), 1, context=one),
        Case("2 toy prompts, ℓ = 1, n = 1", (1, 1), 10, context=two),
        Case("2 toy prompts, ℓ = 0, n = 2", (0, 2), 11, context=two, headline=True),
        Case(f"2 toy prompts, ℓ = 1, n = {L - 1} (to the end)", (1, L - 1), 12, context=two),
    ]


def _signal_cases() -> list[Case]:
    model = toy.toy()
    ids, mask = toy.tokens(model, toy.PROMPTS)
    states = toy.residual_states(model, ids)[1]
    rand = randn(3, 2, 4, 5, seed=50)
    rmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    return [
        Case(
            "random states: 2 blocks, 2 rows of 4 positions (the second padded), d_model 5",
            (rand, rmask),
            120,
        ),
        Case("3 padded toy prompts", (states, mask), 10**6, True),
    ]


def _angle_cases() -> list[Case]:
    (rand, rmask), (states, mask) = (c.args for c in _signal_cases())
    return [
        Case("random states, 2 rows (the second padded), ℓ = 0, n = 2", (rand, rmask, 0, 2), 120),
        Case("3 padded toy prompts, ℓ = 1, n = 2", (states, mask, 1, 2), 10**6, True),
        Case("3 padded toy prompts, ℓ = 0, n = 1", (states, mask, 0, 1), 10**6 + 1),
    ]


# -- the exercises ------------------------------------------------------------------------------------

REMOVE_HOOKS = Exercise(
    "remove_hooks",
    remove_hooks,
    _hook_cases,
    [
        Mistake(
            "bos_kept",
            "BOS is left in place: removed blocks are gone at every position, the first included (unlike skip, which never skips BOS).",
            lambda s, n: _hooks(s, s + n, keep_bos=True),
        ),
        Mistake(
            "one_too_many",
            "one block too many removed: blocks ℓ..ℓ+n−1 go, so h_{ℓ+n} (blocks.{ℓ+n−1}.hook_resid_post) := h_ℓ.",
            lambda s, n: _hooks(s, min(s + n + 1, _n_layers())),
        ),
        Mistake(
            "one_too_few",
            "one block too few removed: blocks ℓ..ℓ+n−1 go, so the last one replaced is blocks.{ℓ+n−1}.hook_resid_post.",
            lambda s, n: _hooks(s, s + n - 1),
        ),
    ],
    describe=lambda out: f"h_0 .. h_ℓ and h_(ℓ+n) .. h_L of shape {list(out.shape)}",
    measure=_run_hooks,
    shape_hint="hooks [(name, fn), ...], checked by the states h_0 .. h_ℓ, h_{ℓ+n} .. h_L of a run with them",
)

BLOCK_INFLUENCE = Exercise(
    "block_influence",
    block_influence,
    _signal_cases,
    [
        Mistake(
            "cos",
            "this is the cosine itself: block influence is 1 − cos(h_j, h_{j+1}) (0 for a block that changes nothing).",
            _bi_cos,
        ),
        Mistake(
            "pads_counted", "pad positions are counted: average only where mask is True.", _bi_pads
        ),
        Mistake(
            "batch_mean",
            "a mean over the batch of each row's mean: average over all real tokens at once.",
            _bi_batch,
        ),
    ],
    describe=lambda out: "BI per block " + ", ".join(f"{float(v):.3f}" for v in out),
    shape_hint="one number per block",
)

ANGULAR_DISTANCE = Exercise(
    "angular_distance",
    angular_distance,
    _angle_cases,
    [
        Mistake(
            "no_pi",
            "the angle is in radians: the angular distance divides arccos(cos) by π (between 0 and 1).",
            _ang_no_pi,
        ),
        Mistake(
            "padded_last",
            "read at the row's last position, a pad in a padded row: use each row's last real token (the last True of mask).",
            _ang_padded_last,
        ),
        Mistake(
            "all_tokens",
            "averaged over every token: Gromov et al.'s distance is read at the last real token of each row (prune calls the all-token one angular_all).",
            _ang_all,
        ),
        Mistake(
            "cosine", "the cosine, not the angle: d = arccos(cos(h_ℓ, h_{ℓ+n})) / π.", _ang_cos
        ),
    ],
    describe=lambda out: f"d(1, 2) = {float(out):.3f}",
    shape_hint="one number",
)

check_remove_hooks = REMOVE_HOOKS.check
check_block_influence = BLOCK_INFLUENCE.check
check_angular_distance = ANGULAR_DISTANCE.check
EXERCISES = (REMOVE_HOOKS, BLOCK_INFLUENCE, ANGULAR_DISTANCE)
