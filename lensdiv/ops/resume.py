"""Resume a forward pass from a cached residual, so an intervention at block ``s`` pays only for
blocks ``s..L-1``.

TransformerLens 4's ``forward(start_at_layer=k)`` still executes blocks ``0..k-1`` and throws their
output away. :class:`Resumer` instead replaces, for the duration of one call, the wrapped Hugging
Face (or TL-native) layer inside each block bridge ``0..k-1`` by a stub that returns the given
residual. Everything around the blocks still runs as the model's own code: embeddings, rotary
tables, causal and padding masks, position ids — so positions and masks are right for every
architecture family without lensdiv reimplementing any of them. The hooks of later blocks fire as
usual; hooks of the stubbed blocks see the stub's output and should not be used.

A pass whose hooks all sit between blocks (a block's residual input or output, the final
residual) needs nothing inside a block, so it runs the model's Hugging Face layers without the
bridge's components (:mod:`lensdiv.ops.purelayers`: the same weights, the arguments the model
gives each layer recorded once per batch of tokens by a forward with every block stubbed), each
hook applied between them (:attr:`Resumer.pure`; ``massive`` and ``skip`` on SmolLM2, 512
tokens: 96 s against 121 s). A float64 model keeps the bridge (several families' own attention
takes its softmax in float32), as does a pass with a hook inside a block.

On first use :class:`Resumer` checks itself on the real batch: resuming at ``L // 2`` from the
clean residual must reproduce the clean logits, through the bridge and then through the pure
layers (a failure of the latter is said once and the bridge kept). Where the bridge's does not
(a family whose layers do not run as a plain sequence), it falls back to an exact but slower full re-run that overwrites the
residual with a hook (``mode == "rerun"``); the mode is recorded in results. The decision is a
property of the model, so it is kept per model (and its readout, which is rebuilt when the
weights change) and the next run on the same model does not pay the check again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager, suppress
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import HookError
from lensdiv.ops.capture import halt_keeping, stop_hook_name, stopping
from lensdiv.ops.kvcache import cache_kwargs, passing_cache, warn_fallback
from lensdiv.ops.purelayers import LayerCalls, pure_layers
from lensdiv.ops.readout import final_readout

# The plugin API of this module (see :mod:`lensdiv`): analyzers with extra forward passes use it.
__all__ = ["Resumer", "resumer_for"]

Hook = tuple[str, Callable[..., Any]]

# First-use decisions per model and settings: the readout they were taken with (a new one after
# the weights change) and (mode, reason, tuple output, readout error).
_DECISIONS: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[Any, tuple[Any, ...]]]] = (
    weakref.WeakKeyDictionary()
)


class Resumer:
    """Run ``model`` from block ``start`` given ``h_start``, reusing nothing but the residual.

    Args:
        model: A ``TransformerBridge`` in eval mode.
        check: Verify the fast path against a full pass on first use (recommended).
        tolerance: Largest relative logit difference the check accepts.
        fast: ``False`` always re-runs every block (the exact reference; for checks and
            benchmarks).
    """

    def __init__(
        self, model: Bridge, *, check: bool = True, tolerance: float = 1e-4, fast: bool = True
    ) -> None:
        self.model = model
        self.fast = fast
        self.n_layers = int(model.cfg.n_layers)
        self.check = check
        self.tolerance = tolerance
        self.mode: str | None = None  # "resume" or "rerun", decided on first use
        self.reason = ""
        self._tuple_output: bool | None = None
        self.readout_error: float | None = None  # the readout against the model's logits
        self.blocks_run = 0  # block executions, for cost accounting
        #: The model's Hugging Face layers run alone (:mod:`lensdiv.ops.purelayers`) when every
        #: hook of a pass sits between blocks: decided with the mode (``None``: the bridge).
        self.pure: list[Any] | None = None
        self._calls: tuple[Tensor, LayerCalls] | None = None  # the last tokens' layer calls

    # -- public --------------------------------------------------------------------------------
    def run(
        self,
        tokens: Int[Tensor, "batch pos"],
        start: int,
        resid: Float[Tensor, "batch pos d_model"],
        fwd_hooks: Sequence[Hook] = (),
        *,
        logits: bool = True,
        grad: bool = False,
    ) -> Float[Tensor, "batch out_pos d_vocab"] | None:
        """Forward ``tokens`` with ``h_start := resid`` (``0 ≤ start ≤ L``; ``L`` = final residual).

        Blocks ``start..L-1`` execute with ``fwd_hooks``; blocks before ``start`` do not run.
        The pass stops at the final norm: with ``logits=False`` it returns ``None`` (read what
        you need by hooks on ``blocks.{l}.hook_resid_post``); with ``logits=True`` the final
        residual is read out by :meth:`readout` (the precision policy: float32 logits whatever
        the model's dtype). With ``grad=True`` autograd records the pass (gradients flow back
        to ``resid``). A hook on ``unembed.hook_in`` may keep only some positions (it is
        applied to the final residual, before the readout's final norm, which acts per
        position); the logits then have only those.
        """
        if not 0 <= start <= self.n_layers:
            raise ValueError(f"start {start} outside 0..{self.n_layers}")
        if self.mode is None:
            self._decide(tokens)
        self.blocks_run += (self.n_layers - start) * tokens.shape[0]
        if self.mode == "resume" and self.pure is not None and not grad:
            between = _between_blocks(fwd_hooks, start, self.n_layers)
            if between is not None and stop_hook_name(self.model.hook_dict) == "ln_final.hook_in":
                return self._run_pure(tokens, start, resid, between, logits)
        if self.mode == "resume" and start > 0:
            with stubbed_blocks(self.model, start, resid, tuple_output=self._tuple_output):
                return self._forward(tokens, fwd_hooks, logits, grad)
        site = "blocks.0.hook_resid_pre" if start == 0 else f"blocks.{start - 1}.hook_resid_post"
        self.blocks_run += start * tokens.shape[0]

        def inject(tensor: Tensor, *, hook: Any) -> Tensor:
            return resid.to(tensor)  # the hooked module's device and dtype

        return self._forward(tokens, [(site, inject), *fwd_hooks], logits, grad)

    def prepare(self, tokens: Int[Tensor, "batch pos"]) -> None:
        """Decide the mode (and check the readout) on ``tokens`` now rather than on first run."""
        if self.mode is None:
            self._decide(tokens)

    def readout(self, resid: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_vocab"]:
        """Logits of final residual vectors in the readout dtype (float32; float64 for a float64
        model): :func:`lensdiv.ops.readout.final_readout`, on ``resid``'s device.

        Raises:
            HookError: The first-use check found that this readout does not reproduce the
                model's own logits.
        """
        if self.readout_error is not None and self.readout_error > _readout_tolerance(resid.dtype):
            raise HookError(
                f"reading the final residual through the final norm and unembedding does not "
                f"give {getattr(self.model.cfg, 'model_name', 'the model')}'s logits "
                f"({self.readout_error:.2g} relative)",
                hint="this analyzer does not support this architecture",
            )
        with torch.no_grad():
            return final_readout(self.model).logits(resid).to(resid.device)

    # -- internals -----------------------------------------------------------------------------
    def _forward(
        self, tokens: Tensor, fwd_hooks: Sequence[Hook], logits: bool, grad: bool = False
    ) -> Float[Tensor, "batch out_pos d_vocab"] | None:
        hooks = list(fwd_hooks)
        stop = stop_hook_name(self.model.hook_dict)
        if logits and stop != "ln_final.hook_in":  # no final residual to read: the model's own
            stop = None
        select = [fn for name, fn in hooks if name == "unembed.hook_in"] if stop else []
        hooks = [(name, fn) for name, fn in hooks if not (select and name == "unembed.hook_in")]
        final: dict[str, Tensor] = {}
        if stop is not None:
            hooks.append((stop, halt_keeping(final)))
        out = None
        with torch.set_grad_enabled(grad), self.model.hooks(fwd_hooks=hooks), stopping():
            out = self.model(tokens)
        if not logits:
            return None
        if stop is None:
            assert out is not None
            return out.to(final_readout(self.model).dtype)
        h = final["h"]
        for fn in select:
            h = fn(h, hook=None)
        with torch.set_grad_enabled(grad):
            flat = final_readout(self.model).logits(h.reshape(-1, h.shape[-1]))
        return flat.to(h.device).view(*h.shape[:-1], -1)

    def _run_pure(
        self,
        tokens: Tensor,
        start: int,
        resid: Tensor,
        between: dict[str, list[Callable[..., Any]]],
        logits: bool,
    ) -> Tensor | None:
        """:meth:`run` through the pure layers: each hook applied between them, the final
        residual read out as :meth:`_forward` reads it."""
        assert self.pure is not None
        calls = self._layer_calls(tokens, resid)

        def hooked(name: str, x: Tensor) -> Tensor:
            for fn in between.get(name, ()):
                out = fn(x, hook=_Site(name))
                x = x if out is None else out
            return x

        x = resid
        with torch.no_grad():
            for k in range(start, self.n_layers):
                x = hooked(f"blocks.{k}.hook_resid_pre", x)
                x = calls.step(self.pure, k, x, None)
                x = hooked(f"blocks.{k}.hook_resid_post", x)
            if not logits:
                return None
            h = hooked("unembed.hook_in", x)
            flat = final_readout(self.model).logits(h.reshape(-1, h.shape[-1]))
        return flat.to(h.device).view(*h.shape[:-1], -1)

    def _layer_calls(self, tokens: Tensor, resid: Tensor) -> LayerCalls:
        """The arguments the model gives each layer on ``tokens`` (recorded by a forward of
        the bridge with every block stubbed to return ``resid``, stopped before the final
        norm; kept for the next call on the same tokens)."""
        if self._calls is not None and torch.equal(self._calls[0], tokens):
            return self._calls[1]
        calls = recorded_calls(self.model, tokens, resid, tuple_output=self._tuple_output)
        self._calls = (tokens.clone(), calls)
        return calls

    def _decide(self, tokens: Tensor) -> None:
        """Probe the block output structure and check the fast path against a full pass, once
        per model, readout and settings."""
        readout, settings = final_readout(self.model), (self.fast, self.check, self.tolerance)
        known = _DECISIONS.setdefault(self.model, {})
        if settings in known and known[settings][0] is readout:
            decided = known[settings][1]
            self.mode, self.reason, self._tuple_output, self.readout_error, self.pure = decided
            return
        self._probe(tokens)
        known[settings] = (
            readout,
            (self.mode, self.reason, self._tuple_output, self.readout_error, self.pure),
        )

    def _probe(self, tokens: Tensor) -> None:
        self.mode = "rerun"
        if not self.fast:
            self.reason = "fast resume disabled"
            return
        blocks = getattr(self.model, "blocks", None)
        if blocks is None or len(blocks) != self.n_layers:
            self.reason = "the model has no standard block stack"
            return
        layer = getattr(blocks[0], "original_component", None)
        if layer is None:
            self.reason = "block bridges wrap no original layer"
            return
        probe = tokens[:2, : min(tokens.shape[1], 32)]
        seen: dict[str, Any] = {}
        handle = layer.register_forward_hook(lambda _m, _a, out: seen.setdefault("out", out))
        middle = self.n_layers // 2
        store: dict[str, Tensor] = {}

        def keep(key: str) -> Any:
            def hook(tensor: Tensor, *, hook: Any) -> Tensor:
                store[key] = tensor.detach().clone()
                return tensor

            return hook

        sites = [
            (f"blocks.{middle}.hook_resid_pre", keep("h")),
            (f"blocks.{self.n_layers - 1}.hook_resid_post", keep("final")),
        ]
        try:
            with torch.no_grad(), self.model.hooks(fwd_hooks=sites):
                model_logits = self.model(probe)
        finally:
            handle.remove()
        self._check_readout(store["final"], model_logits)
        final = store["final"]
        with torch.no_grad():
            flat = final_readout(self.model).logits(final.reshape(-1, final.shape[-1]))
        clean = flat.to(final.device).view(*final.shape[:-1], -1)
        out = seen.get("out")
        if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
            self._tuple_output = True
        elif isinstance(out, Tensor):
            self._tuple_output = False
        else:
            self.reason = f"unexpected block output {type(out).__name__}"
            return
        if not self.check or middle == 0:
            self.mode = "resume"
            return
        self.mode = "resume"
        try:
            resumed = self.run(probe, middle, store["h"])
        except Exception as err:  # any failure of the fast path: use the exact slow one
            self.mode, self.reason = "rerun", f"resume failed: {type(err).__name__}"
            return
        assert resumed is not None
        scale = clean.abs().max().clamp_min(1e-6)
        error = float(((resumed - clean).abs().max() / scale).item())
        if error > self.tolerance:
            self.mode = "rerun"
            self.reason = f"resumed logits differ from a full pass ({error:.2g} relative)"
        else:
            self._probe_pure(probe, middle, store["h"], clean, scale)
        self.blocks_run = 0

    def _probe_pure(
        self, probe: Tensor, middle: int, h: Tensor, clean: Tensor, scale: Tensor
    ) -> None:
        """Take the pure layers if resuming through them reproduces the full pass too; not
        for a float64 model, whose exactness several families' own attention would lose (its
        softmax in float32 whatever the dtype: NeoX, Llama)."""
        self.pure = pure_layers(self.model) if h.dtype != torch.float64 else None
        if self.pure is None:
            return
        try:
            resumed = self.run(probe, middle, h)
            assert resumed is not None
            error = float(((resumed - clean).abs().max() / scale).item())
            # another computation of the same blocks: rounding of the model's own dtype
            if error > max(self.tolerance, _readout_tolerance(h.dtype)):
                raise ValueError(f"resumed logits differ from a full pass ({error:.2g} relative)")
        except Exception as err:  # the bridge's forward, which passed, then runs the blocks
            self.pure, self._calls = None, None
            warn_fallback(
                "resuming through Hugging Face's own layers",
                f"{type(err).__name__}: {err}",
                "each resumed pass runs through the bridge's components",
            )

    def _check_readout(self, final: Tensor, clean: Tensor) -> None:
        """Measure how far the readout of the final residual is from the model's own logits."""
        with torch.no_grad():
            ours = final_readout(self.model).logits(final.reshape(-1, final.shape[-1]))
        want = clean.reshape(-1, clean.shape[-1]).to(device=ours.device, dtype=ours.dtype)
        if ours.shape != want.shape:
            self.readout_error = float("inf")
            return
        scale = want.abs().max().clamp_min(1e-6)
        self.readout_error = float((ours - want).abs().max() / scale)


class _Site:
    """What a hook run between the pure layers is told of its site (its ``name``)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _between_blocks(
    fwd_hooks: Sequence[Hook], start: int, n_layers: int
) -> dict[str, list[Callable[..., Any]]] | None:
    """The hooks by site if every one sits between blocks ``start..L-1`` (a block's residual
    input or output, or the final residual), else ``None``."""
    out: dict[str, list[Callable[..., Any]]] = {}
    for name, fn in fwd_hooks:
        parts = name.split(".")
        between = name == "unembed.hook_in" or (
            len(parts) == 3
            and parts[0] == "blocks"
            and parts[1].isdigit()
            and start <= int(parts[1]) < n_layers
            and parts[2] in ("hook_resid_pre", "hook_resid_post")
        )
        if not between:
            return None
        out.setdefault(name, []).append(fn)
    return out


def _readout_tolerance(dtype: torch.dtype) -> float:
    """How far the float32 readout may be from the model's own logits: a model that computes in
    half precision rounds its logits (and its final norm) to 8 or 11 bits."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 5e-2


def resumer_for(step: Step, *, fast: bool = True) -> Resumer:
    """The run's :class:`Resumer` for ``step.model`` (built, and checked, once per run)."""
    resumer: Resumer = step.cached(("resumer", fast), lambda: Resumer(step.model, fast=fast))
    return resumer


def recorded_calls(
    model: Bridge,
    tokens: Int[Tensor, "batch pos"],
    resid: Tensor,
    *,
    tuple_output: bool | None,
    cache: Any = None,
) -> LayerCalls:
    """The arguments ``model`` gives each of its Hugging Face layers on ``tokens`` (to replay
    through :func:`~lensdiv.ops.purelayers.pure_layers`), recorded by a forward of the bridge
    with every block stubbed to return ``resid`` (no attention runs, nothing is cached) and
    stopped after the last block; ``cache`` handed to that forward (and left out of the
    recorded arguments: each replay gives its own).

    Raises:
        HookError: A layer's call could not be recorded.
    """
    calls = LayerCalls()
    L = len(model.blocks)
    stop = stop_hook_name(model.hook_dict) or f"blocks.{L - 1}.hook_resid_post"
    with (
        torch.no_grad(),
        model.hooks(fwd_hooks=[(stop, halt_keeping({}))]),
        stubbed_blocks(model, L, resid, tuple_output=tuple_output),
        passing_cache(model),
        calls.recording(model, cache),
        stopping(),
    ):
        model(tokens, **(cache_kwargs(model, cache) if cache is not None else {}))
    if not calls.ok:
        raise HookError("the layers' arguments could not be recorded")
    return calls


@contextmanager
def stubbed_blocks(model: Bridge, start: int, resid: Tensor, *, tuple_output: bool | None) -> Any:
    """Blocks ``0..start-1`` of ``model`` return ``resid`` without computing anything (a pass
    resumed at block ``start``; ``tuple_output``: the blocks return a tuple)."""
    value: Any = (resid,) if tuple_output else resid

    def stub(*args: Any, **kwargs: Any) -> Any:
        return value

    layers = [model.blocks[j].original_component for j in range(start)]
    try:
        for layer in layers:
            layer.forward = stub
        yield
    finally:
        for layer in layers:
            with suppress(AttributeError):
                del layer.forward
