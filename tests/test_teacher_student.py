"""Toy teacher–student residual networks (docs/science.md C3): invariants on tiny settings; the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lensdiv.core.errors import OptionError
from lensdiv.core.results import Result
from lensdiv.studies.teacher_student import (
    StudentAdam,
    TeacherStudentConfig,
    fit_depth_exponent,
    make_students,
    make_teacher,
    run_teacher_student,
    student_losses,
    teacher_targets,
)
from tests.test_cli import assert_user_error, invoke

TINY = {"steps": 40, "batch_size": 32, "test_size": 256, "lr": 3e-3, "decay": 0.5}


def _inputs(n: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))


def _reference_logits(net, index: int, x: torch.Tensor) -> torch.Tensor:
    """Network ``index`` of a stack, run alone with the plain block formula of the source."""
    n = len(net.depths)
    x = F.rms_norm(x, (32,))
    for w_fc, b_fc, w_proj in zip(net.w_fc, net.b_fc, net.w_proj, strict=True):
        row = index - (n - w_fc.shape[0])
        if row >= 0:
            hidden = F.rms_norm(x, (32,)) @ w_fc[row] + b_fc[row]
            x = x + F.relu(hidden).square() @ w_proj[row]
    return F.rms_norm(x, (32,)) @ net.head[index]


@pytest.mark.parametrize("rho", [0.0, 1.0])
def test_initial_kl_is_log_vocab_minus_teacher_entropy(rho: float) -> None:
    config = TeacherStudentConfig(rhos=(rho,), temperatures=(0.3,))
    teacher = make_teacher(config, rho)
    students, _ = make_students(config)
    x = _inputs(512)
    targets = teacher_targets(config, [teacher], x)
    entropy = torch.distributions.Categorical(logits=teacher.logits(x)[0] / 0.3).entropy()
    expected = math.log(128) - entropy.mean()
    with torch.no_grad():
        losses = student_losses(config, students, x, targets)
    torch.testing.assert_close(losses, expected.expand_as(losses), rtol=1e-5, atol=1e-6)
    assert expected > 0.1  # a peaked teacher: the identity is not trivially 0 = 0


def test_tied_teacher_shares_block_zero() -> None:
    config = TeacherStudentConfig()
    tied, independent = make_teacher(config, 1.0), make_teacher(config, 0.0)
    assert len(tied.w_fc) == 128
    for blocks in (tied.w_fc, tied.b_fc, tied.w_proj):
        assert all(block is blocks[0] for block in blocks)
    # The same draw: the tied teacher is the independent one with every block set to block 0.
    assert torch.equal(tied.w_fc[0], independent.w_fc[0])
    assert torch.equal(tied.head, independent.head)
    assert not torch.equal(independent.w_fc[0], independent.w_fc[1])
    # Teacher projections are scaled by 1/sqrt(depth) from nn.Linear's ±1/sqrt(128).
    assert float(independent.w_proj[5].abs().max()) <= 1 / math.sqrt(128) / math.sqrt(128)


def test_stacked_networks_match_each_network_run_alone() -> None:
    config = TeacherStudentConfig(depths=(1, 3, 4), rhos=(0.0, 1.0))
    students, order = make_students(config)
    with torch.no_grad():
        for w in students.w_proj:
            w.normal_(0, 0.1)
        students.head.normal_(0, 0.3)
    assert [depth for _, depth in order] == [1, 1, 3, 3, 4, 4]
    x = _inputs(16)
    with torch.no_grad():
        stacked = students.logits(x)
        for i in range(len(order)):
            torch.testing.assert_close(stacked[i], _reference_logits(students, i, x))
    teacher = make_teacher(config, 1.0)
    torch.testing.assert_close(teacher.logits(x)[0], _reference_logits(teacher, 0, x))


def test_student_at_initialisation_is_uniform_identity() -> None:
    config = TeacherStudentConfig(depths=(2, 5, 6), objective="mse")
    students, _ = make_students(config)
    x = _inputs(8)
    with torch.no_grad():
        log_q = F.log_softmax(students.logits(x), dim=-1)
        state = students.final_state(x)
    torch.testing.assert_close(log_q, torch.full_like(log_q, -math.log(128)))
    torch.testing.assert_close(state, F.rms_norm(x, (32,)).expand_as(state))


def test_student_adam_is_torch_adam_per_student() -> None:
    """Stacked students with their own learning rates move exactly as each one would alone."""
    weights = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0))
    lrs = torch.tensor([1e-3, 1e-2, 3e-2])
    stacked = weights.clone().requires_grad_(True)
    alone = [weights[i].clone().requires_grad_(True) for i in range(3)]
    adam = StudentAdam([stacked], lrs)
    torch_adams = [torch.optim.Adam([p], lr=float(lr)) for p, lr in zip(alone, lrs, strict=True)]
    for step in range(5):
        target = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(step))
        (stacked - target).pow(3).abs().sum().backward()
        adam.step(scale=0.5)
        for p, t, opt in zip(alone, target, torch_adams, strict=True):
            opt.param_groups[0]["lr"] *= 0.5
            (p - t).pow(3).abs().sum().backward()
            opt.step()
            opt.zero_grad()
            opt.param_groups[0]["lr"] /= 0.5
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in alone]))


def test_alpha_fit_agrees_with_polyfit() -> None:
    from scipy import stats

    depths = [6, 12, 16, 24, 32, 48]
    rng = np.random.default_rng(0)
    losses = 0.3 * np.asarray(depths, float) ** -1.2 * np.exp(rng.normal(0, 0.05, 6))
    fit = fit_depth_exponent(depths, losses)
    slope, intercept = np.polyfit(np.log(depths), np.log(losses), 1)
    reference = stats.linregress(np.log(depths), np.log(losses))
    assert fit.alpha == pytest.approx(-slope, rel=1e-10)
    assert fit.intercept == pytest.approx(intercept, rel=1e-10)
    assert fit.stderr == pytest.approx(reference.stderr, rel=1e-8)
    assert fit.r2 == pytest.approx(reference.rvalue**2, rel=1e-8)
    assert fit.ci_low < fit.alpha < fit.ci_high
    assert fit.ci_low < 1.2 < fit.ci_high
    exact = fit_depth_exponent(depths, [2.0 / d for d in depths])
    assert exact.alpha == pytest.approx(1.0) and exact.r2 == pytest.approx(1.0)


def test_run_trains_and_reports(tmp_path: Path) -> None:
    config = TeacherStudentConfig(depths=(1, 2, 4), teacher_depth=16, **TINY)
    result = run_teacher_student(config, progress=False)
    losses = result.table("losses")
    assert len(losses) == 6 and set(losses["teacher"]) == {"independent ρ=0, T=1", "tied ρ=1, T=1"}
    assert (losses["test_loss"] < losses["init_loss"]).all()
    alpha = result.table("alpha")
    assert list(alpha["rho"]) == [0.0, 1.0]
    assert (alpha["ci_low"] <= alpha["alpha"]).all() and (alpha["alpha"] <= alpha["ci_high"]).all()
    assert result.meta["seeds"] == {"teacher": 0, "students": 1, "data": 2, "test": 3}
    assert "α_ℓ" in result.summary
    written = {p.name for p in result.save(tmp_path)}
    assert {"alpha.csv", "losses.csv", "curve.csv", "loss_vs_depth.png"} <= written
    assert Result.load(tmp_path).table("alpha").rows == alpha.rows


def test_run_is_seeded() -> None:
    config = TeacherStudentConfig(rhos=(1.0,), depths=(1, 2, 3), teacher_depth=8, **TINY)
    first = run_teacher_student(config, progress=False).table("losses")["test_loss"]
    again = run_teacher_student(config, progress=False).table("losses")["test_loss"]
    np.testing.assert_array_equal(first, again)


def test_deeper_students_fit_a_tied_teacher_better() -> None:
    """A depth-1 student cannot follow a many-step flow that a depth-8 student approximates."""
    config = TeacherStudentConfig(
        rhos=(1.0,), depths=(1, 2, 8), objective="mse", teacher_depth=32, **{**TINY, "steps": 150}
    )
    losses = run_teacher_student(config, progress=False).table("losses")["test_loss"]
    # Seeded, so deterministic; the margins (0.21 > 0.16 > 0.10 here) leave room for platforms.
    assert losses[0] > losses[1] > losses[2]
    assert losses[0] > 1.5 * losses[2]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"rhos": (0.5,)}, "rho"),
        ({"depths": (6, 12)}, "three distinct"),
        ({"temperatures": (0.0,)}, "temperatures"),
        ({"objective": "ce"}, "objective"),
        ({"decay": 2.0}, "decay"),
    ],
)
def test_bad_settings_are_user_errors(overrides: dict, needle: str) -> None:
    with pytest.raises(OptionError, match=needle):
        TeacherStudentConfig(**overrides)


def test_unknown_preset_suggests_the_closest() -> None:
    with pytest.raises(OptionError, match="did you mean 'paper'"):
        TeacherStudentConfig.preset("papers")


def test_paper_preset_is_the_source_recipe() -> None:
    kl = TeacherStudentConfig.preset("paper")
    assert (kl.steps, kl.batch_size, kl.lr, kl.decay, kl.depth_scaled_lr) == (
        40_000, 1024, 6e-4, 0.0, False
    )  # fmt: skip
    assert (kl.teacher_depth, kl.width, kl.hidden, kl.vocab) == (128, 32, 128, 128)
    mse = TeacherStudentConfig.preset("paper", objective="mse")
    assert mse.depth_scaled_lr and mse.decay == 0.2


def test_cpu_preset_is_a_recorded_trial() -> None:
    """``--preset cpu`` is the trial of ``bench/teacher_student_cpu.json`` that docs/findings.md
    quotes: the same settings, with α_ℓ and its interval refitted from its recorded losses."""
    import dataclasses
    import json

    bench = Path(__file__).resolve().parents[1] / "bench" / "teacher_student_cpu.json"
    config = TeacherStudentConfig.preset("cpu")
    wanted = json.loads(json.dumps(dataclasses.asdict(config)))
    (record,) = [r for r in json.loads(bench.read_text()).values() if r["config"] == wanted]
    for label, fit in record["alpha"].items():
        losses = {int(d): v for d, v in record["test_loss"][label].items()}
        refit = fit_depth_exponent(sorted(losses), [losses[d] for d in sorted(losses)])
        assert (refit.alpha, refit.ci_low, refit.ci_high) == pytest.approx(
            (fit["alpha"], fit["ci_low"], fit["ci_high"]), abs=1e-4
        )
    # Its own depths (shallower, cheaper per input than the source's); the other settings' defaults.
    assert config.depths == (4, 6, 8, 12, 16, 24) and config.teacher_depth == 128


def test_cli_writes_result(tmp_path: Path) -> None:
    out = tmp_path / "ts"
    result = invoke(
        "teacher-student", "--steps", "5", "--batch-size", "16", "--test-size", "64",
        "--depths", "1,2,3", "--temperature", "0.5", "--no-progress", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "α_ℓ" in result.output
    assert {"alpha.csv", "losses.csv", "curve.csv", "loss_vs_depth.png", "result.json"} <= {
        p.name for p in out.iterdir()
    }
    assert Result.load(out).meta["config"]["temperatures"] == [0.5]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--rho", "0,2"], "rho"),
        (["--depths", "6,x"], "--depths"),
        (["--preset", "quick"], "preset"),
        (["--objective", "ce"], "objective"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_cli_bad_options(tmp_path: Path, args: list[str], needle: str) -> None:
    assert_user_error(invoke("teacher-student", *args, "--out", str(tmp_path / "o")), needle)


def test_cli_help_has_an_example() -> None:
    result = invoke("teacher-student", "--help")
    assert result.exit_code == 0 and "Example: lensdiv teacher-student" in result.output
