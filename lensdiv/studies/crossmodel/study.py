"""A study: the same analysis over many models, one ordinary run per model, resumable and split
across the tasks of a job array; then one tidy dataset, figures at relative depth and a page.

A study folder::

    study.json          the study manifest: settings, and every model's status
    runs/NAME/          one run folder per model, as `lensdiv analyze --out` writes it
    status/NAME.json    each model's last attempt (status, one-line reason, task, seconds)
    study.parquet       the tidy dataset (study.csv: the same as CSV)
    summary/            the summary result: models, numbers, profiles (CSV, PNG, result.json)
    study.html          one self-contained page linking every model's report.html

Each model's status comes from disk (:mod:`~lensdiv.studies.crossmodel.folder`): a rerun keeps
every ``complete`` run and redoes the others from scratch, so nothing is coordinated but the
folder, and the tasks of a job array each run their share.
"""

from __future__ import annotations

import gc
import inspect
import json
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer
from lensdiv.core.depth import depth_profiles
from lensdiv.core.errors import LensdivError, PluginError, ResultError
from lensdiv.core.progress import progress_allowed
from lensdiv.core.registry import get_analyzer, make_analyzers
from lensdiv.core.results import Rendered, Result, write_json_atomic
from lensdiv.core.settings import RunSettings, settings_keywords
from lensdiv.data.sources import DataSpec, check_source
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.run.defaults import default_data
from lensdiv.run.distributed import current_world
from lensdiv.run.engine import describe
from lensdiv.run.interrupts import handle_signals, interruption, signal_name, signum_of
from lensdiv.run.runner import Run, analyze, load_run
from lensdiv.run.validate import clear_output
from lensdiv.studies.crossmodel.dataset import (
    arrow_table,
    size_facts,
    tidy_columns,
    to_pandas,
    write_dataset,
)
from lensdiv.studies.crossmodel.folder import (
    CSV,
    FINISHED,
    HTML,
    PARQUET,
    RUNS,
    STATUS,
    STUDY,
    SUMMARY,
    ModelEntry,
    entries_of,
    host,
    now,
    open_folder,
    read_study,
    refresh,
    status_on_disk,
    study_manifest,
)
from lensdiv.studies.crossmodel.models import Task, parse_task, resolve_models, run_names
from lensdiv.studies.crossmodel.summary import summarize
from lensdiv.view.study import study_html

# Arguments of `analyze` a study sets itself; every other one passes through to each run.
_OWN = {"model", "data", "plugins", "out", "options", "overwrite", "shard", "feed", "progress"}
_OWN |= {"settings", *RunSettings.names()} - {"device", "dtype"}
_RUN_OPTIONS = tuple(p for p in inspect.signature(analyze).parameters if p not in _OWN)


@dataclass
class Study(Rendered):
    """The outcome of :func:`run_study` or :func:`report_study`.

    Args:
        out: The study folder (``None``: nothing written).
        models: Every model of the study, in order, with its status.
        settings: What the study runs (models, analyzers and options, data, lens, dtype, ...).
        task: This call's share of the models.
        runs: The finished runs by model spec (this call's, and with ``out`` those on disk).
        summary: The summary result (models, numbers, depth profiles), when it was made.
        interrupted: ``"SIGINT"`` or ``"SIGTERM"`` when a signal stopped the study.
        problems: Lines about the study itself (a file that could not be written).
        unwritten: The study's own files (relative to ``out``) that could not be written.
    """

    out: Path | None
    models: list[ModelEntry]
    settings: dict[str, Any]
    task: Task = field(default_factory=Task)
    runs: dict[str, Run] = field(default_factory=dict)
    summary: Result | None = None
    interrupted: str | None = None
    problems: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every model of this task is complete and nothing went wrong."""
        mine = [m for m in self.models if m.task == self.task.index]
        return all(m.status == "complete" for m in mine) and not (self.problems or self.interrupted)

    @property
    def status(self) -> str:
        """``complete`` when every model is, ``partial`` otherwise."""
        return "complete" if all(m.status == "complete" for m in self.models) else "partial"

    def __getitem__(self, model: str) -> Run:
        return self.runs[model]

    def table(self) -> Any:
        """The tidy dataset as a pandas ``DataFrame`` (:data:`~.dataset.COLUMNS`)."""
        return to_pandas(arrow_table(_tidy(self.models, self.runs)))

    def notes(self) -> list[tuple[str, str]]:
        """``(kind, line)`` for every model that is not complete, and the study's problems."""
        notes = []
        for m in self.models:
            if m.status in ("failed", "partial", "interrupted"):
                notes.append(("failed", f"model {m.model!r} {m.status}: {m.reason or '?'}"))
            elif m.status == "pending":
                whose = f" (task {m.task}/{self.task.count})" if self.task.count > 1 else ""
                notes.append(("pending", f"model {m.model!r} not run yet{whose}"))
        notes += [("error", f"error: {p}") for p in self.problems]
        if self.interrupted:
            notes.append(("interrupted", f"interrupted ({self.interrupted}): rerun to go on"))
        return notes

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        yield from self.overview()
        styles = {"failed": "red", "pending": "yellow", "error": "red", "interrupted": "yellow"}
        for kind, line in self.notes():
            yield Text(line, style=styles[kind])

    def overview(self) -> Iterator[Any]:
        """The rich renderables of the study without its :meth:`notes`: every model's status,
        then the summary's numbers."""
        from rich.table import Table as RichTable

        table = RichTable(title="study", title_justify="left")
        for column in ("model", "status", "parameters", "L", "d_model", "s", "this call"):
            table.add_column(column, justify="left" if column == "model" else "right")
        for m in self.models:
            params = m.size.get("params")
            table.add_row(
                m.model,
                m.status,
                f"{params:,}" if params else "–",
                str(m.size.get("n_layers") or "–"),
                str(m.size.get("d_model") or "–"),
                f"{m.seconds:.1f}" if m.seconds is not None else "–",
                m.action or "–",
            )
        yield table
        if self.summary is not None and len(self.summary.tables.get("numbers", ())):
            yield self.summary.tables["numbers"]


@settings_keywords(keep_rest=True)
def run_study(
    models: str | Sequence[str],
    data: Any = None,
    plugins: Any = ("lens", "contrib"),
    *,
    out: str | Path | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    settings: RunSettings | None = None,
    task: str | tuple[int, int] | None = None,
    progress: bool = True,
    report: bool = True,
    **run_options: Any,
) -> Study:
    """Run the same analysis over every model: one :func:`lensdiv.analyze` run per model, the
    models loaded one at a time, then the study's dataset, summary and page.

    Args:
        models: What MODELS names (:func:`~.models.resolve_models`): ``"zoo:depth"``,
            ``"toy:d2,toy:d4"``, ``"EleutherAI/pythia-{70m,160m}"``, a file of specs, folders.
        data, plugins, options: As for :func:`lensdiv.analyze`; the same for every model
            (no data: ``pydoc`` when every model is a real one, else the built-in corpus).
        settings: The run settings (:class:`~lensdiv.core.settings.RunSettings`), or their
            names as keywords, as for ``analyze``; the same for every model. In ``lens``,
            ``{model}`` and ``{run}`` are replaced by each model's spec and run folder name
            (``"tuned:lenses/{run}"``: a lens fitted per model).
        out: The study folder; ``None`` keeps everything in memory (no resume).
        task: ``"I/N"``: run only every N-th model from the I-th (a job array's task; the
            SLURM array variables set it when present). ``lensdiv study report`` then gathers.
        progress: Show each model's progress and a line per model (standard error).
        report: After the models, write the dataset, summary and ``study.html`` (not when the
            study is split into tasks: ``report_study`` does it once they are done).
        **run_options: The run settings as keywords, and any other argument of ``analyze``,
            passed to every run: ``threads``, ``trust_remote_code``, ``device_map``,
            ``max_memory``, ``offload_folder``.

    Returns:
        A :class:`Study`: every model's status (a model that could not be loaded or failed is
        ``failed`` with its one-line reason; the others still ran) and the finished runs.

    Raises:
        LensdivError: Before any model: unknown analyzer or option, bad data, unknown model
            family, bad ``task``, an ``out`` that cannot be written or holds another study.
        TypeError: An argument ``analyze`` does not take.
    """
    settings, run_options = _study_settings(settings, run_options)
    seed, lens = settings.seed, settings.lens
    analyzers = make_analyzers(plugins, options)
    specs = resolve_models(models)
    spec = DataSpec.from_data(data, default=default_data(*specs), **settings.data())
    check_source(spec)
    _check_lens(lens)
    part = parse_task(task)
    world = current_world()
    names = run_names(specs)
    entries = [
        ModelEntry(m, r, task=i % part.count)
        for i, (m, r) in enumerate(zip(specs, names, strict=True))
    ]
    recorded = {
        "models": specs,
        "plugins": {a.name: a.options() for a in analyzers},
        "data": spec.describe(),
        "lens": lens if isinstance(lens, str) else repr(lens),
        "seed": seed,
        **run_options,
    }
    recorded = _plain(recorded)
    out_dir = Path(out) if out is not None else None
    if out_dir is not None and world.main:
        open_folder(out_dir, recorded)
    study = Study(out_dir, entries, recorded, part)
    classes = {a.name: type(a) for a in analyzers}
    say = _Lines(progress and world.main)
    mine = [e for i, e in enumerate(entries) if part.runs(i)]
    runs = _Runs(spec, analyzers, seed, lens, progress, run_options, world.main)
    with handle_signals(), progress_allowed(progress), _collecting():
        _run_models(study, mine, runs, say)
        if world.main:
            _gather(study, classes, report=report, out=out, say=say)
    return study


def _study_settings(
    settings: RunSettings | None, run_options: dict[str, Any]
) -> tuple[RunSettings, dict[str, Any]]:
    """The study's run settings (from ``settings`` and those of ``run_options``), and what
    passes through to every run: ``analyze``'s other arguments, and where the model runs
    (``device``, ``dtype``) as given. An argument ``analyze`` does not take is a TypeError."""
    given = {n: run_options.pop(n) for n in RunSettings.names() if n in run_options}
    unknown = sorted(set(run_options) - set(_RUN_OPTIONS))
    if unknown:
        raise TypeError(
            f"run_study() got an unexpected keyword argument {unknown[0]!r} (its run settings: "
            f"{', '.join(RunSettings.names())}; analyze's: {', '.join(_RUN_OPTIONS)})"
        )
    settings = RunSettings.of(settings, given, caller="run_study")
    # Where the model runs passes through to every run, and is recorded as given.
    placement = {
        n: getattr(settings, n)
        for n in ("device", "dtype")
        if n in given or getattr(settings, n) is not None
    }
    return settings, {**placement, **run_options}


@dataclass(frozen=True)
class _Runs:
    """What every model's run of a study takes: the data, the analyzers, the seed, the lens
    (``{model}`` and ``{run}`` filled in per model), whether to show progress, ``analyze``'s
    other arguments (``options``); ``main``: this process writes the study's records."""

    spec: DataSpec
    analyzers: list[Analyzer]
    seed: int
    lens: Any
    progress: bool
    options: Mapping[str, Any]
    main: bool


def _run_models(study: Study, mine: list[ModelEntry], runs: _Runs, say: _Lines) -> None:
    """Run this call's models in turn (one complete before is kept), a line before and after
    each; a signal stops the study between two models (``study.interrupted``)."""
    out_dir = study.out
    try:
        if out_dir is not None:
            refresh(out_dir, study.models)
        for number, entry in enumerate(mine, 1):
            if entry.status == "complete":
                entry.action = "kept"
                say(f"study [{number}/{len(mine)}] {entry.model}: complete before, kept")
                continue
            say(f"study [{number}/{len(mine)}] {entry.model} -> {_where(out_dir, entry)}")
            stopped = _run_model(study, entry, runs)
            say(f"study [{number}/{len(mine)}] {entry.model}: {_outcome(entry)}")
            if stopped is not None:
                study.interrupted = signal_name(signum_of(stopped))
                break
    except KeyboardInterrupt as err:  # between two models: every record is on disk
        study.interrupted = signal_name(signum_of(err))


def _gather(
    study: Study,
    classes: Mapping[str, type[Analyzer]],
    *,
    report: bool,
    out: str | Path | None,
    say: _Lines,
) -> None:
    """After the models (on the process that writes): the study manifest and, when the study
    is one task and was not stopped, with ``report``, its dataset, summary and page; a split
    study is told how to gather it once every task is done."""
    task, out_dir = study.task, study.out
    gather = report and task.count == 1 and not study.interrupted
    if gather and out_dir is not None:
        say(f"study: writing the dataset, figures and page of {out_dir}")
    try:
        _finish(study, classes, report=gather)
    except KeyboardInterrupt as err:  # the runs and records are on disk already
        study.interrupted = signal_name(signum_of(err))
        study.problems.append(f"stopped while gathering: `lensdiv study report {out}`")
    if study.interrupted is None and report and task.count > 1 and out_dir is not None:
        say(
            f"task {task} done; once every task is, `lensdiv study report {out_dir}` "
            "writes the dataset, figures and page"
        )


def report_study(out: str | Path, *, progress: bool = True) -> Study:
    """Gather a study folder: every model's status from disk, then the dataset, the summary and
    ``study.html`` over every finished run (after the tasks of a job array, or to refresh).

    Raises:
        StudyError: ``out`` holds no study, or its ``study.json`` cannot be read.
    """
    out_dir = Path(out)
    manifest = read_study(out_dir)
    settings = manifest["settings"]
    entries = entries_of(manifest)
    task = Task()
    study = Study(out_dir, entries, settings, task)
    refresh(out_dir, entries)
    say = _Lines(progress)
    finished = sum(e.status in FINISHED for e in entries)
    say(f"study {out_dir}: writing the dataset, figures and page of {finished} finished runs")
    with handle_signals():
        try:
            _finish(study, {}, report=True)
        except KeyboardInterrupt as err:
            study.interrupted = signal_name(signum_of(err))
    return study


def load_study(out: str | Path) -> Any:
    """The tidy dataset of a study folder as a pandas ``DataFrame`` (columns:
    :data:`~lensdiv.studies.crossmodel.dataset.COLUMNS`).

    Reads ``study.parquet``; where it is missing or older than a model's last record (tasks of
    a job array finished since), builds the same table from the runs on disk.

    Raises:
        StudyError: ``out`` holds no study.
    """
    import pyarrow.parquet as pq

    out_dir = Path(out)
    manifest = read_study(out_dir)
    parquet = out_dir / PARQUET
    records = list((out_dir / STATUS).glob("*.json"))
    if parquet.is_file() and all(r.stat().st_mtime <= parquet.stat().st_mtime for r in records):
        return to_pandas(pq.read_table(parquet))
    entries = entries_of(manifest)
    study = Study(out_dir, entries, manifest["settings"])
    refresh(out_dir, entries)
    study.runs = _finished_runs(study)
    return study.table()


# -- one model ----------------------------------------------------------------------------------
def _run_model(study: Study, entry: ModelEntry, runs: _Runs) -> KeyboardInterrupt | None:
    """Run one model (from scratch), record its outcome; return the signal that stopped it."""
    folder = study.out / RUNS / entry.run if study.out is not None else None
    record = study.out / STATUS / f"{entry.run}.json" if study.out is not None else None
    if record is not None and runs.main:
        record.unlink(missing_ok=True)  # an attempt in progress has no record
        clear_output(folder, runs.analyzers)  # a run that did not finish is redone from scratch
    entry.action, entry.reason, entry.size = "ran", None, {}
    started = time.time()
    stopped: KeyboardInterrupt | None = None
    try:
        run = analyze(
            entry.model,
            runs.spec,
            runs.analyzers,
            out=folder,
            seed=runs.seed,
            lens=_lens_for(runs.lens, entry),
            progress=runs.progress,
            **runs.options,
        )
    except KeyboardInterrupt as err:  # before the run could keep anything
        entry.status, entry.reason = "interrupted", "interrupted before any result"
        stopped = err
    except LensdivError as err:  # e.g. a model that cannot be loaded: one line, the study goes on
        entry.status, entry.reason = status_on_disk(folder) or "failed", str(err)
    except Exception as err:  # a crash on one model must not cost the others
        entry.status, entry.reason = status_on_disk(folder) or "failed", describe(err)
    else:
        entry.status = str(run.manifest.get("status", "failed"))
        entry.size = size_facts(run.manifest)
        if entry.status != "complete":
            entry.reason = _why(run)
        if entry.status == "interrupted":
            stopped = interruption(_signum(run.manifest.get("signal")))
        if entry.status in FINISHED:
            study.runs[entry.model] = run
    finally:
        entry.seconds = time.time() - started
        _free()
    if record is not None and runs.main:
        try:
            write_json_atomic(record, {**entry.row(), "finished": now(), "host": host()})
        except OSError as err:
            study.problems.append(f"{record} could not be written: {err.strerror or err}")
            out = study.out
            study.unwritten.append(
                record.relative_to(out).as_posix()
                if out and record.is_relative_to(out)
                else str(record)
            )
    return stopped


@contextmanager
def _collecting() -> Iterator[None]:
    """Within: what exists now (the libraries' own objects) is left out of garbage collection,
    so freeing each model (:func:`_free`) scans only what was made since (gc.freeze)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _free() -> None:
    """Release the model just analysed (its reference cycles too) before the next one loads."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _why(run: Run) -> str:
    """One line on why a run is not complete."""
    lines = [f"{name}: {error}" for name, error in run.errors.items()] + list(run.problems)
    if run.manifest.get("error"):
        lines.insert(0, str(run.manifest["error"]))
    if run.manifest.get("status") == "interrupted":
        lines.insert(0, f"interrupted ({run.manifest.get('signal', 'SIGINT')})")
    return "; ".join(lines) or str(run.manifest.get("status"))


def _signum(name: Any) -> int:
    import signal

    return int(getattr(signal, str(name), signal.SIGINT))


def _finish(study: Study, classes: Mapping[str, type[Analyzer]], *, report: bool) -> None:
    """Write the study manifest (every model's status from disk) and, with ``report``, the
    dataset, summary and page; problems become lines, never the loss of a run."""
    if study.out is not None:
        _refresh_kept(study)
        try:
            write_json_atomic(study.out / STUDY, study_manifest(study.settings, study.models))
        except OSError as err:
            study.problems.append(f"{study.out / STUDY} could not be written: {err}")
            study.unwritten.append(STUDY)
    study.runs = _finished_runs(study) if study.out is not None else study.runs
    if not report:
        return
    rows = [m.row() for m in study.models]
    finished = [
        (m.model, m.size, study.runs[m.model].results)
        for m in study.models
        if m.model in study.runs
    ]
    study.summary = summarize(rows, finished, _profiles(classes))
    if study.out is None:
        return
    try:
        write_dataset(
            _tidy(study.models, study.runs, classes),
            study.out / PARQUET,
            study.out / CSV,
        )
    except Exception as err:  # a full disk, a dataset pyarrow refuses: a line, not a loss
        study.problems.append(f"the dataset could not be written: {describe(err)}")
        study.unwritten += [PARQUET, CSV]
    folder = study.out / SUMMARY
    shutil.rmtree(folder, ignore_errors=True)  # profiles of an earlier gathering go too
    try:
        written = study.summary.save(folder)
    except LensdivError as err:
        study.problems.append(str(err))
        written = getattr(err, "written", [])
        failed = getattr(err, "failed", {}) or {folder: str(err)}
        study.unwritten += [f"{SUMMARY}/{Path(p).name}" for p in failed]
    images = {p.stem: p.read_bytes() for p in written if p.suffix == ".png"}
    try:
        page = study_html(
            study_manifest(study.settings, study.models),
            study.summary,
            [_page_row(study.out, m) for m in study.models],
            images,
        )
        (study.out / HTML).write_text(page, encoding="utf-8")
    except Exception as err:  # the page is a view: the numbers are on disk already
        study.problems.append(f"{HTML} could not be written: {describe(err)}")
        study.unwritten.append(HTML)


def _refresh_kept(study: Study) -> None:
    """Models this call did not run take their status from disk (another task may have run
    them meanwhile); those it ran keep what it recorded."""
    assert study.out is not None
    others = [m for m in study.models if m.action != "ran"]
    refresh(study.out, others)


def _finished_runs(study: Study) -> dict[str, Run]:
    """The finished runs: this call's in memory, the others read from disk."""
    assert study.out is not None
    runs = {}
    for m in study.models:
        if m.status not in FINISHED:
            continue
        if m.model in study.runs:
            runs[m.model] = study.runs[m.model]
            continue
        try:
            runs[m.model] = load_run(study.out / RUNS / m.run)
        except ResultError as err:
            m.status, m.reason = "failed", f"its run cannot be read: {err}"
    return runs


def _tidy(
    models: Sequence[ModelEntry],
    runs: Mapping[str, Run],
    classes: Mapping[str, type[Analyzer]] | None = None,
) -> dict[str, list[Any]]:
    rows = [
        (m.model, m.run, runs[m.model].manifest, runs[m.model].results)
        for m in models
        if m.model in runs
    ]
    return tidy_columns(rows, _profiles(classes or {}))


def _profiles(classes: Mapping[str, type[Analyzer]]) -> Any:
    """``(analyzer, result, n_layers) -> [(table, column)]`` from each analyzer's declaration:
    the class this study ran, else the installed plugin of that name, else the default."""
    found: dict[str, type[Analyzer] | None] = dict(classes)

    def profiles(name: str, result: Result, n_layers: int) -> list[tuple[str, str]]:
        if name not in found:
            try:
                found[name] = get_analyzer(name)
            except (PluginError, LensdivError):  # a plugin not installed here: the default
                found[name] = None
        cls = found[name]
        return cls.profiles(result, n_layers) if cls else depth_profiles(result, n_layers)

    return profiles


def _page_row(out: Path, m: ModelEntry) -> dict[str, Any]:
    report = Path(RUNS) / m.run / "report.html"
    return {**m.row(), "report": report.as_posix() if (out / report).is_file() else None}


# -- small helpers ------------------------------------------------------------------------------
def _check_lens(lens: Any) -> None:
    """A lens with ``{model}``/``{run}`` is read per model; any other is read once, now."""
    if isinstance(lens, str) and ("{model}" in lens or "{run}" in lens):
        return
    parse_lens(lens)


def _lens_for(lens: Any, entry: ModelEntry) -> Any:
    if isinstance(lens, str) and ("{model}" in lens or "{run}" in lens):
        return lens.replace("{model}", entry.model).replace("{run}", entry.run)
    return lens


def _plain(value: Any) -> Any:
    """JSON data as it reads back (tuples as lists, paths as text)."""
    return json.loads(json.dumps(value, default=str))


def _where(out: Path | None, entry: ModelEntry) -> str:
    return str(out / RUNS / entry.run) if out is not None else "(in memory)"


def _outcome(entry: ModelEntry) -> str:
    seconds = f" in {entry.seconds:.0f} s" if entry.seconds is not None else ""
    if entry.status == "complete":
        return f"complete{seconds}"
    return f"{entry.status}{seconds}: {entry.reason}"


class _Lines:
    """One line per model on standard error (between the runs' own progress bars)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str) -> None:
        if self.enabled:
            from rich.console import Console
            from rich.text import Text

            Console(stderr=True, highlight=False).print(Text(text), soft_wrap=True)
