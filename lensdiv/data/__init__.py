"""Data: the built-in synthetic corpus and byte tokenizer, user data sources, packing, task files.

The data sources are registered as ``lensdiv.data_sources`` entry points (lensdiv's own in its
pyproject.toml) and read on first use (:mod:`lensdiv.data.spec`); none of these modules imports
torch.
"""

from lensdiv.data import pydocs as pydocs  # noqa: F401
from lensdiv.data import sources as sources  # noqa: F401
