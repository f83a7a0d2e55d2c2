"""``lensdiv merge``: combine the shards of one run (``--shard i/n``), finalize and write.

The merge checks that the shards describe the same run — model, model facts, data, analyzers
and their options, seed, versions — and that every shard ``0..n-1`` is there and finished; the
first difference is named in one line (:class:`~lensdiv.core.errors.StateError`, exit 2). The
states merge by their declared rules (:func:`~lensdiv.core.stats.merge_all`) and finalize from
the state and the model facts recorded in the manifests: no model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import ResultError, StateError
from lensdiv.core.registry import make_analyzers
from lensdiv.core.stats import Stats, merge_all
from lensdiv.run.engine import describe
from lensdiv.run.outcome import MANIFEST, read_manifest, save_result, write_manifest
from lensdiv.run.report import REPORT, write_report
from lensdiv.run.runner import Run

# What shards must agree on, in the order a difference is reported.
AGREE = ("model", "model_info", "lens", "data", "analyzers", "seed", "versions")
# Per-shard facts that may differ (where each shard ran).
_PLACEMENT = {"device", "device_map"}
# What a folder that is not a run should have been.
_HINT = "pass the --out folders of `lensdiv analyze ... --shard I/N`"


def _comparable(manifest: Mapping[str, Any], key: str) -> Any:
    value = manifest.get(key)
    if key == "model" and isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in _PLACEMENT}
    if key == "analyzers" and isinstance(value, dict):
        return {
            name: {"options": e.get("options"), "numerics": e.get("numerics")}
            for name, e in value.items()
        }
    return value


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first (dotted path, value in ``a``, value in ``b``) where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return where, a.get(key, "(missing)"), b.get(key, "(missing)")
            found = first_difference(a[key], b[key], where)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return None
    return None if a == b else (path, a, b)


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def check_shards(folders: Sequence[Path], manifests: Sequence[Mapping[str, Any]]) -> int:
    """Check that the manifests are the finished shards ``0..n-1`` of one run; return ``n``.

    Raises:
        StateError: One line naming the first shard and setting that differ.
    """
    if not manifests:
        raise StateError("no shards to merge", hint="pass the shards' --out folders")
    seen: dict[int, Path] = {}
    count = None
    for folder, manifest in zip(folders, manifests, strict=True):
        shard = manifest.get("shard")
        if not isinstance(shard, dict):
            raise StateError(
                f"{folder} is not a shard (it was not run with --shard I/N)",
                hint="merge only the folders of one sharded run",
            )
        if manifest.get("status") not in ("complete", "failed"):  # failed: some analyzer
            raise StateError(
                f"shard {shard['index']}/{shard['count']} in {folder} did not finish "
                f"(status {manifest.get('status')!r})",
                hint="run that shard again",
            )
        if count is not None and shard["count"] != count:
            raise StateError(
                f"{folder} is shard {shard['index']} of {shard['count']}, the others of {count}"
            )
        count = int(shard["count"])
        if shard["index"] in seen:
            raise StateError(
                f"shard {shard['index']}/{count} is given twice ({seen[shard['index']]}, {folder})"
            )
        seen[int(shard["index"])] = folder
    assert count is not None
    missing = [i for i in range(count) if i not in seen]
    if missing:
        raise StateError(
            f"shard {missing[0]}/{count} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            hint="run it, then merge every shard",
        )
    reference = manifests[0]
    for folder, manifest in zip(folders[1:], manifests[1:], strict=True):
        for key in AGREE:
            found = first_difference(_comparable(reference, key), _comparable(manifest, key))
            if found:
                where, mine, theirs = found
                where = f"{key}.{where}" if where else key
                raise StateError(
                    f"the shards disagree on {where}: {_short(mine)} in {folders[0]}, "
                    f"{_short(theirs)} in {folder}",
                    hint="merge only shards of one run (same model, data, options, seed, versions)",
                )
    return count


def _options(values: Mapping[str, Any]) -> dict[str, Any]:
    """Options as read back from JSON: lists were tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


def merge_runs(folders: Sequence[str | Path], out: str | Path | None = None) -> Any:
    """Merge the shards of one run (their ``--out`` folders), finalize and write the results.

    Args:
        folders: Every shard's folder, in any order.
        out: Where to write the merged run (``None``: nothing is written).

    Returns:
        A :class:`~lensdiv.run.runner.Run`, as :func:`~lensdiv.run.runner.analyze` gives it.

    Raises:
        StateError: The folders are not the finished shards ``0..n-1`` of one run.
        ResultError: A folder is not a run or a state cannot be read.
    """
    started = time.time()
    paths = [Path(f) for f in folders]
    manifests = [read_manifest(p, hint=_HINT) for p in paths]
    count = check_shards(paths, manifests)
    order = sorted(range(len(paths)), key=lambda i: manifests[i]["shard"]["index"])
    paths, manifests = [paths[i] for i in order], [manifests[i] for i in order]
    reference = manifests[0]
    if "model_info" not in reference:
        raise ResultError(f"{paths[0]} records no model facts (made by an older lensdiv)")
    info = ModelInfo.from_dict(reference["model_info"])
    out_dir = Path(out) if out is not None else None
    manifest = {k: v for k, v in reference.items() if k not in ("shard", "timings", "error")}
    manifest["merged"] = {"shards": count, "from": [str(p) for p in paths]}
    manifest["analyzers"] = {}
    run = Run(out=out_dir, manifest=manifest)
    corpus_tokens = sum(int(m.get("timings", {}).get("tokens", 0)) for m in manifests)
    for name, entry in reference["analyzers"].items():
        merged_entry = {k: entry[k] for k in ("options", "numerics") if k in entry}
        manifest["analyzers"][name] = merged_entry
        own = entry.get("data") == "own examples"
        if own:
            merged_entry["data"] = "own examples"
        failed = [(m["shard"]["index"], m["analyzers"][name]) for m in manifests]
        failed = [(i, e) for i, e in failed if e.get("status") != "saved"]
        if failed:
            index, bad = failed[0]
            error = f"shard {index}: {bad.get('error', 'no state saved')}"
            run.errors[name] = error
            merged_entry.update(status="failed", error=error)
            continue
        state = merge_all(
            Stats.load(p / m["analyzers"][name]["state"])
            for p, m in zip(paths, manifests, strict=True)
        )
        tokens = (
            sum(int(m["analyzers"][name].get("tokens", 0)) for m in manifests)
            if own
            else corpus_tokens
        )
        if own:
            merged_entry["tokens"] = tokens
        (analyzer,) = make_analyzers([name], {name: _options(entry.get("options", {}))})
        try:
            result = analyzer.finalize(state, info)
        except Exception as err:  # as in a run: one analyzer failing does not stop the others
            run.errors[name] = f"{describe(err)} (finalize)"
            merged_entry.update(status="failed", error=run.errors[name])
            continue
        meta = {
            "analyzer": name,
            "options": analyzer.options(),
            "numerics": analyzer.numerics,
            "model": manifest["model"],
            "data": "own examples" if own else manifest["data"],
            "tokens": tokens,
            "seed": manifest["seed"],
            "versions": manifest["versions"],
            "partial": False,
            **result.meta,
        }
        result = dataclasses.replace(result, meta=meta)
        run.results[name] = result
        merged_entry["status"] = "complete"
        if result.warnings:
            merged_entry["warnings"] = list(result.warnings)
        if out_dir is not None:  # each result on its own: a full disk costs only its files
            problem = save_result(result, out_dir, merged_entry)
            if problem is not None:
                run.errors[name] = problem
                merged_entry.update(status="failed", error=problem)
    manifest["status"] = "failed" if run.errors else "complete"
    manifest["timings"] = {"tokens": corpus_tokens, "merge_s": round(time.time() - started, 3)}
    if out_dir is not None:  # a file that cannot be written is a line, as in a run
        problem = write_manifest(out_dir, manifest)
        if problem is not None:
            run.problems.append(problem)
            run.unwritten[MANIFEST] = problem
        try:
            write_report(run)  # without the model: no example prompt views
        except Exception as err:  # a full disk
            run.problems.append(f"{REPORT} could not be written: {describe(err)}")
            run.unwritten[REPORT] = run.problems[-1]
    return run
