"""Lesson 3, activation patching: the metric, one clean → corrupt patch of ``h_l`` at one
position, and the normalised map over every ``(l, position)``.

References: docs/science.md#patch (``patch``'s activation patching of ``resid_pre``);
TransformerLens' own ``patching.get_act_patch_resid_pre`` gives the map (``patch`` is tested
against it).
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
from torch import Tensor

from lensdiv.core.bridge import Bridge
from lensdiv.course import toy
from lensdiv.course.checker import Case, Exercise, Mistake, randn

# -- the references ---------------------------------------------------------------------------------


def logit_diff(logits: Tensor, target: int, foil: int) -> Tensor:
    return logits[:, -1, target] - logits[:, -1, foil]


def _patched(
    model: Bridge, source: Tensor, into: Tensor, layer: int, pos: Any, site: str = "resid_pre"
) -> Tensor:
    name = f"blocks.{layer}.hook_{site}"
    _, cache = model.run_with_cache(source, names_filter=name)
    h = cache[name]

    def patch(resid: Tensor, hook: Any) -> Tensor:
        out = resid.clone()
        out[:, pos] = h[:, pos]
        return out

    with torch.no_grad():
        return model.run_with_hooks(into, fwd_hooks=[(name, patch)]).float()


def patch_run(model: Bridge, clean: Tensor, corrupt: Tensor, layer: int, pos: int) -> Tensor:
    return _patched(model, clean, corrupt, layer, pos)


def _metric_of(target: int, foil: int) -> Any:
    def metric(logits: Tensor) -> Tensor:
        return logit_diff(logits, target, foil)[0]

    return metric


# Every (layer, position) patch of one pair, once per process: the reference and the mistakes
# are transforms of these two sweeps.
_SWEEPS: dict[tuple[Any, ...], tuple[Tensor, float, float]] = {}


def _sweep(
    model: Bridge, source: Tensor, into: Tensor, target: int, foil: int
) -> tuple[Tensor, float, float]:
    """TransformerLens' sweep of ``h_l`` patched from ``source`` into ``into`` at every position:
    the raw metric ``[n_layers, pos]``, and the metric of ``source`` and of ``into``."""
    from transformer_lens import patching

    key = (
        id(model),
        tuple(source.flatten().tolist()),
        tuple(into.flatten().tolist()),
        target,
        foil,
    )
    if key not in _SWEEPS:
        metric = _metric_of(target, foil)
        with torch.no_grad():
            _, cache = model.run_with_cache(source)
            with contextlib.redirect_stderr(io.StringIO()):  # its progress bar
                raw = patching.get_act_patch_resid_pre(model, into, cache, metric)
            _SWEEPS[key] = (raw.double(), float(metric(model(source))), float(metric(model(into))))
    return _SWEEPS[key]


def patching_map(model: Bridge, clean: Tensor, corrupt: Tensor, target: int, foil: int) -> Tensor:
    raw, m_clean, m_corrupt = _sweep(model, clean, corrupt, target, foil)
    return (raw - m_corrupt) / (m_clean - m_corrupt)


# -- the mistakes --------------------------------------------------------------------------------------


def _swapped_map(model: Bridge, clean: Tensor, corrupt: Tensor, target: int, foil: int) -> Tensor:
    raw, m_corrupt, m_clean = _sweep(model, corrupt, clean, target, foil)
    return (raw - m_corrupt) / (m_clean - m_corrupt)


def _unnormalised_map(
    model: Bridge, clean: Tensor, corrupt: Tensor, target: int, foil: int
) -> Tensor:
    raw, _, m_corrupt = _sweep(model, clean, corrupt, target, foil)
    return raw - m_corrupt


def _from_clean_map(
    model: Bridge, clean: Tensor, corrupt: Tensor, target: int, foil: int
) -> Tensor:
    return 1 - patching_map(model, clean, corrupt, target, foil)


# -- the inputs ----------------------------------------------------------------------------------------


def _diff_cases() -> list[Case]:
    model = toy.toy()
    p = toy.pair(model)
    with torch.no_grad():
        logits = model(torch.cat([p["clean"], p["corrupt"]])).float()
    return [
        Case(
            "1 row of 3 positions over a vocabulary of 5, target 1, foil 3",
            (randn(1, 3, 5, seed=30), 1, 3),
            15,
        ),
        Case("2 rows of 4 positions, target 0, foil 2", (randn(2, 4, 6, seed=31), 0, 2), 48),
        Case(
            f"toy: the clean and corrupt prompts {p['text']}",
            (logits, p["target"], p["foil"]),
            10**4,
            True,
        ),
    ]


def _patch_cases() -> list[Case]:
    model = toy.toy()
    p = toy.pair(model)
    T = p["clean"].shape[1]
    args = (model, p["clean"], p["corrupt"])
    return [
        Case(f"pair {p['text']}: h_0 at position 5", (*args, 0, 5), 1),
        Case(f"pair {p['text']}: h_2 at position {T - 1} (the last)", (*args, 2, T - 1), 2, True),
        Case(f"pair {p['text']}: h_1 at position 7", (*args, 1, 7), 3),
    ]


def _map_cases() -> list[Case]:
    model = toy.toy()
    cases = []
    for i in (0,):
        p = toy.pair(model, i)
        cases.append(
            Case(
                f"pair {p['text']}",
                (model, p["clean"], p["corrupt"], p["target"], p["foil"]),
                i,
                i == 0,
            )
        )
    return cases


def _last(out: Tensor) -> str:
    return "at the last position, per layer " + ", ".join(f"{float(v):.2f}" for v in out[:, -1])


# -- the exercises ------------------------------------------------------------------------------------

LOGIT_DIFF = Exercise(
    "logit_diff",
    logit_diff,
    _diff_cases,
    [
        Mistake(
            "sign",
            "the sign is flipped: the metric is logit[target] − logit[foil].",
            lambda z, t, f: -logit_diff(z, t, f),
        ),
        Mistake(
            "first_position",
            "read at the first position: the answer is predicted at the last one (logits[:, -1]).",
            lambda z, t, f: z[:, 0, t] - z[:, 0, f],
        ),
        Mistake(
            "off_by_one",
            "positions off by one: read at the last position (-1), not the one before it.",
            lambda z, t, f: z[:, -2, t] - z[:, -2, f],
        ),
        Mistake(
            "probs",
            "probabilities instead of logits: the metric is the difference of the logits.",
            lambda z, t, f: logit_diff(torch.softmax(z, -1), t, f),
        ),
    ],
    describe=lambda out: f"clean {float(out[0]):+.2f}, corrupt {float(out[1]):+.2f}",
    shape_hint="one number per row of the batch",
)

PATCH_RUN = Exercise(
    "patch_run",
    patch_run,
    _patch_cases,
    [
        Mistake(
            "swapped",
            "the clean and corrupt runs are swapped: run the corrupt prompt and copy the clean activation in.",
            lambda m, c, k, layer, t: _patched(m, k, c, layer, t),
        ),
        Mistake(
            "all_positions",
            "every position is patched: copy the clean h_l in at position pos only.",
            lambda m, c, k, layer, t: _patched(m, c, k, layer, slice(None)),
        ),
        Mistake(
            "resid_post",
            "the wrong state: h_l is blocks.{l}.hook_resid_pre (block l's input); you patched hook_resid_post, h_{l+1}.",
            lambda m, c, k, layer, t: _patched(m, c, k, layer, t, "resid_post"),
        ),
        Mistake(
            "off_by_one",
            "positions off by one: patch position pos itself (index pos of the tokens, BOS is 0).",
            lambda m, c, k, layer, t: _patched(m, c, k, layer, t - 1),
        ),
        Mistake(
            "nothing",
            "the patched run is the corrupt run unchanged: copy the activation from the clean run (run_with_cache(clean)), and return the modified tensor from the hook.",
            lambda m, c, k, layer, t: _patched(m, k, k, layer, t),
        ),
    ],
    describe=lambda out: f"logits of shape {list(out.shape)}",
    atol=1e-4,
    shape_hint="the logits of the patched corrupt run, [1, pos, d_vocab]",
)

PATCHING_MAP = Exercise(
    "patching_map",
    patching_map,
    _map_cases,
    [
        Mistake(
            "swapped",
            "the clean and corrupt runs are swapped: patch clean activations into the corrupt run.",
            _swapped_map,
        ),
        Mistake(
            "unnormalised",
            "not normalised: score (m_patched − m_corrupt) / (m_clean − m_corrupt), so 0 is no effect and 1 restores the clean answer.",
            _unnormalised_map,
        ),
        Mistake(
            "from_clean",
            "normalised from the clean end: (m_patched − m_corrupt) / (m_clean − m_corrupt) is 0 for no effect; yours gives 1 − that.",
            _from_clean_map,
        ),
        Mistake(
            "transposed", "transposed: the map is [layer, position].", lambda *a: patching_map(*a).T
        ),
    ],
    describe=_last,
    atol=1e-4,
    shape_hint="[n_layers, pos]",
    # Its reference's sweep may be cached already (another exercise ran it): a fixed floor.
    time_limit=(30.0, 50.0),
)

check_logit_diff = LOGIT_DIFF.check
check_patch_run = PATCH_RUN.check
check_patching_map = PATCHING_MAP.check
EXERCISES = (LOGIT_DIFF, PATCH_RUN, PATCHING_MAP)
