"""The residual stream as an ensemble (docs/science.md B1): members, exact logit contributions.

Members are the embedding ``h_0`` and every attention and MLP output, in stream order
(``embed, attn0, mlp0, attn1, ...``; ``M = 2L + 1``), so ``h_L = Σ_i c_i`` (parallel-residual
NeoX blocks read ``h_l`` twice but still add both outputs). The final norm is affine in its input
once its scale is fixed, so each member is read through the *final* residual's scale:

    LayerNorm:  u_i = γ ⊙ (c_i − mean(c_i)) / σ(h_L),   σ(h) = sqrt(var(h) + eps)
    RMSNorm:    u_i = γ ⊙ c_i / σ(h_L),                 σ(h) = sqrt(mean(h²) + eps)
    z_i = u_i · W_U,    const = β · W_U + b_U,    z = Σ_i z_i + const   (exactly)

``γ``, ``β`` and ``eps`` are read off the model's own final norm and *verified* against it on probe
vectors (:func:`lensdiv.ops.readout.final_readout`); a norm that does not match either form (or an
adapter whose logit transform is not a scalar multiple) raises :class:`~lensdiv.core.errors.HookError`
rather than being decomposed wrongly. Activations are read in the readout dtype (float32, float64
for a float64 model: :func:`lensdiv.ops.readout.readout_dtype`).

The constant has no member of its own. ``constant="shared"`` gives every member ``const / M``,
so the members' mean times ``M`` is exactly the model's logits (what the bias–diversity identities
of B2/B3 need); ``"separate"`` leaves it out of every member (add it back yourself).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jaxtyping import Bool, Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import HookError
from lensdiv.ops.norms import LayerNorm, RMSNorm, declared_norm
from lensdiv.ops.readout import FinalReadout, final_readout, norm_error

Constant = Literal["shared", "separate"]

_READOUTS: weakref.WeakKeyDictionary[Any, tuple[FinalReadout, MemberReadout]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(eq=False)
class MemberReadout:
    """The model's :class:`~lensdiv.ops.readout.FinalReadout` (final norm and unembedding in the
    readout dtype, where the unembedding runs) and what the members add to it.

    Args:
        full: The shared readout (its norm is an LN or RMSNorm and its output transform at most
            a scalar, folded into ``W_U``: :func:`member_readout` checks both).
        const: ``β · W_U + b_U``: the part of the logits no member writes.
    """

    full: FinalReadout
    const: Float[Tensor, " d_vocab"]
    _gram: Tensor | None = field(default=None, repr=False)

    @property
    def W_U(self) -> Float[Tensor, "d_model d_vocab"]:
        """Unembedding ``[d_model, d_vocab]``, times the adapter's logit scale (if any)."""
        return self.full.W_U

    @property
    def weight(self) -> Float[Tensor, " d_model"]:
        """``γ`` (ones for a non-learnable norm)."""
        return self.full.weight

    def scale(self, h_last: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        """``σ(h_L)`` per row, with the norm's own epsilon (1 when there is no final norm)."""
        return self.full.scale(h_last)

    def normalize(
        self,
        c: Float[Tensor, "member n d_model"],
        sigma: Float[Tensor, " n"],
        *,
        inplace: bool = False,
    ) -> Float[Tensor, "member n d_model"]:
        """``u_i = γ ⊙ (c_i − mean(c_i)) / σ`` (no mean for RMS; ``c_i`` for no final norm).

        ``inplace=True`` overwrites ``c`` (which must then be in the readout dtype) instead of
        copying it.
        """
        c = c.to(self.W_U.dtype) if inplace else c.to(self.W_U.dtype, copy=True)
        return self.full.norm.fold(c, sigma)

    @property
    def gram(self) -> Float[Tensor, "d_model d_model"]:
        """``G = W_U W_Uᵀ`` (computed once in float64, stored in the readout dtype)."""
        if self._gram is None:
            w = self.W_U.double()
            self._gram = (w @ w.T).to(self.W_U.dtype)
        return self._gram


def member_names(info: ModelInfo) -> list[str]:
    """``["embed", "attn0", "mlp0", "attn1", "mlp1", ...]``: ``M = 2L + 1`` members."""
    names = ["embed"]
    for layer in range(info.n_layers):
        names += [f"attn{layer}", f"mlp{layer}"]
    return names


def member_layers(info: ModelInfo) -> list[int]:
    """The block of each member (``-1`` for the embedding), aligned with :func:`member_names`."""
    return [-1] + [layer for layer in range(info.n_layers) for _ in range(2)]


def member_hooks(info: ModelInfo) -> list[str]:
    """Hooks the members need: ``h_0``, every attention and MLP output, then ``h_L``."""
    hooks = [info.resid(0)]
    for layer in range(info.n_layers):
        hooks += [f"blocks.{layer}.hook_attn_out", f"blocks.{layer}.hook_mlp_out"]
    return [*hooks, info.resid(info.n_layers)]


def member_readout(model: Bridge) -> MemberReadout:
    """The model's final norm and unembedding as a :class:`MemberReadout`, verified, cached per model.

    Raises:
        HookError: The final norm is neither a LayerNorm nor an RMSNorm (``γ`` or ``1 + γ``) with
            the epsilon it declares, or the adapter's logit transform is not a scalar multiple:
            the members' contributions would not add up to the logits.
    """
    # Rebuilt whenever the full readout is (folding rewrites the norm and unembedding in place).
    full = final_readout(model)
    cached = _READOUTS.get(model)
    if cached is None or cached[0] is not full:
        cached = _READOUTS[model] = (full, _build_member_readout(model, full))
    return cached[1]


def member_inputs(
    model: Bridge,
    cache: Any,
    info: ModelInfo,
    keep: Bool[Tensor, "batch pos"],
) -> tuple[Float[Tensor, "member n d_model"], Float[Tensor, " d_vocab"]]:
    """The normalised member vectors ``u_i`` at the kept positions, and the constant.

    Args:
        model: The ``TransformerBridge`` (its final norm and unembedding are read once).
        cache: ``{hook: activation}`` holding every hook of :func:`member_hooks`.
        info: Model facts.
        keep: Positions to read (``n = keep.sum()`` rows, in row-major order).

    Returns:
        ``(u, const)``: ``u`` float32 ``[M, n, d_model]`` with ``z_i = u_i · W_U`` (``W_U`` of
        :func:`member_readout`), and ``const = β · W_U + b_U`` so ``Σ_i z_i + const`` is the
        model's logits at those positions.
    """
    readout = member_readout(model)
    hooks = member_hooks(info)
    h_last = cache[hooks[-1]]
    d_model = h_last.shape[-1]
    rows = keep.reshape(-1).nonzero().squeeze(-1)
    # One gather per hook straight into a preallocated readout-dtype block where the
    # unembedding runs (no boolean-mask scans, no stack copy); the norm is then applied in place.
    W_U = readout.W_U
    c = torch.empty(len(hooks) - 1, rows.shape[0], d_model, dtype=W_U.dtype, device=W_U.device)
    for i, hook in enumerate(hooks[:-1]):
        act = cache[hook].reshape(-1, d_model)
        if act.device == c.device and act.dtype == c.dtype:
            torch.index_select(act, 0, rows.to(act.device), out=c[i])
        else:
            c[i].copy_(act.index_select(0, rows.to(act.device)))
    sigma = readout.scale(h_last.reshape(-1, d_model).index_select(0, rows.to(h_last.device)))
    return readout.normalize(c, sigma, inplace=True), readout.const


def logits_from_inputs(
    u: Float[Tensor, "member n d_model"],
    readout: MemberReadout,
    *,
    constant: Constant = "shared",
) -> Float[Tensor, "member n d_vocab"]:
    """``z_i = u_i · W_U`` (plus ``const / M`` each when ``constant="shared"``)."""
    z = u @ readout.W_U
    if constant == "shared":
        z = z + readout.const / u.shape[0]
    elif constant != "separate":
        raise ValueError(f"constant must be 'shared' or 'separate', not {constant!r}")
    return z


def member_logits(
    model: Bridge,
    cache: Any,
    info: ModelInfo,
    keep: Bool[Tensor, "batch pos"],
    *,
    constant: Constant = "shared",
) -> Float[Tensor, "member n d_vocab"]:
    """Every member's logit contribution at the kept positions (float32).

    With ``constant="shared"`` the sum over members is exactly the model's logits; with
    ``"separate"`` add :attr:`MemberReadout.const` to the sum. This materialises ``M × n × d_vocab``
    floats: pass a ``keep`` that covers a chunk of positions, or use
    :func:`iter_member_logits`.
    """
    u, _ = member_inputs(model, cache, info, keep)
    return logits_from_inputs(u, member_readout(model), constant=constant)


def iter_member_logits(
    model: Bridge,
    cache: Any,
    info: ModelInfo,
    keep: Bool[Tensor, "batch pos"],
    *,
    constant: Constant = "shared",
    max_elements: int = 1 << 25,
) -> Iterator[tuple[slice, Float[Tensor, "member chunk d_vocab"]]]:
    """:func:`member_logits` in chunks of kept rows: ``(rows, logits)`` with at most
    ``max_elements`` logits (``M × rows × d_vocab``) alive at once."""
    d_vocab = member_readout(model).W_U.shape[1]
    start = 0
    for mask in keep_chunks(keep, max(1, max_elements // ((2 * info.n_layers + 1) * d_vocab))):
        z = member_logits(model, cache, info, mask, constant=constant)
        yield slice(start, start + z.shape[1]), z
        start += z.shape[1]


def keep_chunks(
    keep: Bool[Tensor, "batch pos"], max_rows: int
) -> Iterator[Bool[Tensor, "batch pos"]]:
    """Split ``keep`` into masks of at most ``max_rows`` kept positions each, in row-major order
    (so the rows of consecutive chunks concatenate to the rows of ``keep``)."""
    flat = keep.reshape(-1)
    order = torch.cumsum(flat.long(), 0) - 1  # rank of each kept position
    total = int(flat.sum())
    for start in range(0, total, max(1, max_rows)):
        yield (flat & (order >= start) & (order < start + max_rows)).view_as(keep)


# -- the final norm, decomposed ---------------------------------------------------------------------


def _build_member_readout(model: Bridge, full: FinalReadout) -> MemberReadout:
    name = str(getattr(model.cfg, "model_name", "this model"))
    if not full.norm.decomposed:
        ln_final = model.ln_final
        inner = getattr(ln_final, "original_component", None) or ln_final
        norm_type = str(getattr(model.cfg, "normalization_type", ""))
        form = declared_norm(norm_type) or (RMSNorm if norm_type.startswith("RMS") else LayerNorm)
        worst = min(
            norm_error(ln_final, form(gamma, full.bias, full.eps), full.model_dtype)
            for gamma in (full.weight, full.weight + 1.0)
        )
        raise HookError(
            f"{name}'s final norm ({type(inner).__name__}) is not a {form.kind} with the weight, bias "
            f"and eps it declares (eps={full.eps:g}; relative error {worst:.2g} on probe "
            "vectors), so member contributions would not add up to the logits",
            hint="this analyzer does not support this architecture",
        )
    if full.transform is not None:
        raise HookError(
            f"{name} transforms its logits non-linearly after the unembedding (e.g. a softcap), "
            "so member contributions cannot add up to the logits",
            hint="this analyzer does not support this architecture",
        )
    return MemberReadout(full=full, const=full.bias @ full.W_U + full.b_U)
