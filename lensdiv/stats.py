"""Deprecated alias of :mod:`lensdiv.core.stats`, where ``lensdiv.stats`` moved when the
package was split into layers: plugins import Stats from :mod:`lensdiv`
(the plugin API, in the README). This alias keeps a plugin written against the old layout
loading, with a ``DeprecationWarning``, until lensdiv 0.3 removes it."""

from __future__ import annotations

import warnings
from typing import Any

from lensdiv.core import stats as _moved

warnings.warn(
    "lensdiv.stats is deprecated and will be removed in lensdiv 0.3: import Stats from lensdiv "
    "(the plugin API; lensdiv.stats itself moved to lensdiv.core.stats)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
