"""The depth scaling-law fit (docs/science.md C2): planted laws are recovered, the Jacobian errors
match independent checks, the built-in Chinchilla table is what its README says and its fit sits at
an optimum, bad CSVs and names are one-line errors and a model family's losses are what an
independent forward pass gives."""

from __future__ import annotations

import csv
import math
from importlib import resources
from pathlib import Path

import numpy as np
import pytest

from lensdiv.core.errors import DataError, OptionError
from lensdiv.core.results import Result, Table
from lensdiv.studies.scaling import (
    DATASETS,
    TERMS,
    Runs,
    chinchilla_runs,
    collect_family,
    design,
    expand_models,
    fit_family_table,
    fit_law,
    fit_runs,
    log_residuals,
    parse_terms,
    read_runs,
)
from lensdiv.studies.scaling.family import _check_same_tokens
from tests.test_cli import assert_user_error, invoke

# A planted law in Chinchilla-like units: width m, depth ℓ, tokens D.
PLANTED = {
    "c_width": 300.0,
    "alpha_width": 0.9,
    "c_depth": 4.0,
    "alpha_depth": 1.0,
    "c_tokens": 600.0,
    "alpha_tokens": 0.3,
    "L0": 1.7,
}
RANGES = {"width": (256.0, 4096.0), "depth": (4.0, 64.0), "tokens": (1e8, 3e10)}


def planted_runs(terms: tuple[str, ...], n: int, noise: float, seed: int = 0) -> Runs:
    """Runs whose loss follows the planted law times ``exp(noise · N(0, 1))``."""
    rng = np.random.default_rng(seed)
    sizes = {t: np.exp(rng.uniform(*np.log(RANGES[t]), n)) for t in terms}
    loss = PLANTED["L0"] + sum(PLANTED[f"c_{t}"] / sizes[t] ** PLANTED[f"alpha_{t}"] for t in terms)
    loss = loss * np.exp(noise * rng.standard_normal(n))
    return Runs(loss=loss, sizes=sizes, labels=tuple(f"run {i}" for i in range(n)))


def planted_theta(fit) -> np.ndarray:
    """The planted law in the fit's own parameters (log c at the reference scales, α, log L0)."""
    k = len(fit.terms)
    theta = np.empty(2 * k + 1)
    for i, t in enumerate(fit.terms):
        alpha = PLANTED[f"alpha_{t}"]
        theta[i] = np.log(PLANTED[f"c_{t}"]) - alpha * np.log(fit.scales[t])
        theta[k + i] = alpha
    theta[2 * k] = np.log(PLANTED["L0"])
    return theta


def objective(theta: np.ndarray, runs: Runs, fit) -> float:
    """Mean squared error of log-loss, computed from the public residual function."""
    u = design(runs.sizes, fit.terms, fit.scales)
    return float(np.mean(log_residuals(theta, u, np.log(runs.loss)) ** 2))


@pytest.fixture(scope="module")
def full_noisy() -> tuple[Runs, object]:
    runs = planted_runs(TERMS, 150, noise=0.005)
    return runs, fit_law(runs, TERMS)


# -- recovery ------------------------------------------------------------------------------------
@pytest.mark.parametrize("terms", [TERMS, ("depth",)], ids=["full", "depth"])
def test_exact_data_is_fitted_exactly(terms: tuple[str, ...]) -> None:
    fit = fit_law(planted_runs(terms, 60, noise=0.0), terms)
    assert fit.mse < 1e-20
    for name, value in fit.values().items():
        assert value == pytest.approx(PLANTED[name], rel=1e-5), name


@pytest.mark.parametrize("terms", [TERMS, ("depth",)], ids=["full", "depth"])
def test_noisy_data_recovers_the_planted_law(terms: tuple[str, ...], full_noisy) -> None:
    fit = full_noisy[1] if terms == TERMS else fit_law(planted_runs(terms, 150, 0.005), terms)
    values = fit.values()
    for t in terms:
        assert abs(values[f"alpha_{t}"] - PLANTED[f"alpha_{t}"]) < 0.05, t
        assert values[f"c_{t}"] == pytest.approx(PLANTED[f"c_{t}"], rel=0.3), t
    assert values["L0"] == pytest.approx(PLANTED["L0"], rel=0.02)


# -- standard errors -------------------------------------------------------------------------------
def test_jacobian_stderr_matches_finite_differences_in_raw_units(full_noisy) -> None:
    """Rebuild σ²(JᵀJ)⁻¹ from a numerical Jacobian taken with respect to the *reported*
    parameters (raw-unit coefficients, exponents, L0): it must equal the fit's stderr, which
    comes from the analytic Jacobian in the scaled log parameters plus the delta method."""
    runs, fit = full_noisy
    names, values = fit.names, fit.values()
    point = np.array([values[n] for n in names])

    def residuals(params: np.ndarray) -> np.ndarray:
        p = dict(zip(names, params, strict=True))
        law = p["L0"] + sum(p[f"c_{t}"] / runs.sizes[t] ** p[f"alpha_{t}"] for t in fit.terms)
        return np.log(law) - np.log(runs.loss)

    steps, eye = 1e-6 * np.abs(point), np.eye(len(point))
    columns = [
        (residuals(point + h * e) - residuals(point - h * e)) / (2 * h)
        for e, h in zip(eye, steps, strict=True)
    ]
    jac = np.stack(columns, axis=1)
    sigma2 = np.sum(residuals(point) ** 2) / (len(runs) - len(point))
    independent = np.sqrt(np.diag(sigma2 * np.linalg.inv(jac.T @ jac)))
    stderr = fit.stderr()
    for name, se in zip(names, independent, strict=True):
        assert stderr[name] == pytest.approx(se, rel=1e-3), name


def test_stderr_matches_the_spread_over_noise_draws() -> None:
    noise, draws = 0.02, 150
    terms = ("depth",)
    first = fit_law(planted_runs(terms, 40, noise, seed=0), terms)
    start = planted_theta(first)
    fits = [
        fit_law(planted_runs(terms, 40, noise, seed=s), terms, scales=first.scales, start=start)
        for s in range(draws)
    ]
    for name in fits[0].names:
        spread = np.std([f.values()[name] for f in fits])
        typical = np.median([f.stderr()[name] for f in fits])
        assert 0.67 < typical / spread < 1.5, (name, typical, spread)


def test_bootstrap_intervals_and_heldout_table() -> None:
    runs = planted_runs(TERMS, 120, noise=0.003, seed=3)
    result = fit_runs(runs, "full", n_bootstrap=40, folds=3, seed=1)
    table = result.tables["parameters"]
    for row in table.rows:
        assert row["ci_low"] <= PLANTED[row["name"]] <= row["ci_high"], row
        assert row["ci_low"] <= row["value"] <= row["ci_high"], row
        assert row["stderr"] > 0
    heldout = result.tables["heldout"].rows
    assert [r["fold"] for r in heldout] == ["1", "2", "3", "mean", "in-sample"]
    assert all(r["test_rmse"] < 0.01 for r in heldout[:3])
    assert heldout[-1]["train_rmse"] == pytest.approx(np.sqrt(result.meta["mse_log_loss"]))
    assert result.meta["seed"] == 1 and result.meta["n_bootstrap"] == 40
    assert "α_ℓ" in result.summary
    assert Result.from_json(result.to_json()).to_json() == result.to_json()


# -- the real Chinchilla table, built in -------------------------------------------------------------
CHINCHILLA_COLUMNS = ["model_size", "FLOP", "loss", "num_tokens", "d_model", "n_layers"]


def test_chinchilla_table_ships_in_the_package_as_documented() -> None:
    """245 runs with the columns data/README.md lists, ``num_tokens = FLOP / (6 · model_size)``,
    one architecture per model size, and the README citing both papers beside the CSV."""
    assert list(DATASETS) == ["chinchilla"] and DATASETS["chinchilla"].name == "chinchilla"
    rows = list(csv.reader(DATASETS["chinchilla"].read_text().splitlines()))
    assert rows[0] == CHINCHILLA_COLUMNS and len(rows) == 246
    table = [dict(zip(rows[0], map(float, row), strict=True)) for row in rows[1:]]
    for run in table:
        assert all(math.isfinite(v) and v > 0 for v in run.values()), run
        assert run["num_tokens"] == pytest.approx(run["FLOP"] / (6 * run["model_size"]), rel=1e-12)
        assert run["n_layers"] == int(run["n_layers"]) and run["d_model"] == int(run["d_model"])
    architectures = {}
    for run in table:
        architectures.setdefault(run["model_size"], set()).add((run["d_model"], run["n_layers"]))
    assert all(len(a) == 1 for a in architectures.values())
    folder = resources.files("lensdiv.studies.scaling") / "data"
    readme = " ".join((folder / "README.md").read_text(encoding="utf-8").split())
    for needle in (
        "chinchilla_runs.csv",
        "Training Compute-Optimal Large Language Models",
        "Chinchilla Scaling: A replication attempt",
        "epoch-research/analyzing-chinchilla",
        "Licence",
        *CHINCHILLA_COLUMNS,
    ):
        assert needle in readme, needle


def test_chinchilla_fit_is_at_an_optimum() -> None:
    runs = chinchilla_runs("full", depth_offset=-2, drop_highest=40)
    by_name = read_runs("chinchilla", "full", depth_offset=-2, drop_highest=40)
    assert runs.source == by_name.source == "chinchilla" and runs.labels == by_name.labels
    assert len(runs) == 203  # 40 dropped, and two more tied with the 40th-highest loss
    fit = fit_law(runs, TERMS)
    best = objective(fit.theta, runs, fit)
    assert best == pytest.approx(fit.mse, rel=1e-12)
    eye = np.eye(len(fit.theta))
    for j in range(len(fit.theta)):  # a small step either way never lowers the objective
        up, down = (
            objective(fit.theta + 1e-4 * eye[j], runs, fit),
            objective(fit.theta - 1e-4 * eye[j], runs, fit),
        )
        assert min(up, down) >= best * (1 - 1e-12), j
    gradient = [
        (objective(fit.theta + 1e-6 * e, runs, fit) - objective(fit.theta - 1e-6 * e, runs, fit))
        / 2e-6
        for e in eye
    ]
    assert np.max(np.abs(gradient)) < 1e-9  # the objective itself is ~3e-5
    stderr, values = fit.stderr(), fit.values()
    assert all(np.isfinite(se) and se > 0 for se in stderr.values())
    assert all(values[f"alpha_{t}"] > 0 for t in TERMS)


def test_cli_fits_the_builtin_table_by_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--drop-highest", "40", "--depth-offset", "-2", "--bootstrap", "0", "--folds", "0"]
    result = invoke("scaling", "fit", "chinchilla", *args, "--out", str(out))
    assert result.exit_code == 0, result.output
    saved = Result.load(out)
    assert saved.meta["source"] == "chinchilla" and saved.meta["n_runs"] == 203
    assert "Besiroglu" in saved.meta["citation"] and "Hoffmann" in saved.meta["citation"]
    assert saved.table()["value"][3] == pytest.approx(1.098, abs=5e-4)  # alpha_depth
    assert "Dropped the 40 highest-loss runs of 245, 2 more tied with the last" in saved.summary


def test_a_name_wins_over_a_file_and_a_path_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted_csv(tmp_path / "chinchilla", ("width", "depth", "tokens"), n=40)
    monkeypatch.chdir(tmp_path)
    assert len(read_runs("chinchilla")) == 245
    assert len(read_runs("./chinchilla")) == len(read_runs(Path("chinchilla"))) == 40
    assert read_runs("./chinchilla").source == "./chinchilla"  # the path as given


def test_unknown_name_is_one_line() -> None:
    assert_user_error(
        invoke("scaling", "fit", "chinchila"),
        "'chinchila' does not exist and is not a built-in table",
        "did you mean 'chinchilla'",
        "name a built-in table: chinchilla",
    )
    with pytest.raises(DataError, match="not a built-in table"):
        read_runs(Path("chinchila"))


# -- CSV errors through the CLI ----------------------------------------------------------------------
def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def planted_csv(path: Path, terms: tuple[str, ...], n: int = 40) -> Path:
    runs = planted_runs(terms, n, noise=0.005, seed=5)
    names = {"width": "d_model", "depth": "n_layers", "tokens": "num_tokens"}
    header = ["loss", *(names[t] for t in terms)]
    rows = [[runs.loss[i], *(runs.sizes[t][i] for t in terms)] for i in range(n)]
    return write_csv(path, header, rows)


@pytest.mark.parametrize(
    "header,rows,args,needles",
    [
        (
            ["loss", "d_model"],
            [[3.0, 64]],
            [],
            ["no column 'n_layers', 'num_tokens'", "it has: loss, d_model"],
        ),
        (["loss", "n_layers"], [[3.0, 4], [0.0, 8]], ["--terms", "depth"], ["line 3", "loss is 0"]),
        (
            ["loss", "n_layers"],
            [[3.0, 4], [2.5, "eight"]],
            ["--terms", "depth"],
            ["line 3", "'eight'", "not a number"],
        ),
        (
            ["loss", "n_layers"],
            [[3.0, 2], [2.5, 8]],
            ["--terms", "depth", "--depth-offset", "-2"],
            ["line 2", "n_layers -2", "--depth-offset"],
        ),
        (
            ["loss", "n_layers"],
            [[3.0, 2], [2.5, "inf"]],
            ["--terms", "depth"],
            ["line 3", "not a finite number"],
        ),
        (["loss", "n_layers"], [], ["--terms", "depth"], ["no runs"]),
        (
            ["loss", "n_layers"],
            [[3.0, 2], [2.5, 4], [2.2, 8]],
            ["--terms", "depth"],
            ["3 runs cannot fit 3 parameters"],
        ),
        (["loss", "layers"], [[3.0, 2]], ["--terms", "depth", "--column", "depth"], ["ROLE=NAME"]),
        (
            ["loss", "layers"],
            [[3.0, 2]],
            ["--terms", "depth", "--column", "dept=layers"],
            ["did you mean 'depth'"],
        ),
        (["loss", "layers"], [[3.0, 2]], ["--terms", "deep"], ["did you mean 'depth'"]),
        (
            ["loss", "n_layers"],
            [[3.0, 2], [2.5, 4]],
            ["--terms", "depth", "--drop-highest", "2"],
            ["cannot drop"],
        ),
    ],
)
def test_bad_csv_is_one_line(tmp_path: Path, header, rows, args, needles) -> None:
    path = write_csv(tmp_path / "runs.csv", header, rows)
    assert_user_error(
        invoke("scaling", "fit", str(path), "--out", str(tmp_path / "o"), *args), *needles
    )
    assert not (tmp_path / "o").exists()


def test_empty_and_missing_csv(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert_user_error(invoke("scaling", "fit", str(empty)), "empty")
    assert_user_error(invoke("scaling", "fit", str(tmp_path / "nope.csv")), "does not exist")


def test_only_the_needed_columns_are_read_and_constant_ones_dropped(tmp_path: Path) -> None:
    runs = planted_runs(("depth",), 30, noise=0.0)
    rows = [[loss, depth, 64] for loss, depth in zip(runs.loss, runs.sizes["depth"], strict=True)]
    path = write_csv(tmp_path / "runs.csv", ["loss", "layers", "d_model"], rows)
    result = fit_runs(
        read_runs(path, "width,depth", columns={"depth": "layers"}),
        "width-depth",
        n_bootstrap=0,
        folds=0,
    )
    assert result.meta["terms"] == ["depth"]
    assert "width term dropped: d_model is 64 in every run" in result.meta["notes"]
    assert result.table()["value"][1] == pytest.approx(PLANTED["alpha_depth"], rel=1e-6)


def test_drop_highest_drops_ties_too() -> None:
    runs = Runs(np.array([3.0, 1.0, 4.0, 3.0, 2.0]), {"depth": np.arange(1.0, 6.0)}, tuple("abcde"))
    assert runs.drop_highest(0) is runs
    assert runs.drop_highest(1).labels == ("a", "b", "d", "e")
    assert runs.drop_highest(2).labels == ("b", "e")
    with pytest.raises(DataError, match="none would be left"):
        runs.drop_highest(5)


def test_parse_terms() -> None:
    assert parse_terms("full") == TERMS
    assert parse_terms("tokens,depth") == ("depth", "tokens")
    assert parse_terms("width-depth") == ("width", "depth")
    with pytest.raises(OptionError, match="did you mean 'tokens'"):
        parse_terms("token")


# -- CLI smoke ----------------------------------------------------------------------------------------
def test_cli_fit_writes_the_result(tmp_path: Path) -> None:
    path = planted_csv(tmp_path / "runs.csv", ("depth", "tokens"))
    out = tmp_path / "out"
    args = ["--terms", "depth,tokens", "--drop-highest", "2", "--bootstrap", "10", "--folds", "3"]
    result = invoke("scaling", "fit", str(path), *args, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "α_ℓ = " in result.output and "alpha_depth" in result.output
    files = ("result.json", "parameters.csv", "runs.csv", "heldout.csv", "depth_term.png")
    for name in (*files, "tokens_term.png"):
        assert (out / name).is_file(), name
    saved = Result.load(out)
    assert saved.analyzer == "scaling" and saved.meta["terms"] == ["depth", "tokens"]
    assert saved.meta["scales"]["tokens"] == pytest.approx(1e9)
    assert len(saved.meta["dropped"]) == 2 and len(saved.tables["runs"]) == 38
    assert "Dropped the 2 highest-loss runs of 40" in saved.summary


def test_cli_help_has_examples() -> None:
    for args in (
        ["scaling", "--help"],
        ["scaling", "fit", "--help"],
        ["scaling", "family", "--help"],
    ):
        result = invoke(*args)
        assert result.exit_code == 0 and "Example" in result.output, args


def test_family_cli_errors() -> None:
    assert_user_error(invoke("scaling", "family", "zoo:dpth"), "did you mean 'zoo:depth'")
    assert_user_error(invoke("scaling", "family", "toy:d2"), "at least two models")
    assert expand_models("zoo:width") == ["toy:d4-w32", "toy:d4-w64", "toy:d4-w128"]


# -- a model family --------------------------------------------------------------------------------
def test_family_losses_match_an_independent_forward(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lensdiv.data.sources import DataSpec, token_batches
    from lensdiv.data.tokenizer import byte_tokenizer
    from lensdiv.testing.models import save_tiny_model

    folders = [
        save_tiny_model("gpt2", tmp_path / f"d{n}", n_layers=n, seed=n) for n in (1, 2, 3, 4)
    ]
    data = DataSpec(max_tokens=256, seq_len=32, batch_size=4)  # two full batches, no padding
    family = collect_family([str(f) for f in folders], data, progress=False)
    batches = list(token_batches(data, byte_tokenizer()))
    assert all(bool(b.mask.all()) for b in batches)
    for folder, loss in zip(folders, family["loss"], strict=True):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = np.mean([float(model(b.tokens, labels=b.tokens).loss) for b in batches])
        assert loss == pytest.approx(expected, rel=1e-5)
    assert list(family["n_layers"]) == [1, 2, 3, 4] and set(family["d_model"]) == {32}
    assert np.isnan(family["tokens"]).all() and (np.diff(family["params"]) > 0).all()
    result = fit_family_table(family, "full", n_bootstrap=5, folds=0)
    assert result.meta["terms"] == ["depth"]
    notes = " ".join(result.meta["notes"])
    assert "tokens term dropped" in notes and "width term dropped: d_model is 32" in notes
    assert len(result.tables["runs"]) == 4 and "params" in result.tables["runs"].columns
    with pytest.raises(DataError, match="3 runs cannot fit 3 parameters"):
        fit_family_table(Table("family", {k: v[:3] for k, v in family.columns.items()}), "depth")


def test_family_refuses_different_tokenizations() -> None:
    import torch

    from lensdiv.core.analyzer import Batch

    def batch(ids: list[int]) -> Batch:
        tokens = torch.tensor([ids])
        return Batch(tokens=tokens, mask=torch.ones_like(tokens, dtype=torch.bool))

    _check_same_tokens(("a", [batch([1, 2, 3])]), "b", [batch([1, 2, 3])])
    with pytest.raises(DataError, match="b and a tokenize the data differently"):
        _check_same_tokens(("a", [batch([1, 2, 3])]), "b", [batch([1, 2, 4])])


def test_fit_runs_defaults_to_the_sizes_the_runs_have() -> None:
    runs = planted_runs(("depth",), 20, noise=0.0)
    assert fit_runs(runs, n_bootstrap=0, folds=0).meta["terms"] == ["depth"]
    with pytest.raises(OptionError, match="the runs have no width, tokens sizes"):
        fit_runs(runs, "full")
