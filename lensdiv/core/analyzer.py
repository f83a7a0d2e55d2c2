"""The analyzer contract: one abstract base class every analysis (built-in or plugin) implements.

An analyzer is a frozen dataclass whose fields are its options. It declares, as class attributes,
what it needs (hooks, logits, extra forward passes, gradients, numerics), so the runner can fuse
all selected analyzers into one forward pass per batch. The data flow of a run::

    analyzer.check_data(data, info)            # once: options that cannot work on this data
    resource = analyzer.setup(model, info)     # once: a reference model, checked inputs
    state = analyzer.init(info)                # a mergeable Stats
    for each pass p:                           # most analyzers have one
        analyzer.start_pass(state, info, p)    # p >= 1: e.g. fit what pass p - 1 summed
        for step in steps: analyzer.update(state, step)
        (states of shards merge here; entries of finished passes are frozen)
    result = analyzer.finalize(state, info)    # from the state alone: no model needed

Analyzers never change during a run: what a run needs beyond the options (the model, the pass
index, what ``setup`` returned, reusable helpers such as a resumer) comes in the
:class:`RunContext` of every :class:`Step`; everything learnt from the data lives in the state.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_type_hints

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.depth import depth_profiles
from lensdiv.core.errors import OptionError, did_you_mean
from lensdiv.core.stats import Stats

if TYPE_CHECKING:
    from lensdiv.core.bridge import Bridge
    from lensdiv.core.results import Result

Numerics = Literal["raw", "folded"]


@dataclass(frozen=True)
class ModelInfo:
    """What analyzers may know about the model before any forward pass.

    Args:
        name: The spec or id the model was loaded from.
        n_layers: Number of blocks ``L``.
        d_model: Residual stream width.
        d_vocab: Vocabulary size.
        n_heads: Attention heads per block.
        normalization: ``"LN"``, ``"RMS"``, ... or ``None``.
        parallel_residual: Attention and MLP both read ``h_l`` (GPT-NeoX/Pythia).
        hook_names: Every hook the model exposes.
        n_ctx: Context length: the most positions one sequence may have (``0``: unknown).
    """

    name: str
    n_layers: int
    d_model: int
    d_vocab: int
    n_heads: int
    normalization: str | None
    parallel_residual: bool
    hook_names: frozenset[str]
    n_ctx: int = 0

    @classmethod
    def from_model(cls, model: Bridge, name: str | None = None) -> ModelInfo:
        """Read the facts off a ``TransformerBridge``."""
        cfg = model.cfg
        return cls(
            name=name or str(getattr(cfg, "model_name", "model")),
            n_layers=int(cfg.n_layers),
            d_model=int(cfg.d_model),
            d_vocab=int(model.W_U.shape[1]),
            n_heads=int(cfg.n_heads),
            normalization=getattr(cfg, "normalization_type", None),
            parallel_residual=bool(getattr(cfg, "parallel_attn_mlp", False)),
            hook_names=frozenset(model.hook_dict),
            n_ctx=int(getattr(cfg, "n_ctx", 0) or 0),
        )

    def to_dict(self) -> dict[str, Any]:
        """The facts as JSON data (hook names sorted): saved in every run's manifest, so merged
        shards finalize without the model."""
        data = dataclasses.asdict(self)
        data["hook_names"] = sorted(self.hook_names)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelInfo:
        """Inverse of :meth:`to_dict`."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        values["hook_names"] = frozenset(values.get("hook_names", ()))
        return cls(**values)

    def resid(self, layer: int) -> str:
        """Hook holding ``h_layer`` (``0 ≤ layer ≤ L``): block inputs, then the last output."""
        if not 0 <= layer <= self.n_layers:
            raise ValueError(f"residual index {layer} outside 0..{self.n_layers}")
        if layer == self.n_layers:
            return f"blocks.{self.n_layers - 1}.hook_resid_post"
        return f"blocks.{layer}.hook_resid_pre"


@dataclass
class Batch:
    """One batch of packed sequences.

    Args:
        tokens: Token ids; pad positions hold the pad id.
        mask: True at real tokens. Sequences are right-padded, so with causal attention no real
            position ever attends to a pad.
        bos: Whether position 0 of every row is a BOS token.
        index: Batch number in the run.
        doc: Index of the source document of every position (-1 at pads), when known; lets
            analyzers hold out whole documents.
        extra: Per-example fields of task data (targets, answer positions, grades, ...), set by
            analyzers that bring their own examples (:meth:`Analyzer.examples`).
    """

    tokens: Int[Tensor, "batch pos"]
    mask: Bool[Tensor, "batch pos"]
    bos: bool = True
    index: int = 0
    doc: Int[Tensor, "batch pos"] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        """Number of real (non-pad) tokens."""
        return int(self.mask.sum())

    def positions(self, *, exclude_bos: bool = False) -> Bool[Tensor, "batch pos"]:
        """Positions that may enter a statistic: real tokens, optionally without BOS."""
        keep = self.mask.clone()
        if exclude_bos and self.bos:
            keep[:, 0] = False
        return keep

    def next_tokens(self) -> tuple[Int[Tensor, "batch pos"], Bool[Tensor, "batch pos"]]:
        """Next-token targets and where they exist (the last real token of a row has none)."""
        targets = torch.zeros_like(self.tokens)
        targets[:, :-1] = self.tokens[:, 1:]
        valid = torch.zeros_like(self.mask)
        valid[:, :-1] = self.mask[:, :-1] & self.mask[:, 1:]
        return targets, valid


@dataclass
class RunContext:
    """What one run gives its analyzers beyond the batch.

    Args:
        model: The ``TransformerBridge``.
        info: Model facts.
        resources: What each analyzer's :meth:`Analyzer.setup` returned, by analyzer name.
        pass_index: Which pass over the data is running.
        lens: The lens residual states are read through (``--lens``): a
            :class:`~lensdiv.ops.translators.Translator`, or ``None`` for the logit lens
            (:func:`lensdiv.ops.readout.lens_of` reads it).
    """

    model: Bridge
    info: ModelInfo
    resources: dict[str, Any] = field(default_factory=dict)
    pass_index: int = 0
    lens: Any = None
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def cached(self, key: Any, factory: Callable[[], Any]) -> Any:
        """A helper object built once per run and shared by every batch and analyzer that asks
        with the same ``key`` (e.g. a :class:`~lensdiv.ops.resume.Resumer`)."""
        if key not in self._cache:
            self._cache[key] = factory()
        return self._cache[key]


class Step:
    """What ``Analyzer.update`` sees for one batch: the clean pass and a way to run more.

    The model, its facts and the pass index belong to the run, so a step reads them from its
    :class:`RunContext`; a step made by hand (in a test) may give ``model`` and ``info``
    instead, and gets a private context.

    Args:
        batch: The tokens and mask.
        cache: Activations of the clean pass for the union of declared hooks.
        logits: Output logits, when some analyzer declared ``needs_logits``.
        model: The ``TransformerBridge``, when no ``context`` is given.
        info: Its facts, when no ``context`` is given.
        pass_index: Which pass over the data this is, when no ``context`` is given.
        context: The run's :class:`RunContext`.
    """

    def __init__(
        self,
        batch: Batch,
        cache: Any,  # {hook name: Tensor}: a dict, or TransformerLens' ActivationCache
        logits: Float[Tensor, "batch pos d_vocab"] | None,
        model: Bridge | None = None,
        info: ModelInfo | None = None,
        pass_index: int = 0,
        *,
        context: RunContext | None = None,
    ) -> None:
        if context is None:
            if model is None or info is None:
                raise TypeError("a Step needs the run's context, or a model and its info")
            context = RunContext(model, info, pass_index=pass_index)
        elif model is not None or info is not None:
            raise TypeError("a Step takes the model and its info from its context: give one")
        self.batch = batch
        self.cache = cache
        self.logits = logits
        self.context = context

    @property
    def model(self) -> Any:
        """The ``TransformerBridge`` (for readouts and interventions)."""
        return self.context.model

    @property
    def info(self) -> ModelInfo:
        """Model facts."""
        return self.context.info

    @property
    def pass_index(self) -> int:
        """Which pass over the data this is (``0`` unless the analyzer asked for more, see
        :attr:`Analyzer.passes`)."""
        return self.context.pass_index

    def __repr__(self) -> str:
        return f"Step(batch {self.batch.index}, pass {self.pass_index}, {self.info.name})"

    def cached(self, key: Any, factory: Callable[[], Any]) -> Any:
        """See :meth:`RunContext.cached`."""
        return self.context.cached(key, factory)

    def resource(self, analyzer: str) -> Any:
        """What ``analyzer``'s :meth:`Analyzer.setup` returned for this run (``None`` if none)."""
        return self.context.resources.get(analyzer)

    def resid(self, layer: int) -> Float[Tensor, "batch pos d_model"]:
        """``h_layer`` from the clean pass."""
        resid: Tensor = self.cache[self.info.resid(layer)]
        return resid

    def forward(
        self,
        tokens: Int[Tensor, "batch pos"] | None = None,
        fwd_hooks: Sequence[tuple[str, Callable[..., Any]]] = (),
    ) -> Float[Tensor, "batch pos d_vocab"]:
        """Run an extra (intervened) forward pass and return its logits."""
        tokens = self.batch.tokens if tokens is None else tokens
        with torch.no_grad(), self.model.hooks(fwd_hooks=list(fwd_hooks)):
            logits: Tensor = self.model(tokens)
        return logits


@dataclass(frozen=True)
class DataFacts:
    """What a run knows of its corpus before the first forward pass, for
    :meth:`Analyzer.check_data`.

    Args:
        seq_len: Tokens per packed row, BOS included (``--seq-len``).
        max_tokens: The token budget (``--max-tokens``).
        batch_size: Rows per batch.
        first_row: Reads ``(real tokens of the first row, why no row is longer)``, on first
            use of :attr:`longest` (it tokenises the start of the data). No later row is longer:
            packing fills every row but the last, and a token tensor's rows share one width.
    """

    seq_len: int
    max_tokens: int
    batch_size: int
    first_row: Callable[[], tuple[int, str]] = field(repr=False, compare=False)

    @functools.cached_property
    def _longest(self) -> tuple[int, str]:
        return self.first_row()

    @property
    def longest(self) -> int:
        """The most real tokens (BOS included) any row of the run holds."""
        return self._longest[0]

    @property
    def limit(self) -> str:
        """What makes :attr:`longest` the most, for messages (``--seq-len 32 makes rows of at
        most 32 tokens``, ``the data holds only 9 tokens``)."""
        return self._longest[1]


class Analyzer(abc.ABC):
    """Base class of every analysis. Subclasses are ``@dataclass(frozen=True)``; fields = options.

    Class attributes declare the plugin and its needs (the runner reads them, never probes):

    Attributes:
        name: Plugin name (also the output folder).
        aliases: Short names accepted on the command line.
        description: One line for ``lensdiv plugins list``.
        needs_logits: The clean pass must run to the logits.
        extra_forwards: ``update`` runs further forward passes (interventional).
        needs_grad: ``update`` needs autograd.
        numerics: ``"raw"`` (Hugging Face weights as they are; right for norms and angles) or
            ``"folded"`` (LayerNorm folded, unembedding centred).
        passes: How many times ``update`` sees the data. An analyzer that needs a dataset
            statistic before it can measure (a mean residual, a fitted map) asks for 2; the
            runner calls :meth:`start_pass` before each later pass and streams the data again.
            Where the count depends on the model, override :meth:`n_passes` instead. A training
            (a tuned lens) reads the data onward instead: see :meth:`pass_tokens`.
        depth_profiles: The per-layer columns that are this analyzer's depth profile, as
            ``"table.column"`` names: the curves a study of several models draws over relative
            depth ℓ/L, one line per model (:mod:`lensdiv.core.depth` says which tables are
            per-layer). ``None`` (the default, right for most third-party analyzers): every
            numeric column of every per-layer table; ``()``: none.
        reads_lens: It reads residual states through the run's lens (``--lens``, with
            :func:`lensdiv.ops.readout.lens_of`); a run with a fitted lens but no such analyzer
            warns that the lens applies to none of them.

    Analyzers that measure on task examples rather than on the corpus (patching pairs, graded
    prompts) override :meth:`examples`; they still stream through ``update``.
    """

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    needs_logits: ClassVar[bool] = False
    extra_forwards: ClassVar[bool] = False
    needs_grad: ClassVar[bool] = False
    numerics: ClassVar[Numerics] = "raw"
    passes: ClassVar[int] = 1
    depth_profiles: ClassVar[tuple[str, ...] | None] = None
    reads_lens: ClassVar[bool] = False

    @abc.abstractmethod
    def hooks(self, info: ModelInfo) -> list[str]:
        """TransformerLens hook names this analyzer reads from the clean pass."""

    @classmethod
    def profiles(cls, result: Result, n_layers: int) -> list[tuple[str, str]]:
        """``(table, column)`` of each depth profile of ``result`` on a model of ``n_layers``
        blocks: the declared :attr:`depth_profiles` the result has, or the default."""
        return depth_profiles(result, n_layers, cls.depth_profiles)

    def n_passes(self, info: ModelInfo) -> int:
        """Passes over the data this analyzer needs on this model (default :attr:`passes`)."""
        return self.passes

    def interventions(self, info: ModelInfo, index: int) -> int:
        """Interventions :meth:`update` makes per sequence in pass ``index`` (default 0: none).
        An interventional analyzer that makes many (every range of blocks removed) declares
        them: the progress bar then counts interventions done beside the tokens."""
        return 0

    def pass_tokens(self, info: ModelInfo) -> int | None:
        """``None`` (the default): every pass streams all the data again. A number ``N``: the
        passes read the data *onward*, one stream cut into steps — pass ``p`` gets the next
        whole batches of at least ``N`` real tokens (the last may have fewer, or none when the
        data ran out) — so that :meth:`start_pass` is an optimiser step on the gradient pass
        ``p - 1`` summed (a training: :class:`~lensdiv.lenses.tuned.TunedFit`). Such an
        analyzer runs in a group of its own, and every pass's tokens count."""
        return None

    def min_tokens(self, info: ModelInfo) -> int:
        """The fewest corpus tokens whose numbers mean anything on this model (default 0: no
        floor). A ``--max-tokens`` below it is refused before the run; a corpus that runs out
        below it puts a warning on the result."""
        return 0

    def check_data(self, data: DataFacts, info: ModelInfo) -> None:  # noqa: B027
        """Refuse, before any forward pass, options that cannot work on the run's corpus (a
        stride longer than any row); the default accepts all. Called once, after the model
        loaded, for an analyzer that reads the corpus (not for one with :meth:`examples`).

        Raises:
            OptionError: Naming the option, what it needs and what the data gives.
        """

    def setup(self, model: Bridge, info: ModelInfo) -> Any:
        """Load and check what the run needs beyond the model (e.g. a reference model), once,
        before any forward pass, so a bad input fails fast. The return value reaches every
        step as ``step.resource(self.name)``; it is never part of the state."""
        return None

    def init(self, info: ModelInfo) -> Stats:
        """Empty state before the first batch."""
        return Stats()

    @abc.abstractmethod
    def update(self, state: Stats, step: Step) -> None:
        """Fold one batch into ``state``."""

    @abc.abstractmethod
    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        """Turn the accumulated state into a result."""

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:  # noqa: B027
        """Called before pass ``index >= 1`` (see :attr:`passes`) on the merged state of all
        shards; e.g. fit what pass 0 summed and ``put`` the fit into the state. It must depend
        on the state alone, so every process computes the same thing."""

    def examples(self, model: Bridge, info: ModelInfo) -> Iterable[Batch] | None:
        """This analyzer's own examples, or ``None`` to read the run's corpus (the default).

        Called once, before any forward pass, so bad task data fails fast with a
        :class:`~lensdiv.core.errors.DataError`; return a list (it is iterated once per pass).
        Per-example fields go in :attr:`Batch.extra`.
        """
        return None

    # -- options -------------------------------------------------------------------------------
    def options(self) -> dict[str, Any]:
        """The option values, as recorded in every result."""
        return {f.name: getattr(self, f.name) for f in self.option_fields()}

    @classmethod
    def option_fields(cls) -> list[dataclasses.Field[Any]]:
        """The dataclass fields that are this analyzer's options."""
        return list(dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else []

    @classmethod
    def option_docs(cls) -> list[dict[str, str]]:
        """Each option's name, default, type (choices spelled out) and its line of the class
        docstring's ``Args:`` section (or of the base class that declares it): what ``lensdiv
        plugins show`` prints."""
        hints = get_type_hints(cls) if cls.option_fields() else {}
        helps: dict[str, str] = {}
        for klass in reversed(cls.__mro__):  # a base's options, unless the class restates them
            helps.update(_docstring_args(klass.__doc__ or ""))
        rows = []
        for f in cls.option_fields():
            if f.default is not dataclasses.MISSING:
                default = str(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = str(f.default_factory())
            else:
                default = "(required)"
            rows.append(
                {
                    "name": f.name,
                    "default": default,
                    "type": _type_name(hints.get(f.name, Any)),
                    "help": helps.get(f.name, ""),
                }
            )
        return rows

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> Analyzer:
        """Build an instance from ``{option: value}``; strings are parsed to the field's type,
        other values checked against it (``True`` is no ``int``, ``2.5`` no ``int``, NaN and
        infinities no ``float``)."""
        options = dict(options or {})
        fields = {f.name: f for f in cls.option_fields()}
        hints = get_type_hints(cls) if fields else {}
        parsed = {}
        for key, value in options.items():
            if key not in fields:
                known = ", ".join(fields) or "none"
                raise OptionError(
                    f"analyzer {cls.name!r} has no option {key!r}{did_you_mean(str(key), list(fields))}",
                    hint=f"its options are: {known}",
                )
            parsed[key] = _parse_option(cls.name, key, value, hints.get(key, Any))
        try:
            return cls(**parsed)
        except Exception as err:  # an option the analyzer refuses (its __post_init__)
            raise OptionError(f"analyzer {cls.name!r}: {err}") from None


def checked_options(analyzer: Analyzer) -> Analyzer:
    """``analyzer`` with every option value checked against its annotation, as
    :meth:`Analyzer.from_options` checks values given by name (``2.0`` for an ``int`` becomes
    ``2``; ``True`` for an ``int``, NaN for a ``float`` raise :class:`OptionError`)."""
    cls = type(analyzer)
    fields = [f for f in cls.option_fields() if f.init]
    hints = get_type_hints(cls) if fields else {}
    changed = {}
    for f in fields:
        value = getattr(analyzer, f.name)
        parsed = _parse_option(cls.name, f.name, value, hints.get(f.name, Any))
        if parsed is not value and (type(parsed) is not type(value) or parsed != value):
            changed[f.name] = parsed
    if not changed:
        return analyzer
    try:
        return dataclasses.replace(analyzer, **changed)  # type: ignore[type-var]  # a dataclass: option_fields() found fields
    except Exception as err:  # an option the analyzer refuses (its __post_init__)
        raise OptionError(f"analyzer {cls.name!r}: {err}") from None


def _parse_option(analyzer: str, key: str, value: Any, hint: Any) -> Any:
    """Coerce a command-line string to the annotated type of an option; check other values."""
    if not isinstance(value, str):
        return _typed_option(analyzer, key, value, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value.lower() in ("none", "null") and len(inner) < len(args):
            return None
        hint = inner[0] if len(inner) == 1 else str
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise OptionError(
                f"option {analyzer}.{key} must be one of {', '.join(map(str, args))}, not {value!r}"
            )
        return value
    if origin in (tuple, list):
        return tuple(
            _parse_option(analyzer, key, v, args[0] if args else str) for v in value.split(",") if v
        )
    try:
        if hint is bool:
            lowered = value.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return lowered in ("true", "1", "yes")
        if hint in (int, float):
            number = hint(value)
    except ValueError:
        raise OptionError(
            f"option {analyzer}.{key} expects {hint.__name__}, got {value!r}"
        ) from None
    if hint in (int, float):
        return _finite(analyzer, key, number, value)
    return value


def _typed_option(analyzer: str, key: str, value: Any, hint: Any) -> Any:
    """Check a value given as a Python object (not text) against an option's annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    wrong = OptionError(
        f"option {analyzer}.{key} expects {_type_name(hint)}, got {value!r} "
        f"({type(value).__name__})"
    )
    if hint is Any or isinstance(hint, typing.TypeVar):
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for inner in (a for a in args if a is not type(None)):
            try:
                return _typed_option(analyzer, key, value, inner)
            except OptionError:
                continue
        raise wrong
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise OptionError(
            f"option {analyzer}.{key} must be one of {', '.join(map(str, args))}, not {value!r}"
        )
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            raise wrong
        item = args[0] if args else Any
        return tuple(_parse_option(analyzer, key, v, item) for v in value)
    if hint is bool:
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            return bool(value)
        raise wrong
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong
        if isinstance(value, numbers.Integral):
            return int(value)
        number = float(value)
        if math.isfinite(number) and number.is_integer():
            return int(number)
        raise wrong
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise wrong
        return _finite(analyzer, key, float(value), value)
    if hint is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        raise wrong
    if isinstance(hint, type) and not isinstance(value, hint):
        raise wrong
    return value


def _finite(analyzer: str, key: str, number: Any, given: Any) -> Any:
    if isinstance(number, float) and not math.isfinite(number):
        raise OptionError(
            f"option {analyzer}.{key} must be a finite number, got {given!r}",
            hint=f"give a number such as -O {analyzer}.{key}=0.5",
        )
    return number


def _type_name(hint: Any) -> str:
    """``Literal['a', 'b']`` → ``a|b``; ``int | None`` → ``int|None``; classes by name."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "|".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in args)
    if origin in (tuple, list):
        return f"comma-separated {_type_name(args[0]) if args else 'str'}"
    if hint is type(None):
        return "None"
    return getattr(hint, "__name__", str(hint))


def _docstring_args(doc: str) -> dict[str, str]:
    """``{name: text}`` from a Google-style ``Args:`` section (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = doc.expandtabs().splitlines()
    inside, indent, current = False, None, None
    for line in lines:
        stripped = line.strip()
        if stripped in ("Args:", "Arguments:"):
            inside, indent, current = True, None, None
            continue
        if not inside:
            continue
        if not stripped:
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent or (stripped.endswith(":") and width <= indent and " " not in stripped):
            inside = False
            continue
        if width == indent and ":" in stripped:
            names, text = stripped.split(":", 1)
            current = [n.strip() for n in names.split(",")]
            for name in current:
                out[name] = text.strip()
        elif current:
            for name in current:
                out[name] = f"{out[name]} {stripped}".strip()
    return out
