"""The kinds of lens as a user meets them (issue 29, points 1, 2, 5, 6): every kind fitted by
``lensdiv lenses fit --out D`` is named by ``D`` (``--lens KIND:D``, ``--lens D``) in ``analyze``
and the prompt view, through the CLI and the API; a path is never a hub name; the fit is public
API; a lens that no selected analyzer reads says so."""

from __future__ import annotations

import json
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import lensdiv
from lensdiv.cli import app
from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensError, LensWarning
from lensdiv.data.sources import DataSpec
from lensdiv.lenses.fit import evaluate_lens, fit_lens
from lensdiv.ops.lens_files import save_jacobian, save_tuned
from lensdiv.ops.lens_specs import LENS_FILE, parse_lens, write_lens
from lensdiv.ops.translators import LENS_KINDS, fitted_kinds
from lensdiv.run.runner import analyze

KINDS_FITTED = ("affine", "jacobian", "tuned")
SMALL = ["--max-tokens", "256", "--seq-len", "64", "--no-progress"]
FIT_OPTIONS = {
    "affine": [],
    "jacobian": ["-O", "skip_first=4"],
    "tuned": ["--preset", "toy", "-O", "steps=2", "-O", "tokens_per_step=256"],
}


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind fitted on the toy model by the CLI, each into its own ``--out`` folder."""
    root = tmp_path_factory.mktemp("fits")
    for kind in KINDS_FITTED:
        result = CliRunner().invoke(
            app,
            ["lenses", "fit", "toy", "--kind", kind, "--out", str(root / kind),
             "--max-tokens", "1024", "--eval-tokens", "0", "--seq-len", "64", "--no-progress",
             *FIT_OPTIONS[kind]],
        )
        assert result.exit_code == 0, (kind, result.output)
        # The fit names its folder as the lens to use.
        assert f"--lens {kind}:{root / kind}" in " ".join(result.output.split())
    return {kind: root / kind for kind in KINDS_FITTED}


def test_the_kinds_are_one_registry() -> None:
    assert sorted(fitted_kinds()) == sorted(KINDS_FITTED)
    for kind in KINDS_FITTED:
        found = LENS_KINDS[kind]
        assert found.read is not None and found.fitter is not None and found.fitted
    assert LENS_KINDS["logit"].read is None and LENS_KINDS["logit"].fitter is None


@pytest.mark.parametrize("kind", KINDS_FITTED)
def test_a_lens_is_named_by_the_folder_its_fit_wrote(
    kind: str, fits: dict[str, Path], tmp_path: Path
) -> None:
    folder = fits[kind]
    pointer = json.loads((folder / LENS_FILE).read_text())
    inner = folder / pointer["path"]
    assert pointer["kind"] == kind and inner.exists()
    assert pointer["path"] == LENS_KINDS[kind].fitted  # where the registry says a fit leaves it
    # The API: the folder with and without the kind, its Path, and the inner file or folder.
    lenses = [parse_lens(f"{kind}:{folder}"), parse_lens(str(folder)), parse_lens(folder),
              parse_lens(f"{kind}:{inner}")]
    assert {lens.kind for lens in lenses} == {kind}
    assert len({lens.fingerprint() for lens in lenses}) == 1
    assert lenses[0].source == str(folder)
    # The CLI: analyze through the folder, named with and without the kind.
    for n, spec in enumerate((f"{kind}:{folder}", str(folder))):
        out = tmp_path / f"run{n}"
        result = CliRunner().invoke(app, ["analyze", "toy", "--plugins", "lens", "--lens", spec,
                                          "--out", str(out), *SMALL])
        assert result.exit_code == 0, result.output
        lens = json.loads((out / "manifest.json").read_text())["lens"]
        assert lens["kind"] == kind and lens["sha256"] == lenses[0].fingerprint()
    # The prompt view beside the logit lens: the CLI and the API.
    result = CliRunner().invoke(app, ["lens", "toy", "The happy dog", "--lens",
                                      f"logit,{kind}:{folder}"])
    assert result.exit_code == 0, result.output
    assert LENS_KINDS[kind].label in result.output
    views = lensdiv.prompt_view("toy", "The happy dog", lens=f"logit,{kind}:{folder}")
    assert [v.title for v in views.views] == ["Logit lens", LENS_KINDS[kind].label]


@pytest.mark.parametrize("kind", KINDS_FITTED)
def test_each_kinds_writer_and_reader_round_trip(kind: str, fits: dict[str, Path],
                                                 tmp_path: Path) -> None:
    lens = parse_lens(str(fits[kind]))
    path = tmp_path / ("copy.pt" if kind == "jacobian" else "copy")
    write_lens(path, lens, n_layers=max(lens.maps) + 1, model_name="toy")
    back = parse_lens(f"{kind}:{path}")
    assert back.kind == kind and sorted(back.maps) == sorted(lens.maps)
    assert back.fingerprint() == lens.fingerprint()


def test_the_kind_is_read_from_the_files(fits: dict[str, Path], native_model: Any,
                                         tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    # Other tools' files: a folder in tuned-lens's layout is a tuned lens, a .pt a Jacobian one.
    save_tuned(tmp_path / "theirs", {}, {}, d_model=info.d_model, n_layers=info.n_layers,
               model_name="x")
    assert parse_lens(str(tmp_path / "theirs")).kind == "tuned"
    save_jacobian(tmp_path / "tl.pt", {0: parse_lens(f"tuned:{tmp_path / 'theirs'}").maps[0]
                                       .weight}, n_prompts=1, d_model=info.d_model)
    assert parse_lens(str(tmp_path / "tl.pt")).kind == "jacobian"
    # A lensdiv affine lens in tuned-lens's layout says it is affine.
    inner = fits["affine"] / str(LENS_KINDS["affine"].fitted)
    assert parse_lens(str(inner)).kind == "affine"
    # A fit's folder without its lens.json (merged shards): found where a fit leaves it.
    copy = tmp_path / "merged"
    shutil.copytree(fits["jacobian"], copy)
    (copy / LENS_FILE).unlink()
    assert parse_lens(str(copy)).kind == "jacobian"
    assert parse_lens(f"jacobian:{copy}").fingerprint() == parse_lens(
        str(fits["jacobian"])).fingerprint()
    # The folder of one kind named as another: one line saying which it holds.
    with pytest.raises(LensError, match="holds a lens of kind 'affine'"):
        parse_lens(f"tuned:{fits['affine']}")
    with pytest.raises(LensError, match="cannot tell which kind of lens"):
        parse_lens(str(tmp_path))


@pytest.mark.parametrize("spec", [
    "tuned:/nonexistent/lens",
    "affine:./no-such-lens",
    "jacobian:../no-such-lens.pt",
    "tuned:~/no-such-lens-29",
    "/nonexistent/lens",
])
def test_a_path_is_never_looked_up_on_the_hub(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub
    from transformer_lens.tools.analysis import JacobianLens

    def hub(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    monkeypatch.setattr(JacobianLens, "from_pretrained", hub)
    started = time.perf_counter()
    with pytest.raises(LensError, match="no such file or folder") as err:
        parse_lens(spec)
    assert time.perf_counter() - started < 1.0
    assert repr(spec.partition(":")[2] or spec) in str(err.value)
    assert "the hub was asked" not in str(err.value)
    result = CliRunner().invoke(app, ["analyze", "toy", "--lens", spec, "--no-progress"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("error: cannot read") and "no such file" in result.output


def test_a_hub_name_honours_hf_hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    asked: list[dict[str, Any]] = []
    real = huggingface_hub.hf_hub_download

    def recording(*args: Any, **kwargs: Any) -> Any:
        asked.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", recording)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for spec in ("tuned:no-such-published-model-29", "jacobian:no-such-published-model-29"):
        started = time.perf_counter()
        with pytest.raises(LensError, match="HF_HUB_OFFLINE"):
            parse_lens(spec)
        assert time.perf_counter() - started < 5.0, spec
    assert asked and all(kwargs.get("local_files_only") for kwargs in asked)


def test_fit_lens_and_evaluate_lens_are_public_api() -> None:
    assert {"fit_lens", "evaluate_lens", "LensFit"} <= set(lensdiv.__all__)
    assert lensdiv.fit_lens is fit_lens and lensdiv.evaluate_lens is evaluate_lens
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "lensdiv.fit_lens(" in readme


def test_a_lens_no_selected_analyzer_reads_says_so(native_model: Any, tmp_path: Path) -> None:
    info = ModelInfo.from_model(native_model)
    folder = tmp_path / "zero"
    save_tuned(folder, {}, {}, d_model=info.d_model, n_layers=info.n_layers, model_name="x")
    data = DataSpec(seq_len=32, max_tokens=64, batch_size=2)
    with pytest.warns(LensWarning, match="applies to none of the selected analyzers"):
        analyze(native_model, data=data, plugins="contrib", lens=f"tuned:{folder}",
                progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LensWarning)
        analyze(native_model, data=data, plugins="lens,contrib", lens=f"tuned:{folder}",
                progress=False)
        analyze(native_model, data=data, plugins="contrib", progress=False)  # the logit lens
    toy = ModelInfo.from_model(lensdiv.load_model("toy", progress=False))
    zero = tmp_path / "toy-zero"
    save_tuned(zero, {}, {}, d_model=toy.d_model, n_layers=toy.n_layers, model_name="toy")
    result = CliRunner().invoke(app, ["analyze", "toy", "--plugins", "contrib", "--lens",
                                      f"tuned:{zero}", "--out", str(tmp_path / "run"), *SMALL])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "applies to none of the selected analyzers (contrib)" in lines[0]


def test_a_hub_name_without_the_network_fails_in_one_quick_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import huggingface_hub
    from huggingface_hub import utils
    from transformer_lens.tools.analysis import JacobianLens

    class Unreachable:
        def head(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError("Name or service not known")

    def download(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a download with retries was started")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(utils, "get_session", lambda: Unreachable())
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(JacobianLens, "from_pretrained", download)
    for spec in ("tuned:gpt2", "jacobian:gpt2-small"):
        with pytest.raises(LensError, match="hub cannot be reached") as err:
            parse_lens(spec)
        assert "\n" not in str(err.value) and "retries" not in str(err.value)


def test_every_import_path_resolves() -> None:
    """Every ``"module:attribute"`` a registry holds names something that exists: the lens
    kinds' makers and fitters (imported when first asked) and the analyzers' entry points in
    pyproject.toml, so a renamed module fails here, not in a user's run."""
    import importlib
    from pathlib import Path

    from lensdiv.ops.translators import LENS_KINDS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    paths = [
        value
        for kind in LENS_KINDS.values()
        for value in (kind.make, kind.fitter)
        if isinstance(value, str)
    ]
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for group in pyproject["project"]["entry-points"].values():
        paths += list(group.values())
    paths.append(pyproject["project"]["scripts"]["lensdiv"])
    assert len(paths) > 20
    for where in paths:
        module, _, attribute = where.partition(":")
        found = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
        assert found is not None, where
