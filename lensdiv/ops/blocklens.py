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
(:class:`~lensdiv.ops.inspection.Inspection`), and each patched state runs as a continuation of
``m − j`` tokens (one, with the patch at the last position) from block ``ℓ*`` to the output
against them. The
continuation runs the model's Hugging Face layers without the bridge's components
(:mod:`~lensdiv.ops.purelayers`: nothing inside a block is read), replaying the arguments the
model gave them on a recorded call, with an attention that holds the prefix once for every row
(``kvcache.shared_prefix_attention``: the prefix's part one product per key head over all rows).
So a state costs ``L − ℓ*`` one-token block evaluations plus its readout, and every state of a
batch with the same ``ℓ*`` (all of them for a fixed ``ℓ*``) runs in one call, in equal parts of
bounded memory. Each way is checked on first use by the identity (patching the prompt's own
``h_ℓ*`` back reproduces its output) and the first that passes is taken (``Inspection.layers``):
the shared prefix; Hugging Face's layers with a full-attention layer's prefix copied per row into
buffers written in place (``kvcache.prefixed_layer``); the bridge's forward, the blocks before
``ℓ*`` stubbed as :mod:`lensdiv.ops.resume` does. A model without a KV cache (a TL-native
bridge, such as the toy zoo) or one that fails the check runs the whole prompt per state
instead (``mode == "rerun"``; exact, ``m / (m − j)`` times the cost); ``Inspection.describe()``
says which way runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import LensError
from lensdiv.ops.inspection import Inspection, inspection, prompt_tokens
from lensdiv.ops.resume import Resumer
from lensdiv.ops.translators import Lens, Reader, split_unquoted, unquoted

#: The token identity inspection prompt of the Patchscopes paper (patched at its last position).
DEFAULT_PROMPT = "cat -> cat; 1135 -> 1135; hello -> hello; ?"
#: ``target`` rules besides a fixed block: ``same`` (``ℓ* = ℓ``), ``last`` (``ℓ* = L − 1``).
TARGETS = ("same", "last")

# Residual elements of the stacked last-block inputs run at once (64 MiB in fp32).
_STACK_ELEMENTS = 1 << 24
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
        """``R_l(h_l)`` at ``rows`` for every ``l < L``: the continuations from each target
        block (:meth:`~lensdiv.ops.inspection.Inspection.run_each`: few rows run in sweeps)."""
        L = found.n_layers
        groups: dict[int, list[int]] = {}
        for index in range(L):
            groups.setdefault(self.target_layer(index, L), []).append(index)
        out: dict[int, Tensor] = {}
        n = int(rows.numel())
        finals = found.run_each(
            {
                start: torch.cat(
                    [states[i].index_select(0, rows.to(states[i].device)) for i in indices]
                )
                for start, indices in groups.items()
            }
        )
        for start, indices in groups.items():
            for k, index in enumerate(indices):
                out[index] = finals[start][k * n : (k + 1) * n]
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


__all__ = [
    "DEFAULT_PROMPT",
    "TARGETS",
    "LastBlockLens",
    "PatchscopeLens",
    "last_block",
    "patchscope",
    "through_last_block",
]
