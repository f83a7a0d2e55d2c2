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
import functools
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

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
