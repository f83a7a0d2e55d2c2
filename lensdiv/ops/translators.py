"""Translators: what a lens does to a residual state before the final norm and unembedding.

A lens reads residual state ``h_l`` as ``p_l = softmax(W_U N(T_l(h_l)) + b_U)``; the translator
``T_l`` is what tells lenses apart (docs/science.md, D1–D3):

==============  =================================  ============================================
lens            ``T_l(h)``                         fitted to / file
==============  =================================  ============================================
``logit``       ``h``                              nothing (the logit lens)
``tuned``       ``h + A_l h + b_l``                ``KL(p_L ‖ p_l)`` by SGD; tuned-lens's layout
``jacobian``    ``J_l h``                          the average Jacobian ∂h_L/∂h_l; TL's file
``affine``      ``W_l h + c_l``                    least squares to ``h_L``; tuned-lens's layout
==============  =================================  ============================================

Every translator is affine, so one class holds them all: per residual index ``l`` (``h_0`` the
embedding, ``h_L`` the final residual, as everywhere in lensdiv) a weight and an optional bias,
applied either as ``h Wᵀ + b`` or residually as ``h + h Wᵀ + b`` (the tuned lens' own form, so a
zero-initialised lens is the logit lens to the last bit). Indices without a map read ``h`` as it
is: the last (``h_L``) always, and ``h_0`` for a Jacobian lens.

Index conventions of the files: a tuned lens' translator ``i`` reads Hugging Face's
``hidden_states[i]`` = ``h_i`` (``i = 0..L-1``); a TransformerLens Jacobian lens' layer ``k``
reads the output of block ``k`` = ``h_{k+1}`` (``k = 0..L-2``).

**Precision.** A translator is applied in the readout dtype (float32, or float64 for a float64
model) on the readout's device, to a state already converted to that dtype: the policy of
:mod:`lensdiv.ops.readout` holds, and the cost is one ``d_model × d_model`` matmul per state.

**Kinds of lens** are objects in one registry, :mod:`lensdiv.ops.lens_kinds` (``LENS_KINDS``,
``LensKind``, ``parse_lens``, the files' readers). Every lens is a :class:`Lens`: affine
translators here, readouts that run model blocks (``last-block``, ``patchscope``) in
:mod:`lensdiv.ops.blocklens`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensError

if TYPE_CHECKING:
    from lensdiv.ops.lens_kinds import LensKind
from lensdiv.ops.lens_files import (
    Map,
)

#: What a lens' reader does: ``read(states, index, rows)`` → the state the final norm reads for
#: the given flat rows of residual state ``h_index`` (``states``: every ``h_l`` of one batch,
#: flattened to ``[rows, d_model]``).
Reader = Callable[[Sequence[Tensor], int, Tensor], Tensor]


class Lens(ABC):
    """A lens: reads residual states ``h_l`` (any ``l``, any positions) into next-token logits,
    as ``readout(R_l(h_l))`` with the model's final norm and unembedding (:mod:`lensdiv.ops.readout`).

    Two families: affine translators (:class:`Translator`: logit, tuned, Jacobian, affine), whose
    ``R_l`` is an affine map of the state alone, and readouts that run model blocks
    (:mod:`lensdiv.ops.blocklens`: ``last-block``, ``patchscope``). Every lens reads ``h_L`` (the
    final residual) as it is, so the model's output is every lens' reference.

    Attributes:
        kind: The name of its kind in :data:`LENS_KINDS`.
        affine: Whether ``R_l`` is an affine map of ``h_l`` alone (what a decomposition into
            members needs: ``bias``).
    """

    kind: str
    affine: ClassVar[bool] = False

    @property
    def lens_kind(self) -> LensKind:
        """Its kind, from the registry."""
        from lensdiv.ops.lens_kinds import LENS_KINDS  # the registry imports this module

        return LENS_KINDS[self.kind]

    @property
    def label(self) -> str:
        """``"Tuned lens"``: how results name it."""
        return self.lens_kind.label

    @property
    def identity(self) -> bool:
        """The logit lens: every state read as it is."""
        return False

    @property
    def source(self) -> str | None:
        """Where its files came from (``None``: it has none)."""
        return None

    @property
    @abstractmethod
    def spec(self) -> str:
        """What ``--lens`` takes to make this lens again."""

    def translates(self, index: int) -> bool:
        """Whether residual state ``h_index`` is changed before the readout."""
        return False

    def shown(self, n_layers: int) -> range:
        """The residual indices the prompt view shows (``h_0..h_L``; fewer where two coincide)."""
        return range(n_layers + 1)

    def check(self, info: ModelInfo) -> None:  # noqa: B027 - most lenses fit every model
        """Refuse a model this lens cannot read (raises :class:`LensError`)."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the manifest and every result record of the lens (the same on every shard)."""

    @abstractmethod
    def reader(
        self, model: Any, tokens: Tensor | None, *, dtype: torch.dtype, device: torch.device
    ) -> Reader:
        """The reader of one batch: ``tokens`` ``[batch, pos]`` are the batch's (what a lens
        that runs blocks over the sequence needs); ``dtype`` and ``device`` are the readout's."""


@dataclass(frozen=True, eq=False)
class Translator(Lens):
    """A lens' per-layer affine translators (see the module docstring).

    Args:
        kind: ``logit``, ``tuned``, ``jacobian`` or ``affine``.
        maps: ``{residual index l: Map}``; an index without one reads ``h_l`` as it is.
        source: Where it was read from (a path or a hub name; ``None`` for the logit lens).
        d_model: Width the maps were fitted for (0 for the logit lens).
        meta: Provenance recorded with the file (prompts, tokens, fit settings).
    """

    kind: str = "logit"
    maps: Mapping[int, Map] = field(default_factory=dict)
    source: str | None = None
    d_model: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    _placed: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor | None]] = field(
        default_factory=dict, repr=False
    )
    affine: ClassVar[bool] = True

    @property
    def identity(self) -> bool:
        """The logit lens: every state read as it is."""
        return not self.maps

    @property
    def spec(self) -> str:
        """``kind`` or ``kind:source``, as ``--lens`` takes it."""
        return self.kind if self.source is None else f"{self.kind}:{self.source}"

    def translates(self, index: int) -> bool:
        """Whether residual state ``h_index`` is changed before the readout."""
        return index in self.maps

    def reader(
        self, model: Any, tokens: Tensor | None, *, dtype: torch.dtype, device: torch.device
    ) -> Reader:
        """The rows of ``h_index``, through ``T_index`` where it has one."""

        def read(states: Sequence[Tensor], index: int, rows: Tensor) -> Tensor:
            h = states[index].index_select(0, rows.to(states[index].device))
            if self.translates(index):
                h = self.apply(h, index, dtype=dtype, device=device)
            return h

        return read

    def apply(
        self,
        h: Float[Tensor, "n d_model"],
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Float[Tensor, "n d_model"]:
        """``T_index(h)`` in ``dtype`` on ``device`` (``h`` as it is where no map applies)."""
        found = self.maps.get(index)
        if found is None:
            return h
        key = (index, dtype, device)
        if key not in self._placed:
            bias = found.bias.to(device, dtype) if found.bias is not None else None
            self._placed[key] = (found.weight.to(device, dtype).T.contiguous(), bias)
        weight_t, bias = self._placed[key]
        x = h.to(device=device, dtype=dtype)
        out = torch.addmm(x, x, weight_t) if found.residual else x @ weight_t
        return out if bias is None else out.add_(bias)

    def check(self, info: ModelInfo) -> None:
        """Refuse a lens fitted for another shape of model.

        Raises:
            LensError: Another width, or a map for a residual index the model lacks.
        """
        if self.identity:
            return
        if self.d_model != info.d_model:
            raise LensError(
                f"the {self.lens_kind.phrase} {self.source!r} was fitted for d_model {self.d_model}, "
                f"but {info.name} has d_model {info.d_model}",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )
        bad = [i for i in self.maps if not 0 <= i < info.n_layers]
        if bad:
            raise LensError(
                f"the {self.lens_kind.phrase} {self.source!r} has a translator for residual state "
                f"h{max(bad)}, but {info.name} has {info.n_layers} blocks (h0..h{info.n_layers - 1} "
                "can be translated)",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )

    def describe(self) -> dict[str, Any]:
        """What the manifest and every result record of the lens."""
        if self.identity:
            return {"kind": self.kind, "label": self.label}
        return {
            "kind": self.kind,
            "label": self.label,
            "source": self.source,
            "states": sorted(self.maps),
            "d_model": self.d_model,
            "sha256": self.fingerprint(),
            **({"meta": dict(self.meta)} if self.meta else {}),
        }

    def fingerprint(self) -> str:
        """A hash of the maps' values (shards and merges check they used the same lens)."""
        digest = hashlib.sha256()
        for index in sorted(self.maps):
            found = self.maps[index]
            digest.update(f"{index}:{found.residual}".encode())
            digest.update(found.weight.detach().float().cpu().numpy().tobytes())
            if found.bias is not None:
                digest.update(found.bias.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


LOGIT = Translator()


__all__ = ["LOGIT", "Lens", "Reader", "Translator"]
