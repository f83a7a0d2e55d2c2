"""Lenses that run model blocks: the last-block lens and Patchscopes (docs/science.md C1, P1).

Both are :class:`~lensdiv.ops.translators.Lens` es like the affine translators, read by every
analyzer that reads a lens; what differs is ``R_l``, what turns ``h_l`` into the state the final
norm reads:

- ``last-block`` (C1): ``R_l(h_l) = f_{L-1}(h_l)``, the final block run over the *same* sequence
  with ``h_l`` at every position (resumed at block ``L − 1``: :class:`~lensdiv.ops.resume.Resumer`);
  ``h_{L-1}`` and ``h_L`` both read as ``h_L``.
- ``patchscope`` (P1; Ghandeharioun et al., ICML 2024): ``h_l`` patched into an *inspection
  prompt* at one position (default its last) as the input of block ``ℓ*`` (default ``ℓ* = ℓ``;
  or a fixed ``ℓ*``; or ``ℓ* = L − 1``, the last-block style), the model run on from there, and
  the final residual of the prompt's last position read out. The default prompt is the token
  identity prompt ``cat -> cat; 1135 -> 1135; hello -> hello; ?``, tokenised as the model
  tokenises (with its BOS when it adds one).

**Cost.** The inspection prompt's prefix (the positions before the patch) is the same for every
state read: its keys and values at every layer are computed once per model and prompt
(:class:`Inspection`), and each patched state runs as a continuation of ``m − j`` tokens (one,
with the patch at the last position) from block ``ℓ*`` to the output against that cache —
Hugging Face's own KV cache through the bridge, the blocks before ``ℓ*`` replaced by the patched
residual as :mod:`lensdiv.ops.resume` does. A full-attention layer's cache is a buffer sized for
the whole prompt, the prefix copied in once and each continuation writing only its own tokens
in place (``kvcache.prefixed_layer``; Hugging Face's own layer would copy the prefix once per row and
call). So a state costs ``L − ℓ*`` one-token block evaluations plus its readout, and every state
of a batch with the same ``ℓ*`` (all of them for a fixed ``ℓ*``) runs under one set of hooks,
in equal parts of bounded memory. On first use the fast path is checked by the identity
(patching the prompt's own ``h_ℓ*`` back reproduces its output); a model without a KV cache (a
TL-native bridge, such as the toy zoo) or one that fails the check runs the whole prompt per
state instead (``mode == "rerun"``; exact, ``m / (m − j)`` times the cost), recorded in results.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import input_device
from lensdiv.core.errors import LensError
from lensdiv.ops.capture import StopPass, capture, stop_hook_name, stopping
from lensdiv.ops.kvcache import cache_kwargs, passing_cache, prefixed_layer, warn_fallback
from lensdiv.ops.readout import final_readout
from lensdiv.ops.resume import Resumer, stubbed_blocks
from lensdiv.ops.translators import Lens, Reader, split_unquoted, unquoted

#: The token identity inspection prompt of the Patchscopes paper (patched at its last position).
DEFAULT_PROMPT = "cat -> cat; 1135 -> 1135; hello -> hello; ?"
#: ``target`` rules besides a fixed block: ``same`` (``ℓ* = ℓ``), ``last`` (``ℓ* = L − 1``).
TARGETS = ("same", "last")

# Residual elements of the stacked last-block inputs run at once (64 MiB in fp32).
_STACK_ELEMENTS = 1 << 24
# Elements one continuation call may hold off a GPU: the prefix's keys and values for its rows
# (kept for the next call) and its activations (512 MiB in fp32; fewer, larger calls spare the
# bridge's fixed cost of a forward, a few milliseconds each).
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


# Relative error of the fast path's identity check (float rounding of a different schedule).
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
_TOLERANCE_LOW = 5e-2


# -- last-block ------------------------------------------------------------------------------------


def _the_model(model: Bridge | None, label: str) -> Bridge:
    """``model``, which a lens that runs the model's blocks cannot do without.

    Raises:
        LensError: There is no model to run (``None``).
    """
    if model is None:
        raise LensError(f"the {label} runs the model's blocks: it needs the model, not None")
    return model


@dataclass(frozen=True, eq=False)
class LastBlockLens(Lens):
    """The last-block lens (docs/science.md C1): ``h_l`` through the final block, then the
    readout."""

    kind: ClassVar[str] = "last-block"  # type: ignore[misc]  # a constant of the class

    @property
    def spec(self) -> str:
        return self.kind

    def shown(self, n_layers: int) -> range:
        """``h_0..h_{L-1}`` (``h_{L-1}`` through the last block is ``h_L``)."""
        return range(n_layers)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "spec": self.spec}

    def reader(
        self,
        model: Bridge | None,
        tokens: Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Reader:
        """Every ``h_l`` (``l ≤ L − 2``) of the batch through block ``L − 1`` over its own
        sequence, computed on the first read; ``h_{L-1}`` and ``h_L`` read as ``h_L``."""
        if tokens is None:
            raise LensError("the last-block lens runs the final block: it needs the batch's tokens")
        model = _the_model(model, self.label)
        L = int(model.cfg.n_layers)
        done: dict[int, Tensor] = {}

        def read(states: Sequence[Tensor], index: int, rows: Tensor) -> Tensor:
            if index >= L - 1:
                source = states[L]
            else:
                if not done:
                    done.update(through_last_block(model, tokens, states, L))
                source = done[index]
            return source.index_select(0, rows.to(source.device))

        return read


def through_last_block(
    model: Bridge, tokens: Tensor, states: Sequence[Tensor], n_layers: int
) -> dict[int, Float[Tensor, "rows d_model"]]:
    """``f_{L-1}(h_l)`` for ``l = 0..L-2`` over the batch's sequences (``states[l]``: ``h_l``
    flattened to ``[batch·pos, d_model]``), the layers stacked into few resumed passes."""
    n_seq, n_pos = tokens.shape
    out: dict[int, Tensor] = {}
    passes = last_block_passes(
        Resumer(model), tokens, lambda i: states[i].reshape(n_seq, n_pos, -1), n_layers
    )
    for layers, final in passes:
        for k, layer in enumerate(layers):
            out[layer] = final[k].reshape(n_seq * n_pos, -1)
    return out


def last_block_passes(
    resumer: Resumer, tokens: Tensor, state: Callable[[int], Tensor], n_layers: int
) -> Iterator[tuple[list[int], Float[Tensor, "k batch pos d_model"]]]:
    """``f_{L-1}(h_l)`` for ``l = 0..L-2`` (``state(l)``: ``h_l`` as ``[batch, pos, d_model]``),
    the states stacked into as few passes resumed at the last block as :data:`_STACK_ELEMENTS`
    allows: yields each pass's layers and their outputs. The one loop the last-block lens and
    ``dynamics`` share."""
    L, (n_seq, n_pos) = n_layers, tokens.shape
    inputs = list(range(L - 1))  # h_{L-1} needs no block: f_{L-1}(h_{L-1}) = h_L
    if not inputs:
        return
    kept: dict[str, Tensor] = {}

    def keep(tensor: Tensor, *, hook: Any) -> Tensor:
        kept["h"] = tensor.detach()
        return tensor

    first = state(inputs[0])
    chunk = max(1, _STACK_ELEMENTS // (n_seq * n_pos * first.shape[-1]))
    for lo in range(0, len(inputs), chunk):
        layers = inputs[lo : lo + chunk]
        stacked = torch.cat([first if i == inputs[0] else state(i) for i in layers])
        resumer.run(
            tokens.repeat(len(layers), 1),
            L - 1,
            stacked,
            [(f"blocks.{L - 1}.hook_resid_post", keep)],
            logits=False,
        )
        yield layers, kept["h"].view(len(layers), n_seq, n_pos, -1)


def last_block(options: str) -> LastBlockLens:
    """``--lens last-block`` (no options)."""
    if options:
        raise LensError(f"the last-block lens takes no options, not {options!r}")
    return LastBlockLens()


# -- patchscope ------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PatchscopeLens(Lens):
    """A Patchscope (docs/science.md P1): ``h_l`` patched into an inspection prompt.

    Args:
        prompt: The inspection prompt (default :data:`DEFAULT_PROMPT`).
        position: The position patched (negative from the end; default its last).
        target: The block ``ℓ*`` the state enters: ``"same"`` (``ℓ* = ℓ``), ``"last"``
            (``ℓ* = L − 1``, the last-block style) or a block index.
    """

    prompt: str = DEFAULT_PROMPT
    position: int = -1
    target: str | int = "same"
    kind: ClassVar[str] = "patchscope"  # type: ignore[misc]  # a constant of the class

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise LensError("the patchscope's inspection prompt is empty")
        if isinstance(self.target, str) and self.target not in TARGETS:
            raise LensError(
                f"unknown patchscope target {self.target!r}",
                hint="use target=same, target=last or target=BLOCK (a number)",
            )
        if isinstance(self.target, int) and self.target < 0:
            raise LensError(f"the patchscope's target block must be ≥ 0, got {self.target}")

    @property
    def spec(self) -> str:
        given = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != f.default
        ]
        return self.kind + (":" + "&".join(given) if given else "")

    def target_layer(self, index: int, n_layers: int) -> int:
        """``ℓ*`` for the state ``h_index``."""
        if self.target == "same":
            return index
        if self.target == "last":
            return n_layers - 1
        return int(self.target)

    def check(self, info: ModelInfo, model: Bridge | None = None) -> None:
        if isinstance(self.target, int) and self.target >= info.n_layers:
            raise LensError(
                f"the patchscope's target block {self.target} is not one of {info.name}'s "
                f"{info.n_layers} blocks (0-{info.n_layers - 1})"
            )
        if model is not None:  # the position against the prompt's tokens, before any pass
            m = len(prompt_tokens(model, self.prompt)[0])
            if not -m <= self.position < m:
                raise LensError(
                    f"the patchscope's position {self.position} is outside its inspection "
                    f"prompt's {m} tokens",
                    hint=f"use a position from {-m} to {m - 1} (-1: the last token)",
                )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "label": self.label,
            "spec": self.spec,
            "prompt": self.prompt,
            "position": self.position,
            "target": self.target,
        }

    def reader(
        self,
        model: Bridge | None,
        tokens: Tensor | None,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Reader:
        """The rows of every ``h_l`` (``l < L``) patched in, all read on the first read of a
        block of rows (the states with the same ``ℓ*`` in one continuation); ``h_L`` as it is."""
        found = inspection(_the_model(model, self.label), self.prompt, self.position)
        L = found.n_layers
        last: dict[str, Any] = {}

        def read(states: Sequence[Tensor], index: int, rows: Tensor) -> Tensor:
            if index >= L:
                return states[index].index_select(0, rows.to(states[index].device))
            if last.get("rows") is not rows:
                last["rows"], last["out"] = rows, self.read_all(found, states, rows)
            out: Tensor = last["out"][index]
            return out

        return read

    def read_all(
        self, found: Inspection, states: Sequence[Tensor], rows: Tensor
    ) -> dict[int, Tensor]:
        """``R_l(h_l)`` at ``rows`` for every ``l < L``: one continuation per target block."""
        L = found.n_layers
        groups: dict[int, list[int]] = {}
        for index in range(L):
            groups.setdefault(self.target_layer(index, L), []).append(index)
        out: dict[int, Tensor] = {}
        n = int(rows.numel())
        for start, indices in groups.items():
            h = torch.cat([states[i].index_select(0, rows.to(states[i].device)) for i in indices])
            final = found.run(start, h)
            for k, index in enumerate(indices):
                out[index] = final[k * n : (k + 1) * n]
        return out


def patchscope(options: str) -> PatchscopeLens:
    """``--lens patchscope[:KEY=VALUE&...]`` with ``prompt=TEXT``, ``prompt_file=PATH``,
    ``position=J`` and ``target=same|last|BLOCK``."""
    given: dict[str, Any] = {}
    for part in split_unquoted(options, "&"):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("prompt", "prompt_file", "position", "target"):
            raise LensError(
                f"unknown patchscope option {part!r}",
                hint="use patchscope:prompt=TEXT, prompt_file=PATH, position=J, "
                "target=same|last|BLOCK (joined by &; quote a prompt with & or a comma: "
                'prompt="a, b & c", or put it in a file: prompt_file=PATH)',
            )
        given[key] = unquoted(value)
    if "prompt_file" in given:
        path = Path(given.pop("prompt_file")).expanduser()
        try:
            given["prompt"] = path.read_text().rstrip("\n")
        except OSError as err:
            raise LensError(f"cannot read the inspection prompt {str(path)!r}: {err}") from None
    try:
        if "position" in given:
            given["position"] = int(given["position"])
        target = given.get("target")
        if target is not None and target.strip().lstrip("-").isdigit():
            given["target"] = int(target)
    except ValueError:
        raise LensError(f"the patchscope's position must be an integer: {options!r}") from None
    return PatchscopeLens(**given)


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
            **({"reason": self.reason} if self.mode == "rerun" else {}),
        }

    # -- running -------------------------------------------------------------------------------
    def run(self, start: int, h: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """The prompt's final residual at its last position with ``h`` as block ``start``'s
        input at the patch position, per row (in the model's dtype)."""
        L, j, m = self.n_layers, self.position, self.clean[0].shape[0]
        if start >= L:  # no block runs: the patch is the output (or does not reach the end)
            last = self.clean[L][-1]
            return h.to(last) if j == m - 1 else last.expand(h.shape[0], -1).clone()
        if self.mode == "rerun":
            per_row = m * 3 * h.shape[-1] * (L - start + 1)
        else:  # the prefix's buffers, kept, and one call's activations (its MLP's the widest)
            kv = sum(keys.shape[1] * keys.shape[3] for keys, _ in self.prefix)
            per_row = 2 * m * kv + (m - j) * h.shape[-1] * 8
        parts_n = -(-h.shape[0] // max(1, _call_elements(h.device, h.element_size()) // per_row))
        step = -(-h.shape[0] // parts_n)  # equal parts, not a ragged last one
        parts = [h[lo : lo + step] for lo in range(0, h.shape[0], step)]
        if self.mode == "cache":
            out = self._continue(start, parts)
        else:
            out = [self._rerun(start, part) for part in parts]
        return out[0] if len(out) == 1 else torch.cat(out)

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

    def _continue(self, start: int, parts: Sequence[Tensor]) -> list[Tensor]:
        """The tokens from the patch position on, against the prefix's cached keys and values,
        from block ``start`` (the blocks before it return the patched residual), per part of
        the rows (one forward each, under one set of hooks)."""
        j, at = self.position, self.clean[start]
        final: list[Tensor] = []
        fed: dict[str, Tensor] = {}

        def halt(tensor: Tensor, *, hook: Any) -> Tensor:
            final.append(tensor[:, -1])
            raise StopPass

        def inject(tensor: Tensor, *, hook: Any) -> Tensor:
            return fed["resid"].to(tensor)

        stop = stop_hook_name(self.model.hook_dict)
        hooks = [(stop or f"blocks.{self.n_layers - 1}.hook_resid_post", halt)]
        if start == 0:
            hooks.append(("blocks.0.hook_resid_pre", inject))
        with torch.no_grad(), self.model.hooks(fwd_hooks=hooks):
            for h in parts:
                n = h.shape[0]
                resid = fed["resid"] = torch.cat(
                    [h.to(at)[:, None], at[None, j + 1 :].expand(n, -1, -1)], dim=1
                )
                kwargs = cache_kwargs(self.model, self._cache(n)) if self.prefix else {}
                with (
                    stubbed_blocks(self.model, start, resid, tuple_output=self._tuple),
                    passing_cache(self.model),
                    stopping(),
                ):
                    self.model(self.tokens[:, j:].expand(n, -1), **kwargs)
        return final

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
            want = self.clean[self.n_layers][-1]
            scale = float(want.abs().max().clamp_min(1e-6))
            tolerance = _TOLERANCE.get(want.dtype, _TOLERANCE_LOW)
            for start in sorted({0, self.n_layers // 2}):
                got = self._continue(start, [self.clean[start][j][None]])[0][0]
                error = float((got - want).abs().max()) / scale
                if error > tolerance:
                    raise ValueError(f"the identity is off by {error:.2g} relative")
        except Exception as err:  # any failure of the fast path: the exact slow one
            self.mode, self.prefix, self._buffers = "rerun", [], {}
            self.reason = f"the cached continuation failed: {type(err).__name__}: {err}"
            warn_fallback(
                "the patchscope's cached prefix",
                self.reason,
                "each state re-runs the whole inspection prompt (about its length in tokens "
                "times the work); please report it with your transformers version",
            )

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


__all__ = [
    "DEFAULT_PROMPT",
    "TARGETS",
    "Inspection",
    "LastBlockLens",
    "PatchscopeLens",
    "inspection",
    "last_block",
    "patchscope",
    "through_last_block",
]
