"""Deprecated alias of :mod:`lensdiv.core.analyzer`, where ``lensdiv.analyzer`` moved when the
package was split into layers: plugins import Analyzer, ModelInfo, Batch and Step from :mod:`lensdiv`
(the plugin API, in the README). This alias keeps a plugin written against the old layout
loading, with a ``DeprecationWarning``, until lensdiv 0.3 removes it."""

from __future__ import annotations

import warnings
from typing import Any

from lensdiv.core import analyzer as _moved

warnings.warn(
    "lensdiv.analyzer is deprecated and will be removed in lensdiv 0.3: import Analyzer, ModelInfo, Batch and Step from lensdiv "
    "(the plugin API; lensdiv.analyzer itself moved to lensdiv.core.analyzer)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
