"""Shared fixtures: tiny random Hugging Face models saved locally and booted through TL 4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.models import ARCHITECTURES, boot_tiny, save_tiny_model

ARCH_NAMES = list(ARCHITECTURES)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny architecture saved once per session: ``{arch: hf_directory}``."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: save_tiny_model(arch, root / arch) for arch in ARCH_NAMES}


@pytest.fixture(scope="session")
def _booted_bridges() -> dict[str, Any]:
    """Session cache so each architecture boots at most once."""
    return {}


@pytest.fixture(params=ARCH_NAMES, ids=ARCH_NAMES)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    """The architecture name of the current ``tiny_model`` parametrisation."""
    return request.param


@pytest.fixture
def tiny_model(tiny_arch: str, tiny_dirs: dict[str, Path], _booted_bridges: dict[str, Any]) -> Any:
    """A booted ``TransformerBridge`` (eval mode, CPU, fp32) for each tiny architecture.

    Shared across the session: tests must not leave hooks attached or change its mode.
    """
    if tiny_arch not in _booted_bridges:
        _booted_bridges[tiny_arch] = boot_tiny(tiny_arch, tiny_dirs[tiny_arch])
    model = _booted_bridges[tiny_arch]
    model.eval()
    return model
