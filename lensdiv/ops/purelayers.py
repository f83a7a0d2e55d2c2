"""A model's Hugging Face layers as Hugging Face wrote them, for computations that need no hook.

A ``TransformerBridge`` puts its own components (hook points around every norm, projection and
attention, and an attention it reconstructs from ``q``, ``k`` and ``v`` to expose the pattern)
in place of the modules inside each Hugging Face layer. That costs a few hundred microseconds
of Python per block call and a slower attention; a computation that reads nothing inside a
block — the patchscope's continuations (:mod:`lensdiv.ops.inspection`) — can do without it:

- :func:`pure_layer` is a shallow copy of a layer whose bridged submodules are their originals,
  recursively: the same parameters and buffers (nothing copied, an edit to a weight seen by
  both), no hooks; the model itself is not changed, so a bridge running in another thread is
  not disturbed.
- :class:`LayerCalls` records, from one forward pass of the bridge, the arguments the model
  gives each layer (rotary tables, masks, positions: whatever the family computes around its
  blocks) and replays them through the pure layers with another residual and another cache.
  The recorded arguments depend on the tokens and their positions only, never on the residual,
  so a replay on the same tokens is the model's own computation.

A layer under Accelerate's hooks (a model split by ``device_map`` or offloaded) keeps the
bridge (:func:`pure_layers` says ``None``): its hooks move inputs and load weights in the
layer's own ``forward``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lensdiv.core.bridge import Bridge


def pure_layer(module: nn.Module, attention: str | None = None) -> nn.Module:
    """``module`` (or, for a bridge component, its original) with every bridged submodule
    replaced by its original, recursively: a shallow copy without hooks where anything
    changed, ``module`` itself where nothing did. ``attention``: the name of the attention
    implementation (Hugging Face's ``AttentionInterface``) each copy with a ``config`` runs
    (on a copy of the config; the model's own is untouched)."""
    original = getattr(module, "original_component", None)
    if isinstance(original, nn.Module):
        module = original
    changed = {}
    for name, child in module._modules.items():
        if child is not None and (pure := pure_layer(child, attention)) is not child:
            changed[name] = pure
    hooked = any(
        key.startswith(("_forward", "_backward")) and isinstance(value, dict) and value
        for key, value in vars(module).items()
    )
    config: Any = getattr(module, "config", None)
    configured = attention is not None and hasattr(config, "_attn_implementation")
    if not changed and not hooked and not configured and "forward" not in vars(module):
        return module
    out = copy.copy(module)  # a new __dict__: parameters and buffers shared, not copied
    state = vars(out)
    state.pop("forward", None)  # an instance-level forward (a stub) belongs to the original
    for key, value in list(state.items()):
        if key.startswith(("_forward", "_backward")) and isinstance(value, dict):
            state[key] = type(value)()
    state["_modules"] = {**module._modules, **changed}
    if configured:
        state["config"] = own = copy.copy(config)
        if "_attn_implementation_internal" in vars(own):  # not the setter: it would change
            vars(own)["_attn_implementation_internal"] = attention  # the shared sub-configs
        else:
            own._attn_implementation = attention
    return out


def pure_layers(model: Bridge, attention: str | None = None) -> list[nn.Module] | None:
    """The pure copy of each block's Hugging Face layer (``attention``: as :func:`pure_layer`),
    or ``None`` where there is no Hugging Face model or Accelerate's hooks manage a layer
    (``device_map``, offloading)."""
    if getattr(model, "original_model", None) is None:
        return None
    layers = [block.original_component for block in model.blocks]
    if any(hasattr(sub, "_hf_hook") for layer in layers for sub in layer.modules()):
        return None
    return [pure_layer(layer, attention) for layer in layers]


@dataclass
class _Call:
    """One layer's recorded call: its arguments, where the residual and the cache were."""

    args: list[Any]
    kwargs: dict[str, Any]
    resid: int | str  # the position or keyword of the residual
    cache: list[int | str]  # the positions and keywords that held the cache


class LayerCalls:
    """The arguments a model gives each of its layers on one forward pass, to replay.

    :meth:`recording` is open around a bridge forward pass handed ``cache``; afterwards
    :meth:`run` runs layers ``start..L-1`` of ``layers`` on a residual with another cache of
    the same kind in its place.
    """

    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.ok = False

    def recording(self, model: Bridge, cache: Any = None) -> Any:
        """A context manager: while open, each block's Hugging Face layer records its call;
        on exit :attr:`ok` says whether every layer was called once with its residual first
        and ``cache`` handed to it. With ``cache=None`` any cache the model made itself is
        replaced on replay (by ``None``: no keys and values kept)."""
        return _Recording(self, model, cache)

    def run(self, layers: Sequence[nn.Module], start: int, resid: Tensor, cache: Any) -> Tensor:
        """``resid`` (``[n, t, d_model]``) through ``layers[start:]`` with the recorded
        arguments, ``cache`` in place of the recorded one: the last layer's output."""
        x = resid
        for index in range(start, len(layers)):
            x = self.step(layers, index, x, cache)
        return x

    def step(self, layers: Sequence[nn.Module], index: int, x: Tensor, cache: Any) -> Tensor:
        """``x`` through ``layers[index]`` alone with its recorded arguments."""
        call = self.calls[index]
        args, kwargs = list(call.args), dict(call.kwargs)
        for slot in (call.resid, *call.cache):
            value = x if slot == call.resid else cache
            if isinstance(slot, int):
                args[slot] = value
            else:
                kwargs[slot] = value
        out = layers[index](*args, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Recording:
    def __init__(self, owner: LayerCalls, model: Bridge, cache: Any) -> None:
        self.owner, self.model, self.cache = owner, model, cache
        self.seen: list[tuple[int, tuple[Any, ...], dict[str, Any]]] = []
        self.handles: list[Any] = []

    def __enter__(self) -> LayerCalls:
        for index, block in enumerate(self.model.blocks):

            def record(_m: Any, args: tuple, kwargs: dict, index: int = index) -> None:
                self.seen.append((index, args, dict(kwargs)))

            layer = block.original_component
            self.handles.append(layer.register_forward_pre_hook(record, with_kwargs=True))
        return self.owner

    def _cache(self, value: Any) -> bool:
        """Whether ``value`` is the cache handed over (or, with none, any KV cache the model
        made itself: a replay without a cache must not keep it)."""
        if self.cache is not None:
            return value is self.cache
        return hasattr(value, "update") and hasattr(value, "get_seq_length")

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        n_layers = len(self.model.blocks)
        calls = []
        for want, (index, args, kwargs) in enumerate(self.seen):
            if index != want:
                break
            cache: list[int | str] = [i for i, a in enumerate(args) if self._cache(a)]
            cache += [k for k, v in kwargs.items() if self._cache(v)]
            if args and isinstance(args[0], Tensor):
                resid: int | str = 0
            elif isinstance(kwargs.get("hidden_states"), Tensor):
                resid = "hidden_states"
            else:
                break
            if self.cache is not None and not cache:
                break
            call = _Call(list(args), kwargs, resid, cache)
            for slot in (resid, *cache):  # not kept: replaced on every replay
                if isinstance(slot, int):
                    call.args[slot] = None
                else:
                    call.kwargs[slot] = None
            calls.append(call)
        self.owner.calls = calls
        self.owner.ok = exc[0] is None and len(calls) == n_layers == len(self.seen)


__all__ = ["LayerCalls", "pure_layer", "pure_layers"]
