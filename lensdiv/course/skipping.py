"""Lesson 2, skip a block: hooks that set ``h_{s+1} := h_s``, its effect on later blocks and on
the output (``skip``'s ``current`` mode: skipped at every position but BOS, measured everywhere).

References: docs/science.md#skip; :mod:`lensdiv.ops.skipping` computes the same effects by
resuming from the cached ``h_s`` (``tests/test_course.py`` holds them against each other).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lensdiv.course import toy
from lensdiv.course.checker import Case, Exercise, Mistake, randn

EPS = 1e-6
Hook = tuple[str, Callable[..., Any]]

# -- the references ----------------------------------------------------------------------------------


def _replace_hooks(
    save_at: str, replace_at: str, how: Callable[[Tensor, Tensor], Tensor]
) -> list[Hook]:
    saved: dict[str, Tensor] = {}

    def save(resid: Tensor, hook: Any) -> Tensor:
        saved["h"] = resid.clone()
        return resid

    def replace(resid: Tensor, hook: Any) -> Tensor:
        return how(resid, saved["h"])

    return [(save_at, save), (replace_at, replace)]


def _but_bos(resid: Tensor, h: Tensor) -> Tensor:
    out = resid.clone()
    out[:, 1:] = h[:, 1:]
    return out


def skip_hooks(s: int) -> list[Hook]:
    return _replace_hooks(f"blocks.{s}.hook_resid_pre", f"blocks.{s}.hook_resid_post", _but_bos)


def update_effect(clean: Tensor, skipped: Tensor) -> Tensor:
    d_clean = (clean[1:] - clean[:-1]).double()
    d_skip = (skipped[1:] - skipped[:-1]).double()
    ratio = (d_clean - d_skip).norm(dim=-1) / d_clean.norm(dim=-1).clamp_min(EPS)
    return ratio.amax(-1)


def output_effect(clean_logits: Tensor, skipped_logits: Tensor) -> Tensor:
    p, q = torch.softmax(clean_logits.double(), -1), torch.softmax(skipped_logits.double(), -1)
    return (p - q).norm(dim=-1).amax()


# -- the mistakes --------------------------------------------------------------------------------------


def _bos_skipped(s: int) -> list[Hook]:
    return _replace_hooks(
        f"blocks.{s}.hook_resid_pre", f"blocks.{s}.hook_resid_post", lambda r, h: h
    )


def _nothing(s: int) -> list[Hook]:
    return _replace_hooks(f"blocks.{s}.hook_resid_post", f"blocks.{s}.hook_resid_post", _but_bos)


def _zeroed(s: int) -> list[Hook]:
    def zero(resid: Tensor, h: Tensor) -> Tensor:
        out = resid.clone()
        out[:, 1:] = 0
        return out

    return _replace_hooks(f"blocks.{s}.hook_resid_pre", f"blocks.{s}.hook_resid_post", zero)


def _next_block(s: int) -> list[Hook]:
    L = toy.toy().cfg.n_layers
    b = min(s + 1, L - 1)
    return _replace_hooks(f"blocks.{b}.hook_resid_pre", f"blocks.{b}.hook_resid_post", _but_bos)


def _mean_positions(clean: Tensor, skipped: Tensor) -> Tensor:
    d_clean = (clean[1:] - clean[:-1]).double()
    d_skip = (skipped[1:] - skipped[:-1]).double()
    return ((d_clean - d_skip).norm(dim=-1) / d_clean.norm(dim=-1).clamp_min(EPS)).mean(-1)


def _relative_to_skipped(clean: Tensor, skipped: Tensor) -> Tensor:
    return update_effect(skipped, clean)


def _states(clean: Tensor, skipped: Tensor) -> Tensor:
    c, k = clean.double(), skipped.double()
    return ((c - k).norm(dim=-1) / c.norm(dim=-1).clamp_min(EPS)).amax(-1)[1:]


def _absolute(clean: Tensor, skipped: Tensor) -> Tensor:
    d = (clean[1:] - clean[:-1]).double() - (skipped[1:] - skipped[:-1]).double()
    return d.norm(dim=-1).amax(-1)


def _logits_distance(a: Tensor, b: Tensor) -> Tensor:
    return (a.double() - b.double()).norm(dim=-1).amax()


def _output_mean(a: Tensor, b: Tensor) -> Tensor:
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    return (p - q).norm(dim=-1).mean()


def _output_kl(a: Tensor, b: Tensor) -> Tensor:
    lp, lq = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).amax()


# -- the inputs ----------------------------------------------------------------------------------------


def _run_hooks(hooks: Any, case: Case) -> Tensor:
    return toy.residual_states(toy.toy(), case.context, list(hooks))[1]


def _hook_cases() -> list[Case]:
    model = toy.toy()
    one, _ = toy.tokens(model, "")  # BOS alone
    two, _ = toy.tokens(model, toy.PROMPTS[:2])
    L = model.cfg.n_layers
    return [
        Case("a one-token prompt (BOS only), s = 0", (0,), 1, context=one),
        Case("2 toy prompts, s = 0", (0,), 10, context=two),
        Case("2 toy prompts, s = 1", (1,), 11, context=two, headline=True),
        Case(f"2 toy prompts, s = {L - 1} (the last block)", (L - 1,), 12, context=two),
    ]


def _skip_states(text: str, s: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    model = toy.toy()
    tokens, _ = toy.tokens(model, text)
    logits, clean = toy.residual_states(model, tokens)
    skipped_logits, skipped = toy.residual_states(model, tokens, skip_hooks(s))
    return clean[:, 0], skipped[:, 0], logits[0], skipped_logits[0]


def _effect_cases() -> list[Case]:
    clean, skipped, _, _ = _skip_states(toy.PROMPTS[0], 1)
    rand = randn(4, 3, 6, seed=20)
    moved = rand.clone()
    moved[2:] += randn(2, 3, 6, seed=21, scale=0.5)
    one = _skip_states("", 0)
    return [
        Case("random states, 3 blocks, 3 positions, d_model 6", (rand, moved), 72),
        Case("one position (BOS alone): nothing can change", (one[0], one[1]), 100),
        Case(f"toy, block 1 skipped on {toy.PROMPTS[0]!r}", (clean, skipped), 10**5, True),
    ]


def _output_cases() -> list[Case]:
    clean, skipped, logits, skipped_logits = _skip_states(toy.PROMPTS[0], 1)
    return [
        Case("2 positions over a vocabulary of 4", (randn(2, 4, seed=22), randn(2, 4, seed=23)), 8),
        Case(f"toy, block 1 skipped on {toy.PROMPTS[0]!r}", (logits, skipped_logits), 10**5, True),
    ]


# -- the exercises ------------------------------------------------------------------------------------

SKIP_HOOKS = Exercise(
    "skip_hooks",
    skip_hooks,
    _hook_cases,
    [
        Mistake(
            "bos_skipped",
            "BOS is skipped too: the skip convention leaves position 0 alone (h_{s+1} := h_s at positions 1, 2, …).",
            _bos_skipped,
        ),
        Mistake(
            "nothing",
            "nothing was skipped: the states equal the clean run's. Save h_s at blocks.{s}.hook_resid_pre, and return the new tensor from the hook at blocks.{s}.hook_resid_post.",
            _nothing,
        ),
        Mistake(
            "zeroed",
            "h_{s+1} is set to zero: skipping a block means it adds nothing, h_{s+1} := h_s.",
            _zeroed,
        ),
        Mistake(
            "next_block",
            "the wrong block is skipped (s + 1, off by one): block s reads blocks.{s}.hook_resid_pre and writes blocks.{s}.hook_resid_post.",
            _next_block,
        ),
    ],
    describe=lambda out: f"states of shape {list(out.shape)}",
    measure=_run_hooks,
    shape_hint="[L + 1, batch, pos, d_model] states of the run with your hooks",
)

UPDATE_EFFECT = Exercise(
    "update_effect",
    update_effect,
    _effect_cases,
    [
        Mistake(
            "mean_positions",
            "a mean over positions: E[s, l] is the maximum over the measured positions.",
            _mean_positions,
        ),
        Mistake(
            "relative_to_skipped",
            "divided by the skipped run's update: the effect is relative to the clean update, ‖Δ_l − Δ̃_l‖ / ‖Δ_l‖.",
            _relative_to_skipped,
        ),
        Mistake(
            "states",
            "states compared instead of updates: E compares what block l writes, Δ_l = h_{l+1} − h_l, in the two runs.",
            _states,
        ),
        Mistake("absolute", "not relative: divide ‖Δ_l − Δ̃_l‖ by max(‖Δ_l‖, 1e-6).", _absolute),
    ],
    describe=lambda out: "E[1, l] = " + ", ".join(f"{float(v):.2f}" for v in out),
    shape_hint="one number per block",
)

OUTPUT_EFFECT = Exercise(
    "output_effect",
    output_effect,
    _output_cases,
    [
        Mistake(
            "logits",
            "the distance of logits: O[s] compares the output distributions, ‖softmax(z) − softmax(z̃)‖₂.",
            _logits_distance,
        ),
        Mistake(
            "mean_positions", "a mean over positions: O[s] is the maximum over them.", _output_mean
        ),
        Mistake(
            "kl",
            "a KL: O[s] is the L2 distance of the two distributions (between 0 and √2).",
            _output_kl,
        ),
    ],
    describe=lambda out: f"O[1] = {float(out):.3f}",
    shape_hint="one number",
)

check_skip_hooks = SKIP_HOOKS.check
check_update_effect = UPDATE_EFFECT.check
check_output_effect = OUTPUT_EFFECT.check
EXERCISES = (SKIP_HOOKS, UPDATE_EFFECT, OUTPUT_EFFECT)
