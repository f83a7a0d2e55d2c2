"""``report.html``: one self-contained page for a whole run.

The page holds the manifest's summary (model, data, options, versions, timings, the status of
every analyzer), every warning and failure at the top, the prompt views of a few example prompts
(when the run computed them), and one section per analyzer with its summary, headline table and
plots. Plots are drawn from the results' declarative specs and inlined as PNG, styles are inline,
and nothing is loaded from the network: the file can be mailed, archived or opened offline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lensdiv.core.errors import ResultError
from lensdiv.core.results import Result
from lensdiv.view.html import figure_data_uri, render
from lensdiv.view.prompt import PromptView

# Rows of an analyzer's headline table shown in the page (the CSV next to it has them all).
MAX_ROWS = 60
_STATUS_CLASS = {
    "complete": "ok",
    "partial": "warn",
    "interrupted": "warn",
    "running": "warn",
    "pending": "warn",
    "failed": "bad",
    "data_error": "bad",
}


def report_html(
    manifest: Mapping[str, Any],
    results: Mapping[str, Result],
    errors: Mapping[str, str] | None = None,
    views: Sequence[PromptView] = (),
    notes: Sequence[str] = (),
) -> str:
    """The report page of a run.

    Args:
        manifest: The run's ``manifest.json`` contents.
        results: Finished results by analyzer name.
        errors: ``{analyzer: message}`` of analyzers that failed.
        views: Prompt views to show (example prompts read through the logit lens).
        notes: Extra lines for the warnings box (e.g. why there are no prompt views).

    Returns:
        The complete HTML document.
    """
    errors = dict(errors or {})
    entries: Mapping[str, Any] = manifest.get("analyzers", {})
    names = list(entries) + [n for n in [*results, *errors] if n not in entries]
    names = list(dict.fromkeys(names))
    timings = manifest.get("timings", {})
    analyzers = []
    for name in names:
        entry = entries.get(name, {})
        status = entry.get("status") or ("complete" if name in results else "failed")
        analyzers.append(
            {
                "name": name,
                "status": status,
                "status_class": _STATUS_CLASS.get(status, "warn"),
                "seconds": timings.get(f"{name}_s"),
                "data": entry.get("data", "corpus"),
                "tokens": entry.get("tokens", timings.get("tokens")),
                "options": entry.get("options", {}),
                "warnings": list(results[name].warnings) if name in results else [],
                "error": errors.get(name) or entry.get("error"),
                "section": _section(results[name]) if name in results else None,
            }
        )
    warnings = [(a["name"], w) for a in analyzers for w in a["warnings"]]
    status = str(manifest.get("status", "unknown"))
    run_notes = list(notes)
    if status == "interrupted":
        run_notes.insert(0, "The run was interrupted: results are partial.")
    if manifest.get("error"):
        run_notes.insert(0, f"The run stopped on bad data: {manifest['error']}")
    return render(
        "report.html.j2",
        title=f"lensdiv report: {_model_label(manifest.get('model', {}))}",
        manifest=manifest,
        status=status,
        status_class=_STATUS_CLASS.get(status, "warn"),
        model=manifest.get("model", {}),
        data=manifest.get("data", {}),
        timings=timings,
        versions=manifest.get("versions", {}),
        analyzers=analyzers,
        warnings=warnings,
        failures=[(a["name"], a["error"]) for a in analyzers if a["error"]],
        notes=run_notes,
        views=[view.html(style=False) for view in views],
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def _model_label(model: dict[str, Any]) -> str:
    """The model's name, with the quantization its weights were dequantized from (a GGUF file)."""
    source = model.get("source") or {}
    quant = source.get("quant_label")
    spec = str(model.get("spec", "run"))
    return f"{spec} (dequantized from {quant})" if quant else spec


def _section(result: Result) -> dict[str, Any]:
    """An analyzer's section: summary, headline table, plots as inline PNG, other tables."""
    table = result.table() if result.tables else None
    head = None
    if table is not None:
        rows = table.rows
        head = {
            "name": table.name,
            "description": table.description or table.name,
            "columns": list(table.columns),
            "rows": rows[:MAX_ROWS],
            "hidden": max(len(rows) - MAX_ROWS, 0),
        }
    plots = []
    for spec in result.plots:
        try:
            fig, _ = spec.figure(result, caption=False)
        except ResultError as err:  # a spec naming a missing table or array: says which
            plots.append({"title": spec.title, "error": str(err)})
            continue
        except (KeyError, ValueError, TypeError, IndexError) as err:
            plots.append({"title": spec.title, "error": f"{type(err).__name__}: {err}"})
            continue
        plots.append(
            {
                "title": spec.title,
                "name": spec.name,
                "uri": figure_data_uri(fig),
                "caption": spec.full_caption(result),
            }
        )
    others = [(t.name, t.description, len(t)) for t in list(result.tables.values())[1:]]
    meta = {k: v for k, v in result.meta.items() if k not in ("versions", "model", "data")}
    return {
        "summary": result.summary,
        "table": head,
        "plots": plots,
        "others": others,
        "meta": json.dumps(meta, indent=1, default=str),
    }
