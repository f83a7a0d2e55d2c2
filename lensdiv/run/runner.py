"""The runner: fuse every selected analyzer into one forward pass per batch, isolate failures,
write each result as soon as it is final, and leave a manifest that says what is there.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.jupyter import JupyterMixin

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.errors import HookError, LensdivError, ResultError
from lensdiv.core.provenance import versions
from lensdiv.core.results import Result, write_json_atomic
from lensdiv.data.sources import DataSpec, check_source, token_batches

MANIFEST = "manifest.json"


@dataclass
class Run(JupyterMixin):
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


def check_hooks(analyzers: Iterable[Analyzer], info: ModelInfo) -> dict[str, list[str]]:
    """Every analyzer's hooks, after checking each exists on the model."""
    needed = {}
    for analyzer in analyzers:
        hooks = list(dict.fromkeys(analyzer.hooks(info)))
        for hook in hooks:
            if hook not in info.hook_names:
                parts = hook.split(".")
                extra = ""
                if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
                    extra = f" ({info.n_layers} blocks: 0-{info.n_layers - 1})"
                raise HookError(
                    f"analyzer {analyzer.name!r} needs hook {hook!r} but {info.name} has no such "
                    f"hook{extra}",
                    hint="this analyzer does not support this architecture",
                )
        needed[analyzer.name] = hooks
    return needed


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
        device, dtype: Where and in which precision the model runs.
        seed: Seeds torch and the built-in corpus; recorded in every result.
        trust_remote_code: Allow hub models with custom code.
        progress: Show a progress bar with tokens/s.

    Returns:
        A :class:`Run` with results, errors and the manifest.

    Raises:
        LensdivError: Bad model spec, data, plugin name, option or hook — before any work.
    """
    import torch

    from lensdiv.core.registry import make_analyzers
    from lensdiv.models.load import load_model

    started = time.time()
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
            "device": str(next(bridge.parameters()).device),
            "dtype": str(next(bridge.parameters()).dtype).replace("torch.", ""),
        },
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

    # Task analyzers bring their own examples (and linmap its second model): read and check
    # them all before any forward pass, so a bad task file fails at once and nothing is written.
    tasks = {a.name: a.examples(bridge, info) for a in analyzers}
    for a in analyzers:
        if tasks[a.name] is not None:
            tasks[a.name] = list(tasks[a.name])  # type: ignore[arg-type]
            run.manifest["analyzers"][a.name]["data"] = "own examples"
    save_manifest()
    # One fused stream over the corpus per numerics kind, then one stream per task analyzer.
    groups: list[tuple[list[Analyzer], Any, int]] = []
    for kind in ("raw", "folded"):
        shared = [a for a in analyzers if a.numerics == kind and tasks[a.name] is None]
        if shared:
            groups.append((shared, lambda: token_batches(spec, bridge.tokenizer), spec.max_tokens))
        for a in analyzers:
            own = tasks[a.name]
            if a.numerics == kind and own is not None:
                size = sum(b.n_tokens for b in own)
                groups.append(([a], lambda own=own: iter(own), size))
    stopped: BaseException | None = None
    for group, batches, total in groups:
        if stopped is not None:
            break
        if group[0].numerics == "folded" and not getattr(bridge, "compatibility_mode", False):
            bridge.enable_compatibility_mode()
        stopped = _stream(
            bridge, group, batches, total, info, hooks, run, out_dir, progress, save_manifest
        )
    if isinstance(stopped, LensdivError):
        run.manifest["status"] = "data_error"
        run.manifest["error"] = str(stopped)
    else:
        run.manifest["status"] = (
            "interrupted" if stopped else ("failed" if run.errors else "complete")
        )
    run.manifest["timings"]["total_s"] = round(time.time() - started, 3)
    save_manifest()
    if isinstance(stopped, LensdivError):
        raise stopped  # after the partial results and the manifest are on disk
    return run


def _stream(
    bridge: Any,
    analyzers: list[Analyzer],
    batches: Any,
    total: int,
    info: ModelInfo,
    hooks: dict[str, list[str]],
    run: Run,
    out_dir: Path | None,
    progress: bool,
    save_manifest: Any,
) -> BaseException | None:
    """Feed a group of analyzers batch by batch (one fused forward pass per batch, once per
    requested pass), then finalize and save each.

    Returns what stopped the stream early (Ctrl-C, or bad data met mid-way), if anything: the
    analyzers are still finalized on the tokens seen so far and marked partial.
    """
    states = {a.name: a.init(info) for a in analyzers}
    active = list(analyzers)
    timings = run.manifest["timings"]
    spent = {a.name: 0.0 for a in analyzers}
    counts = {"tokens": 0, "forward_s": 0.0}
    stopped: BaseException | None = None
    for a in analyzers:
        run.manifest["analyzers"][a.name]["status"] = "running"
    n_passes = max(a.passes for a in analyzers)
    try:
        for index in range(n_passes):
            members = [a for a in active if a.passes > index]
            for a in list(members):
                if index == 0:
                    continue
                t0 = time.perf_counter()
                try:
                    a.start_pass(states[a.name], info, index)
                except Exception as err:
                    _fail(run, a.name, err, None)
                    active.remove(a)
                    members.remove(a)
                spent[a.name] += time.perf_counter() - t0
            if not members:
                break
            label = ", ".join(a.name for a in members)
            if n_passes > 1:
                label += f" (pass {index + 1}/{n_passes})"
            bar = _progress(progress, label)
            _pass(
                bridge,
                members,
                batches(),
                info,
                hooks,
                run,
                states,
                spent,
                index,
                bar,
                total,
                counts,
            )
            active = [a for a in active if a.name not in run.errors]
    except (KeyboardInterrupt, LensdivError) as err:
        stopped = err
    n_tokens, forward_s = int(counts["tokens"]), counts["forward_s"]
    interrupted = stopped is not None
    timings["forward_s"] = round(timings.get("forward_s", 0.0) + forward_s, 3)
    own = len(analyzers) == 1 and run.manifest["analyzers"][analyzers[0].name].get("data")
    if own:
        run.manifest["analyzers"][analyzers[0].name]["tokens"] = n_tokens
    else:
        timings["tokens"] = n_tokens
    for a in active:
        t0 = time.perf_counter()
        if n_tokens == 0:
            _fail(
                run,
                a.name,
                RuntimeError("no batch was processed, so there is nothing to report"),
                None,
            )
            continue
        try:
            result = a.finalize(states[a.name], info)
            meta = {
                "analyzer": a.name,
                "options": a.options(),
                "numerics": a.numerics,
                "model": run.manifest["model"],
                "data": "own examples" if own else run.manifest["data"],
                "tokens": n_tokens,
                "seed": run.manifest["seed"],
                "versions": run.manifest["versions"],
                "partial": interrupted,
                **result.meta,
            }
            result = dataclasses.replace(result, meta=meta)
        except Exception as err:
            _fail(run, a.name, err, None)
            continue
        spent[a.name] += time.perf_counter() - t0
        run.results[a.name] = result
        entry = run.manifest["analyzers"][a.name]
        entry["status"] = "partial" if interrupted else "complete"
        if out_dir is not None:
            result.save(out_dir / a.name)
            entry["path"] = a.name
        timings[a.name + "_s"] = round(spent[a.name], 3)
        save_manifest()
    save_manifest()
    return stopped


def _pass(
    bridge: Any,
    analyzers: list[Analyzer],
    batches: Iterable[Any],
    info: ModelInfo,
    hooks: dict[str, list[str]],
    run: Run,
    states: dict[str, Any],
    spent: dict[str, float],
    index: int,
    bar: Any,
    total: int,
    counts: dict[str, Any],
) -> None:
    """One pass over ``batches``; adds the clean forward's seconds (and, in pass 0, the real
    tokens seen) to ``counts`` as it goes, so an interrupted pass still reports them."""
    import torch

    from lensdiv.ops.capture import capture

    names = list(dict.fromkeys(h for a in analyzers for h in hooks[a.name]))
    need_logits = any(a.needs_logits for a in analyzers)
    grad = any(a.needs_grad for a in analyzers)
    device = next(bridge.parameters()).device
    active = list(analyzers)
    with bar:
        task = bar.add_task("analyzing", total=total)
        for batch in batches:
            batch.tokens, batch.mask = batch.tokens.to(device), batch.mask.to(device)
            if batch.doc is not None:
                batch.doc = batch.doc.to(device)
            t0 = time.perf_counter()
            logits, cache = capture(bridge, batch.tokens, names, need_logits=need_logits, grad=grad)
            counts["forward_s"] += time.perf_counter() - t0
            step = Step(
                batch=batch, cache=cache, logits=logits, model=bridge, info=info, pass_index=index
            )
            for a in list(active):
                t0 = time.perf_counter()
                try:
                    with torch.set_grad_enabled(a.needs_grad):
                        a.update(states[a.name], step)
                except Exception as err:  # one analyzer failing must not stop the others
                    _fail(run, a.name, err, batch.index)
                    active.remove(a)
                spent[a.name] += time.perf_counter() - t0
            if index == 0:
                counts["tokens"] += batch.n_tokens
            bar.update(task, advance=batch.n_tokens)
            if not active:
                break


def _fail(run: Run, name: str, err: Exception, batch: int | None) -> None:
    where = f" (batch {batch})" if batch is not None else " (finalize)"
    message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    run.errors[name] = message + where
    run.manifest["analyzers"][name].update(status="failed", error=message + where)


def _progress(enabled: bool, label: str) -> Any:
    """A progress bar over tokens, with tokens/s."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    from lensdiv.core.progress import progress_bar

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
