"""Layer skipping (docs/science.md A3) against a naive full-rerun implementation, and its invariants.

The naive reference (``tests.helpers.naive_effects``, shared with depth-score) re-runs the
whole model once per (sequence, skipped block) with plain TransformerLens hooks and computes
every ratio with a per-position Python loop in float64; the analyzer resumes from the cached
clean residual and vectorises. They must agree to 1e-5.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from lensdiv.analyzers.skip import LayerSkip, SkipEffects
from lensdiv.cli import app
from lensdiv.core.analyzer import ModelInfo, Step
from lensdiv.data.sources import DataSpec
from lensdiv.ops.resume import Resumer
from lensdiv.ops.skipping import later_effect, skip_effects, split_intervals
from lensdiv.run.runner import analyze
from tests.helpers import batches_of, naive_effects, random_step, run_state


def make_step(model: Any, seed: int = 0, width: int = 40) -> Step:
    """Two rows of random tokens after BOS; the second is right-padded (pads never measured)."""
    info = ModelInfo.from_model(model)
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    names += [f"blocks.{i}.hook_{p}_out" for i in range(info.n_layers) for p in ("attn", "mlp")]
    return random_step(model, names, rows=2, width=width, pad=9, seed=seed)


CASES = [
    ("future", "block"),
    ("current", "block"),
    ("local", "block"),
    ("future", "attn"),
    ("current", "mlp"),
    ("local", "mlp"),
]


@pytest.mark.parametrize(("mode", "part"), CASES, ids=[f"{m}-{p}" for m, p in CASES])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "native"])
def test_agrees_with_naive_full_rerun(model: Any, mode: str, part: str) -> None:
    step = make_step(model)
    g = torch.Generator().manual_seed(1)
    intervals = split_intervals(step.batch.mask, mode=mode, splits=2, stride=8, generator=g)
    resumer = Resumer(model)
    E, out = skip_effects(step, intervals, part=part, local=mode == "local", resumer=resumer)
    assert resumer.mode == "resume", resumer.reason
    E_ref, O_ref = naive_effects(step, intervals, part, mode == "local")
    torch.testing.assert_close(E.cpu(), E_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), O_ref, atol=1e-5, rtol=1e-5)


def test_future_skip_agrees_with_naive_full_rerun(model: Any) -> None:
    """Every architecture (qwen2, olmo and olmo2 too), whole-block future skips."""
    step = make_step(model, seed=4)
    g = torch.Generator().manual_seed(5)
    intervals = split_intervals(step.batch.mask, mode="future", splits=2, stride=8, generator=g)
    E, out = skip_effects(step, intervals)
    E_ref, O_ref = naive_effects(step, intervals, "block", False)
    torch.testing.assert_close(E.cpu(), E_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.cpu(), O_ref, atol=1e-5, rtol=1e-5)


def test_resumer_reproduces_the_clean_pass_from_every_layer(model: Any) -> None:
    step = make_step(model)
    resumer = Resumer(model)
    for start in range(step.info.n_layers + 1):
        logits = resumer.run(step.batch.tokens, start, step.resid(start))
        torch.testing.assert_close(logits, step.logits, atol=1e-5, rtol=1e-5)
    assert resumer.mode == "resume"
    # The readout (decomposed final norm + unembedding, float32) is the model's own output head,
    # as TransformerLens' chunked readout is.
    from transformer_lens.tools.analysis.logit_lens import logit_readout

    L = step.info.n_layers
    assert resumer.readout_error is not None and resumer.readout_error < 1e-5
    ours = resumer.readout(step.resid(L)[0])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, step.logits[0], atol=1e-5, rtol=1e-5)
    theirs = logit_readout(model, step.resid(L)[0][None], return_type="logits").values[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_resumer_decides_once_per_model_and_weights(native_model: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-use check is a property of the model: a second resumer (the next run) reuses
    it, and new weights (a new readout) or other settings check again."""
    from lensdiv.ops import readout as readout_module

    step = make_step(native_model)
    probes: list[int] = []
    real = Resumer._probe

    def counted(self: Resumer, tokens: torch.Tensor) -> None:
        probes.append(1)
        real(self, tokens)

    monkeypatch.setattr(Resumer, "_probe", counted)
    readout_module._READOUTS.pop(native_model, None)  # as if the weights had just changed
    first, second = Resumer(native_model), Resumer(native_model)
    first.prepare(step.batch.tokens)
    second.prepare(step.batch.tokens)
    assert len(probes) == 1 and second.mode == first.mode == "resume"
    assert second.readout_error == first.readout_error
    Resumer(native_model, tolerance=1e-3).prepare(step.batch.tokens)
    assert len(probes) == 2
    readout_module._READOUTS.pop(native_model, None)
    Resumer(native_model).prepare(step.batch.tokens)
    assert len(probes) == 3


def test_rerun_fallback_is_exact(model: Any) -> None:
    step = make_step(model)
    g = torch.Generator().manual_seed(2)
    intervals = split_intervals(step.batch.mask, mode="future", splits=2, stride=8, generator=g)
    fast = skip_effects(step, intervals, resumer=Resumer(model))
    slow_resumer = Resumer(model)
    slow_resumer.mode, slow_resumer._tuple_output = "rerun", False
    slow = skip_effects(step, intervals, resumer=slow_resumer)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # The fast path really skips work: blocks run per sequence ~ L(L-1)/2 instead of L².
    L = step.info.n_layers
    n = int(intervals.rows.numel())
    assert slow_resumer.blocks_run == n * L * L


@pytest.mark.parametrize("arch", ["gpt2", "llama", "neox", "native"])
def test_invariants(model: Any) -> None:
    step = make_step(model, seed=3)
    L = step.info.n_layers
    g = torch.Generator().manual_seed(0)
    future = split_intervals(step.batch.mask, mode="future", splits=3, stride=8, generator=g)
    E, out = skip_effects(step, future)
    lower = torch.tril(torch.ones(L, L, dtype=torch.bool))  # l <= s
    assert float(E[:, lower].abs().max()) == 0.0  # future mode: nothing changes up to s
    assert float(out.min()) >= 0.0 and float(out.max()) <= math.sqrt(2) + 1e-9
    assert not (E.requires_grad or out.requires_grad)  # measuring builds no autograd graph
    assert float(E[:, ~lower].max()) > 0.0  # ... but later layers do change
    # No intervention (empty skip set) gives zero effect everywhere.
    empty = type(future)(future.rows, torch.zeros_like(future.skip), future.measure)
    E0, O0 = skip_effects(step, empty)
    assert float(E0.max()) < 1e-5 and float(O0.max()) < 1e-5
    # Current mode, whole block: the skipped block's own update vanishes, E[s, s] = 1.
    current = split_intervals(step.batch.mask, mode="current", splits=1, stride=8, generator=g)
    Ec, _ = skip_effects(step, current)
    torch.testing.assert_close(
        Ec[:, range(L), range(L)], torch.ones(Ec.shape[0], L, dtype=torch.float64)
    )


def test_intervals() -> None:
    mask = torch.ones(3, 40, dtype=torch.bool)
    mask[1, 30:] = False
    mask[2, 12:] = False  # too short for range(8, n - 4, 8)
    g = torch.Generator().manual_seed(0)
    iv = split_intervals(mask, mode="future", splits=4, stride=8, generator=g)
    assert set(iv.rows.tolist()) == {0, 1}
    for p, r in enumerate(iv.rows.tolist()):
        t = int(iv.measure[p].int().argmax())
        assert t in range(8, int(mask[r].sum()) - 4, 8)
        assert not iv.skip[p, 0] and iv.skip[p, 1:t].all() and not iv.skip[p, t:].any()
        assert not (iv.measure[p] & ~mask[r]).any()
    assert (iv.rows == 0).sum() == 4 and (iv.rows == 1).sum() == 3  # 8, 16, 24 for n = 30
    again = split_intervals(mask, mode="future", splits=4, stride=8, generator=g.manual_seed(0))
    assert torch.equal(iv.skip, again.skip)


def test_later_effect_definition() -> None:
    E = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    want = [(1 + 2 + 3) / 3, (6 + 7) / 2, 11 / 1, 0.0]
    torch.testing.assert_close(later_effect(E), torch.tensor(want, dtype=torch.float64))


def test_analyzer_end_to_end(native_model: Any, tmp_path: Any) -> None:
    run = analyze(
        native_model,
        plugins=[LayerSkip(splits=2)],
        max_tokens=512,
        seq_len=64,
        out=tmp_path,
        progress=False,
    )
    result = run["skip"]
    L = native_model.cfg.n_layers
    assert result.arrays["effect_max"].shape == (L, L)
    assert result.meta["resume"] == "resume"
    assert result.meta["prompts"] == 8
    assert (result.arrays["effect_mean"] <= result.arrays["effect_max"] + 1e-12).all()
    # A resumed sweep runs fewer blocks per split point than L re-runs of L blocks.
    assert result.meta["block_runs_per_prompt"] == L * (L - 1) / 2
    assert (tmp_path / "skip" / "skip_effect.png").is_file()


def test_effects_are_the_numbers_of_the_result(native_model: Any) -> None:
    """``SkipEffects`` (the computation alone, no Result) holds what the tables show; future
    mode leaves ``E[s, l] = 0`` for ``l ≤ s`` and ``O ∈ [0, √2]`` (docs/science.md A3)."""
    analyzer = LayerSkip(splits=2)
    info = ModelInfo.from_model(native_model)
    state = run_state(analyzer, native_model, batches_of(native_model, DataSpec(
        seq_len=40, max_tokens=160, batch_size=2)))
    effects = SkipEffects.from_state(state)
    result = analyzer.finalize(state, info)
    L = info.n_layers
    assert effects.prompts == result.meta["prompts"] == 4
    for agg in ("max", "mean"):
        assert effects.effect[agg].shape == (L, L)
        assert (effects.effect[agg].tril() == 0).all()
        assert ((effects.output[agg] >= 0) & (effects.output[agg] <= math.sqrt(2))).all()
        assert effects.output[agg].tolist() == result.table("skip")[f"output_{agg}"].tolist()
        assert effects.later(agg).tolist() == result.table("skip")[f"later_{agg}"].tolist()
    assert (effects.effect["mean"] <= effects.effect["max"] + 1e-12).all()
    later = effects.later("max")
    half = max(1, L // 2)
    first, second = effects.halves("max")
    assert first == pytest.approx(float(later[:half].mean()))
    assert second == pytest.approx(
        float(later[half : L - 1].mean()) if L > 2 else math.nan, nan_ok=True
    )


@pytest.mark.parametrize("exclude_bos", ["false", "true"])
def test_removing_one_block_is_skip_current_from_the_command_line(
    tmp_path: Path, exclude_bos: str
) -> None:
    """docs/science.md's identity, as a user checks it: ``prune``'s one-block removal KL per
    block (``blocks.csv``) is ``skip``'s current-mode KL per block (``skip.csv``) once ``skip``
    skips the first position too, the first position counted or left out alike."""
    out = tmp_path / "run"
    options = {
        "skip.mode": "current",
        "skip.skip_bos": "true",
        "skip.exclude_bos": exclude_bos,
        "prune.exclude_bos": exclude_bos,
        "prune.max_n": "1",
        "prune.curves": "false",
        "prune.linearity": "false",
    }
    args = ["analyze", "toy", "--plugins", "prune,skip", "--max-tokens", "256"]
    args += ["--seq-len", "32", "--out", str(out)]
    for key, value in options.items():
        args += ["-O", f"{key}={value}"]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output

    def column(path: Path, name: str) -> list[float]:
        with path.open() as f:
            return [float(row[name]) for row in csv.DictReader(f)]

    removed = column(out / "prune" / "blocks.csv", "kl_remove")
    skipped = column(out / "skip" / "skip.csv", "output_kl")
    assert len(removed) == len(skipped) > 1 and min(removed) > 0
    assert skipped == pytest.approx(removed, rel=1e-5, abs=1e-7)
    manifest = json.loads((out / "skip" / "result.json").read_text())["meta"]["bos"]
    assert manifest.startswith("skipped")
