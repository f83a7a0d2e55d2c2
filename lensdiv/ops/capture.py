"""One forward pass that caches exactly the requested hooks and stops before the unembedding when
nobody needs logits.

TransformerLens' ``run_with_cache(stop_at_layer=L)`` still unembeds and forces
``output_attentions``; this registers one hook per hook point (aliases share storage and would
fire twice) and aborts the pass at the final norm.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.bridge import Bridge


class StopPass(Exception):
    """Raised by a hook to end a forward pass once what it needs has been seen: the one way
    lensdiv stops a pass early (capture, resumed passes, surgery, the block lenses), caught by
    :func:`stopping`."""


def stopping() -> contextlib.suppress:
    """The context a pass that a hook may stop runs in."""
    return contextlib.suppress(StopPass)


def halt_keeping(kept: dict[str, Tensor], key: str = "h") -> Any:
    """A hook that keeps the tensor it sees in ``kept[key]`` and stops the pass."""

    def hook(tensor: Tensor, *, hook: Any) -> Tensor:
        kept[key] = tensor
        raise StopPass

    return hook


def stop_hook_name(hook_names: Iterable[str]) -> str | None:
    """The first hook after the last block: the final norm's input, else the unembedding's."""
    names = set(hook_names)
    for name in ("ln_final.hook_in", "unembed.hook_in"):
        if name in names:
            return name
    return None


def capture(
    model: Bridge,
    tokens: Int[Tensor, "batch pos"],
    names: Iterable[str],
    *,
    need_logits: bool,
    grad: bool = False,
) -> tuple[Float[Tensor, "batch pos d_vocab"] | None, dict[str, Tensor]]:
    """Run ``model`` on ``tokens`` and return ``(logits or None, {hook name: activation})``."""
    hook_dict = model.hook_dict
    groups: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    for name in dict.fromkeys(names):
        key = id(hook_dict[name])
        groups.setdefault(key, []).append(name)
        first.setdefault(key, name)
    store: dict[str, Tensor] = {}

    def saver(aliases: list[str]) -> Any:
        def hook(tensor: Tensor, *, hook: Any) -> Tensor:
            value = tensor if grad else tensor.detach()
            for alias in aliases:
                store[alias] = value
            return tensor

        return hook

    fwd_hooks = [(first[key], saver(aliases)) for key, aliases in groups.items()]
    stop = None if need_logits else stop_hook_name(hook_dict)
    if stop is not None and id(hook_dict[stop]) not in groups:

        def halt(tensor: Tensor, *, hook: Any) -> Tensor:
            raise StopPass

        fwd_hooks.append((stop, halt))
    logits = None
    with torch.set_grad_enabled(grad), model.hooks(fwd_hooks=fwd_hooks), stopping():
        logits = model(tokens)
    return logits, store
