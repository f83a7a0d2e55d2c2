"""The run settings, declared once: how a run reads its data and runs its model.

:class:`RunSettings` is the one declaration of every setting that :func:`lensdiv.analyze`,
:func:`~lensdiv.studies.crossmodel.run_study`, :func:`~lensdiv.lenses.fit.fit_lens`,
:func:`~lensdiv.lenses.fit.evaluate_lens` and the ``lensdiv`` commands share: its name, type,
default and help. The API functions take ``settings=RunSettings(...)`` or the same names as
keywords (:meth:`RunSettings.of`; :func:`settings_keywords` shows them in the function's
signature, for ``help()`` and notebooks); the commands' options, defaults and help are made from
it (``lensdiv.cli.common.run_settings``). A new setting is one field here, then used where it
acts (see ARCHITECTURE.md, "Run settings").

No torch here (``lensdiv --help`` reads it).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def _setting(default: Any, help: str, *, cli: Any = None, data: bool = False) -> Any:
    """A field of :class:`RunSettings`: its default and its help (the option's on the command
    line); ``cli`` the option's type there (default: the field's), ``data`` whether it is a field
    of :class:`~lensdiv.data.sources.DataSpec` too."""
    return dataclasses.field(default=default, metadata={"help": help, "cli": cli, "data": data})


@dataclass(frozen=True)
class RunSettings:
    """How a run reads its data and runs its model (every field has its default).

    Args:
        field: The JSONL / data-set field holding the text.
        split: The split of an ``hf:`` data set.
        seq_len: Tokens per row, BOS included.
        max_tokens: Stop after this many real tokens (``None``: a fit's own budget, where
            :func:`~lensdiv.lenses.fit.fit_lens` says; a run needs a number).
        batch_size: Rows per forward pass.
        bos: ``"prepend"`` puts BOS at position 0 of every row; ``"none"`` does not.
        seed: Seeds torch and the built-in corpus; recorded in every result.
        lens: The lens every analyzer reads residual states through: ``"logit"``,
            ``"last-block"``, ``"patchscope[:OPTIONS]"``, ``"tuned:PATH"``, ``"jacobian:PATH"``, ``"affine:PATH"`` (PATH: a fit's ``--out``
            folder, the lens' file or folder, or a published lens' name), a path alone (the
            kind read from its files) or a ``Lens``.
        device: Where the model runs (``"cpu"``, ``"cuda:1"``, a ``torch.device``); ``None``:
            the best available.
        dtype: The model's precision (``"bfloat16"``, a ``torch.dtype``); ``None``: float32.
            Residual states are read out in float32 whatever it is (float64 for a float64
            model).

    Each is checked where it acts, before any work (the data fields by
    :class:`~lensdiv.data.sources.DataSpec`, the device and dtype before the model loads, the
    lens before the run starts).
    """

    field: str = _setting("text", "JSONL / data-set field holding the text.", data=True)
    split: str = _setting("train", "Split of an hf: data set.", data=True)
    seq_len: int = _setting(128, "Tokens per sequence (BOS included).", data=True)
    max_tokens: int | None = _setting(16384, "Stop after this many tokens.", cli=int, data=True)
    batch_size: int = _setting(8, "Sequences per forward pass.", data=True)
    bos: str = _setting("prepend", "BOS policy: prepend | none.", data=True)
    seed: int = _setting(0, "Random seed (recorded in every result).", data=True)
    lens: Any = _setting(
        "logit",
        "Read residual states through: logit (default), last-block, patchscope (h_l patched into "
        "an inspection prompt; patchscope:target=last&prompt_file=P for options), tuned:PATH, "
        "jacobian:PATH or affine:PATH (PATH: the --out folder of `lensdiv lenses fit`, the lens' file or folder, "
        "or a published lens' name), or PATH alone (the kind read from the files).",
        cli=str,
    )
    device: Any = _setting(None, "cpu, cuda, cuda:1 ... Default: best available.", cli=str | None)
    dtype: Any = _setting(
        None,
        "float32 (default), bfloat16, float16, float64. Readouts are float32.",
        cli=str | None,
    )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting's name, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def declared(cls, name: str) -> dataclasses.Field[Any]:
        """The declaration of setting ``name`` (default, ``metadata["help"]``, ...)."""
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f
        raise KeyError(name)

    @classmethod
    def of(
        cls,
        settings: RunSettings | None = None,
        given: Mapping[str, Any] | None = None,
        *,
        caller: str,
        defaults: Mapping[str, Any] | None = None,
    ) -> RunSettings:
        """The settings of a call: ``settings`` (or the defaults, with the caller's own
        ``defaults``) with the keywords ``given`` changed.

        Raises:
            TypeError: ``settings`` is not a :class:`RunSettings`, or ``given`` names no
                setting (``caller`` names the function, as Python does).
        """
        given = dict(given or {})
        unknown = sorted(set(given) - set(cls.names()))
        if unknown:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument {unknown[0]!r} "
                f"(its run settings: {', '.join(cls.names())})"
            )
        if settings is None:
            settings = cls(**(defaults or {}))
        elif not isinstance(settings, cls):
            raise TypeError(
                f"{caller}() takes settings=RunSettings(...), not {type(settings).__name__}"
            )
        return dataclasses.replace(settings, **given) if given else settings

    def data(self, **changes: Any) -> dict[str, Any]:
        """The fields that are also :class:`~lensdiv.data.sources.DataSpec`'s, as keywords of
        ``DataSpec.from_data`` (``changes`` replace some)."""
        chosen = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["data"]
        }
        return {**chosen, **changes}


DEFAULTS = RunSettings()


def settings_keywords(
    *, keep_rest: bool = False, hide: tuple[str, ...] = (), **defaults: Any
) -> Callable[[F], F]:
    """Show the run settings as keyword-only parameters in the signature of a function that
    takes them as ``**keywords`` (for ``help()``, ``inspect.signature`` and notebooks), with
    ``defaults`` where the function's own defaults differ (``evaluate_lens``: ``max_tokens``).

    ``keep_rest``: the function's ``**keywords`` also takes other arguments (shown after the
    settings); ``hide``: settings left out of the signature (those the function refuses). A
    setting that is already a parameter of the function keeps its own place.
    """

    def wrap(func: F) -> F:
        signature = inspect.signature(func)
        params = list(signature.parameters.values())
        rest = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        own = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
        types = typing.get_type_hints(RunSettings)
        extra = [
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(f.name, f.default),
                annotation=types[f.name],
            )
            for f in dataclasses.fields(RunSettings)
            if f.name not in signature.parameters and f.name not in hide
        ]
        shown = signature.replace(parameters=[*own, *extra, *(rest if keep_rest else [])])
        setattr(func, "__signature__", shown)  # noqa: B010  (a function has no such attribute for mypy)
        return func

    return wrap
