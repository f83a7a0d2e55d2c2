"""Copies derived from a model's weights (the bfloat16 unembeddings of ``cells`` and
``kl_grad``): one cache, one staleness rule. A copy is made once per owner and name, and made
again whenever a weight it was made from is not the same any more — another storage, dtype,
device or shape, or written in place (its ``_version``)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import Tensor

T = TypeVar("T")

_DERIVED: weakref.WeakKeyDictionary[Any, dict[str, tuple[tuple[Any, ...], Any]]] = (
    weakref.WeakKeyDictionary()
)


def stamp(tensors: Sequence[Tensor]) -> tuple[Any, ...]:
    """What identifies the contents of ``tensors`` without reading them: storage, in-place
    version, dtype, device and shape of each."""
    return tuple((t.data_ptr(), t._version, t.dtype, t.device, tuple(t.shape)) for t in tensors)


def derived(owner: Any, name: str, sources: Sequence[Tensor], make: Callable[[], T]) -> T:
    """``make()`` of ``sources``, kept while ``owner`` lives (weakly referenced) and made again
    when :func:`stamp` of ``sources`` changes.

    Args:
        owner: What the copy belongs to (a :class:`~lensdiv.ops.readout.FinalReadout`).
        name: Which copy of the owner (several kinds per owner).
        sources: The weights the copy is computed from.
        make: Computes the copy from ``sources``.
    """
    entries = _DERIVED.setdefault(owner, {})
    key = stamp(sources)
    cached = entries.get(name)
    if cached is None or cached[0] != key:
        cached = entries[name] = (key, make())
    value: T = cached[1]
    return value
