"""``study.html``: one self-contained page for a study of many models.

The page holds every model's status, size facts and a link to its own ``report.html``, failures
and models still to run at the top, the papers' numbers against model size, and one figure per
depth profile (every model on relative depth, coloured by size) with the paper's reading under
it. Plots are the summary's PNG files (or drawn from its declarative specs) inlined, styles are
inline, and nothing is loaded from the network (the links to the reports are relative).
"""

from __future__ import annotations

import base64
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from lensdiv.core.results import Result
from lensdiv.view.html import figure_data_uri, render
from lensdiv.view.report import MAX_ROWS

_STATUS_CLASS = {"complete": "ok", "partial": "warn", "pending": "warn", "interrupted": "warn"}


def study_html(
    manifest: Mapping[str, Any],
    summary: Result,
    models: Sequence[Mapping[str, Any]],
    images: Mapping[str, bytes] | None = None,
) -> str:
    """The page of a study.

    Args:
        manifest: The study's ``study.json`` contents (settings, status).
        summary: The study's summary result (tables ``models``, ``numbers``, profile tables and
            their plots).
        models: One row per model: ``model``, ``run``, ``status``, ``reason``, ``seconds``,
            size facts and ``report`` (the relative link to its report, or ``None``).
        images: The summary's PNG files as written (caption inside), by plot name: shown as
            they are, so each figure is drawn once. A plot without one is drawn here.

    Returns:
        The complete HTML document.
    """
    settings = manifest.get("settings", {})
    rows = [
        {
            **m,
            "status_class": _STATUS_CLASS.get(str(m.get("status")), "bad"),
            "params_text": f"{m['params']:,}" if isinstance(m.get("params"), int) else "–",
        }
        for m in models
    ]
    numbers = summary.tables.get("numbers")
    figures: list[dict[str, Any]] = []
    scaling: list[dict[str, Any]] = []
    for spec in summary.plots:
        item: dict[str, Any] = {
            "title": spec.title,
            "name": spec.name,
            "caption": spec.full_caption(summary),
        }
        if images is not None and spec.name in images:
            item["uri"] = "data:image/png;base64," + base64.b64encode(images[spec.name]).decode()
            item["captioned"] = True
        else:
            try:
                item["uri"] = figure_data_uri(spec.figure(summary, caption=False)[0])
            except (KeyError, ValueError, TypeError, IndexError) as err:
                item["error"] = f"{type(err).__name__}: {err}"
        (scaling if spec.name == "update_scaling" else figures).append(item)
    status = str(manifest.get("status", "partial"))
    return render(
        "study.html.j2",
        title=f"lensdiv study: {len(rows)} models",
        status=status,
        status_class=_STATUS_CLASS.get(status, "warn"),
        summary=summary.summary,
        settings=settings,
        plugins=", ".join(settings.get("plugins", {})),
        data=settings.get("data", {}),
        models=rows,
        failures=[m for m in rows if m.get("status") in ("failed", "partial", "interrupted")],
        pending=[m for m in rows if m.get("status") == "pending"],
        numbers=_table(numbers) if numbers is not None and len(numbers) else None,
        descriptions=summary.meta.get("numbers", {}),
        scaling=scaling,
        figures=figures,
        settings_json=json.dumps(settings, indent=1, default=str),
        written=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def _table(table: Any) -> dict[str, Any]:
    rows = table.rows
    return {
        "columns": list(table.columns),
        "rows": [{k: _cell(k, v) for k, v in row.items()} for row in rows[:MAX_ROWS]],
        "description": table.description,
    }


def _cell(column: str, value: Any) -> Any:
    """Parameter counts with thousands separators; every other cell as it is."""
    if column == "params" and isinstance(value, (int, float)) and math.isfinite(value):
        return f"{int(value):,}"
    return value
