"""lensdiv: how does a transformer language model use its depth?

The public surface is small: load a model, run analyzers, read results, write your own analyzer.
Heavy modules (torch, TransformerLens) load on first use, so ``import lensdiv`` is cheap.

The plugin API (the README's "The plugin API") is ``__all__`` here, ``lensdiv.testing.__all__``
and ``lensdiv.ops.resume.__all__``: a plugin that imports only these names keeps working when
modules inside the package move (``tests/test_public_api.py`` holds the scaffold's plugin and
``plugins/lensdiv-attention`` to it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lensdiv.core.analyzer import Analyzer as Analyzer
    from lensdiv.core.analyzer import Batch as Batch
    from lensdiv.core.analyzer import DataFacts as DataFacts
    from lensdiv.core.analyzer import ModelInfo as ModelInfo
    from lensdiv.core.analyzer import Step as Step
    from lensdiv.core.bridge import Bridge as Bridge
    from lensdiv.core.bridge import Tokenizer as Tokenizer
    from lensdiv.core.errors import DataError as DataError
    from lensdiv.core.errors import LensdivError as LensdivError
    from lensdiv.core.errors import UnsupportedModelError as UnsupportedModelError
    from lensdiv.core.registry import get_analyzer as get_analyzer
    from lensdiv.core.registry import list_plugins as list_plugins
    from lensdiv.core.results import Plot as Plot
    from lensdiv.core.results import Result as Result
    from lensdiv.core.results import Table as Table
    from lensdiv.core.settings import RunSettings as RunSettings
    from lensdiv.core.stats import Stats as Stats
    from lensdiv.data.sources import DataSpec as DataSpec
    from lensdiv.data.sources import Source as Source
    from lensdiv.lenses.fit import LensFit as LensFit
    from lensdiv.lenses.fit import evaluate_lens as evaluate_lens
    from lensdiv.lenses.fit import fit_lens as fit_lens
    from lensdiv.models.load import load_model as load_model
    from lensdiv.ops.prompt import prompt_view as prompt_view
    from lensdiv.run.merge import merge_runs as merge_runs
    from lensdiv.run.runner import Run as Run
    from lensdiv.run.runner import analyze as analyze
    from lensdiv.run.runner import load_run as load_run
    from lensdiv.studies.crossmodel import load_study as load_study
    from lensdiv.studies.crossmodel import run_study as run_study
    from lensdiv.view.prompt import PromptView as PromptView
    from lensdiv.web.serve import explore as explore

_EXPORTS = {
    "Analyzer": "lensdiv.core.analyzer",
    "Batch": "lensdiv.core.analyzer",
    "DataFacts": "lensdiv.core.analyzer",
    "ModelInfo": "lensdiv.core.analyzer",
    "Step": "lensdiv.core.analyzer",
    "Bridge": "lensdiv.core.bridge",
    "Tokenizer": "lensdiv.core.bridge",
    "DataSpec": "lensdiv.data.sources",
    "Source": "lensdiv.data.sources",
    "DataError": "lensdiv.core.errors",
    "LensdivError": "lensdiv.core.errors",
    "UnsupportedModelError": "lensdiv.core.errors",
    "load_model": "lensdiv.models.load",
    "merge_runs": "lensdiv.run.merge",
    "get_analyzer": "lensdiv.core.registry",
    "list_plugins": "lensdiv.core.registry",
    "Plot": "lensdiv.core.results",
    "Result": "lensdiv.core.results",
    "Table": "lensdiv.core.results",
    "RunSettings": "lensdiv.core.settings",
    "Run": "lensdiv.run.runner",
    "analyze": "lensdiv.run.runner",
    "load_run": "lensdiv.run.runner",
    "run_study": "lensdiv.studies.crossmodel",
    "load_study": "lensdiv.studies.crossmodel",
    "Stats": "lensdiv.core.stats",
    "prompt_view": "lensdiv.ops.prompt",
    "fit_lens": "lensdiv.lenses.fit",
    "evaluate_lens": "lensdiv.lenses.fit",
    "LensFit": "lensdiv.lenses.fit",
    "PromptView": "lensdiv.view.prompt",
    "explore": "lensdiv.web.serve",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lensdiv' has no attribute {name!r}")
