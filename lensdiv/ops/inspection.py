"""The patchscope's inspection prompt on a model, computed once, and the continuations that read
a state through it (docs/science.md P1; the lens is :class:`~lensdiv.ops.blocklens.PatchscopeLens`).

An :class:`Inspection` holds the prompt's clean states and its prefix's keys and values at every
layer (Hugging Face's cache), and runs each patched state as a continuation from its target
block: through the model's Hugging Face layers with the prefix held once for every row
(:mod:`~lensdiv.ops.purelayers`, ``kvcache.shared_prefix_attention``), else with the prefix
copied per row into buffers written in place, else through the bridge's forward; each way checked
on first use by the identity (the prompt's own state patched back gives its output), the whole
prompt re-run per state where none passes (``mode == "rerun"``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor, nn

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import input_device
from lensdiv.core.errors import LensError
from lensdiv.ops.capture import StopPass, capture, stop_hook_name, stopping
from lensdiv.ops.kvcache import (
    SHARED_PREFIX,
    SHARED_PREFIX_FLOAT32,
    cache_kwargs,
    passing_cache,
    prefixed_layer,
    shared_layer,
    shared_prefix,
    warn_fallback,
)
from lensdiv.ops.purelayers import LayerCalls, pure_layers
from lensdiv.ops.readout import final_readout
from lensdiv.ops.resume import Resumer, recorded_calls, stubbed_blocks

# Elements one continuation call may hold off a GPU: the prefix's keys and values for its rows
# where they are copied per row (kept for the next call) and its activations (512 MiB in fp32;
# fewer, larger calls spare the fixed cost of a call).
_CALL_ELEMENTS = 1 << 27
# The same on a GPU, at most (2 GiB in bfloat16: about 150 rows of a 70B model's 80 layers).
_GPU_CALL_ELEMENTS = 1 << 30


def _call_elements(device: torch.device, itemsize: int) -> int:
    """Elements one continuation call may hold: :data:`_CALL_ELEMENTS`, or on a GPU a quarter
    of its free memory up to :data:`_GPU_CALL_ELEMENTS` (the prefix's buffers, which the
    inspection keeps, for a few hundred rows of a large model)."""
    if device.type != "cuda":
        return _CALL_ELEMENTS
    free, _ = torch.cuda.mem_get_info(device)
    return max(_CALL_ELEMENTS, min(free // 4 // itemsize, _GPU_CALL_ELEMENTS))


# Rows one call of a sweep (:meth:`Inspection.run_each`) holds at most on a CPU. Fewer rows
# read a block's weights for too little work (16 rows of a 12-layer d768 GPT-2: the 78 block
# calls of one start at a time took 2.2x their time with the weights in cache); more gain
# nothing on a 2-core CPU (the continuations of 512 rows per start in sweeps of 1024-6144 rows
# took 0.9-1.3x their time one start at a time).
SWEEP_ROWS = 512
# On a GPU a small call's time is its weights' reads: a sweep holds as many rows as a call's
# memory allows (:func:`_call_elements`), up to this.
_GPU_SWEEP_ROWS = 1 << 14


def sweep_rows(device: torch.device) -> int:
    """Rows one call of a sweep holds at most on ``device``."""
    return SWEEP_ROWS if device.type == "cpu" else _GPU_SWEEP_ROWS


# Relative error of the fast path's identity check (float rounding of a different schedule).
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_TOLERANCE_LOW = 5e-2


# -- the inspection prompt, computed once ----------------------------------------------------------

# Per model: (readout, inspection) per (prompt, position); a new readout (the weights changed)
# computes the prompt again.
_INSPECTIONS: weakref.WeakKeyDictionary[Any, dict[tuple[str, int], tuple[Any, Inspection]]] = (
    weakref.WeakKeyDictionary()
)


def inspection(model: Bridge, prompt: str, position: int) -> Inspection:
    """The model's :class:`Inspection` of ``prompt`` patched at ``position`` (computed once per
    model, prompt and position, and again when the weights change)."""
    readout = final_readout(model)
    known = _INSPECTIONS.setdefault(model, {})
    cached = known.get((prompt, position))
    if cached is None or cached[0] is not readout:
        cached = known[(prompt, position)] = (readout, Inspection(model, prompt, position))
    return cached[1]


def prompt_tokens(model: Bridge, prompt: str) -> Tensor:
    """The inspection prompt's tokens ``[1, m]``, BOS first whatever the bridge's default
    (NeoX's is off): as lensdiv's data rows and the prompt view have it, so a source prompt and
    the same inspection prompt are one sequence."""
    tokens: Tensor = model.to_tokens(prompt, prepend_bos=True, truncate=False, move_to_device=False)
    return tokens


class Inspection:
    """An inspection prompt on a model: its clean states from the patch position on, and its
    prefix's keys and values at every layer (Hugging Face's cache), computed once.

    Args:
        model: A ``TransformerBridge`` in eval mode.
        prompt: The inspection prompt (tokenised as lensdiv's data rows are: the tokenizer's BOS
            first, whatever the bridge's ``default_prepend_bos``).
        position: The patched position (negative from the end).
        fast: ``False``: always run the whole prompt per state (the exact reference).
    """

    def __init__(self, model: Bridge, prompt: str, position: int, *, fast: bool = True) -> None:
        self.model = model
        self.n_layers = L = int(model.cfg.n_layers)
        # where the embedding computes (a split model's weights may sit on the meta device)
        tokens = prompt_tokens(model, prompt).to(input_device(model))
        m = int(tokens.shape[1])
        if not -m <= position < m:
            raise LensError(
                f"the patchscope's position {position} is outside its inspection prompt's "
                f"{m} tokens"
            )
        self.tokens, self.position = tokens, position % m
        info = ModelInfo.from_model(model)
        names = [info.resid(layer) for layer in range(L + 1)]
        with torch.no_grad():
            _, clean = capture(model, tokens, names, need_logits=False)
        #: ``h_l`` of the prompt at every position, per residual index (``[m, d_model]``).
        self.clean = [clean[name][0] for name in names]
        self.mode, self.reason = "rerun", "fast path disabled"
        self.prefix: list[tuple[Tensor, Tensor]] = []
        self._buffers: dict[int, tuple[Tensor, Tensor]] = {}
        self._tuple: bool | None = None
        #: The pure Hugging Face layers the continuations run (None: the bridge's forward).
        self._pure: list[nn.Module] | None = None
        self._shared = False  # the pure layers' attention reads one copy of the prefix
        self._shared_held: Any = None  # its cache, made on first use
        self._calls: dict[int, LayerCalls] = {}  # the layers' recorded arguments, per rows
        #: What runs a continuation's layers: ``"shared prefix"`` (Hugging Face's layers, the
        #: prefix's keys and values held once for every row), ``"hugging face"`` (its layers,
        #: the prefix copied per row) or ``"bridge"`` (the bridge's forward); and why not the
        #: first.
        self.layers, self.layers_reason = "bridge", ""
        if fast:
            self._decide()

    @property
    def tokens_list(self) -> list[int]:
        """The inspection prompt's token ids."""
        return [int(t) for t in self.tokens[0]]

    def describe(self) -> dict[str, Any]:
        """The prompt's tokens, the patch position and how continuations run."""
        return {
            "tokens": self.tokens_list,
            "patched": self.position,
            "mode": self.mode,
            **({"reason": self.reason} if self.mode == "rerun" else {"layers": self.layers}),
        }

    # -- running -------------------------------------------------------------------------------
    def run(self, start: int, h: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """The prompt's final residual at its last position with ``h`` as block ``start``'s
        input at the patch position, per row (in the model's dtype)."""
        L, j, m = self.n_layers, self.position, self.clean[0].shape[0]
        if start >= L:  # no block runs: the patch is the output (or does not reach the end)
            last = self.clean[L][-1]
            return h.to(last) if j == m - 1 else last.expand(h.shape[0], -1).clone()
        parts = _equal_parts(h, self._parts(h, L - start))
        if self.mode == "cache":
            out = self._continue(start, parts)
        else:
            out = [self._rerun(start, part) for part in parts]
        return out[0] if len(out) == 1 else torch.cat(out)

    def run_each(
        self, by_start: dict[int, Float[Tensor, "n d_model"]]
    ) -> dict[int, Float[Tensor, "n d_model"]]:
        """:meth:`run` of each ``start``'s rows. Where the continuations hold the prefix once
        (``layers == "shared prefix"``), starts whose rows are few run in *sweeps*: block
        ``k`` runs once on the rows of every start ``≤ k`` of the sweep, each start's rows
        joining at their own block, so a block's weights are read once for all of them
        rather than once per start (:func:`sweep_rows` rows a call at most). The same
        layers, arguments and prefix as :meth:`run`: only the rows' grouping differs."""
        out: dict[int, Tensor] = {}
        swept: list[int] = []
        limit = self._sweep_limit(next(iter(by_start.values()))) if by_start else 0
        for start in sorted(by_start):
            h = by_start[start]
            if start >= self.n_layers or h.shape[0] * 2 > limit:
                out[start] = self.run(start, h)
            else:
                swept.append(start)
        group: list[int] = []
        for start in swept:  # consecutive starts while their rows fit in one call
            if (
                group
                and sum(by_start[s].shape[0] for s in group) + by_start[start].shape[0] > limit
            ):
                out.update(self._sweep(group, by_start))
                group = []
            group.append(start)
        if group:
            out.update(self._sweep(group, by_start))
        return out

    def _sweep_limit(self, h: Tensor) -> int:
        """Rows one call of a sweep may hold: :func:`sweep_rows`, within the memory of a call
        (:func:`_call_elements`); 0 where the continuations do not hold the prefix once."""
        if self.mode != "cache" or self._pure is None or not self._shared or not self.prefix:
            return 0
        budget = _call_elements(h.device, h.element_size()) // self._per_row(h)
        return min(sweep_rows(h.device), budget)

    def _sweep(self, starts: list[int], by_start: dict[int, Tensor]) -> dict[int, Tensor]:
        """One sweep from ``starts[0]``: each start's rows join at their block."""
        assert self._pure is not None
        x: Tensor | None = None
        cache = self._shared_cache()
        with torch.no_grad(), shared_prefix(cache):
            for k in range(starts[0], self.n_layers):
                if k in starts:
                    resid = self._resid(k, by_start[k])
                    x = resid if x is None else torch.cat([x, resid])
                assert x is not None
                x = self._recorded(x.shape[0]).step(self._pure, k, x, cache)
        assert x is not None
        final, out, lo = x[:, -1], {}, 0
        for start in starts:
            n = by_start[start].shape[0]
            out[start], lo = final[lo : lo + n], lo + n
        return out

    def _per_row(self, h: Tensor) -> int:
        """Elements a continuation holds per row: the prefix's buffers where they are copied
        per row (kept), and one call's activations (its MLP's the widest)."""
        j, m = self.position, self.clean[0].shape[0]
        kv = sum(keys.shape[1] * keys.shape[3] for keys, _ in self.prefix)
        return (0 if self._shared else 2 * m * kv) + (m - j) * h.shape[-1] * 8

    def _parts(self, h: Tensor, blocks: int) -> int:
        """How many equal parts ``h``'s rows run in, for :func:`_call_elements`."""
        m = self.clean[0].shape[0]
        rerun = m * 3 * h.shape[-1] * (blocks + 1)  # the whole prompt's activations per row
        per_row = rerun if self.mode == "rerun" else self._per_row(h)
        return -(-h.shape[0] // max(1, _call_elements(h.device, h.element_size()) // per_row))

    def _resid(self, start: int, h: Tensor) -> Tensor:
        """The continuation's input at block ``start``: ``h`` at the patch position, the
        prompt's clean states after it."""
        j, at = self.position, self.clean[start]
        n = h.shape[0]
        return torch.cat([h.to(at)[:, None], at[None, j + 1 :].expand(n, -1, -1)], dim=1)

    def _recorded(self, n: int) -> LayerCalls:
        """The layers' arguments for ``n`` rows, recorded on first use by a forward of the
        bridge with every block stubbed (no attention runs, nothing is cached)."""
        calls = self._calls.get(n)
        if calls is None:
            j = self.position
            cache = self._shared_cache() if self._shared else self._cache(n)
            resid = self.clean[0][j:][None].expand(n, -1, -1)
            tokens = self.tokens[:, j:].expand(n, -1)
            calls = recorded_calls(self.model, tokens, resid, tuple_output=self._tuple, cache=cache)
            self._calls[n] = calls
        return calls

    def generate(
        self, start: int, h: Float[Tensor, " d_model"], n_tokens: int
    ) -> tuple[list[int], list[float]]:
        """What the model says about ``h``: the greedy continuation of the inspection prompt
        with ``h`` as block ``start``'s input at the patch position (``start == L``: the
        output there), ``n_tokens`` tokens and the probability of each (float32 softmax).
        Each token is one forward pass of the prompt and the tokens so far with the patch
        hooked in (exact for every model; a short answer for a person, not a statistic)."""
        if n_tokens < 1:
            raise LensError(f"a continuation has at least one token, not {n_tokens}")
        n_ctx = int(getattr(self.model.cfg, "n_ctx", 0) or 0)
        if n_ctx and self.tokens.shape[1] + n_tokens > n_ctx:
            raise LensError(
                f"the inspection prompt's {self.tokens.shape[1]} tokens and {n_tokens} more "
                f"exceed the model's context of {n_ctx}"
            )
        name = ModelInfo.from_model(self.model).resid(start)
        j = self.position

        def patch(tensor: Tensor, *, hook: Any) -> Tensor:
            tensor[:, j] = h.to(tensor)
            return tensor

        tokens, said, probs = self.tokens, [], []
        with torch.no_grad(), self.model.hooks(fwd_hooks=[(name, patch)]):
            for _ in range(n_tokens):
                logits = self.model(tokens, return_type="logits")[0, -1].float()
                p = torch.softmax(logits, -1)
                token = int(p.argmax())
                said.append(token)
                probs.append(float(p[token]))
                tokens = torch.cat([tokens, tokens.new_tensor([[token]])], dim=1)
        return said, probs

    def _rerun(self, start: int, h: Tensor) -> Tensor:
        """The whole prompt per row, resumed at ``start`` from its clean states."""
        n, j, L = h.shape[0], self.position, self.n_layers
        at = self.clean[start]
        resid = at.expand(n, -1, -1).clone()
        resid[:, j] = h.to(resid)
        kept: dict[str, Tensor] = {}

        def keep(tensor: Tensor, *, hook: Any) -> Tensor:
            kept["h"] = tensor[:, -1].detach()
            return tensor

        with torch.no_grad():
            Resumer(self.model).run(
                self.tokens.expand(n, -1),
                start,
                resid,
                [(f"blocks.{L - 1}.hook_resid_post", keep)],
                logits=False,
            )
        return kept["h"]

    def _continue(self, start: int, parts: Sequence[Tensor], *, pure: bool = True) -> list[Tensor]:
        """The tokens from the patch position on, against the prefix's cached keys and values,
        from block ``start``, per part of the rows: through the pure Hugging Face layers
        (:mod:`~lensdiv.ops.purelayers`) with the arguments the model gave them on a call of
        the same number of rows, else one forward of the bridge (the blocks before ``start``
        returning the patched residual), which records those arguments."""
        final: list[Tensor] = []
        for h in parts:
            n = h.shape[0]
            resid = self._resid(start, h)
            use = pure and self._pure is not None and bool(self.prefix)
            calls = self._recorded(n) if use else None
            if calls is not None and self._pure is not None:  # every answer from one path
                cache = self._shared_cache() if self._shared else self._cache(n)
                with torch.no_grad(), shared_prefix(cache):
                    final.append(calls.run(self._pure, start, resid, cache)[:, -1])
            else:
                cache = self._cache(n) if self.prefix else None
                final.append(self._bridged(start, resid, cache))
        return final

    def _bridged(self, start: int, resid: Tensor, cache: Any) -> Tensor:
        """One continuation through the bridge's forward."""
        j, n = self.position, resid.shape[0]
        final: list[Tensor] = []

        def halt(tensor: Tensor, *, hook: Any) -> Tensor:
            final.append(tensor[:, -1])
            raise StopPass

        def inject(tensor: Tensor, *, hook: Any) -> Tensor:
            return resid.to(tensor)

        stop = stop_hook_name(self.model.hook_dict)
        hooks = [(stop or f"blocks.{self.n_layers - 1}.hook_resid_post", halt)]
        if start == 0:
            hooks.append(("blocks.0.hook_resid_pre", inject))
        kwargs = cache_kwargs(self.model, cache) if cache is not None else {}
        with (
            torch.no_grad(),
            self.model.hooks(fwd_hooks=hooks),
            stubbed_blocks(self.model, start, resid, tuple_output=self._tuple),
            passing_cache(self.model),
            stopping(),
        ):
            self.model(self.tokens[:, j:].expand(n, -1), **kwargs)
        return final[0]

    def _cache(self, n: int) -> Any:
        """A fresh cache of the prefix for ``n`` rows, filled at one row by the cache's own
        update (so a sliding-window layer keeps its window and count). A full-attention layer
        then reads and writes :meth:`_buffer` in place (:func:`~lensdiv.ops.kvcache.prefixed_layer`): the prefix copied
        there once, each continuation writing only its own tokens; a sliding layer has its keys
        and values expanded to ``n`` rows and appends to them (one copy of the prefix per row
        and call, as Hugging Face's cache does)."""
        from transformers import DynamicCache  # only models with a KV cache get here
        from transformers.cache_utils import DynamicLayer

        config = getattr(getattr(self.model, "original_model", None), "config", None)
        cache = DynamicCache(config=config)
        for layer, (keys, values) in enumerate(self.prefix):
            cache.update(keys, values, layer)
        for index, entry in enumerate(cache.layers):
            plain = getattr(type(entry), "update", None) is DynamicLayer.update
            if getattr(entry, "is_sliding", False) or not plain:
                held: Any = entry  # a layer of keys and values (filled by the update above)
                held.keys, held.values = (t.expand(n, -1, -1, -1) for t in (held.keys, held.values))
            else:
                cache.layers[index] = prefixed_layer()(*self._buffer(index, n), self.position)
        return cache

    def _shared_cache(self) -> Any:
        """The cache whose layers hold the prefix once, for any number of rows
        (:func:`~lensdiv.ops.kvcache.shared_layer`): made once, its count of keys reset."""
        if self._shared_held is None:
            from transformers import DynamicCache  # only models with a KV cache get here

            config = getattr(getattr(self.model, "original_model", None), "config", None)
            self._shared_held = DynamicCache(config=config)
            self._shared_held.layers = [shared_layer()(*kv) for kv in self.prefix]
        for layer in self._shared_held.layers:
            layer.past = self.position
        return self._shared_held

    def _buffer(self, layer: int, n: int) -> tuple[Tensor, Tensor]:
        """Keys and values of ``layer`` for at least ``n`` rows over the whole prompt, the
        prefix's copied in once (kept for the next call; grown when a call has more rows)."""
        held = self._buffers.get(layer)
        if held is None or held[0].shape[0] < n:
            m = int(self.tokens.shape[1])
            keys, values = (
                torch.empty((n, t.shape[1], m, t.shape[3]), dtype=t.dtype, device=t.device)
                for t in self.prefix[layer]
            )
            keys[:, :, : self.position] = self.prefix[layer][0]
            values[:, :, : self.position] = self.prefix[layer][1]
            held = self._buffers[layer] = (keys, values)
        return held[0][:n], held[1][:n]

    # -- deciding the mode ---------------------------------------------------------------------
    def _decide(self) -> None:
        """Compute the prefix's cache and take the fast path if it passes the identity: the
        prompt's own ``h_ℓ*`` patched back at ``ℓ* = L // 2`` (and 0) gives its output."""
        model, j = self.model, self.position
        if getattr(model, "original_model", None) is None:
            self.reason = "the model has no Hugging Face KV cache (a TL-native bridge)"
            return
        try:
            self._tuple = self._probe_tuple()
            if j > 0:
                with torch.no_grad(), passing_cache(model):
                    _, cache = model(self.tokens[:, :j], return_type="logits_and_cache")
                if cache is None:  # expected of a TL-native bridge: nothing to warn of
                    self.mode, self.reason = (
                        "rerun",
                        "the model returns no KV cache (a TL-native bridge)",
                    )
                    return
                self.prefix = [(layer.keys, layer.values) for layer in cache.layers]
                if len(self.prefix) != self.n_layers:
                    raise ValueError(f"a cache of {len(self.prefix)} layers")
            self.mode, self.reason = "cache", ""
            for start in sorted({0, self.n_layers // 2}):
                self._identity(start, pure=False)
        except Exception as err:  # any failure of the fast path: the exact slow one
            self.mode, self.prefix, self._buffers = "rerun", [], {}
            self.reason = f"the cached continuation failed: {type(err).__name__}: {err}"
            warn_fallback(
                "the patchscope's cached prefix",
                self.reason,
                "each state re-runs the whole inspection prompt (about its length in tokens "
                "times the work); please report it with your transformers version",
            )
            return
        failed = ""
        # the prefix shared by every row (the softmax's precision as the model's), or copied
        for attention in (SHARED_PREFIX, SHARED_PREFIX_FLOAT32, None):
            self._pure, self._shared = pure_layers(model, attention), attention is not None
            if self._pure is None:  # no Hugging Face layers to run alone (split by device_map)
                self.layers, self.layers_reason = "bridge", "Accelerate's hooks run the layers"
                return
            try:
                for start in sorted({0, self.n_layers // 2}):
                    self._identity(start, pure=True)
            except NotImplementedError as err:  # a known limit of the shared prefix's attention
                self.layers_reason = f"the prefix is not shared: {err}"
                continue
            except Exception as err:
                failed = self.layers_reason = f"{type(err).__name__}: {err}"
                continue
            self.layers = "shared prefix" if self._shared else "hugging face"
            if self._shared:
                self._buffers = {}  # the copies of the prefix per row were for recording
            return
        self._pure, self._calls, self.layers, self.layers_reason = None, {}, "bridge", failed
        warn_fallback(
            "the patchscope's continuation through Hugging Face's own layers",
            failed,
            "each continuation runs through the bridge's components (up to about 1.5 "
            "times the time); please report it with your transformers version",
        )

    def _identity(self, start: int, *, pure: bool) -> None:
        """Check that the prompt's own ``h_start`` patched back gives its output.

        Raises:
            ValueError: It does not, within the dtype's tolerance.
        """
        want = self.clean[self.n_layers][-1]
        scale = float(want.abs().max().clamp_min(1e-6))
        tolerance = _TOLERANCE.get(want.dtype, _TOLERANCE_LOW)
        got = self._continue(start, [self.clean[start][self.position][None]], pure=pure)[0][0]
        error = float((got - want).abs().max()) / scale
        if error > tolerance:
            raise ValueError(f"the identity is off by {error:.2g} relative")

    def _probe_tuple(self) -> bool:
        """Whether the wrapped layers return a tuple (what a stub must return)."""
        layer = self.model.blocks[0].original_component
        seen: dict[str, Any] = {}
        handle = layer.register_forward_hook(lambda _m, _a, out: seen.setdefault("out", out))
        try:
            with torch.no_grad():
                self.model(self.tokens[:, :1])
        finally:
            handle.remove()
        return isinstance(seen.get("out"), tuple)


def _equal_parts(h: Tensor, n_parts: int) -> list[Tensor]:
    """``h``'s rows in ``n_parts`` equal parts (not a ragged last one)."""
    step = -(-h.shape[0] // max(1, n_parts))
    return [h[lo : lo + step] for lo in range(0, h.shape[0], step)]


__all__ = ["Inspection", "inspection", "prompt_tokens"]
