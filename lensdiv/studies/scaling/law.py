"""The law ``L = Σ_k c_k/x_k^α_k + L0``: its terms, its symbols and its value on the fit's scale.

Inside the fit each size ``x_k`` is divided by a reference scale ``s_k`` and the parameters are
``theta = [log c_1..k (at the reference scales), α_1..k, log L0]``, so the problem is well
conditioned; :func:`reported` turns them back into the data's own units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from jaxtyping import Float

from lensdiv.core.errors import OptionError, did_you_mean

# The size variables, in the order they appear in the law, with their symbols.
TERMS = ("width", "depth", "tokens")
SYMBOLS = {"width": "m", "depth": "ℓ", "tokens": "D"}


def parse_terms(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"full"`` or names joined by commas or hyphens (``"depth,tokens"``, ``"width-depth"``).

    Returns:
        The terms in the law's order (width, depth, tokens).
    """
    if isinstance(text, str):
        names = [n.strip().lower() for n in text.replace("-", ",").split(",") if n.strip()]
    else:
        names = [str(n).strip().lower() for n in text]
    if names in (["full"], ["all"]):
        return TERMS
    for name in names:
        if name not in TERMS:
            raise OptionError(
                f"unknown scaling term {name!r}{did_you_mean(name, TERMS)}",
                hint="use 'full' or some of width, depth, tokens, e.g. --terms depth,tokens",
            )
    if not names:
        raise OptionError("no scaling terms given", hint="use 'full' or e.g. --terms depth")
    return tuple(t for t in TERMS if t in names)


def formula(terms: Sequence[str]) -> str:
    """The law in symbols, e.g. ``L = c_ℓ/ℓ^α_ℓ + L0``."""
    parts = [f"c_{SYMBOLS[t]}/{SYMBOLS[t]}^α_{SYMBOLS[t]}" for t in terms]
    return "L = " + " + ".join([*parts, "L0"])


def design(
    sizes: Mapping[str, np.ndarray], terms: Sequence[str], scales: Mapping[str, float]
) -> Float[np.ndarray, "n k"]:
    """``u[i, k] = log(x_ik / s_k)``: the sizes on the fit's log scale."""
    return np.stack([np.log(np.asarray(sizes[t], float) / scales[t]) for t in terms], axis=1)


def term_values(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"]
) -> tuple[Float[np.ndarray, "n k"], float]:
    """Each term's value ``c_k (x/s)^-α_k`` per run, and the floor L0."""
    k = u.shape[1]
    exponent = np.clip(theta[:k] - u * theta[k : 2 * k], -700.0, 700.0)  # no overflow mid-search
    return np.exp(exponent), float(np.exp(theta[2 * k]))


def log_residuals(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"], log_loss: Float[np.ndarray, " n"]
) -> Float[np.ndarray, " n"]:
    """``log L̂ − log L`` per run.

    Args:
        theta: ``[log c_1..k (at the reference scales), α_1..k, log L0]``.
        u: :func:`design` of the runs.
        log_loss: Log of each run's loss.
    """
    parts, floor = term_values(theta, u)
    return np.log(parts.sum(axis=1) + floor) - log_loss


def log_jacobian(
    theta: Float[np.ndarray, " p"], u: Float[np.ndarray, "n k"], log_loss: Float[np.ndarray, " n"]
) -> Float[np.ndarray, "n p"]:
    """∂(log L̂)/∂theta per run (``log_loss`` is unused; scipy passes it)."""
    parts, floor = term_values(theta, u)
    total = (parts.sum(axis=1) + floor)[:, None]
    return np.concatenate([parts / total, -u * parts / total, floor / total], axis=1)


def reported(
    theta: Float[np.ndarray, " p"], terms: Sequence[str], scales: Mapping[str, float]
) -> list[float]:
    """``[c_t, α_t for each term] + [L0]`` from the optimiser's parameters (raw units)."""
    k = len(terms)
    out = []
    for i, t in enumerate(terms):
        out += [float(np.exp(theta[i] + theta[k + i] * math.log(scales[t]))), float(theta[k + i])]
    return [*out, float(np.exp(theta[2 * k]))]
