"""Models split across devices: a tiny Hugging Face model whose embedding, some blocks, the final
norm and ``lm_head`` are offloaded to disk (weights on the ``meta`` device, loaded per call by
accelerate) gives every analyzer the results of the unsplit model; the options parse and fail
in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.devices import (
    device_map_of,
    execution_device,
    input_device,
    parse_device_map,
    parse_max_memory,
    stack_on,
)
from lensdiv.core.errors import ModelLoadError
from lensdiv.core.results import Result
from lensdiv.data.sources import DataSpec
from lensdiv.models.load import load_model
from lensdiv.run.runner import analyze
from lensdiv.testing.contract import assert_results_close
from lensdiv.testing.models import save_tiny_model

# Embedding, block 1, final norm and unembedding on disk; blocks 0 and 2 in CPU memory.
DEVICE_MAP = {
    "model.embed_tokens": "disk",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "disk",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}
SPEC = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)
OPTIONS = {
    "patch": {"ig_steps": "8", "batch_size": "4"},
    "depth-score": {"per_grade": "3", "batch_size": "6"},
    "submod": {"samples": "8", "greedy": "2"},
    "skip": {"splits": "2"},
}
ANALYZERS = ["lens", "contrib", "patch", "linmap", "skip", "depth-score", "bias", "submod",
             "dynamics"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("device_map")
    model = save_tiny_model("llama", root / "llama")
    (root / "map.json").write_text(json.dumps(DEVICE_MAP))
    return {"model": model, "map": root / "map.json", "offload": root / "offload"}


@pytest.fixture(scope="module")
def split(folders: dict[str, Path]) -> Any:
    return load_model(str(folders["model"]), device_map=str(folders["map"]),
                      offload_folder=folders["offload"])


@pytest.fixture(scope="module")
def whole(folders: dict[str, Path]) -> Any:
    return load_model(str(folders["model"]), device="cpu")


def test_the_model_is_really_split(split: Any) -> None:
    assert split.embed.W_E.device.type == "meta"  # offloaded: loaded for each call
    assert split.W_U.device.type == "meta"
    assert device_map_of(split) == DEVICE_MAP
    # Tokens go where the embedding computes, not where its (meta) weight sits.
    assert input_device(split) == torch.device("cpu")
    assert execution_device(split.blocks[1]) == torch.device("cpu")
    assert load_model(split, device="cpu", dtype="float32") is split  # left where the map put it


@pytest.mark.parametrize("name", ANALYZERS)
def test_every_analyzer_matches_the_unsplit_model(split: Any, whole: Any, name: str) -> None:
    options = {name: OPTIONS.get(name, {})}
    one = analyze(whole, data=SPEC, plugins=name, options=options, progress=False)
    two = analyze(split, data=SPEC, plugins=name, options=options, progress=False)
    assert not one.errors and not two.errors, (one.errors, two.errors)
    assert two[name].meta["model"]["device_map"] == DEVICE_MAP  # results carry their placement
    assert_results_close(_unplaced(two[name]), _unplaced(one[name]), rtol=1e-6, what=name)


def test_the_patchscope_lens_matches_the_unsplit_model(split: Any, whole: Any) -> None:
    """The inspection prompt's cached prefix and the continuations on a split model."""
    one = analyze(whole, data=SPEC, plugins="lens", lens="patchscope", progress=False)
    two = analyze(split, data=SPEC, plugins="lens", lens="patchscope", progress=False)
    assert not one.errors and not two.errors, (one.errors, two.errors)
    assert_results_close(_unplaced(two["lens"]), _unplaced(one["lens"]), rtol=1e-6,
                         what="lens through patchscope")


def _unplaced(result: Result) -> Result:
    model = {k: v for k, v in result.meta["model"].items() if k != "device_map"}
    return dataclasses.replace(result, meta={**result.meta, "model": model})


def test_cli_device_map_and_manifest(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "analyze", str(folders["model"]), "--plugins", "contrib", "--seq-len", "24",
        "--max-tokens", "60", "--device-map", str(folders["map"]), "--offload-folder",
        str(tmp_path / "offload"), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["device_map"] == DEVICE_MAP
    assert manifest["model"]["device"] == "cpu"


@pytest.mark.parametrize("args, message", [
    (["toy", "--device-map", "auto"], "error: --device-map needs a Hugging Face model"),
    (["toy", "--max-memory", "cpu=1GiB"], "error: --max-memory only applies with a device map"),
    (["toy", "--offload-folder", "x"], "error: --offload-folder only applies with a device map"),
    (["MODEL", "--device-map", "everywhere"], "error: device map 'everywhere' is neither"),
    (["MODEL", "--device-map", "auto", "--max-memory", "gpu=1GiB"],
     "error: --max-memory names unknown device 'gpu'"),
])
def test_cli_placement_mistakes_are_one_line(folders: dict[str, Path], tmp_path: Path,
                                             args: list[str], message: str) -> None:
    args = [str(folders["model"]) if a == "MODEL" else a for a in args]
    result = CliRunner().invoke(app, ["analyze", *args, "--out", str(tmp_path / "x"),
                                      "--no-progress"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), result.output


def test_parse_device_map(tmp_path: Path) -> None:
    assert parse_device_map(None) is None
    for strategy in ("auto", "balanced", "balanced_low_0", "sequential"):
        assert parse_device_map(strategy) == strategy
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model.embed_tokens": 0, "model.layers.0": "1",
                                "lm_head": "cuda:1", "model.norm": "cpu"}))
    assert parse_device_map(str(path)) == {"model.embed_tokens": 0, "model.layers.0": 1,
                                           "lm_head": "cuda:1", "model.norm": "cpu"}
    for text, message in (("[1, 2]", "must be a non-empty JSON object"),
                          ("{", "cannot read device map"),
                          ('{"lm_head": "tpu"}', "module 'lm_head' has unknown device 'tpu'"),
                          ('{"lm_head": true}', "module 'lm_head' has device True")):
        path.write_text(text)
        with pytest.raises(ModelLoadError, match=message):
            parse_device_map(str(path))


def test_parse_max_memory() -> None:
    assert parse_max_memory(None) is None
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB",
                                                              "cpu": "200GiB"}
    assert parse_max_memory({0: "10 GB"}) == {0: "10GB"}
    assert parse_max_memory("disk=1000000") == {"disk": "1000000"}
    for text, message in (("0:70GiB", "bad --max-memory entry '0:70GiB'"),
                          ("0=lots", "size 'lots' of device '0' does not parse"),
                          ("", "--max-memory is empty")):
        with pytest.raises(ModelLoadError, match=message):
            parse_max_memory(text)


def test_stack_on_moves_every_layer_to_one_device() -> None:
    parts = [torch.ones(2), torch.zeros(2)]
    assert stack_on(parts).tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert stack_on(parts, torch.device("cpu"), dim=1).shape == (2, 2)
