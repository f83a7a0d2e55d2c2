"""Data: the built-in synthetic corpus and byte tokenizer, user data sources, packing, task files.

The built-in sources are registered here, so that a :class:`~lensdiv.data.spec.DataSpec` finds
its source whichever module of this package was imported first (none of them imports torch).
"""

from lensdiv.data import sources as sources  # noqa: F401  # registers the built-in sources

# isort: split
# after the path sources, which claim any string: `pydoc` names Python's documentation
from lensdiv.data import pydocs as pydocs  # noqa: F401
