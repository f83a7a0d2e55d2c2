"""The third-party plugin package ``plugins/lensdiv-attention``: install, discover, run, check."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import pip_install

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plugins" / "lensdiv-attention"
TOL = 1e-6


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed (wheel build, no dependencies, offline) into a private folder."""
    root = tmp_path_factory.mktemp("plugin")
    # Build from a copy: an in-tree build leaves build/ and *.egg-info in the repository.
    source = root / "src"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = root / "site"
    pip_install(source, target)
    assert (target / "lensdiv_attention" / "__init__.py").is_file()
    return target


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    # Wide enough that rich does not wrap the "provided by" cell of `plugins list`.
    env["COLUMNS"] = "250"
    return env


def _lensdiv(site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lensdiv", *args], capture_output=True,
                          text=True, env=_env(site), cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def plugin(site: Path) -> Iterator[Any]:
    """The ``lensdiv_attention`` module imported from the install folder (not the source)."""
    sys.path.insert(0, str(site))
    try:
        import lensdiv_attention

        assert Path(lensdiv_attention.__file__).is_relative_to(site)
        yield lensdiv_attention
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("lensdiv_attention", None)


def test_plugins_list_shows_provider(site: Path) -> None:
    proc = _lensdiv(site, "plugins", "list")
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "attn-entropy" in line]
    assert rows, proc.stdout
    assert "lensdiv-attention 0.1.0" in rows[0]
    assert "attent" in rows[0]
    assert "failed to load" not in proc.stdout
    assert "attn-entropy" not in proc.stderr  # no registry warning about it


def test_analyze_writes_result(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _lensdiv(site, "analyze", "toy", "--plugins", "attn-entropy,lens", "--max-tokens",
                    "512", "--seq-len", "64", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    folder = out / "attn-entropy"
    data = json.loads((folder / "result.json").read_text())
    assert data["analyzer"] == "attn-entropy"
    assert data["summary"]
    assert data["meta"]["options"] == {"exclude_bos": True}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["analyzers"]["attn-entropy"]["status"] == "complete"
    n_layers = manifest["model"]["n_layers"]

    with open(folder / "attn_entropy.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == n_layers
    assert {"layer", "entropy", "norm_entropy", "bos_mass", "max_entropy_head",
            "min_entropy_head"} <= set(rows[0])
    for plot in data["plots"]:
        assert (folder / f"{plot['name']}.png").stat().st_size > 0
    assert {p["kind"] for p in data["plots"]} == {"heatmap", "line"}
    assert any(p["kind"] == "heatmap" and p["source"] == "entropy" for p in data["plots"])

    entropy, norm, bos = (data["arrays"][k] for k in ("entropy", "norm_entropy", "bos_mass"))
    assert len(entropy) == len(bos) == n_layers
    n_heads = len(entropy[0])
    for layer in range(n_layers):
        assert len(entropy[layer]) == len(bos[layer]) == n_heads
        for head in range(n_heads):
            assert entropy[layer][head] >= -TOL
            # No head can beat uniform attention over the longest context seen.
            assert entropy[layer][head] <= math.log(64) + TOL
            assert -TOL <= norm[layer][head] <= 1 + TOL
            assert -TOL <= bos[layer][head] <= 1 + TOL
        # The table's per-layer values are the head means of the arrays.
        assert float(rows[layer]["entropy"]) == pytest.approx(sum(entropy[layer]) / n_heads)
        most = int(rows[layer]["max_entropy_head"])
        assert entropy[layer][most] == max(entropy[layer])


def _naive(pattern: Any, mask: Any, exclude_bos: bool) -> tuple[list, list, list]:
    """Per-head means by explicit loops over rows, queries and keys (float64 Python)."""
    batch, n_heads, n_pos, _ = pattern.shape
    p = pattern.double().tolist()
    ent, norm, bos = [0.0] * n_heads, [0.0] * n_heads, [0.0] * n_heads
    n = n_norm = 0
    for b in range(batch):
        for q in range(n_pos):
            if not mask[b][q] or (exclude_bos and q == 0):
                continue
            n += 1
            n_norm += q >= 1
            for h in range(n_heads):
                row = p[b][h][q]
                entropy = -sum(x * math.log(x) for x in row[: q + 1] if x > 0)
                ent[h] += entropy
                bos[h] += row[0]
                if q >= 1:
                    norm[h] += entropy / math.log(q + 1)
    return [e / n for e in ent], [e / n_norm for e in norm], [x / n for x in bos]


@pytest.mark.parametrize("exclude_bos", [True, False])
def test_entropy_matches_naive_loop(plugin: Any, exclude_bos: bool) -> None:
    import torch

    import lensdiv
    from lensdiv.core.analyzer import Batch, ModelInfo, Step

    model = lensdiv.load_model("toy", device="cpu")
    info = ModelInfo.from_model(model, name="toy")
    analyzer = plugin.AttentionEntropy(exclude_bos=exclude_bos)
    hooks = [f"blocks.{layer}.attn.hook_pattern" for layer in range(info.n_layers)]
    assert analyzer.hooks(info) == hooks

    torch.manual_seed(0)
    n_pos = 12
    tokens = torch.randint(3, 200, (3, n_pos))
    tokens[:, 0] = model.tokenizer.bos_token_id
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[1, 7:] = False  # right padding: queries 7.. of row 1 must not count
    mask[2, 2:] = False
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern0 = cache["blocks.0.attn.hook_pattern"]
    assert pattern0.shape == (3, info.n_heads, n_pos, n_pos)  # [batch, head, query, key]
    assert torch.allclose(pattern0.sum(-1), torch.ones(()), atol=1e-5)

    state = analyzer.init(info)
    step = Step(batch=Batch(tokens=tokens, mask=mask), cache=dict(cache.items()), logits=None,
                model=model, info=info)
    analyzer.update(state, step)
    result = analyzer.finalize(state, info)

    kept = int(mask.sum()) - (3 if exclude_bos else 0)
    assert result.meta["positions"] == kept
    for layer in range(info.n_layers):
        ent, norm, bos = _naive(cache[f"blocks.{layer}.attn.hook_pattern"], mask.tolist(),
                                exclude_bos)
        assert result.arrays["entropy"][layer].tolist() == pytest.approx(ent, abs=1e-5)
        assert result.arrays["norm_entropy"][layer].tolist() == pytest.approx(norm, abs=1e-5)
        assert result.arrays["bos_mass"][layer].tolist() == pytest.approx(bos, abs=1e-5)

    # Streaming: two shards merged give the same means as one pass over both.
    shard = analyzer.init(info)
    analyzer.update(shard, step)
    merged = analyzer.finalize(state.merge(shard), info)
    assert merged.arrays["entropy"] == pytest.approx(result.arrays["entropy"])
    assert merged.meta["positions"] == 2 * kept


def test_plugin_obeys_the_contract(plugin: Any) -> None:
    """The whole analyzer contract, as a plugin author runs it (lensdiv.testing)."""
    from lensdiv.testing import check_analyzer

    report = check_analyzer(plugin.AttentionEntropy, architectures=("gpt2", "llama", "native"))
    assert report.checked == ["gpt2", "llama", "native"], report.skipped
