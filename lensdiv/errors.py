"""Deprecated alias of :mod:`lensdiv.core.errors`, where ``lensdiv.errors`` moved when the
package was split into layers: plugins import LensdivError and UnsupportedModelError from :mod:`lensdiv`
(the plugin API, in the README). This alias keeps a plugin written against the old layout
loading, with a ``DeprecationWarning``, until lensdiv 0.3 removes it."""

from __future__ import annotations

import warnings
from typing import Any

from lensdiv.core import errors as _moved

warnings.warn(
    "lensdiv.errors is deprecated and will be removed in lensdiv 0.3: import LensdivError and UnsupportedModelError from lensdiv "
    "(the plugin API; lensdiv.errors itself moved to lensdiv.core.errors)",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
