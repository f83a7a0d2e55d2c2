"""Write a run's ``report.html``, with the prompt views of a few example prompts when ``lens`` ran.

``analyze`` calls :func:`write_report` once its results are on disk; ``lensdiv report DIR --html``
calls it again on a saved run. The example prompts are the beginnings of the first documents of
the run's own data, read through the logit lens (and the last-block lens when ``dynamics`` ran);
they are saved next to the manifest (``prompt_views.json``) so a rebuilt report shows them
without the model.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import ResultError
from lensdiv.core.results import Result, write_json_atomic
from lensdiv.data.sources import DataSpec, documents
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.prompt import prompt_view
from lensdiv.view.prompt import PromptView
from lensdiv.view.report import report_html

REPORT = "report.html"
VIEWS = "prompt_views.json"
# Example prompts: the first EXAMPLES documents, cut to EXAMPLE_TOKENS tokens each.
EXAMPLES = 3
EXAMPLE_TOKENS = 20


@runtime_checkable
class Run(Protocol):
    """What a report reads of a run (:class:`lensdiv.run.runner.Run`, finished or loaded)."""

    @property
    def results(self) -> Mapping[str, Result]: ...

    @property
    def errors(self) -> Mapping[str, str]: ...

    @property
    def manifest(self) -> Mapping[str, Any]: ...

    @property
    def out(self) -> Path | None: ...


def write_report(
    run: Run,
    model: Bridge | None = None,
    *,
    path: str | Path | None = None,
    prompts: Sequence[str] | None = None,
) -> Path:
    """Write ``report.html`` for ``run`` and return its path.

    Args:
        run: A finished (or loaded) run with an output folder.
        model: The run's model; with it and a ``lens`` result the example prompt views are
            computed (and saved as ``prompt_views.json``); without it the saved ones are used.
        path: Where to write (default: ``run.out / "report.html"``).
        prompts: Prompts for the views (default: the beginnings of the data's first documents).

    Raises:
        ResultError: The run has no output folder and no ``path`` was given.
    """
    if run.out is None and path is None:
        raise ResultError("this run was not written to disk", hint="pass path= or run with out=")
    out = Path(run.out) if run.out is not None else Path(str(path)).parent
    target = Path(path) if path is not None else out / REPORT
    notes: list[str] = []
    views: list[PromptView] = []
    if model is not None and "lens" in run.results:
        try:
            views = example_views(run, model, prompts)
        except Exception as err:  # a view is an extra: the report still shows every result
            notes.append(f"The prompt views could not be computed ({type(err).__name__}: {err}).")
        else:
            write_json_atomic(out / VIEWS, [view.to_dict() for view in views])
    elif (out / VIEWS).is_file():
        try:
            views = [PromptView.from_dict(v) for v in json.loads((out / VIEWS).read_text())]
        except (json.JSONDecodeError, TypeError, ResultError) as err:
            notes.append(f"{VIEWS} could not be read ({err}).")
    html = report_html(run.manifest, run.results, run.errors, views, notes)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(target)
    return target


def example_views(
    run: Run, model: Bridge, prompts: Sequence[str] | None = None
) -> list[PromptView]:
    """Logit-lens views of the example prompts (plus the run's fitted lens, if any, and the
    last-block lens when ``dynamics`` ran, of the first one), with the ``lens`` analyzer's
    ``top_k`` (at most 5)."""
    texts = list(prompts) if prompts is not None else example_prompts(run, model)
    options = run.manifest.get("analyzers", {}).get("lens", {}).get("options", {})
    top_k = max(1, min(int(options.get("top_k", 3)), 5))
    bos = run.manifest.get("data", {}).get("bos", "prepend") == "prepend"
    views = [prompt_view(model, text, top_k=top_k, prepend_bos=bos) for text in texts]
    lens = run.manifest.get("lens", {})
    spec = lens.get("spec") or (f"{lens['kind']}:{lens['source']}" if lens.get("source") else "")
    if texts and spec and spec != "last-block":  # the run's own lens: show it beside
        fitted = parse_lens(spec)
        views.insert(1, prompt_view(model, texts[0], top_k=top_k, lens=fitted, prepend_bos=bos))
    if texts and "dynamics" in run.results:
        views.append(prompt_view(model, texts[0], top_k=top_k, lens="last-block", prepend_bos=bos))
    return views


def example_prompts(run: Run, model: Bridge) -> list[str]:
    """The first ``EXAMPLE_TOKENS`` tokens of the first ``EXAMPLES`` documents of the run's data."""
    known = {f.name for f in dataclasses.fields(DataSpec)}
    spec = DataSpec(**{k: v for k, v in run.manifest.get("data", {}).items() if k in known})
    tokenizer = model.tokenizer
    prompts: list[str] = []
    for doc in itertools.islice(documents(spec), 50):
        ids = model.to_tokens(doc[:4000], prepend_bos=False)[0][:EXAMPLE_TOKENS]
        text = tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        if text.strip():
            prompts.append(text)
        if len(prompts) == EXAMPLES:
            break
    return prompts
