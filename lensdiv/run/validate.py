"""One validation step, shared by the command line and the Python API: every check that can be
made before expensive work is made before it, and every failure is one
:class:`~lensdiv.core.errors.LensdivError` (the CLI prints one line and exits 2).

Before the model loads: argument types, the data source, analyzer names and option values, the
device, the output folder (and the toy-model cache, in :func:`lensdiv.models.toy.check_cache`).
After it loads, before any batch: the context length against ``seq_len`` and every task prompt,
the tokenizer against the vocabulary, and each analyzer's ``hooks``, ``examples`` and ``setup``
— isolated, so an analyzer that cannot support the model is skipped with its reason and one that
crashes is marked failed while the others run. During the run, :func:`checked` checks every
batch against the model before it is fed.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lensdiv.core.analyzer import Analyzer, Batch, DataFacts, ModelInfo
from lensdiv.core.bridge import Bridge, Tokenizer
from lensdiv.core.devices import check_device, input_device
from lensdiv.core.errors import (
    DataError,
    LensdivError,
    LensWarning,
    ModelLoadError,
    OptionError,
    UnsupportedModelError,
)
from lensdiv.core.files import folder_problem
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.ops.capture import capture
from lensdiv.ops.translators import PHRASES
from lensdiv.run.engine import check_hooks, describe, shown
from lensdiv.run.outcome import MANIFEST
from lensdiv.run.report import REPORT, VIEWS


def warn_unread_lens(lens: Any, analyzers: Sequence[Analyzer]) -> None:
    """Warn (:class:`~lensdiv.core.errors.LensWarning`) when a fitted lens is given but none of
    ``analyzers`` reads residual states through it (``Analyzer.reads_lens``)."""
    if lens.identity or any(type(a).reads_lens for a in analyzers):
        return
    names = ", ".join(a.name for a in analyzers)
    warnings.warn(
        f"the {PHRASES[lens.kind]} {lens.spec} applies to none of the selected analyzers "
        f"({names}): none of them reads residual states through a lens, so the run is the "
        "same without it",
        LensWarning,
        stacklevel=3,  # at the caller of analyze()
    )


# A text any tokenizer worth the name turns into several tokens.
_PROBE = "The quick brown fox jumps over the lazy dog."


# -- before the model loads ------------------------------------------------------------------------
def check_arguments(
    *,
    out: Any,
    device: Any,
    seed: Any,
    flags: dict[str, Any],
) -> Path | None:
    """Check the arguments of :func:`~lensdiv.run.runner.analyze` that are not data or options.

    Args:
        out: The output folder argument (``None``, a string or a path).
        device: The device argument (``None``/``"auto"``, a name, an index or a ``torch.device``).
        seed: The seed (a whole number torch accepts).
        flags: ``{name: value}`` of arguments that must be ``True`` or ``False``.

    Returns:
        ``out`` as a ``Path`` (``None`` stays ``None``).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        raise OptionError(
            f"--seed must be a whole number between -2^63 and 2^63 - 1, not {seed!r}",
            hint="e.g. --seed 0",
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise OptionError(
                f"{name} must be True or False, not {value!r} ({type(value).__name__})"
            )
    if device is not None and str(device) != "auto":
        check_device(device)
    if out is None:
        return None
    if isinstance(out, bool) or not isinstance(out, (str, os.PathLike)):
        raise OptionError(
            f"out must be a folder path, not {out!r} ({type(out).__name__})",
            hint="e.g. out='runs/toy', or out=None to write nothing",
        )
    if not os.fspath(out).strip():
        raise OptionError("the output folder is empty", hint="name a folder, e.g. --out runs/toy")
    return Path(out).expanduser()


def check_output(out: Path | None, analyzers: Sequence[Analyzer], *, overwrite: bool) -> None:
    """The results can be written to ``out``, and it holds no other run (unless ``overwrite``).

    Raises:
        OptionError: ``out`` is (or lies under) a file, is not writable, holds another run, or
            has a folder of the name an analyzer writes to that lensdiv did not write.
    """
    if out is None:
        return
    problem = folder_problem(out)
    if problem is not None:
        raise OptionError(
            f"cannot write results to --out {out}: {problem}",
            hint="choose a folder you can write to",
        )
    old, foreign = previous_run(out, analyzers)
    if foreign:
        raise OptionError(
            f"--out {out} has a folder {foreign[0]} that is no lensdiv result, where "
            f"analyzer {foreign[0].rstrip('/')!r} would write",
            hint="move that folder, or choose another --out (--overwrite never removes it)",
        )
    if old and not overwrite:
        shown = ", ".join(old[:4]) + (", ..." if len(old) > 4 else "")
        raise OptionError(
            f"--out {out} already holds a run ({shown})",
            hint="pass --overwrite (overwrite=True) to replace it, or choose another folder",
        )


def previous_run(out: Path, analyzers: Sequence[Analyzer]) -> tuple[list[str], list[str]]:
    """What of an earlier run sits in ``out`` — its manifest, the folders it names, and result
    folders of this run's analyzers — and which folders this run would write into that are not
    lensdiv's (no ``result.json``, named by no manifest)."""
    if not out.is_dir():
        return [], []
    ours, named = [], []
    manifest = out / MANIFEST
    if manifest.exists():
        # The run's own files: its manifest, report and prompt views.
        ours += [name for name in (MANIFEST, REPORT, VIEWS) if (out / name).is_file()]
        try:
            old = json.loads(manifest.read_text())
            entries = old.get("analyzers", {}) if isinstance(old, dict) else {}
            named = [n for n in entries if isinstance(n, str)] if isinstance(entries, dict) else []
        except (OSError, ValueError):  # a damaged manifest: the result folders still count
            pass
    foreign = []
    for name in dict.fromkeys([*named, *(a.name for a in analyzers)]):
        folder = out / name
        if not _plain_name(name) or not folder.exists():
            continue
        if name in named or (folder / "result.json").is_file():
            ours.append(f"{name}/")
        else:
            foreign.append(f"{name}/")
    return ours, foreign


def clear_output(out: Path | None, analyzers: Sequence[Analyzer]) -> None:
    """Remove an earlier run from ``out``: its manifest and the result folders it (or this run)
    has there. Nothing else in the folder is touched."""
    if out is None:
        return
    for name in previous_run(out, analyzers)[0]:
        path = out / name.rstrip("/")
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as err:
            raise OptionError(
                f"--overwrite cannot remove {path}: {err.strerror or err}",
                hint="remove it yourself, or choose another --out",
            ) from None


def _plain_name(name: str) -> bool:
    """A single path component (never ``..``, ``/`` or empty): safe to remove under ``out``."""
    return bool(name) and name not in (".", "..") and Path(name).name == name


# -- after the model loads, before any batch --------------------------------------------------------
def check_model(model: Bridge, info: ModelInfo, spec: DataSpec) -> None:
    """The data fits the model: ``seq_len`` (or a token tensor's width) within the context,
    a usable tokenizer whose ids (and the BOS/EOS/pad ids packing uses) the model can embed.

    Raises:
        OptionError: ``seq_len`` beyond the context.
        DataError: A token tensor too wide, or with ids outside the vocabulary.
        ModelLoadError: No usable tokenizer, or one with more tokens than the model embeds.
    """
    if spec.tokens is not None:
        width, top = int(spec.tokens.shape[1]), int(spec.tokens.max())
        if info.n_ctx and width > info.n_ctx:
            raise DataError(
                f"the token tensor has {width} positions, more than the {info.n_ctx} of "
                f"{info.name}'s context",
                hint=f"cut its rows to at most {info.n_ctx} tokens",
            )
        if top >= info.d_vocab:
            raise DataError(
                f"the token tensor holds id {top}, outside {info.name}'s vocabulary of "
                f"{info.d_vocab} tokens",
                hint="tokenize with this model's tokenizer",
            )
        return
    if info.n_ctx and spec.seq_len > info.n_ctx:
        raise OptionError(
            f"--seq-len {spec.seq_len} is longer than the {info.n_ctx} positions of "
            f"{info.name}'s context",
            hint=f"use --seq-len {info.n_ctx} or less",
        )
    tokenizer = getattr(model, "tokenizer", None)
    problem = tokenizer_problem(tokenizer)
    if problem is not None:
        raise ModelLoadError(
            f"{info.name} has no usable tokenizer: {problem}",
            hint="save the model's tokenizer beside it (tokenizer.save_pretrained(FOLDER)), "
            "or pass token ids as data",
        )
    size = int(getattr(tokenizer, "vocab_size", 0) or 0)
    if size > info.d_vocab:
        raise ModelLoadError(
            f"{info.name}'s tokenizer has {size} tokens but the model embeds only "
            f"{info.d_vocab}, so ids {info.d_vocab}-{size - 1} cannot be read",
            hint="use the tokenizer that belongs to this model",
        )
    for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, special, None)
        if special == "bos_token_id" and spec.bos == "none":
            continue
        if isinstance(value, int) and value >= info.d_vocab:
            raise ModelLoadError(
                f"{info.name}'s tokenizer uses id {value} as its {special[:-9].upper()} token, "
                f"outside the model's vocabulary of {info.d_vocab}",
                hint="use the tokenizer that belongs to this model"
                + (" (or --bos none)" if special == "bos_token_id" else ""),
            )


def check_runs(model: Bridge, info: ModelInfo) -> None:
    """The model runs: one forward pass over a few tokens, reading every residual state and the
    logits as a run does. TransformerLens boots some architectures it cannot run (a component
    adapter that does not match the installed ``transformers``): that is said once, here, not
    by every analyzer after the data was read. Once per model: a later run on the same model
    (same dtype, device, weights and compatibility mode) does not probe it again.

    Raises:
        ModelLoadError: The forward pass fails, naming the architecture and the error.
        OptionError: It runs out of memory.
    """
    key: tuple[Any, ...] | None = _probe_key(model)
    try:
        if _PROBED.get(model) == key:
            return
    except TypeError:  # a model that cannot be weakly referenced: probed every time
        key = None
    tokens = torch.arange(min(8, info.d_vocab, info.n_ctx or 8))[None].to(input_device(model))
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    try:
        with torch.no_grad():
            capture(model, tokens, [n for n in names if n in info.hook_names], need_logits=True)
    except (MemoryError, torch.cuda.OutOfMemoryError) as err:
        raise OptionError(
            f"out of memory in a forward pass over {tokens.shape[1]} tokens ({describe(err)})",
            hint="use a smaller --dtype, or --device-map to spread the model",
        ) from None
    except LensdivError:
        raise
    except Exception as err:  # whatever the architecture's code raises
        cfg = getattr(model, "cfg", None)
        arch = getattr(cfg, "architecture", None) or type(model).__name__
        raise ModelLoadError(
            f"TransformerLens {_version('transformer-lens')} loads {info.name} ({arch}) but cannot "
            f"run it: {describe(err)}",
            hint="this architecture does not run in the installed TransformerLens "
            f"{_version('transformer-lens')} / transformers {_version('transformers')}; try "
            "other versions of them, or another model",
        ) from None
    if key is not None:
        _PROBED[model] = key


# The models that passed the probe, with what it ran on: a later run on the same model skips it
# (a forward pass, a run's largest fixed cost on a loaded machine) unless the model was moved to
# another dtype or device, its weights replaced (folding) or its compatibility mode switched.
_PROBED: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def _probe_key(model: Bridge) -> tuple[Any, ...]:
    """What the probe's success depends on, beyond the model object: its first weight's dtype,
    device and storage, and the compatibility mode."""
    weight = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    where: tuple[Any, ...] = ()
    if weight is not None:
        ptr = weight.data_ptr() if weight.device.type != "meta" else id(weight)
        where = (weight.dtype, str(weight.device), ptr)
    return (bool(getattr(model, "compatibility_mode", False)), *where)


def _version(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def tokenizer_problem(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` cannot tokenize text (missing, a placeholder, no tokens), or ``None``."""
    if tokenizer is None:
        return "none was found"
    try:
        size = len(tokenizer)
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as err:  # whatever a broken tokenizer raises
        return f"it fails on plain text ({describe(err)})"
    if size < 2 or not ids:
        return f"it has {size} token(s) and turns text into {len(ids)} ids (a placeholder)"
    return None


@dataclass
class Prepared:
    """What each analyzer needs for the run, gathered before any forward pass.

    Args:
        hooks: Hook names by analyzer (checked to exist).
        tasks: Each analyzer's own examples, or ``None`` for the corpus.
        resources: What each analyzer's ``setup`` returned.
        skipped: ``{analyzer: reason}`` for analyzers that cannot support the model.
        failed: ``{analyzer: "Type: message (where)"}`` for analyzers that crashed.
    """

    hooks: dict[str, list[str]] = field(default_factory=dict)
    tasks: dict[str, list[Batch] | None] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def ready(self, analyzers: Iterable[Analyzer]) -> list[Analyzer]:
        """The analyzers neither skipped nor failed."""
        return [a for a in analyzers if a.name not in self.skipped and a.name not in self.failed]


def prepare(
    analyzers: Sequence[Analyzer], model: Bridge, info: ModelInfo, data: DataFacts | None = None
) -> Prepared:
    """Each analyzer's hooks, examples, check of the corpus (``data``, for those that read it)
    and setup, in that order for all (so a bad task file or an option the data cannot serve
    fails before a reference model loads), each call isolated.

    An :class:`~lensdiv.core.errors.UnsupportedModelError` skips that analyzer; another
    ``LensdivError`` (a bad task file, a bad option value for this model) is the user's to fix
    and stops the run before anything is written; any other exception marks the analyzer failed.

    Raises:
        LensdivError: A mistake of the user's, found by an analyzer or in its examples.
    """
    done = Prepared()

    def attempt(a: Analyzer, where: str, call: Callable[[], Any]) -> Any:
        if a.name in done.skipped or a.name in done.failed:
            return None
        try:
            return call()
        except UnsupportedModelError as err:
            done.skipped[a.name] = str(err)
        except (LensdivError, KeyboardInterrupt):
            raise
        except BaseException as err:  # a broken plugin (sys.exit too) must not take the run down
            done.failed[a.name] = f"{describe(err)} ({where})"
        return None

    def needs(a: Analyzer) -> list[str]:
        # Model-dependent; a plugin may raise here too, or return what the runner cannot use.
        for method, least in (("n_passes", 1), ("min_tokens", 0)):
            value = getattr(a, method)(info)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise TypeError(
                    f"{method} returned {shown(value)}, expected a whole number of at least {least}"
                )
        return check_hooks([a], info)[a.name]

    for a in analyzers:
        hooks = attempt(a, "hooks", partial(needs, a))
        if hooks is not None:
            done.hooks[a.name] = hooks
    for a in analyzers:
        done.tasks[a.name] = attempt(a, "examples", partial(_own_examples, a, model, info))
    for a in analyzers:
        if data is not None and done.tasks.get(a.name) is None:
            attempt(a, "check_data", partial(a.check_data, data, info))
    for a in analyzers:
        done.resources[a.name] = attempt(a, "setup", partial(a.setup, model, info))
    return done


def corpus_facts(spec: DataSpec, tokenizer: Tokenizer) -> DataFacts:
    """What :meth:`Analyzer.check_data` may know of the corpus of ``spec``; the length of its
    first row is read (the start of the data tokenised) only if an analyzer asks."""

    def first_row() -> tuple[int, str]:
        stream = iter(token_batches(spec, tokenizer))
        try:
            n = int(next(stream).mask[0].sum())
        finally:  # the rest is read by the run itself
            if isinstance(stream, Generator):
                stream.close()
        if spec.tokens is not None and n == spec.tokens.shape[1]:
            return n, f"the token tensor's rows hold {n} tokens"
        if spec.tokens is None and n >= spec.seq_len:
            return n, f"--seq-len {spec.seq_len} makes rows of at most {n} tokens"
        if n >= spec.max_tokens:
            return n, f"--max-tokens {spec.max_tokens} leaves one row of {n} tokens"
        return n, f"the data makes one row of only {n} tokens"

    return DataFacts(
        seq_len=spec.seq_len,
        max_tokens=spec.max_tokens,
        batch_size=spec.batch_size,
        first_row=first_row,
    )


def check_budget(analyzers: Iterable[Analyzer], info: ModelInfo, spec: DataSpec) -> None:
    """``--max-tokens`` gives every corpus analyzer at least the tokens it needs
    (:meth:`Analyzer.min_tokens`).

    Raises:
        OptionError: Naming the analyzer, what it needs and the flag to raise.
    """
    for a in analyzers:
        need = a.min_tokens(info)
        if spec.max_tokens < need:
            raise OptionError(
                f"{a.name} needs at least {need} tokens on {info.name} for numbers that mean "
                f"anything; --max-tokens {spec.max_tokens} gives fewer",
                hint=f"use --max-tokens {need} or more",
            )


def short_data_warning(analyzer: Analyzer, info: ModelInfo, tokens: int) -> str | None:
    """A warning for a result computed on fewer corpus tokens than the analyzer needs."""
    try:
        need = analyzer.min_tokens(info)
    except Exception:  # checked in prepare(); a plugin that raises now gets no warning
        return None
    if tokens >= need:
        return None
    return (
        f"only {tokens} tokens were analysed, fewer than the {need} {analyzer.name} needs on "
        f"{info.name}: treat these numbers as unreliable"
    )


def _own_examples(analyzer: Analyzer, model: Bridge, info: ModelInfo) -> list[Batch] | None:
    own = analyzer.examples(model, info)
    if own is None:
        return None
    batches = list(own)
    for batch in batches:
        if not isinstance(batch, Batch):
            raise TypeError(f"examples returned {shown(batch)} among its batches, expected Batches")
        _check_batch(batch, info, _examples_of(analyzer))
    return batches


def _examples_of(analyzer: Analyzer) -> str:
    """How messages name an analyzer's examples: by the task file an option names, if any."""
    for name, value in analyzer.options().items():
        if isinstance(value, str) and value and Path(value).is_file():
            return f"{analyzer.name}'s examples (-O {analyzer.name}.{name}={value})"
    return f"{analyzer.name}'s examples"


def _check_batch(batch: Batch, info: ModelInfo, what: str) -> None:
    """A batch fits the model: width within the context, ids within the vocabulary."""
    width = int(batch.tokens.shape[-1])
    lengths = batch.mask.sum(-1) if batch.mask is not None else None
    if info.n_ctx and width > info.n_ctx:
        row = int(lengths.argmax()) if lengths is not None else 0
        lines = batch.extra.get("line") if isinstance(batch.extra, dict) else None
        which = f"line {lines[row]}" if isinstance(lines, list) and row < len(lines) else "one"
        raise DataError(
            f"{what}: {which} has {width} tokens, more than the {info.n_ctx} positions of "
            f"{info.name}'s context",
            hint="shorten the prompts, or use a model with a longer context",
        )
    if batch.tokens.numel():
        top = int(batch.tokens.max())
        if top >= info.d_vocab or int(batch.tokens.min()) < 0:
            raise DataError(
                f"{what}: batch {batch.index} holds token id {top}, outside {info.name}'s "
                f"vocabulary of {info.d_vocab}",
                hint="the tokenizer does not match the model; use the model's own tokenizer",
            )


def checked(batches: Iterable[Batch], info: ModelInfo, what: str = "the data") -> Iterator[Batch]:
    """``batches``, each checked against the model before it is fed (:class:`DataError`)."""
    for batch in batches:
        _check_batch(batch, info, what)
        yield batch
