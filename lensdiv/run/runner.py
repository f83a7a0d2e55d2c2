"""The runner: fuse every selected analyzer into one forward pass per batch, isolate failures,
write each result as soon as it is final, and leave a manifest that says what is there.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import device_map_of
from lensdiv.core.errors import (
    LensdivError,
    RankError,
    ResultError,
    UnsupportedModelError,
)
from lensdiv.core.progress import progress_allowed
from lensdiv.core.provenance import versions
from lensdiv.core.results import Rendered, Result
from lensdiv.core.settings import RunSettings, settings_keywords
from lensdiv.data.prefetch import ready_batches
from lensdiv.data.sources import DataSpec, most_tokens
from lensdiv.models.load import load_model
from lensdiv.ops.readout import readout_dtype
from lensdiv.ops.translators import Lens
from lensdiv.run.distributed import DataParallelFeed, World
from lensdiv.run.engine import Engine, describe, input_device
from lensdiv.run.feed import Feed, LocalFeed
from lensdiv.run.interrupts import handle_signals, interruption, shielded, signals_received
from lensdiv.run.outcome import (
    MANIFEST,
    Written,
    finish,
    read_manifest,
    save_result,
    write_manifest,
    written,
)
from lensdiv.run.passes import Reader, feed_passes, own_batches
from lensdiv.run.report import REPORT, VIEWS, write_report
from lensdiv.run.request import Request, check_request
from lensdiv.run.shards import ShardFeed, check_shardable
from lensdiv.run.validate import (
    Prepared,
    check_budget,
    check_model,
    check_runs,
    checked,
    clear_output,
    corpus_facts,
    prepare,
    short_data_warning,
)


@dataclass
class Run(Rendered):
    """The outcome of :func:`analyze`.

    Args:
        results: Finished results by analyzer name.
        errors: ``{analyzer: "ExceptionType: message"}`` for analyzers that failed.
        manifest: Everything needed to reproduce and audit the run.
        out: Output folder, if results were written.
        skipped: ``{analyzer: reason}`` for analyzers that cannot support the model.
        problems: Lines about the run itself (a manifest that could not be written).
        unwritten: ``{file: why}`` for the run's own files in :attr:`out` (``manifest.json``,
            ``report.html``) whose last write failed; :meth:`written` says what is there.
    """

    results: dict[str, Result] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unwritten: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every analyzer finished on all the data."""
        return not self.errors and self.manifest.get("status") == "complete"

    def __getitem__(self, name: str) -> Result:
        return self.results[name]

    def written(self) -> Written | None:
        """What the run wrote to :attr:`out` and what it could not write (a full disk, a
        file-size limit); ``None`` when the run wrote nothing (no ``out``)."""
        return None if self.out is None else written(self.out, self.manifest, self.unwritten)

    def notes(self) -> list[tuple[str, str]]:
        """``(kind, line)`` for everything besides the results: ``skipped`` and ``failed``
        analyzers, ``error`` lines about the run itself, ``interrupted``."""
        notes = [("skipped", f"analyzer {n!r} skipped: {why}") for n, why in self.skipped.items()]
        notes += [("failed", f"analyzer {n!r} failed: {err}") for n, err in self.errors.items()]
        notes += [("error", f"error: {problem}") for problem in self.problems]
        if self.manifest.get("status") == "interrupted":
            notes.append(("interrupted", "interrupted: results are partial (see manifest.json)"))
        return notes

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield from self.results.values()
        styles = {"skipped": "yellow", "failed": "red", "error": "red", "interrupted": "yellow"}
        for kind, line in self.notes():
            yield Text(line, style=styles[kind])


@settings_keywords()
def analyze(
    model: Any = "toy",
    data: Any = None,
    plugins: Any = ("lens", "contrib"),
    *,
    out: str | Path | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    settings: RunSettings | None = None,
    threads: int | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    overwrite: bool = False,
    device_map: Any = None,
    max_memory: Any = None,
    offload_folder: str | Path | None = None,
    shard: str | tuple[int, int] | None = None,
    feed: Feed | None = None,
    **given: Any,
) -> Run:
    """Run analyzers over a model and data; one fused forward pass per batch.

    Args:
        model: Model spec (hub name, local folder, ``toy``) or a ``TransformerBridge``.
        data: ``None`` for the model's default (``pydoc``, Python's documentation, for a
            real model — a catalog name, a ``.gguf`` file —, else the built-in corpus:
            :mod:`lensdiv.run.defaults`); a source string or path (file, folder,
            ``hf:NAME``, ``pydoc``, ``pydoc:heldout``); ``"text:..."`` (the text after ``text:`` is one document — a plain
            string always names a source); a list of strings (one document each); a token
            tensor ``[batch, pos]`` (rows used as they are); or a :class:`DataSpec`.
        plugins: Analyzer names/aliases (``"lens,contrib"``), classes or instances.
        out: Folder for ``manifest.json`` and ``<analyzer>/`` results; ``None`` writes nothing.
        options: ``{analyzer: {option: value}}``.
        settings: The run settings (:class:`~lensdiv.core.settings.RunSettings`: ``seq_len``,
            ``max_tokens``, ``batch_size``, ``field``, ``split``, ``bos``, ``seed``, ``lens``,
            ``device``, ``dtype``), or the same names as keywords (they change ``settings``, or
            the defaults). The data settings say how data is read and packed (see
            :class:`DataSpec`; ignored when ``data`` is a ``DataSpec``); ``device`` and
            ``dtype`` where and in which precision the model runs (residual states are read
            out in float32 whatever the dtype, float64 for a float64 model: see the README's
            precision policy); ``seed`` seeds torch and the built-in corpus (recorded in every
            result); ``lens`` is the lens every analyzer reads residual states through:
            ``"logit"`` (the default), ``"last-block"``, ``"patchscope[:OPTIONS]"``,
            ``"tuned:PATH"``, ``"jacobian:PATH"``, ``"affine:PATH"`` (a fitted lens' file or
            folder, or a published lens' name) or a
            :class:`~lensdiv.ops.translators.Lens`, recorded in the manifest and named in
            the results of the analyzers that use it.
        threads: Set torch's intra-op threads (``torch.set_num_threads``, for this process)
            before the run; ``None`` keeps torch's setting. Recorded in the manifest.
        trust_remote_code: Allow hub models with custom code.
        progress: Show progress bars (``False`` silences every bar of the run, model loading
            included).
        overwrite: Replace an earlier run in ``out`` (its manifest and analyzer folders are
            removed first); without it, an ``out`` that holds a run is refused.
        device_map, max_memory, offload_folder: Split the model across devices (see
            :func:`~lensdiv.models.load.load_model`); the manifest records the placement.
        shard: ``"I/N"`` or ``(I, N)``: run shard ``I`` of ``N`` (batch ``j`` when
            ``j mod N == I``) and save the analyzers' states for ``lensdiv merge`` instead of
            results (single-pass analyzers only).
        feed: How this process's batches reach the analyzers and what becomes of the states
            after each pass (a :class:`~lensdiv.run.feed.Feed`); by default one process feeds
            everything, or the process group (``torchrun``) or ``shard`` decide. For new ways
            to split a run; not together with ``shard`` or a process group.

    Inside an initialised ``torch.distributed`` process group (``torchrun``) every rank runs
    its share of the batches, the states are all-reduced after every pass, and rank 0 alone
    finalizes, writes and returns the results (see :mod:`lensdiv.run.distributed`).

    Returns:
        A :class:`Run` with results, errors, skipped analyzers and the manifest, whose status
        is final (``complete``, ``partial``, ``failed`` or ``interrupted``) however the run ends.

    Raises:
        LensdivError: Bad model spec, data, plugin name, option, device, output folder, context
            length or task file — before any work (see :mod:`lensdiv.run.validate`).
        TypeError: A keyword that is neither an argument nor a run setting.
    """
    settings = RunSettings.of(settings, given, caller="analyze")
    request = check_request(
        model,
        data,
        plugins,
        settings,
        out=out,
        options=options,
        threads=threads,
        trust_remote_code=trust_remote_code,
        progress=progress,
        overwrite=overwrite,
        placement={
            "device_map": device_map,
            "max_memory": max_memory,
            "offload_folder": offload_folder,
        },
        shard=shard,
        feed=feed,
    )
    with handle_signals(), progress_allowed(progress):
        return _run(request)


def _run(request: Request) -> Run:
    """Load the model, prepare the analyzers, write the manifest, and stream each group of
    analyzers; the manifest ends in its final state however the run ends."""
    started = time.time()
    bridge, info = _load(request)
    prepared = _prepare(request, bridge, info)
    out_dir = request.out_dir if request.world.main else None
    if request.overwrite:
        clear_output(out_dir, request.analyzers)
    run = Run(out=out_dir)
    run.manifest = _manifest(request, bridge, info, started)
    feed = _feed(request.world, request.part, bridge, info, out_dir, run.manifest, request.feed)
    _record_prepared(run, prepared)
    analyzers = prepared.ready(request.analyzers)
    save_manifest = partial(_save_manifest, run)
    groups = _groups(analyzers, prepared.tasks, request.spec, bridge, info)
    stopped: BaseException | None = None
    try:
        feed.start()  # every process has its model: the run starts (and its manifest says so)
        save_manifest()
        for group, batches, total in groups:
            if signals_received():  # arrived while the last group's results were saved
                stopped = interruption(signals_received()[0])
                break
            engine = _engine(bridge, info, group, prepared, request.translator)
            stopped = _stream(
                engine, batches, total, run, out_dir, request.progress, save_manifest, feed
            )
            if stopped is not None:
                break
    except KeyboardInterrupt as err:  # between two groups: what is saved stays saved
        stopped = err
    except BaseException as err:  # a bug, not a plugin's: the manifest still ends final
        run.manifest["error"] = describe(err)
        _finish(run, err, started, save_manifest)
        raise
    if not isinstance(stopped, RankError):  # every rank is here: complete the manifest
        feed.close(run.manifest)
    _finish(run, stopped, started, save_manifest)
    if out_dir is not None and feed.finalizes:  # a shard's report comes with `lensdiv merge`
        interrupted = run.manifest["status"] == "interrupted"
        _report(run, None if interrupted else bridge)  # stopped: no prompt views computed now
    if isinstance(stopped, LensdivError):
        raise stopped  # after the partial results and the manifest are on disk
    return run


def _load(request: Request) -> tuple[Any, ModelInfo]:
    """The model (torch's threads and seed set first), its facts, and every check of them
    against the data and the lens."""
    import torch

    if request.threads is not None:
        torch.set_num_threads(request.threads)
    torch.manual_seed(request.seed)
    folded_only = all(a.numerics == "folded" for a in request.analyzers)
    bridge = load_model(
        request.model,
        device=request.device,
        dtype=request.dtype,
        trust_remote_code=request.trust_remote_code,
        numerics="folded" if folded_only else "raw",
        progress=request.progress,
        **request.placement,
    )
    info = ModelInfo.from_model(bridge, name=bridge.lensdiv_spec.spec)
    check_model(bridge, info, request.spec)
    check_runs(bridge, info)
    request.translator.check(info, bridge)
    return bridge, info


def _prepare(request: Request, bridge: Any, info: ModelInfo) -> Prepared:
    """Each analyzer's hooks, own examples and resources, before any forward pass.

    Task analyzers bring their own examples, and setup() loads what else a run needs (a
    reference model): all of it is read and checked before any forward pass, so a bad task
    file fails at once and nothing is written. An analyzer that cannot support the model is
    skipped with its reason; one that crashes here is marked failed; the others run.
    """
    analyzers, spec = request.analyzers, request.spec
    prepared = prepare(analyzers, bridge, info, corpus_facts(spec, bridge.tokenizer))
    if not prepared.ready(analyzers) and not prepared.failed:
        by_reason: dict[str, list[str]] = {}
        for name, why in prepared.skipped.items():
            by_reason.setdefault(why, []).append(name)
        reasons = "; ".join(f"{', '.join(names)}: {why}" for why, names in by_reason.items())
        raise UnsupportedModelError(
            f"no selected analyzer supports {info.name} ({reasons})",
            hint="choose other analyzers (`lensdiv plugins list`)",
        )
    tasks = prepared.tasks
    check_budget([a for a in prepared.ready(analyzers) if tasks[a.name] is None], info, spec)
    if request.part is not None:
        check_shardable(prepared.ready(analyzers), info)
    return prepared


def _manifest(request: Request, bridge: Any, info: ModelInfo, started: float) -> dict[str, Any]:
    """The run's manifest as it starts: the model, the lens, data, seed and every analyzer
    pending."""
    import torch

    parsed = bridge.lensdiv_spec
    dtype = next(bridge.parameters()).dtype
    return {
        "lensdiv_manifest": 1,
        "status": "running",
        "model": {
            "spec": parsed.spec,
            "kind": parsed.kind,
            "resolved": parsed.resolved,
            "source": getattr(parsed, "origin", None),  # a GGUF file's name, digest, quantization
            "n_layers": info.n_layers,
            "d_model": info.d_model,
            "d_vocab": info.d_vocab,
            "parameters": sum(p.numel() for p in bridge.parameters()),  # a study's size axis
            "normalization": info.normalization,
            "parallel_residual": info.parallel_residual,
            "device": str(input_device(bridge)),
            "dtype": str(dtype).replace("torch.", ""),
            "readout_dtype": str(readout_dtype(dtype)).replace("torch.", ""),
        },
        "threads": torch.get_num_threads(),
        "world_size": request.world.size,  # processes of a torchrun group (see "distributed")
        "lens": request.translator.describe(),
        "data": request.spec.describe(),
        "seed": request.seed,
        "analyzers": {
            a.name: {"options": a.options(), "status": "pending", "numerics": a.numerics}
            for a in request.analyzers
        },
        "versions": versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "timings": {},
    }


def _record_prepared(run: Run, prepared: Prepared) -> None:
    """The manifest's and the run's record of the analyzers skipped or failed in preparation,
    and of those reading their own examples."""
    entries = run.manifest["analyzers"]
    for name, reason in prepared.skipped.items():
        entries[name].update(status="skipped", reason=reason)
        run.skipped[name] = reason
    for name, error in prepared.failed.items():
        entries[name].update(status="failed", error=error)
        run.errors[name] = error
    for name, own in prepared.tasks.items():
        if own is not None:
            entries[name]["data"] = "own examples"


def _save_manifest(run: Run) -> None:
    """Write the manifest to the run's folder; a write that fails is a problem of the run."""
    problem = write_manifest(run.out, run.manifest)
    run.unwritten.pop(MANIFEST, None)
    if problem is not None:
        run.unwritten[MANIFEST] = problem
        if problem not in run.problems:
            run.problems.append(problem)


def _groups(
    analyzers: list[Analyzer],
    tasks: Mapping[str, Any],
    spec: DataSpec,
    bridge: Any,
    info: ModelInfo,
) -> list[tuple[list[Analyzer], Reader, int]]:
    """The run's streams: one fused stream over the corpus per numerics kind, then one stream
    per task analyzer.

    Each with the most tokens it can read (a progress bar's total until the data's end is
    known: the data tells it, see _stream). A training (passes that read the data onward:
    Analyzer.pass_tokens) streams on its own.
    """
    groups: list[tuple[list[Analyzer], Reader, int]] = []
    for kind in ("raw", "folded"):
        shared = [a for a in analyzers if a.numerics == kind and tasks[a.name] is None]
        corpus = partial(_checked, partial(ready_batches, spec, bridge.tokenizer), info)
        together = [a for a in shared if a.pass_tokens(info) is None]
        for group in ([together] if together else []) + [[a] for a in shared if a not in together]:
            groups.append((group, corpus, most_tokens(spec)))
        for a in analyzers:
            own = tasks[a.name]
            if a.numerics == kind and own is not None:
                size = sum(b.n_tokens for b in own)
                groups.append(([a], partial(own_batches, own), size))
    return groups


def _engine(
    bridge: Any, info: ModelInfo, group: list[Analyzer], prepared: Prepared, lens: Lens
) -> Engine:
    """The engine of one group (the model in compatibility mode for folded numerics)."""
    if group[0].numerics == "folded" and not getattr(bridge, "compatibility_mode", False):
        bridge.enable_compatibility_mode()
    return Engine(
        bridge,
        info,
        group,
        hooks={a.name: prepared.hooks[a.name] for a in group},
        resources={a.name: prepared.resources[a.name] for a in group},
        lens=lens,
    )


def _report(run: Run, model: Bridge | None) -> None:
    """report.html (and the example prompt views when lens ran), after every result: a report
    that cannot be written is one line, never the loss of a result."""
    with shielded():
        try:
            write_report(run, model)
        except Exception as err:  # a full disk, a view that cannot be drawn
            run.problems.append(f"{REPORT} could not be written: {describe(err)}")
            run.unwritten[REPORT] = run.problems[-1]
            views = None if run.out is None else run.out / VIEWS  # written before the page
            if model is not None and "lens" in run.results and views and not views.is_file():
                run.unwritten[VIEWS] = run.problems[-1]


def _checked(
    batches: Callable[..., Generator[Batch, None, None]],
    info: ModelInfo,
    on_end: Callable[[int], None],
) -> Iterator[Batch]:
    """The corpus' batches (made ahead on a thread: :mod:`lensdiv.data.prefetch`), each checked
    against the model before it is fed; closing this stream stops the thread. ``on_end`` is
    told the data's real tokens as soon as the reader reaches their end."""
    stream = batches(on_end=on_end)
    try:
        yield from checked(stream, info)
    finally:
        stream.close()


def _finish(
    run: Run, stopped: BaseException | None, started: float, save_manifest: Callable[[], None]
) -> None:
    """Put the manifest into its final state and write it (signals wait until it is on disk)."""
    with shielded():
        if isinstance(stopped, LensdivError):
            run.manifest["error"] = str(stopped)
        finish(run.manifest, stopped)
        if isinstance(stopped, RankError):  # another process failed: the run did
            run.manifest["status"] = "failed"
        run.manifest["timings"]["total_s"] = round(time.time() - started, 3)
        save_manifest()


def _stream(
    engine: Engine,
    batches: Reader,
    total: int,
    run: Run,
    out_dir: Path | None,
    progress: bool,
    save_manifest: Callable[[], None],
    feed: Feed,
) -> BaseException | None:
    """Run a group through all its passes (:func:`~lensdiv.run.passes.feed_passes`), then
    finalize and save each analyzer.

    Returns what stopped the stream early (Ctrl-C, SIGTERM, bad data met mid-way, memory), if
    anything: the analyzers are still finalized on the tokens seen so far and marked partial.
    """
    entries = run.manifest["analyzers"]
    for a in engine.analyzers:
        entries[a.name]["status"] = "running"
    states, stopped = feed_passes(engine, batches, total, progress, feed)
    with shielded():  # a second Ctrl-C waits until the results in hand are on disk
        _wrap_up(engine, states, stopped, run, out_dir, save_manifest, feed.finalizes)
    return stopped


def _wrap_up(
    engine: Engine,
    states: dict[str, Any],
    stopped: BaseException | None,
    run: Run,
    out_dir: Path | None,
    save_manifest: Callable[[], None],
    finalizes: bool = True,
) -> None:
    """Finalize each analyzer of the group on what it saw, save each result on its own (a
    shard, or a rank other than 0, only records what it counted)."""
    entries = run.manifest["analyzers"]
    interrupted = stopped is not None
    timings = run.manifest["timings"]
    timings["forward_s"] = round(timings.get("forward_s", 0.0) + engine.forward_s, 3)
    own = len(engine.analyzers) == 1 and entries[engine.analyzers[0].name].get("data")
    if own:
        entries[engine.analyzers[0].name]["tokens"] = engine.tokens
    else:
        timings["tokens"] = engine.tokens
    if engine.tokens == 0 and finalizes:
        for a in engine.active:
            if isinstance(stopped, KeyboardInterrupt):  # stopped before its first batch
                entries[a.name]["status"] = "interrupted"
                continue
            engine.fail(
                a, RuntimeError("no batch was processed, so there is nothing to report"), "finalize"
            )
    results = engine.finalize(states) if engine.tokens and finalizes else {}
    for name, error in engine.failures.items():
        run.errors[name] = error
        entries[name].update(status="failed", error=error)
    for a in engine.analyzers:
        if a.name not in results:
            continue
        meta = {
            "analyzer": a.name,
            "options": a.options(),
            "numerics": a.numerics,
            "model": run.manifest["model"],
            "data": "own examples" if own else run.manifest["data"],
            "tokens": engine.tokens,
            "seed": run.manifest["seed"],
            "versions": run.manifest["versions"],
            "partial": interrupted,
            **results[a.name].meta,
        }
        result = dataclasses.replace(results[a.name], meta=meta)
        short = None if own else short_data_warning(a, engine.info, engine.tokens)
        if short is not None:
            result = dataclasses.replace(result, warnings=(*result.warnings, short))
        run.results[a.name] = result
        entries[a.name]["status"] = "partial" if interrupted else "complete"
        if result.warnings:
            entries[a.name]["warnings"] = list(result.warnings)
        if out_dir is not None:
            problem = save_result(result, out_dir, entries[a.name])
            if problem is not None:
                run.errors[a.name] = problem
                entries[a.name].update(status="failed", error=problem)
        run.manifest["timings"][a.name + "_s"] = round(engine.spent[a.name], 3)
        save_manifest()
    save_manifest()


def _feed(
    world: World,
    split: tuple[int, int] | None,
    bridge: Any,
    info: ModelInfo,
    out_dir: Path | None,
    manifest: dict[str, Any],
    given: Feed | None = None,
) -> Feed:
    """How the batches are split (the feed given, into a shard, between ranks, or not at all);
    records in the manifest the model facts a merge finalizes with, the device map and the
    split."""
    manifest["model"]["device_map"] = device_map_of(bridge)
    manifest["model_info"] = info.to_dict()
    feed: Feed = (
        given
        if given is not None
        else ShardFeed(*split, out_dir, manifest["analyzers"])
        if split is not None
        else DataParallelFeed(world, str(input_device(bridge)))
        if world.parallel
        else LocalFeed()
    )
    manifest.update(feed.describe())
    return feed


def load_run(out: str | Path) -> Run:
    """Read a saved run (its manifest and every result) back from disk.

    Raises:
        ResultError: Not a run folder, or a damaged manifest or result (naming the file).
    """
    if isinstance(out, bool) or not isinstance(out, (str, os.PathLike)):
        raise ResultError(f"a run folder is a path, not {out!r} ({type(out).__name__})")
    out = Path(out)
    manifest = read_manifest(out, hint="pass the --out folder of `lensdiv analyze`")
    run = Run(manifest=manifest, out=out)
    for name, entry in manifest.get("analyzers", {}).items():
        if (
            entry.get("status") in ("complete", "partial")
            and (out / name / "result.json").is_file()
        ):
            run.results[name] = Result.load(out / name)
        elif entry.get("status") == "failed":
            run.errors[name] = str(entry.get("error", "failed"))
        elif entry.get("status") == "skipped":
            run.skipped[name] = str(entry.get("reason", "skipped"))
    return run
