"""What lensdiv reads of a model and its tokenizer, as types: :class:`Bridge` and
:class:`Tokenizer`.

A model lensdiv analyses is a TransformerLens 4 ``TransformerBridge`` (a Hugging Face model
wrapped with hooks), a ``HookedTransformer`` (TransformerLens' own models, the toys), or anything
else with the same surface. These protocols name that surface, so a signature says ``model:
Bridge`` instead of ``model: Any`` and a type checker catches a call to something no model has.
They are structural (:class:`typing.Protocol`): nothing has to inherit from them. They are for the
type checker only: at run time both names are :data:`typing.Any`, so a run-time type checker
(beartype, in lensdiv's tests) lets every model through, a ``HookedTransformer`` without
``original_model`` and a test's stand-in included; what a run needs of a model is checked with
one-line errors by ``lensdiv.run.validate``.

The members are those lensdiv's own code uses. ``cfg`` is TransformerLens' config
(``n_layers``, ``d_model``, ``d_vocab``, ``n_heads``, ``default_prepend_bos``, ``dtype``,
``device``, ...) and stays ``Any``: the two config classes differ, and lensdiv reads it through
:func:`getattr` with defaults where they do.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # no torch at import: `lensdiv --help` reads modules that name these types
    from torch import Tensor


class Tokenizer(Protocol):
    """What lensdiv reads of a tokenizer (a Hugging Face ``PreTrainedTokenizerBase``, or the
    toys' wrapper of the ``tokenizers`` byte tokenizer)."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any: ...

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str: ...

    def convert_ids_to_tokens(self, ids: Any, *args: Any, **kwargs: Any) -> Any: ...

    def get_vocab(self) -> dict[str, int]: ...

    def __len__(self) -> int: ...


class Bridge(Protocol):
    """What lensdiv reads of a model: its config, tokenizer and blocks, its hooks, a forward pass
    (with hooks, or with a cache of activations), and the module methods every ``torch.nn.Module``
    has. ``original_model`` is the Hugging Face model a ``TransformerBridge`` wraps (a
    ``HookedTransformer`` has none: code that may meet one reads it with :func:`getattr`)."""

    cfg: Any
    tokenizer: Any
    original_model: Any

    @property
    def W_U(self) -> Tensor: ...  # noqa: N802  # TransformerLens' name

    @property
    def ln_final(self) -> Any: ...

    @property
    def blocks(self) -> Sequence[Any]: ...

    @property
    def hook_dict(self) -> Mapping[str, Any]: ...

    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any: ...

    def to_tokens(self, input: Any, *args: Any, **kwargs: Any) -> Tensor: ...

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...

    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]: ...

    def hooks(self, *args: Any, **kwargs: Any) -> AbstractContextManager[Any]: ...

    def parameters(self, recurse: bool = True) -> Iterator[Any]: ...

    def modules(self) -> Iterator[Any]: ...

    def eval(self) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...


if not TYPE_CHECKING:  # for the type checker only (see the module's docstring)
    Bridge = Tokenizer = Any  # noqa: F811


__all__ = ["Bridge", "Tokenizer"]
