"""lensdiv: how does a transformer language model use its depth?

The public surface is small: load a model, run analyzers, read results, write your own analyzer.
Heavy modules (torch, TransformerLens) load on first use, so ``import lensdiv`` is cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lensdiv.analyzer import Analyzer as Analyzer
    from lensdiv.analyzer import Batch as Batch
    from lensdiv.analyzer import ModelInfo as ModelInfo
    from lensdiv.analyzer import Step as Step
    from lensdiv.data import DataSpec as DataSpec
    from lensdiv.errors import LensdivError as LensdivError
    from lensdiv.models import load_model as load_model
    from lensdiv.registry import get_analyzer as get_analyzer
    from lensdiv.registry import list_plugins as list_plugins
    from lensdiv.results import Plot as Plot
    from lensdiv.results import Result as Result
    from lensdiv.results import Table as Table
    from lensdiv.runner import Run as Run
    from lensdiv.runner import analyze as analyze
    from lensdiv.runner import load_run as load_run
    from lensdiv.stats import Stats as Stats

_EXPORTS = {
    "Analyzer": "lensdiv.analyzer",
    "Batch": "lensdiv.analyzer",
    "ModelInfo": "lensdiv.analyzer",
    "Step": "lensdiv.analyzer",
    "DataSpec": "lensdiv.data",
    "LensdivError": "lensdiv.errors",
    "load_model": "lensdiv.models",
    "get_analyzer": "lensdiv.registry",
    "list_plugins": "lensdiv.registry",
    "Plot": "lensdiv.results",
    "Result": "lensdiv.results",
    "Table": "lensdiv.results",
    "Run": "lensdiv.runner",
    "analyze": "lensdiv.runner",
    "load_run": "lensdiv.runner",
    "Stats": "lensdiv.stats",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lensdiv' has no attribute {name!r}")
