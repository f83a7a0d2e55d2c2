"""The residual stream as an ensemble (SCIENCE.md B1): members and their exact logit contributions.

Members are the embedding ``h_0`` and every attention and MLP output, in stream order
(``embed, attn0, mlp0, attn1, ...``; ``M = 2L + 1``), so ``h_L = Σ_i c_i`` (parallel-residual
NeoX blocks read ``h_l`` twice but still add both outputs). The final norm is affine in its input
once its scale is fixed, so each member is read through the *final* residual's scale:

    LayerNorm:  u_i = γ ⊙ (c_i − mean(c_i)) / σ(h_L),   σ(h) = sqrt(var(h) + eps)
    RMSNorm:    u_i = γ ⊙ c_i / σ(h_L),                 σ(h) = sqrt(mean(h²) + eps)
    z_i = u_i · W_U,    const = β · W_U + b_U,    z = Σ_i z_i + const   (exactly)

``γ``, ``β`` and ``eps`` are read off the model's own final norm and *verified* against it on probe
vectors (:func:`final_readout`); a norm that does not match either form (or an adapter whose logit
transform is not a scalar multiple) raises :class:`~lensdiv.core.errors.HookError` rather than being
decomposed wrongly. Activations are read in float32.

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
from lensdiv.core.errors import HookError

Constant = Literal["shared", "separate"]
NormKind = Literal["LN", "RMS", "none"]

# Relative error allowed when checking the decomposed norm against the model's own module, per
# parameter dtype (fp32 agrees to ~1e-7; half precision rounds every output).
_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_PROBE_RTOL_LOW = 2e-2

_READOUTS: weakref.WeakKeyDictionary[Any, tuple[tuple[bool, int], Readout]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class Readout:
    """The model's final norm and unembedding, decomposed (float32, on the model's device).

    Args:
        kind: ``"LN"`` (centre, then scale), ``"RMS"`` (scale only) or ``"none"`` (no final norm).
        weight: ``γ`` (ones for a non-learnable norm).
        bias: ``β`` (zeros when the norm has none).
        eps: The norm's own epsilon.
        W_U: Unembedding ``[d_model, d_vocab]``, times the adapter's logit scale (if any).
        const: ``β · W_U + b_U``: the part of the logits no member writes.
        logit_scale: The adapter's scalar output transform (1.0 for almost every model).
    """

    kind: NormKind
    weight: Float[Tensor, " d_model"]
    bias: Float[Tensor, " d_model"]
    eps: float
    W_U: Float[Tensor, "d_model d_vocab"]
    const: Float[Tensor, " d_vocab"]
    logit_scale: float = 1.0
    _gram: Tensor | None = field(default=None, repr=False)

    def scale(self, h_last: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        """``σ(h_L)`` per row, with the norm's own epsilon (1 when there is no final norm)."""
        h = h_last.float()
        if self.kind == "LN":
            return (h.var(-1, unbiased=False) + self.eps).sqrt()
        if self.kind == "RMS":
            return (h.pow(2).mean(-1) + self.eps).sqrt()
        return torch.ones(h.shape[:-1], dtype=h.dtype, device=h.device)

    def normalise(
        self,
        c: Float[Tensor, "member n d_model"],
        sigma: Float[Tensor, " n"],
        *,
        inplace: bool = False,
    ) -> Float[Tensor, "member n d_model"]:
        """``u_i = γ ⊙ (c_i − mean(c_i)) / σ`` (no mean for RMS; ``c_i`` for no final norm).

        ``inplace=True`` overwrites ``c`` (which must then be float32) instead of copying it.
        """
        c = c.float() if inplace else c.float().clone()
        if self.kind == "LN":
            c.sub_(c.mean(-1, keepdim=True))
        if self.kind != "none":
            c.mul_(self.weight / sigma.unsqueeze(-1))
        return c

    @property
    def gram(self) -> Float[Tensor, "d_model d_model"]:
        """``G = W_U W_Uᵀ`` (computed once, in float64 then stored as float32)."""
        if self._gram is None:
            w = self.W_U.double()
            self._gram = (w @ w.T).float()
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


def final_readout(model: Any) -> Readout:
    """The model's final norm and unembedding as a :class:`Readout`, verified, cached per model.

    Raises:
        HookError: The final norm is neither a LayerNorm nor an RMSNorm (``γ`` or ``1 + γ``) with
            the epsilon it declares, or the adapter's logit transform is not a scalar multiple:
            the members' contributions would not add up to the logits.
    """
    # Folding (compatibility mode) rewrites the norm and unembedding in place: rebuild then.
    key = (bool(getattr(model, "compatibility_mode", False)), model.W_U.data_ptr())
    cached = _READOUTS.get(model)
    if cached is None or cached[0] != key:
        cached = _READOUTS[model] = (key, _build_readout(model))
    return cached[1]


def member_inputs(
    model: Any,
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
        :func:`final_readout`), and ``const = β · W_U + b_U`` so ``Σ_i z_i + const`` is the
        model's logits at those positions.
    """
    readout = final_readout(model)
    hooks = member_hooks(info)
    h_last = cache[hooks[-1]]
    d_model = h_last.shape[-1]
    rows = keep.reshape(-1).nonzero().squeeze(-1).to(h_last.device)
    # One gather per hook straight into a preallocated float32 block (no boolean-mask scans,
    # no stack copy); the norm is then applied in place.
    c = torch.empty(len(hooks) - 1, rows.shape[0], d_model, device=h_last.device)
    for i, hook in enumerate(hooks[:-1]):
        c[i].copy_(cache[hook].reshape(-1, d_model).index_select(0, rows))
    sigma = readout.scale(h_last.reshape(-1, d_model).index_select(0, rows))
    return readout.normalise(c, sigma, inplace=True), readout.const


def logits_from_inputs(
    u: Float[Tensor, "member n d_model"],
    readout: Readout,
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
    model: Any,
    cache: Any,
    info: ModelInfo,
    keep: Bool[Tensor, "batch pos"],
    *,
    constant: Constant = "shared",
) -> Float[Tensor, "member n d_vocab"]:
    """Every member's logit contribution at the kept positions (float32).

    With ``constant="shared"`` the sum over members is exactly the model's logits; with
    ``"separate"`` add :attr:`Readout.const` to the sum. This materialises ``M × n × d_vocab``
    floats: pass a ``keep`` that covers a chunk of positions, or use
    :func:`iter_member_logits`.
    """
    u, _ = member_inputs(model, cache, info, keep)
    return logits_from_inputs(u, final_readout(model), constant=constant)


def iter_member_logits(
    model: Any,
    cache: Any,
    info: ModelInfo,
    keep: Bool[Tensor, "batch pos"],
    *,
    constant: Constant = "shared",
    max_elements: int = 1 << 25,
) -> Iterator[tuple[slice, Float[Tensor, "member chunk d_vocab"]]]:
    """:func:`member_logits` in chunks of kept rows: ``(rows, logits)`` with at most
    ``max_elements`` logits (``M × rows × d_vocab``) alive at once."""
    readout = final_readout(model)
    per_chunk = max(1, max_elements // ((2 * info.n_layers + 1) * readout.W_U.shape[1]))
    start = 0
    for mask in keep_chunks(keep, per_chunk):
        u, _ = member_inputs(model, cache, info, mask)
        yield slice(start, start + u.shape[1]), logits_from_inputs(u, readout, constant=constant)
        start += u.shape[1]


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


# -- reading the final norm off the model ---------------------------------------------------------


def _build_readout(model: Any) -> Readout:
    name = str(getattr(model.cfg, "model_name", "this model"))
    norm_type = getattr(model.cfg, "normalization_type", None)
    W_U = model.W_U.detach()
    dtype, device = W_U.dtype, W_U.device
    d_model = int(W_U.shape[0])
    W_U = W_U.float()
    b_U = getattr(model, "b_U", None)
    b_U = torch.zeros(W_U.shape[1], device=device) if b_U is None else b_U.detach().float()
    ones = torch.ones(d_model, device=device)
    zeros = torch.zeros(d_model, device=device)
    ln_final = getattr(model, "ln_final", None)
    if norm_type is None and ln_final is None:
        kind: NormKind = "none"
        weight, bias, eps = ones, zeros, 0.0
    elif norm_type in ("LN", "LNPre", "RMS", "RMSPre") and isinstance(ln_final, torch.nn.Module):
        kind = "RMS" if norm_type.startswith("RMS") else "LN"
        inner = getattr(ln_final, "original_component", None) or ln_final
        weight = _param(inner, "weight", ones)
        bias = _param(inner, "bias", zeros)
        eps = _eps(inner, model.cfg)
        weight = _verify_norm(model, ln_final, kind, weight, bias, eps, dtype, name)
    else:
        raise HookError(
            f"{name}'s final norm ({norm_type!r}, {type(ln_final).__name__}) cannot be "
            "decomposed into member contributions",
            hint="members need a LayerNorm or RMSNorm before the unembedding",
        )
    scale = _logit_scale(model, W_U.shape[1], device, dtype, name)
    W_U, b_U = W_U * scale, b_U * scale
    return Readout(
        kind=kind,
        weight=weight,
        bias=bias,
        eps=eps,
        W_U=W_U,
        const=bias @ W_U + b_U,
        logit_scale=scale,
    )


def _param(module: torch.nn.Module, attr: str, default: Tensor) -> Tensor:
    value = getattr(module, attr, None)
    if not isinstance(value, Tensor):
        return default
    return value.detach().float().to(default.device).reshape(default.shape)


def _eps(module: torch.nn.Module, cfg: Any) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return float(getattr(cfg, "eps", 1e-5))


def _verify_norm(
    model: Any,
    ln_final: torch.nn.Module,
    kind: NormKind,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    dtype: torch.dtype,
    name: str,
) -> Tensor:
    """Check ``γ ⊙ normalise(x) + β`` against the module on probe vectors (small ones make
    ``eps`` visible); try ``1 + γ`` (Gemma's convention) before giving up. Returns ``γ``."""
    gen = torch.Generator().manual_seed(0)
    d_model = weight.shape[0]
    scales = torch.tensor([1e-3, 3e-2, 1.0, 30.0]).repeat_interleave(4).unsqueeze(-1)
    probe = torch.randn(scales.shape[0], d_model, generator=gen) * scales + 0.1 * scales
    probe = probe.to(device=weight.device, dtype=dtype)
    with torch.no_grad():
        theirs = ln_final(probe.unsqueeze(0)).squeeze(0).float()
    rtol = _PROBE_RTOL.get(dtype, _PROBE_RTOL_LOW)
    worst = float("inf")
    for gamma in (weight, weight + 1.0):
        trial = Readout(kind, gamma, bias, eps, weight.new_zeros(d_model, 1), weight.new_zeros(1))
        x = probe.float()
        ours = trial.normalise(x.unsqueeze(0), trial.scale(x))[0] + bias
        err = float(((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1).clamp_min(1e-12)).max())
        if err <= rtol:
            return gamma
        worst = min(worst, err)
    raise HookError(
        f"{name}'s final norm ({type(ln_final).__name__}) is not a {kind} with the weight, bias "
        f"and eps it declares (eps={eps:g}; relative error {worst:.2g} on probe vectors), so "
        "member contributions would not add up to the logits",
        hint="this analyzer does not support this architecture",
    )


def _logit_scale(model: Any, d_vocab: int, device: Any, dtype: torch.dtype, name: str) -> float:
    """The adapter's post-unembedding transform as a scalar, or an error if it is not one."""
    transform = getattr(getattr(model, "adapter", None), "apply_output_logits_transform", None)
    if not callable(transform):
        return 1.0
    gen = torch.Generator().manual_seed(1)
    probe = (torch.randn(2, d_vocab, generator=gen) * 3.0).to(device=device, dtype=dtype)
    with torch.no_grad():
        out = transform(probe)
    out, probe = out.float(), probe.float()
    scale = float((out * probe).sum() / (probe * probe).sum())
    err = float((out - scale * probe).norm() / out.norm().clamp_min(1e-12))
    if err > _PROBE_RTOL.get(dtype, _PROBE_RTOL_LOW):
        raise HookError(
            f"{name} transforms its logits non-linearly after the unembedding (e.g. a softcap), "
            "so member contributions cannot add up to the logits",
            hint="this analyzer does not support this architecture",
        )
    return scale
