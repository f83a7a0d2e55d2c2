"""Hidden-state dynamics (docs/science.md C1): its invariants on every architecture, and agreement with
naive references — the source paper's formulas (``arccos`` of cosines, per token, float64) on
Hugging Face's own ``hidden_states``, numpy's PCA of the stored angle matrix, and a last-block
lens computed by full forward passes with TransformerLens hooks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from lensdiv.analyzers.dynamics import (
    Dynamics,
    LayerDynamics,
    angle,
    stop_layer,
    token_dynamics,
)
from lensdiv.core.analyzer import Batch, ModelInfo, Step
from lensdiv.core.errors import OptionError
from lensdiv.ops.capture import capture
from lensdiv.run.runner import analyze
from tests.test_cli import FAST, assert_user_error, invoke

TOL = 1e-4


def resid_step(model: Any, seed: int = 0, width: int = 24, rows: int = 2, pad: int = 0) -> Step:
    """A step that caches every residual; the last row loses ``pad`` positions to padding."""
    info = ModelInfo.from_model(model)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, min(info.d_vocab, 250), (rows, width), generator=g)
    tokens[:, 0] = model.tokenizer.bos_token_id or 0
    mask = torch.ones_like(tokens, dtype=torch.bool)
    if pad:
        mask[-1, width - pad :] = False
        tokens[-1, width - pad :] = model.tokenizer.pad_token_id or 0
    names = [info.resid(layer) for layer in range(info.n_layers + 1)]
    logits, cache = capture(model, tokens, names, need_logits=True)
    return Step(Batch(tokens, mask, index=seed), cache, logits, model, info)


def run_steps(analyzer: Dynamics, steps: list[Step]) -> Any:
    state = analyzer.init(steps[0].info)
    for step in steps:
        analyzer.update(state, step)
    return state, analyzer.finalize(state, steps[0].info)


def naive_profiles(states: np.ndarray) -> dict[str, np.ndarray]:
    """The source paper's per-token formulas, one token at a time, in float64."""

    def ang(a: np.ndarray, b: np.ndarray) -> float:
        cos = a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300)
        return float(np.arccos(np.clip(cos, -1.0, 1.0)))

    n_states, n = states.shape[:2]
    L = n_states - 1
    out = {k: np.zeros((n, w)) for k, w in (("theta", L), ("norm", L + 1), ("to_final", L + 1))}
    out["theta_update"] = np.zeros((n, L - 1))
    out["progress"] = np.zeros((n, L + 1))
    for t in range(n):
        h = states[:, t].astype(np.float64)
        dh = h[1:] - h[:-1]
        chord = h[L] - h[0]
        for layer in range(L + 1):
            out["norm"][t, layer] = np.linalg.norm(h[layer])
            out["to_final"][t, layer] = ang(h[layer], h[L])
            out["progress"][t, layer] = (h[layer] - h[0]) @ chord / (chord @ chord)
            if layer < L:
                out["theta"][t, layer] = ang(h[layer], h[layer + 1])
            if layer < L - 1:
                out["theta_update"][t, layer] = ang(dh[layer], dh[layer + 1])
    return out


def test_angle_is_exact_where_arccos_is_not() -> None:
    a = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1e-7], [-1.0, 1e-7], [0.0, 3.0], [1.0, 0.0]], dtype=torch.float64)
    got = angle(a, b)
    assert got[0].item() == pytest.approx(1e-7, rel=1e-6)
    assert got[1].item() == pytest.approx(math.pi - 1e-7, rel=1e-12)
    assert got[2].item() == pytest.approx(math.pi / 2)
    assert got[3].item() == pytest.approx(math.pi / 2)  # no direction: as a clamped cosine


def test_token_dynamics_matches_the_papers_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    states = torch.randn(6, 40, 16, generator=g, dtype=torch.float64).cumsum(0)
    got = token_dynamics(states)
    want = naive_profiles(states.numpy())
    for key, value in want.items():
        np.testing.assert_allclose(getattr(got, key).numpy(), value, atol=1e-5, err_msg=key)


def test_stop_layer() -> None:
    theta = torch.tensor(
        [
            [1.0, 1.0, 1.0, 1.0, 5.0],  # rotates evenly (the last block is not counted)
            [1.0, 0.0, 0.0, 0.0, 5.0],  # all its rotation is in block 0
            [0.0, 0.0, 0.0, 0.0, 5.0],  # never rotates before the last block
            [0.0, 0.0, 0.0, 1.0, 0.0],
        ]
    )
    assert stop_layer(theta, 0.9).tolist() == [4, 1, 0, 4]
    assert stop_layer(theta, 0.5).tolist() == [2, 1, 0, 4]


def test_invariants(model: Any) -> None:
    """C1 on every architecture: angles in [0, π], ∠(h_0, h_L) ≤ Σ θ_l, s_0 = 0, s_L = 1."""
    step = resid_step(model, pad=5)
    L = step.info.n_layers
    keep = step.batch.positions()
    token = token_dynamics(torch.stack([step.resid(layer)[keep] for layer in range(L + 1)]))
    for key in ("theta", "theta_update", "to_final"):
        values = getattr(token, key)
        assert values.min() >= 0 and values.max() <= math.pi, key
    assert (token.to_final[:, 0] <= token.theta.sum(-1) + 1e-5).all()
    assert torch.equal(token.progress[:, 0], torch.zeros_like(token.progress[:, 0]))
    torch.testing.assert_close(token.progress[:, -1], torch.ones_like(token.progress[:, -1]))
    assert token.to_final[:, -1].abs().max() < 1e-3  # ∠(h_L, h_L), float32 rounding only

    state, result = run_steps(Dynamics(every=3), [step])
    assert result.meta["positions"] == int(keep.sum())
    assert result.meta["triangle_gap_max"] <= 1e-5
    assert sum(result.table("stop")["fraction"]) == pytest.approx(1.0)
    assert result.table("states")["progress"][0] == 0.0
    assert result.table("states")["progress"][-1] == pytest.approx(1.0, abs=1e-5)
    hist = np.asarray(result.arrays["theta_hist"])
    np.testing.assert_allclose(hist.sum(0), 1.0)  # every token lands in one bin per block


def test_agrees_with_hugging_face_hidden_states(
    tiny_arch: str, tiny_model: Any, tiny_dirs: Any
) -> None:
    """``final_state=post`` measured on the bridge equals the source's formulas on HF's own
    ``output_hidden_states`` (whose last entry is after the final norm)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[tiny_arch], dtype=torch.float32).eval()
    step = resid_step(tiny_model, width=20)
    with torch.no_grad():
        hidden = hf(step.batch.tokens, output_hidden_states=True).hidden_states
    L = step.info.n_layers
    assert len(hidden) == L + 1
    states = torch.stack(list(hidden)).flatten(1, 2).numpy()
    want = naive_profiles(states)
    _, result = run_steps(Dynamics(final_state="post", every=0), [step])
    updates, states_table = result.table("updates"), result.table("states")
    np.testing.assert_allclose(updates["theta"], want["theta"].mean(0), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(
        updates["theta_update"][:-1], want["theta_update"].mean(0), rtol=TOL, atol=TOL
    )
    for key in ("norm", "to_final", "progress"):
        np.testing.assert_allclose(
            states_table[key], want[key].mean(0), rtol=TOL, atol=TOL, err_msg=key
        )


def test_last_block_lens_agrees_with_full_forward_passes(model: Any) -> None:
    """Each ``h_l`` written in as the final block's input by a TL hook on a full pass, then the
    model's own logits: the same cross-entropy as the resumed, stacked analyzer."""
    step = resid_step(model, pad=4)
    info, L = step.info, step.info.n_layers
    targets, has_target = step.batch.next_tokens()
    scored = step.batch.mask & has_target
    want = []
    for layer in range(L):
        hooks = []
        if layer < L - 1:
            value = step.resid(layer)

            def put(x: Any, hook: Any, value: Any = value) -> Any:
                return value

            hooks = [(info.resid(L - 1), put)]
        with torch.no_grad(), model.hooks(fwd_hooks=hooks):
            logits = model(step.batch.tokens)
        logp = torch.log_softmax(logits.double(), -1)
        ce = -logp.gather(-1, targets[..., None])[..., 0]
        want.append(float(ce[scored].mean()))
    _, result = run_steps(Dynamics(every=1), [step])
    np.testing.assert_allclose(result.table("updates")["last_block_lens_ce"], want, rtol=1e-4)
    # At h_{L-1} the last-block lens is the model's own next-token loss.
    assert want[-1] == pytest.approx(
        float(torch.nn.functional.cross_entropy(step.logits[scored].double(), targets[scored])),
        rel=1e-5,
    )


def test_layer_dynamics_are_the_numbers_of_the_result(native_model: Any) -> None:
    """``LayerDynamics`` (the computation alone, no Result): C1's identities on the means
    (``s_0 = 0``, ``s_L = 1``, angles in [0, π]), stop fractions and explained variance that add
    up, and the numbers the result's tables and metadata hold."""
    steps = [resid_step(native_model, seed=s, pad=2 * s) for s in range(2)]
    analyzer = Dynamics(every=2, components=2)
    state, result = run_steps(analyzer, steps)
    numbers = LayerDynamics.from_state(state, steps[0].info, components=2)
    L = numbers.n_layers
    assert numbers.positions == int(sum(int(s.batch.mask.sum()) for s in steps))
    assert numbers.mean["progress"][0] == 0.0
    assert numbers.mean["progress"][-1] == pytest.approx(1.0, abs=1e-5)
    for key in ("theta", "theta_update", "to_final"):
        assert all(0 <= v <= math.pi for v in numbers.mean[key]), key
    assert len(numbers.per_block("theta_update")) == L
    assert math.isnan(numbers.per_block("theta_update")[-1])
    assert float(numbers.stops.sum()) == pytest.approx(1.0)
    assert 0 < sum(numbers.explained) <= 1 + 1e-9 and len(numbers.components) == 2
    assert numbers.triangle_gap_max <= 1e-5
    updates = result.table("updates")
    assert updates["theta"].tolist() == numbers.mean["theta"]
    assert updates["last_block_lens_ce"].tolist() == numbers.lens_ce
    assert result.table("pca")["explained"].tolist() == numbers.explained
    assert result.meta["mean_middle_update"] == numbers.middle_mean("update")
    assert result.meta["early_stop_fraction"] == numbers.early_stop_fraction


def test_streams_and_merges_like_one_pass_and_pca_matches_numpy(native_model: Any) -> None:
    steps = [resid_step(native_model, seed=s, pad=3 * s) for s in range(3)]
    analyzer = Dynamics(every=2, components=4)
    whole, result = run_steps(analyzer, steps)
    parts = [run_steps(analyzer, [s])[0] for s in steps]
    merged = parts[0].merge(parts[1]).merge(parts[2])
    merged_result = analyzer.finalize(merged, steps[0].info)
    for name in ("updates", "states", "stop", "pca"):
        for column, values in result.table(name).columns.items():
            np.testing.assert_allclose(
                merged_result.table(name)[column], values, rtol=1e-9, err_msg=f"{name}.{column}"
            )
    # PCA from the streamed moments = numpy's PCA of the stored token × block angle matrix.
    L = steps[0].info.n_layers
    theta = torch.cat(
        [
            token_dynamics(
                torch.stack([s.resid(layer)[s.batch.mask] for layer in range(L + 1)])
            ).theta
            for s in steps
        ]
    ).double()
    cov = np.cov(theta.numpy(), rowvar=False, bias=True)
    values, vectors = np.linalg.eigh(cov)
    values, vectors = values[::-1], vectors[:, ::-1]
    k = min(4, L)
    np.testing.assert_allclose(
        result.table("pca")["explained"], values[:k] / values.sum(), atol=1e-9
    )
    got = np.asarray(result.arrays["pca_components"])
    for i in range(k):
        assert abs(got[i] @ vectors[:, i]) == pytest.approx(1.0, abs=1e-6)


def test_fused_with_lens_in_one_pass(native_model: Any) -> None:
    run = analyze(
        native_model,
        plugins=["lens", Dynamics(every=1)],
        max_tokens=256,
        seq_len=32,
        batch_size=4,
        progress=False,
    )
    assert run.ok
    lens, dynamics = run["lens"], run["dynamics"]
    # The last-block lens at h_{L-1} and the logit lens at h_L both read the model's output.
    assert dynamics.table("updates")["last_block_lens_ce"][-1] == pytest.approx(
        lens.table()["ce"][-1], rel=1e-4
    )
    assert dynamics.meta["positions"] == lens.meta["positions"]


def test_bad_options() -> None:
    with pytest.raises(OptionError, match="every"):
        Dynamics.from_options({"every": "-1"})
    with pytest.raises(OptionError, match="pre, post"):
        Dynamics.from_options({"final_state": "middle"})
    assert_user_error(
        invoke("analyze", "toy", "--plugins", "dynamics", "-O", "dynamics.settle=2", *FAST),
        "settle",
    )


def test_update_scaling_recovers_a_planted_power_law() -> None:
    from lensdiv.analyzers.dynamics import update_scaling
    from lensdiv.core.results import Result, Table

    def fake(depth: int) -> Result:
        rel = [0.5 / depth] * depth  # every block moves the state by 0.5/L of its norm
        return Result("dynamics", tables={"updates": Table("updates", {"rel_update": rel})})

    fit = update_scaling([fake(d) for d in (4, 8, 16, 32)])
    assert fit["slope"] == pytest.approx(-1.0, abs=1e-9)
    assert math.exp(fit["intercept"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two different depths"):
        update_scaling([fake(4), fake(4)])


def test_middle_blocks() -> None:
    from lensdiv.analyzers.dynamics import middle_blocks

    assert middle_blocks(8) == [2, 3, 4, 5]
    assert middle_blocks(4) == [1, 2]
    assert middle_blocks(6) == [2, 3, 4]
    assert middle_blocks(3) == [1]
    assert middle_blocks(2) == [0, 1]
    assert middle_blocks(1) == [0]
