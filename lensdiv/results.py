"""Deprecated alias of :mod:`lensdiv.core.results`, where ``lensdiv.results`` moved when the
package was split into layers: plugins import Result, Table and Plot from :mod:`lensdiv`
(the plugin API, in the README). This alias keeps a plugin written against the old layout
loading, with a ``DeprecationWarning``, until lensdiv 0.3 removes it."""

from __future__ import annotations

import warnings
from typing import Any

from lensdiv.core import results as _moved

warnings.warn(
    "lensdiv.results is deprecated and will be removed in lensdiv 0.3: import Result, Table and Plot from lensdiv "
    "(the plugin API; lensdiv.results itself moved to lensdiv.core.results)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
