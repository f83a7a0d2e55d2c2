"""The runner: fuse every selected analyzer into one forward pass per batch, isolate failures,
write each result as soon as it is final, and leave a manifest that says what is there.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.errors import LensdivError, OptionError, ResultError
from lensdiv.core.progress import progress_bar
from lensdiv.core.provenance import versions
from lensdiv.core.registry import make_analyzers
from lensdiv.core.results import Rendered, Result, write_json_atomic
from lensdiv.data.sources import DataSpec, check_source, token_batches
from lensdiv.models.load import load_model
from lensdiv.ops.readout import readout_dtype
from lensdiv.run.engine import Engine, check_hooks, input_device
from lensdiv.run.report import write_report

MANIFEST = "manifest.json"


@dataclass
class Run(Rendered):
    """The outcome of :func:`analyze`.

    Args:
        results: Finished results by analyzer name.
        errors: ``{analyzer: "ExceptionType: message"}`` for analyzers that failed.
        manifest: Everything needed to reproduce and audit the run.
        out: Output folder, if results were written.
    """

    results: dict[str, Result] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    out: Path | None = None

    @property
    def ok(self) -> bool:
        """True when every analyzer finished on all the data."""
        return not self.errors and self.manifest.get("status") == "complete"

    def __getitem__(self, name: str) -> Result:
        return self.results[name]

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from self.results.values()
        for name, err in self.errors.items():
            yield f"[red]analyzer {name!r} failed:[/red] {err}"
        if self.manifest.get("status") == "interrupted":
            yield "[yellow]interrupted: results are partial (see manifest.json)[/yellow]"


def analyze(
    model: Any = "toy",
    data: str | DataSpec | None = None,
    plugins: str | Iterable[str | Analyzer] = ("lens", "contrib"),
    *,
    out: str | Path | None = None,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    seq_len: int = 128,
    max_tokens: int = 16384,
    batch_size: int = 8,
    field: str = "text",
    split: str = "train",
    bos: str = "prepend",
    device: Any = None,
    dtype: Any = None,
    threads: int | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> Run:
    """Run analyzers over a model and data; one fused forward pass per batch.

    Args:
        model: Model spec (hub name, local folder, ``toy``) or a ``TransformerBridge``.
        data: A :class:`DataSpec`, a source string (file, folder, ``hf:NAME``), or ``None``
            for the built-in corpus.
        plugins: Analyzer names/aliases (``"lens,contrib"``) or instances.
        out: Folder for ``manifest.json`` and ``<analyzer>/`` results; ``None`` writes nothing.
        options: ``{analyzer: {option: value}}``.
        seq_len, max_tokens, batch_size, field, split, bos: How data is read and packed
            (see :class:`DataSpec`); ignored when ``data`` is a ``DataSpec``.
        device, dtype: Where and in which precision the model runs (residual states are read
            out in float32 whatever the dtype, float64 for a float64 model: see the README's
            precision policy).
        threads: Set torch's intra-op threads (``torch.set_num_threads``, for this process)
            before the run; ``None`` keeps torch's setting. Recorded in the manifest.
        seed: Seeds torch and the built-in corpus; recorded in every result.
        trust_remote_code: Allow hub models with custom code.
        progress: Show a progress bar with tokens/s.

    Returns:
        A :class:`Run` with results, errors and the manifest.

    Raises:
        LensdivError: Bad model spec, data, plugin name, option or hook — before any work.
    """
    import torch

    started = time.time()
    if threads is not None:
        if threads < 1:
            raise OptionError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    analyzers = make_analyzers(plugins, {k: dict(v) for k, v in (options or {}).items()})
    if isinstance(data, DataSpec):
        spec = data
    else:
        spec = DataSpec(
            source=data or "builtin",
            field=field,
            split=split,
            seq_len=seq_len,
            max_tokens=max_tokens,
            batch_size=batch_size,
            bos=bos,
            seed=seed,
        )
    check_source(spec)
    torch.manual_seed(seed)
    folded_only = all(a.numerics == "folded" for a in analyzers)
    bridge = load_model(
        model,
        device=device,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        numerics="folded" if folded_only else "raw",
        progress=progress,
    )
    parsed = bridge.lensdiv_spec
    info = ModelInfo.from_model(bridge, name=parsed.spec)
    hooks = check_hooks(analyzers, info)

    out_dir = Path(out) if out is not None else None
    run = Run(out=out_dir)
    run.manifest = {
        "lensdiv_manifest": 1,
        "status": "running",
        "model": {
            "spec": parsed.spec,
            "kind": parsed.kind,
            "resolved": parsed.resolved,
            "n_layers": info.n_layers,
            "d_model": info.d_model,
            "d_vocab": info.d_vocab,
            "normalization": info.normalization,
            "parallel_residual": info.parallel_residual,
            "device": str(input_device(bridge)),
            "dtype": str(next(bridge.parameters()).dtype).replace("torch.", ""),
            "readout_dtype": str(readout_dtype(next(bridge.parameters()).dtype)).replace(
                "torch.", ""
            ),
        },
        "threads": torch.get_num_threads(),
        "data": dataclasses.asdict(spec),
        "seed": seed,
        "analyzers": {
            a.name: {"options": a.options(), "status": "pending", "numerics": a.numerics}
            for a in analyzers
        },
        "versions": versions(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "timings": {},
    }

    def save_manifest() -> None:
        if out_dir is not None:
            write_json_atomic(out_dir / MANIFEST, run.manifest)

    # Task analyzers bring their own examples, and setup() loads what else a run needs (a
    # reference model): all of it is read and checked before any forward pass, so a bad task
    # file fails at once and nothing is written.
    tasks: dict[str, list[Batch] | None] = {}
    for a in analyzers:
        own = a.examples(bridge, info)
        tasks[a.name] = None if own is None else list(own)
        if own is not None:
            run.manifest["analyzers"][a.name]["data"] = "own examples"
    resources = {a.name: a.setup(bridge, info) for a in analyzers}
    save_manifest()
    # One fused stream over the corpus per numerics kind, then one stream per task analyzer.
    groups: list[tuple[list[Analyzer], Callable[[], Iterable[Batch]], int]] = []
    for kind in ("raw", "folded"):
        shared = [a for a in analyzers if a.numerics == kind and tasks[a.name] is None]
        if shared:
            groups.append((shared, partial(token_batches, spec, bridge.tokenizer), spec.max_tokens))
        for a in analyzers:
            own = tasks[a.name]
            if a.numerics == kind and own is not None:
                size = sum(b.n_tokens for b in own)
                groups.append(([a], partial(iter, own), size))
    stopped: BaseException | None = None
    for group, batches, total in groups:
        if stopped is not None:
            break
        if group[0].numerics == "folded" and not getattr(bridge, "compatibility_mode", False):
            bridge.enable_compatibility_mode()
        engine = Engine(
            bridge,
            info,
            group,
            hooks={a.name: hooks[a.name] for a in group},
            resources={a.name: resources[a.name] for a in group},
        )
        stopped = _stream(engine, batches, total, run, out_dir, progress, save_manifest)
    if isinstance(stopped, LensdivError):
        run.manifest["status"] = "data_error"
        run.manifest["error"] = str(stopped)
    else:
        run.manifest["status"] = (
            "interrupted" if stopped else ("failed" if run.errors else "complete")
        )
    run.manifest["timings"]["total_s"] = round(time.time() - started, 3)
    save_manifest()
    if out_dir is not None:
        write_report(run, bridge)  # report.html (and the example prompt views when lens ran)
    if isinstance(stopped, LensdivError):
        raise stopped  # after the partial results and the manifest are on disk
    return run


def _stream(
    engine: Engine,
    batches: Callable[[], Iterable[Batch]],
    total: int,
    run: Run,
    out_dir: Path | None,
    progress: bool,
    save_manifest: Callable[[], None],
) -> BaseException | None:
    """Run a group through all its passes, then finalize and save each analyzer.

    Returns what stopped the stream early (Ctrl-C, or bad data met mid-way), if anything: the
    analyzers are still finalized on the tokens seen so far and marked partial.
    """
    entries = run.manifest["analyzers"]
    for a in engine.analyzers:
        entries[a.name]["status"] = "running"
    stopped: BaseException | None = None
    n_passes = engine.n_passes
    states: dict[str, Any] = {}
    try:
        states = engine.init()
        for index in range(n_passes):
            members = engine.begin_pass(index, states)
            if not members:
                break
            label = ", ".join(a.name for a in members)
            if n_passes > 1:
                label += f" (pass {index + 1}/{n_passes})"
            bar = _progress(progress, label)
            with bar:
                task = bar.add_task("analyzing", total=total)

                def advance(batch: Batch, bar: Any = bar, task: Any = task) -> None:
                    bar.update(task, advance=batch.n_tokens)

                engine.feed(index, batches(), states, on_batch=advance)
    except (KeyboardInterrupt, LensdivError) as err:
        stopped = err
    interrupted = stopped is not None
    timings = run.manifest["timings"]
    timings["forward_s"] = round(timings.get("forward_s", 0.0) + engine.forward_s, 3)
    own = len(engine.analyzers) == 1 and entries[engine.analyzers[0].name].get("data")
    if own:
        entries[engine.analyzers[0].name]["tokens"] = engine.tokens
    else:
        timings["tokens"] = engine.tokens
    if engine.tokens == 0:
        for a in list(engine.active):
            engine.fail(
                a, RuntimeError("no batch was processed, so there is nothing to report"), "finalize"
            )
    results = engine.finalize(states) if engine.tokens else {}
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
        run.results[a.name] = result
        entries[a.name]["status"] = "partial" if interrupted else "complete"
        if result.warnings:
            entries[a.name]["warnings"] = list(result.warnings)
        if out_dir is not None:
            result.save(out_dir / a.name)
            entries[a.name]["path"] = a.name
        timings[a.name + "_s"] = round(engine.spent[a.name], 3)
        save_manifest()
    save_manifest()
    return stopped


def _progress(enabled: bool, label: str) -> Any:
    """A progress bar over tokens, with tokens/s."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class SpeedColumn(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} tok/s" if speed else "… tok/s", style="cyan")

    return progress_bar(f"[bold]{label}[/bold]", "tokens", SpeedColumn(), enabled=enabled)


def load_run(out: str | Path) -> Run:
    """Read a saved run (its manifest and every result) back from disk."""
    out = Path(out)
    path = out / MANIFEST
    if not path.is_file():
        raise ResultError(
            f"{str(out)!r} is not a lensdiv run folder (no {MANIFEST})",
            hint="pass the --out folder of `lensdiv analyze`",
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ResultError(f"{path} is not valid JSON: {err.msg}") from None
    run = Run(manifest=manifest, out=out)
    for name, entry in manifest.get("analyzers", {}).items():
        if (
            entry.get("status") in ("complete", "partial")
            and (out / name / "result.json").is_file()
        ):
            run.results[name] = Result.load(out / name)
        elif entry.get("status") == "failed":
            run.errors[name] = entry.get("error", "failed")
    return run
