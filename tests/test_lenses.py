"""Fitted lenses (docs/science.md D1–D3): translators in the one readout, the three fits, their
files in the formats of TransformerLens and tuned-lens, shards, and every lens-reading analyzer
through every kind of lens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from lensdiv.cli import app
from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensError
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.lenses.affine import AFFINE_FOLDER, AffineFit
from lensdiv.lenses.fit import fit_lens, recipe_with
from lensdiv.lenses.jacobian import JacobianFit
from lensdiv.lenses.tuned import PRESETS, Translators, save_trained, train_tuned
from lensdiv.ops.lens_files import JACOBIAN_FILE, Map, save_tuned
from lensdiv.ops.lens_specs import parse_lens, read_jacobian, read_tuned
from lensdiv.ops.readout import final_readout
from lensdiv.ops.translators import LOGIT, Translator
from lensdiv.run.merge import merge_runs
from lensdiv.run.runner import analyze
from lensdiv.testing.models import boot_tiny, save_tiny_model
from tests.helpers import same

SPEC = DataSpec(seq_len=32, max_tokens=32 * 12, batch_size=3)
ARCHS = ("gpt2", "llama", "neox")


def _random_tuned(info: ModelInfo, folder: Path, scale: float = 0.05) -> Path:
    gen = torch.Generator().manual_seed(3)
    d = info.d_model
    weights = {i: torch.randn(d, d, generator=gen) * scale for i in range(info.n_layers)}
    biases = {i: torch.randn(d, generator=gen) * scale for i in range(info.n_layers)}
    save_tuned(folder, weights, biases, d_model=d, n_layers=info.n_layers, model_name="tiny")
    return folder


# -- translators ---------------------------------------------------------------------------------


def test_translator_forms_match_their_formulas() -> None:
    gen = torch.Generator().manual_seed(0)
    w, b, h = (torch.randn(*s, generator=gen) for s in ((6, 6), (6,), (4, 6)))
    cpu = torch.device("cpu")
    affine = Translator("affine", {2: Map(w, b)}, source="x", d_model=6)
    tuned = Translator("tuned", {2: Map(w, b, residual=True)}, source="x", d_model=6)
    jac = Translator("jacobian", {2: Map(w)}, source="x", d_model=6)
    torch.testing.assert_close(affine.apply(h, 2, dtype=torch.float64, device=cpu),
                               h.double() @ w.double().T + b.double())
    torch.testing.assert_close(tuned.apply(h, 2, dtype=torch.float64, device=cpu),
                               h.double() + h.double() @ w.double().T + b.double())
    torch.testing.assert_close(jac.apply(h, 2, dtype=torch.float64, device=cpu),
                               h.double() @ w.double().T)
    assert jac.apply(h, 1, dtype=torch.float32, device=cpu) is h  # no map: h as it is
    assert LOGIT.identity and not tuned.identity and tuned.translates(2)
    assert parse_lens("logit") is LOGIT and parse_lens(None) is LOGIT


@pytest.mark.parametrize("spec, message", [
    ("tuned", "unknown lens 'tuned'"),
    ("sharp:x", "unknown lens 'sharp:x'"),
    ("tuned:/nonexistent/lens", "neither a lens folder nor a published tuned lens"),
    ("jacobian:/nonexistent/lens.pt", "cannot read the Jacobian lens"),
    (3, "a lens is 'logit'"),
])
def test_bad_lenses_are_one_line(spec: Any, message: str) -> None:
    with pytest.raises(LensError, match=message):
        parse_lens(spec)


def test_a_lens_of_another_width_is_refused(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    save_tuned(tmp_path, {}, {}, d_model=info.d_model + 1, n_layers=info.n_layers,
               model_name="other")
    with pytest.raises(LensError, match=f"fitted for d_model {info.d_model + 1}"):
        analyze(native_model, data=SPEC, plugins="lens", lens=f"tuned:{tmp_path}",
                progress=False)
    result = CliRunner().invoke(app, ["analyze", "toy", "--lens", "sharp:x", "--no-progress"])
    assert result.exit_code == 2 and result.output.splitlines()[0].startswith(
        "error: unknown lens 'sharp:x'")


def test_a_zero_tuned_lens_is_the_logit_lens_to_the_last_bit(native_model: Any,
                                                              tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    save_tuned(tmp_path, {}, {}, d_model=info.d_model, n_layers=info.n_layers, model_name="x")
    logit = analyze(native_model, data=SPEC, plugins="lens", progress=False)["lens"]
    zero = analyze(native_model, data=SPEC, plugins="lens", lens=f"tuned:{tmp_path}",
                   progress=False)["lens"]
    assert same(dict(zero.table().columns), dict(logit.table().columns))
    assert zero.meta["lens"]["kind"] == "tuned" and "lens" not in logit.meta
    assert zero.plots[0].title == "Tuned lens: KL to the output"
    assert logit.plots[0].title == "Logit lens: KL to the output"


def test_the_lens_analyzer_reads_through_the_translator(native_model: Any, tmp_path: Path) -> None:
    """KL(p_l ‖ p_out) through a random tuned lens, recomputed naively in float64."""
    info = ModelInfo.from_model(native_model)
    lens = read_tuned(_random_tuned(info, tmp_path))
    run = analyze(native_model, data=SPEC, plugins="lens", lens=lens, progress=False)
    readout = final_readout(native_model)
    kl = np.zeros(info.n_layers + 1)
    n = 0
    for batch in token_batches(SPEC, native_model.tokenizer):
        _, cache = native_model.run_with_cache(batch.tokens)
        keep = batch.mask
        out = readout.logits(cache[info.resid(info.n_layers)][keep]).double().log_softmax(-1)
        for layer in range(info.n_layers + 1):
            h = cache[info.resid(layer)][keep].double()
            if layer < info.n_layers:
                m = lens.maps[layer]
                h = h + h @ m.weight.double().T + m.bias.double()
            logp = readout.logits(h.float()).double().log_softmax(-1)
            kl[layer] += float((logp.exp() * (logp - out)).sum())
        n += int(keep.sum())
    np.testing.assert_allclose(run["lens"].table()["kl"], kl / n, rtol=1e-4, atol=1e-6)


# -- the Jacobian lens ---------------------------------------------------------------------------


def _rows(model: Any, texts: list[str], length: int) -> torch.Tensor:
    rows = [model.to_tokens(t)[0, :length] for t in texts]
    assert all(r.shape[0] == length for r in rows)
    return torch.stack(rows)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the hills.",
    "A lens reads every layer of the model; each layer says what it would predict next, too.",
    "Deep networks spread their computation over layers, and most middle layers are similar.",
]


def test_jacobian_fit_equals_transformer_lens_fit(native_model: Any, tmp_path: Path) -> None:
    from transformer_lens.tools.analysis import JacobianLens

    rows = _rows(native_model, PROMPTS, 40)
    ours = analyze(native_model, data=rows, plugins=[JacobianFit()], out=tmp_path,
                   progress=False, batch_size=2)
    assert ours.ok, ours.errors
    theirs = JacobianLens.fit(native_model, PROMPTS, corpus="test", max_seq_len=40,
                              show_progress=False)
    lens = JacobianLens.load(str(tmp_path / "fit-jacobian" / JACOBIAN_FILE))  # TL reads ours
    assert lens.n_prompts == theirs.n_prompts == 3
    assert lens.source_layers == theirs.source_layers
    for layer in theirs.source_layers:
        a, b = lens.jacobians[layer], theirs.jacobians[layer]
        assert float((a - b).norm() / b.norm()) <= 1e-5, layer
    # lensdiv reads TL's file: layer k is the output of block k, h_{k+1}.
    theirs.save(str(tmp_path / "tl.pt"))
    back = read_jacobian(tmp_path / "tl.pt")
    assert sorted(back.maps) == [k + 1 for k in theirs.source_layers]
    for k in theirs.source_layers:
        torch.testing.assert_close(back.maps[k + 1].weight, theirs.jacobians[k].half().float())


def test_jacobian_shards_merge_into_one_fit(native_model: Any, tmp_path: Path) -> None:
    whole = analyze(native_model, data=SPEC, plugins=[JacobianFit(skip_first=4)],
                    out=tmp_path / "whole", progress=False)
    for i in range(2):
        analyze(native_model, data=SPEC, plugins=[JacobianFit(skip_first=4)],
                out=tmp_path / f"s{i}", shard=f"{i}/2", progress=False)
    merged = merge_runs([tmp_path / "s0", tmp_path / "s1"], out=tmp_path / "merged")
    assert merged.ok and whole.ok
    a = read_jacobian(tmp_path / "whole" / "fit-jacobian" / JACOBIAN_FILE)
    b = read_jacobian(tmp_path / "merged" / "fit-jacobian" / JACOBIAN_FILE)
    assert a.meta["n_prompts"] == b.meta["n_prompts"] == 12
    for k in a.maps:
        torch.testing.assert_close(a.maps[k].weight, b.maps[k].weight, rtol=1e-6, atol=1e-7)


def test_the_sketch_is_close_to_the_exact_fit(native_model: Any) -> None:
    """Random orthonormal probes with a control variate: unbiased, and on these prompts within
    a few per cent of the exact Jacobian with a quarter of its backward rows."""
    exact = analyze(native_model, data=SPEC, plugins=[JacobianFit(skip_first=4)],
                    progress=False)["fit-jacobian"]
    sketch = analyze(native_model, data=SPEC,
                     plugins=[JacobianFit(skip_first=4, estimator="sketch", probes=8)],
                     progress=False)["fit-jacobian"]
    assert sketch.meta["prompts"] == exact.meta["prompts"]
    assert sketch.meta["prompts_sketched"] == exact.meta["prompts"] - 3  # the warm-up batch
    got = dict(zip(exact.table()["layer"], exact.table()["frobenius"], strict=True))
    for layer, norm in zip(sketch.table()["layer"], sketch.table()["frobenius"], strict=True):
        assert norm == pytest.approx(got[layer], rel=0.05)


# -- the affine lens -----------------------------------------------------------------------------


def test_affine_fit_equals_numpy_least_squares(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    run = analyze(native_model, data=SPEC, plugins=[AffineFit(ridge=0.0)], out=tmp_path,
                  progress=False)
    assert run.ok, run.errors
    lens = read_tuned(tmp_path / "fit-affine" / AFFINE_FOLDER, kind="affine")
    xs: dict[int, list[np.ndarray]] = {layer: [] for layer in range(info.n_layers)}
    ys = []
    for batch in token_batches(SPEC, native_model.tokenizer):
        _, cache = native_model.run_with_cache(batch.tokens)
        keep = batch.positions(exclude_bos=True)
        for layer in range(info.n_layers):
            xs[layer].append(cache[info.resid(layer)][keep].double().numpy())
        ys.append(cache[info.resid(info.n_layers)][keep].double().numpy())
    y = np.concatenate(ys)
    for layer in range(info.n_layers):
        x = np.concatenate(xs[layer])
        solution, *_ = np.linalg.lstsq(np.hstack([x, np.ones((len(x), 1))]), y, rcond=None)
        found = lens.maps[layer]
        weight = found.weight.double().numpy() + np.eye(info.d_model)  # stored as W − I
        np.testing.assert_allclose(weight, solution[:-1].T, rtol=0, atol=1e-6 * np.abs(
            solution[:-1]).max())
        np.testing.assert_allclose(found.bias.double().numpy(), solution[-1], rtol=0,
                                   atol=1e-6 * np.abs(solution[-1]).max())
    assert all(0 < r2 <= 1 for r2 in run["fit-affine"].table()["r2"])


def test_affine_shards_merge_into_one_fit(native_model: Any, tmp_path: Path) -> None:
    analyze(native_model, data=SPEC, plugins=[AffineFit()], out=tmp_path / "whole",
            progress=False)
    for i in range(2):
        analyze(native_model, data=SPEC, plugins=[AffineFit()], out=tmp_path / f"s{i}",
                shard=f"{i}/2", progress=False)
    merge_runs([tmp_path / "s0", tmp_path / "s1"], out=tmp_path / "merged")
    a = read_tuned(tmp_path / "whole" / "fit-affine" / AFFINE_FOLDER)
    b = read_tuned(tmp_path / "merged" / "fit-affine" / AFFINE_FOLDER)
    for layer in a.maps:
        torch.testing.assert_close(a.maps[layer].weight, b.maps[layer].weight, rtol=1e-5,
                                   atol=1e-6)


# -- the tuned lens ------------------------------------------------------------------------------


def test_tuned_lens_files_follow_tuned_lens_layout(native_model: Any, tmp_path: Path) -> None:
    """What tuned-lens 0.2.0's ``TunedLens.from_unembed_and_pretrained`` does with our folder:
    ``TunedLensConfig(**config)``, then ``ModuleList([Linear(d, d, bias=True)] * L)
    .load_state_dict(params)`` (strict: every name and shape must match)."""
    info = ModelInfo.from_model(native_model)
    folder = _random_tuned(info, tmp_path / "lens")
    config = json.loads((folder / "config.json").read_text())
    assert {"base_model_name_or_path", "d_model", "num_hidden_layers", "bias",
            "base_model_revision", "unembed_hash", "lens_type"} <= set(config)
    assert config["lens_type"] == "linear_tuned_lens" and config["bias"] is True
    translators = torch.nn.ModuleList(
        [torch.nn.Linear(config["d_model"], config["d_model"], bias=config["bias"])
         for _ in range(config["num_hidden_layers"])])
    params = torch.load(folder / "params.pt", weights_only=True)
    translators.load_state_dict(params, strict=True)
    assert sorted(params) == sorted(f"{i}.{p}" for i in range(info.n_layers)
                                    for p in ("weight", "bias"))
    # tuned-lens 0.0.x saved its translators under "layer_translators.": read too.
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(config))
    torch.save({f"layer_translators.{k}": v for k, v in params.items()}, old / "params.pt")
    assert sorted(read_tuned(old).maps) == list(range(info.n_layers))


def test_tuned_lens_lowers_kl_below_the_logit_lens(tmp_path: Path) -> None:
    """On the toy model, on tokens the training never saw: lower KL at every layer but the last
    (where both are the model's output)."""
    fit = fit_lens("toy", "tuned", out=tmp_path, preset="toy",
                   options={"steps": 40, "tokens_per_step": 1024}, eval_tokens=2048,
                   seq_len=64, progress=False)
    table = fit.evaluation
    assert table is not None
    logit, tuned = table["kl_logit"], table["kl_tuned"]
    assert all(t < g for t, g in zip(tuned[:-1], logit[:-1], strict=True)), (tuned, logit)
    assert tuned[-1] == logit[-1] == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["status"] == "complete" and fit.run is not None
    assert fit.run["fit-tuned"].meta["steps"] == 40  # a run's manifest; the steps in the result
    config = tmp_path / "fit-tuned" / "tuned_lens" / "config.json"
    assert json.loads(config.read_text())["complete"]


def test_tuned_training_starts_from_an_affine_lens(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    start = read_tuned(_random_tuned(info, tmp_path / "start"))
    lens = Translators(info.n_layers, info.d_model, start)
    for layer, found in start.maps.items():
        torch.testing.assert_close(lens.weight[layer].detach(), found.weight)
        assert found.bias is not None
        torch.testing.assert_close(lens.bias[layer].detach(), found.bias)
    recipe = recipe_with(PRESETS["toy"], {"steps": "2", "tokens_per_step": "64"})
    trained, done = train_tuned(native_model, info,
                                lambda: token_batches(SPEC, native_model.tokenizer), recipe,
                                start=start)
    assert done.complete and done.steps == 2 and len(done.loss or []) == info.n_layers
    save_trained(tmp_path / "out", trained, info, recipe, done)
    assert read_tuned(tmp_path / "out").meta["steps_done"] == 2


@pytest.mark.parametrize("options, message", [
    ({"steps": "many"}, "expects int"),
    ({"speed": "1"}, "has no option 'speed'"),
])
def test_bad_tuned_options_are_one_line(options: dict[str, str], message: str) -> None:
    from lensdiv.core.errors import OptionError

    with pytest.raises(OptionError, match=message):
        recipe_with(PRESETS["cpu"], options)


# -- every lens-reading analyzer through every kind of lens --------------------------------------


@pytest.fixture(scope="module")
def lens_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lens_models")
    return {arch: boot_tiny(arch, save_tiny_model(arch, root / arch)) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_lens_kind_on_every_lens_reading_analyzer(
    arch: str, lens_models: dict[str, Any], tmp_path: Path
) -> None:
    model = lens_models[arch]
    info = ModelInfo.from_model(model)
    lenses = {"logit": "logit"}
    for kind in ("affine", "jacobian"):
        fit = fit_lens(model, kind, out=tmp_path / kind, max_tokens=SPEC.max_tokens,
                       seq_len=32, eval_tokens=0, progress=False,
                       options={"skip_first": 4} if kind == "jacobian" else {})
        assert fit.spec is not None
        lenses[kind] = fit.spec
    lenses["tuned"] = f"tuned:{_random_tuned(info, tmp_path / 'tuned')}"
    for kind, spec in lenses.items():
        run = analyze(model, data=SPEC, plugins="lens,dynamics,bias", lens=spec,
                      progress=False, options={"bias": {"members": "states"}})
        assert run.ok, (kind, run.errors)
        assert run.manifest["lens"]["kind"] == kind
        kl = run["lens"].table()["kl"]
        assert kl[-1] == 0 and all(k >= 0 for k in kl), (kind, kl)
        if kind != "logit":
            assert run["lens"].meta["lens"]["kind"] == kind
            assert kind.capitalize() in run["lens"].plots[0].title


def test_lens_fit_cli_writes_and_prints_the_lens(tmp_path: Path) -> None:
    out = tmp_path / "fit"
    result = CliRunner().invoke(app, ["lenses", "fit", "toy", "--kind", "affine", "--out",
                                      str(out), "--max-tokens", "1024", "--eval-tokens", "512",
                                      "--seq-len", "64", "--no-progress"])
    assert result.exit_code == 0, result.output
    folder = out / "fit-affine" / AFFINE_FOLDER
    assert (folder / "params.pt").is_file()
    assert f"--lens affine:{folder}" in " ".join(result.output.split())
    assert (out / "evaluation.csv").is_file()
    bad = CliRunner().invoke(app, ["lenses", "fit", "toy", "--kind", "sharp", "--out",
                                   str(tmp_path / "x"), "--no-progress"])
    assert bad.exit_code == 2 and bad.output.startswith("error: unknown lens kind 'sharp'")


def test_prompt_view_shows_several_lenses_side_by_side(native_model: Any, tmp_path: Path) -> None:
    from lensdiv.ops.prompt import prompt_view
    from lensdiv.view.prompt import PromptView, PromptViews

    info = ModelInfo.from_model(native_model)
    zero = tmp_path / "zero"
    save_tuned(zero, {}, {}, d_model=info.d_model, n_layers=info.n_layers, model_name="x")
    tuned = _random_tuned(info, tmp_path / "tuned")
    views = prompt_view(native_model, "The happy dog", lens=f"logit,tuned:{zero},tuned:{tuned}")
    assert isinstance(views, PromptViews) and len(views) == 3
    logit, identity, fitted = views.views
    assert (logit.title, identity.title) == ("Logit lens", "Tuned lens")
    assert identity.top_probs == logit.top_probs and identity.kl == logit.kl  # a zero lens
    assert fitted.top_probs[-1] == logit.top_probs[-1]  # h_L is never translated
    assert fitted.kl[0] != logit.kl[0]
    assert fitted.meta["translator"]["kind"] == "tuned"
    for suffix in (".html", ".png", ".json"):
        assert views.save(tmp_path / f"views{suffix}").stat().st_size > 0
    page = (tmp_path / "views.html").read_text()
    assert page.count('class="lensdiv-pv"') == 3 and "http" not in page.split("<body>")[1]
    back = PromptViews.from_dict(json.loads((tmp_path / "views.json").read_text()))
    assert same(back.to_dict(), views.to_dict())  # NaN (no next token) equals NaN
    one = prompt_view(native_model, "The happy dog", lens=f"tuned:{tuned}")
    assert isinstance(one, PromptView) and one.lens == "tuned"
    from lensdiv.core.errors import OptionError

    with pytest.raises(OptionError, match="unknown lens 'sharp'"):
        prompt_view(native_model, "The happy dog", lens="logit,sharp")
