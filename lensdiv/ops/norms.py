"""The final norm's kinds as objects: what the readout and the members do with each.

A model's final norm, as :func:`lensdiv.ops.readout.final_readout` finds it, is one of:

- :class:`LayerNorm` (``"LN"``): ``γ ⊙ (h − mean h)/σ(h) + β``, ``σ(h) = sqrt(var(h) + eps)``;
- :class:`RMSNorm` (``"RMS"``): ``γ ⊙ h/σ(h) + β``, ``σ(h) = sqrt(mean(h²) + eps)``;
- :class:`NoNorm` (``"none"``): the model has no final norm;
- :class:`ModuleNorm` (``"module"``): a norm of neither form (checked on probe vectors), run as
  the model's own module in the model's dtype.

Each kind knows how to compute ``σ`` (:meth:`FinalNorm.scale`), how to apply itself to residual
states in the readout dtype (:meth:`FinalNorm.apply`, the readout's) and how to fold a fixed
``σ`` into member vectors (:meth:`FinalNorm.fold`, the members' ``u_i = γ ⊙ centre(c_i)/σ``:
:mod:`lensdiv.ops.members`). A new kind is one subclass here, added to :data:`FINAL_NORMS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.errors import HookError


@dataclass(eq=False)
class FinalNorm:
    """A final norm with its parameters in the readout dtype.

    Args:
        weight: ``γ`` (ones for a non-learnable norm or none).
        bias: ``β`` (zeros when the norm has none).
        eps: The norm's own epsilon (0 without a norm).
    """

    weight: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"]
    eps: float

    #: The kind's name, as results and tests see it (:attr:`FinalReadout.kind`).
    kind: ClassVar[str] = ""
    #: Applied from ``γ``, ``β`` and ``eps`` in the readout dtype, affine in its input once
    #: ``σ`` is fixed (so members can be read through it); False: the model's module runs.
    decomposed: ClassVar[bool] = True

    def scale(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        """``σ(x)`` per row of readout-dtype ``x`` (ones without a scale)."""
        return torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device)

    def apply(
        self, h: Float[Tensor, "n d_model"], *, dtype: torch.dtype, device: torch.device
    ) -> Float[Tensor, "n d_model"]:
        """The norm's output in ``dtype`` on ``device`` (a new tensor: ``h`` is never modified)."""
        return h.to(device=device, dtype=dtype, copy=True)

    def fold(
        self, c: Float[Tensor, "member n d_model"], sigma: Float[Tensor, " n"]
    ) -> Float[Tensor, "member n d_model"]:
        """``u = γ ⊙ centre(c)/σ`` for a fixed ``σ`` per row, in place in readout-dtype ``c``."""
        return c


class NoNorm(FinalNorm):
    """No final norm: states are read out as they are."""

    kind = "none"


class _AffineNorm(FinalNorm):
    """``γ ⊙ centre(h)/σ(h) + β`` with ``σ(h) = sqrt(mean(centre(h)²) + eps)``."""

    def _centre(self, x: Tensor, *, inplace: bool) -> Tensor:
        return x

    def apply(
        self, h: Float[Tensor, "n d_model"], *, dtype: torch.dtype, device: torch.device
    ) -> Float[Tensor, "n d_model"]:
        x = h.to(device=device, dtype=dtype, copy=True)
        if torch.is_grad_enabled() and x.requires_grad:  # autograd: no in-place updates
            x = self._centre(x, inplace=False)
            sigma = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
            return x / sigma * self.weight + self.bias
        x = self._centre(x, inplace=True)
        sigma = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        return x.div_(sigma).mul_(self.weight).add_(self.bias)

    def fold(
        self, c: Float[Tensor, "member n d_model"], sigma: Float[Tensor, " n"]
    ) -> Float[Tensor, "member n d_model"]:
        c = self._centre(c, inplace=True)
        return c.mul_(self.weight / sigma.unsqueeze(-1))


class LayerNorm(_AffineNorm):
    """A LayerNorm: centre, then scale."""

    kind = "LN"

    def scale(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        return (x.var(-1, unbiased=False) + self.eps).sqrt()

    def _centre(self, x: Tensor, *, inplace: bool) -> Tensor:
        if inplace:
            return x.sub_(x.mean(-1, keepdim=True))
        return x - x.mean(-1, keepdim=True)


class RMSNorm(_AffineNorm):
    """An RMSNorm: scale only."""

    kind = "RMS"

    def scale(self, x: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        return (x.pow(2).mean(-1) + self.eps).sqrt()


@dataclass(eq=False)
class ModuleNorm(FinalNorm):
    """A norm of neither form, run as the model's own module in the model's dtype (the one
    place the precision policy cannot hold). It has no ``σ`` to fold: members refuse it.

    Args:
        module: The model's final norm module.
        model_dtype: The dtype it runs in.
    """

    module: Any = None
    model_dtype: torch.dtype = torch.float32

    kind = "module"
    decomposed = False

    def apply(
        self, h: Float[Tensor, "n d_model"], *, dtype: torch.dtype, device: torch.device
    ) -> Float[Tensor, "n d_model"]:
        x = h.to(device=device, dtype=self.model_dtype)
        with torch.no_grad():
            out: Tensor = self.module(x.unsqueeze(0)).squeeze(0).to(dtype)
        return out

    def fold(
        self, c: Float[Tensor, "member n d_model"], sigma: Float[Tensor, " n"]
    ) -> Float[Tensor, "member n d_model"]:
        raise HookError(
            "this final norm is neither a LayerNorm nor an RMSNorm, so it cannot be folded",
            hint="this analyzer does not support this architecture",
        )


#: Every kind of final norm, by :attr:`FinalNorm.kind`.
FINAL_NORMS: dict[str, type[FinalNorm]] = {
    cls.kind: cls for cls in (LayerNorm, RMSNorm, NoNorm, ModuleNorm)
}

# The decomposed form a TransformerLens ``cfg.normalization_type`` declares.
_DECLARED: dict[str, type[_AffineNorm]] = {
    "LN": LayerNorm,
    "LNPre": LayerNorm,
    "RMS": RMSNorm,
    "RMSPre": RMSNorm,
}


def declared_norm(norm_type: Any) -> type[_AffineNorm] | None:
    """The decomposed form ``cfg.normalization_type`` declares (``None``: neither form)."""
    return _DECLARED.get(norm_type) if isinstance(norm_type, str) else None
