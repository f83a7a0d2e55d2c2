"""Testing tools for analyzer authors: the contract check and tiny local models.

    from lensdiv.testing import check_analyzer

    def test_contract():
        check_analyzer(MyAnalyzer)

This is the top layer (beside the CLI): it drives analyzers through the run engine on tiny
random models built from Hugging Face configs, with no download. ``token_batches(spec,
tokenizer)`` gives the batches a run of ``spec`` feeds, for checking an analyzer against a
direct computation. ``__all__`` is part of the plugin API (see :mod:`lensdiv`).
"""

from lensdiv.data.sources import token_batches
from lensdiv.testing.contract import (
    ContractReport,
    assert_results_close,
    assert_states_close,
    check_analyzer,
)
from lensdiv.testing.models import ARCHITECTURES, boot_native_tiny, boot_tiny, save_tiny_model

__all__ = [
    "ARCHITECTURES",
    "ContractReport",
    "assert_results_close",
    "assert_states_close",
    "boot_native_tiny",
    "boot_tiny",
    "check_analyzer",
    "save_tiny_model",
    "token_batches",
]
