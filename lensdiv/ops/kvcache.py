"""Hugging Face's KV cache as the patchscope's continuations use it, across transformers versions.

transformers 5.24 renamed the cache argument of its models and layers from ``past_key_values``
to ``cache`` (the old name still accepted at the top, renamed there). TransformerLens 4.3's
attention bridges read the cache from ``past_key_values`` alone, so under 5.24 a bridge ignores
the cache it is handed: keys and values are never written, and a cached continuation cannot
run. :func:`passing_cache` hands the cache to each attention bridge under both names while a
continuation runs (nothing is changed where the names already agree), and :func:`cache_kwargs`
names the argument as the installed transformers expects it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lensdiv.core.bridge import Bridge

#: The names transformers has given the cache argument, newest first.
_NAMES = ("cache", "past_key_values")


def cache_kwargs(model: Bridge, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` with the name the model's Hugging Face forward takes."""
    hf_class: Any = type(model.original_model)
    return {_cache_name(hf_class): cache}


@functools.cache
def _cache_name(hf_class: Any) -> str:  # a model class: hashable, cached by identity
    params = inspect.signature(hf_class.forward).parameters
    return next((name for name in _NAMES if name in params), "past_key_values")


@contextlib.contextmanager
def passing_cache(model: Bridge) -> Iterator[None]:
    """While open, each attention bridge of ``model`` also finds a ``cache`` argument under
    ``past_key_values`` (the name TransformerLens 4.3 reads): one keyword pre-hook per block."""

    def alias(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if kwargs.get("cache") is not None and kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = kwargs["cache"]
            return args, kwargs
        return None

    handles = []
    for block in getattr(model, "blocks", ()):
        attn = getattr(block, "attn", None)
        if attn is not None:
            handles.append(attn.register_forward_pre_hook(alias, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@functools.cache
def prefixed_layer() -> Any:
    """The class of a full-attention cache layer over a prefix held in place (made on first
    use: ``transformers`` is imported only for models with a KV cache)."""
    from transformers.cache_utils import DynamicLayer

    class Prefixed(DynamicLayer):
        """Keys and values ``[n, heads, m, d_head]`` allocated for the whole prompt, the first
        ``past`` positions holding the prefix: an update writes its tokens in place and returns
        the keys and values so far (no copy of the prefix per call, as ``DynamicLayer`` makes
        by appending)."""

        def __init__(self, keys: Tensor, values: Tensor, past: int) -> None:
            super().__init__()
            self.buffers, self.past = (keys, values), past
            self.keys, self.values = keys[:, :, :past], values[:, :, :past]
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(
            self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            keys, values = self.buffers
            end = self.past + key_states.shape[-2]
            keys[:, :, self.past : end] = key_states
            values[:, :, self.past : end] = value_states
            self.past = end
            self.keys, self.values = keys[:, :, :end], values[:, :, :end]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.past

    return Prefixed


# -- the prefix shared by every row ------------------------------------------------------------------

#: The names lensdiv's attention is registered under in Hugging Face's ``AttentionInterface``:
#: its softmax in the scores' precision (at least float32), or in float32 whatever the dtype
#: (as many families' eager attention has it, which a float64 model then reproduces).
SHARED_PREFIX = "lensdiv_shared_prefix"
SHARED_PREFIX_FLOAT32 = "lensdiv_shared_prefix_float32"
# The cache of the continuation running now (its layers hold the shared prefix).
_RUNNING: contextvars.ContextVar[Any] = contextvars.ContextVar("lensdiv_shared_prefix")


@functools.cache
def shared_layer() -> Any:
    """The class of a cache layer whose prefix is one row shared by every row of a call (made on
    first use, with :func:`shared_prefix_attention` registered)."""
    from transformers import AttentionInterface
    from transformers.cache_utils import DynamicLayer

    AttentionInterface.register(SHARED_PREFIX, shared_prefix_attention)
    AttentionInterface.register(
        SHARED_PREFIX_FLOAT32, functools.partial(shared_prefix_attention, float32_softmax=True)
    )

    class Shared(DynamicLayer):
        """The prefix's keys and values ``[1, kv_heads, j, d_head]``, held once; an update
        returns the new tokens' own keys and values (the attention reads the prefix from here)."""

        def __init__(self, keys: Tensor, values: Tensor) -> None:
            super().__init__()
            self.prefix, self.past = (keys, values), int(keys.shape[-2])
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(
            self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
        ) -> tuple[Tensor, Tensor]:
            self.past += int(key_states.shape[-2])
            return key_states, value_states

        def get_seq_length(self) -> int:
            return self.past

    return Shared


@contextlib.contextmanager
def shared_prefix(cache: Any) -> Iterator[None]:
    """While open, :func:`shared_prefix_attention` reads its prefix from ``cache``'s layers."""
    token = _RUNNING.set(cache)
    try:
        yield
    finally:
        _RUNNING.reset(token)


def shared_prefix_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    *,
    float32_softmax: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Hugging Face's eager attention for ``n`` rows that share their first ``j`` keys and
    values (the prefix, one copy in the running cache's layer ``module.layer_idx``): the
    prefix's scores and weighted values as one product per key head over every row, the rows'
    own ``t`` tokens per row. ``query`` ``[n, heads, t, d]``; ``key``, ``value``
    ``[n, kv_heads, t, d]`` (the new tokens only); returns ``[n, t, heads, d]`` as Hugging
    Face's attention functions do. The softmax is in float32, or in float64 for float64
    scores unless ``float32_softmax``.

    Raises:
        NotImplementedError: Attention sinks, dropout, or a sliding window shorter than the
            keys (the caller then runs the model's own attention).
    """
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError("attention sinks")
    if dropout:
        raise NotImplementedError("attention dropout")
    keys_p, values_p = _RUNNING.get().layers[module.layer_idx].prefix
    n, heads, t, d = query.shape
    kv, j = int(keys_p.shape[1]), int(keys_p.shape[2])
    if sliding_window is not None and j + t > sliding_window:
        raise NotImplementedError(f"a sliding window of {sliding_window} < {j + t} keys")
    g, keys = heads // kv, j + t
    # everything by key head: [kv, n, g, t, ·], the prefix's part one product over every row
    q = query.view(n, kv, g, t, d).transpose(0, 1)
    own_k = key.view(n, kv, 1, t, d).transpose(0, 1)  # shared by the g heads of its group
    own_v = value.view(n, kv, 1, t, d).transpose(0, 1)
    on_prefix = torch.bmm(q.reshape(kv, n * g * t, d), keys_p[0].transpose(1, 2))
    # one own token (the usual patch at the last position): products, not 1×1 matrix calls
    on_own = (q * own_k).sum(-1, keepdim=True) if t == 1 else q @ own_k.transpose(-1, -2)
    scores = torch.cat([on_prefix, on_own.reshape(kv, n * g * t, t)], dim=-1)
    scores = scores.mul_(d**-0.5 if scaling is None else scaling).view(kv, n, g, t, keys)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        mask = attention_mask[..., :keys]  # [rows or 1, 1 or heads, t, keys]
        if mask.shape[1] == 1:
            mask = mask[None]
        elif mask.shape[1] == heads:
            mask = mask.reshape(mask.shape[0], kv, g, t, keys).transpose(0, 1)
        else:
            raise NotImplementedError(f"an attention mask of shape {tuple(attention_mask.shape)}")
        scores = (
            scores.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else (scores + mask)
        )
    elif t > 1:  # causal among the row's own tokens
        causal = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
        scores[..., j:] = scores[..., j:].masked_fill(causal, float("-inf"))
    exact = torch.float32 if float32_softmax else torch.promote_types(scores.dtype, torch.float32)
    weights = torch.softmax(scores, dim=-1, dtype=exact).to(value.dtype)
    flat = weights.view(kv, n * g * t, keys)
    out = torch.bmm(flat[..., :j], values_p[0]).view(kv, n, g, t, d)
    out += weights[..., j:] * own_v if t == 1 else weights[..., j:] @ own_v
    return out.permute(1, 3, 0, 2, 4).reshape(n, t, heads, d), None


class FallbackWarning(RuntimeWarning):
    """A fast path could not be taken and an exact, slower one runs instead."""


_WARNED: set[str] = set()


def warn_fallback(what: str, reason: str, cost: str) -> None:
    """Say once per process and reason that ``what`` fell back to its slow path, and its cost."""
    key = f"{what}: {reason}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"{what} falls back to its slow path ({reason}); {cost}", FallbackWarning, 3)
