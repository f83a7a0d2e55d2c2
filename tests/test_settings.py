"""The run settings are declared once (``lensdiv.core.settings.RunSettings``): the API functions
take them as a settings object or as keywords, the commands' options come from the declaration."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import typer

import lensdiv
from lensdiv.cli import app
from lensdiv.core.errors import OptionError
from lensdiv.core.settings import DEFAULTS, RunSettings
from lensdiv.data.sources import DataSpec
from lensdiv.lenses.fit import evaluate_lens, fit_lens
from lensdiv.studies.crossmodel import run_study

NAMES = RunSettings.names()
# The commands that take run settings, and the settings each leaves out (a command that takes
# some of them says so; a new setting reaches every other command).
COMMANDS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("analyze",): (),
    ("compare",): ("lens",),
    ("study", "run"): (),
    ("lenses", "fit"): ("lens",),
    ("lenses", "evaluate"): ("lens",),  # --lens is its own (required) option there
    ("scaling", "family"): ("lens",),
    ("lens",): tuple(n for n in NAMES if n not in ("device", "dtype")),
}
# Where a command's option says more than the declaration (its own default or help).
OWN = {
    (("lenses", "fit"), "max_tokens"): (None, "Tokens the fit reads."),
    (("lenses", "evaluate"), "max_tokens"): (8192, "Tokens to evaluate on."),
    (("scaling", "family"), "max_tokens"): (16384, "Evaluate every model on this many tokens."),
    (("scaling", "family"), "seed"): (0, "Seeds the bootstrap and the folds"),
    (("lens",), "bos"): (True, "Prepend the BOS token."),  # the prompt view's own flag
}


def _command(path: tuple[str, ...]) -> Any:
    command: Any = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_command_option_comes_from_the_declaration(path: tuple[str, ...]) -> None:
    options = {p.name: p for p in _command(path).params}
    for name in NAMES:
        if (path, name) in OWN:
            default, help_start = OWN[path, name]
            assert options[name].default == default
            assert options[name].help.startswith(help_start)
            continue
        if name in COMMANDS[path]:
            assert name not in options or name == "lens", (path, name)
            continue
        declared = RunSettings.declared(name)
        option = options[name]
        assert option.opts == [f"--{name.replace('_', '-')}"]
        assert option.default == declared.default, (path, name)
        assert option.help == declared.metadata["help"], (path, name)


def test_the_data_spec_and_the_api_take_the_declared_defaults() -> None:
    spec = DataSpec()
    for name, value in DEFAULTS.data().items():
        assert getattr(spec, name) == value
    for func, own in (
        (lensdiv.analyze, {}),
        (run_study, {}),
        (fit_lens, {"max_tokens": None}),
        (evaluate_lens, {"max_tokens": 8192}),
    ):
        params = inspect.signature(func).parameters
        assert params["settings"].default is None
        for name in NAMES:
            if name == "lens" and func in (fit_lens, evaluate_lens):
                continue  # fit_lens refuses one; evaluate_lens' lens is its argument
            param = params[name]
            assert param.kind is inspect.Parameter.KEYWORD_ONLY, (func, name)
            assert param.default == own.get(name, getattr(DEFAULTS, name)), (func, name)


@pytest.mark.parametrize("func", [lensdiv.analyze, run_study, fit_lens, evaluate_lens])
def test_an_unknown_keyword_or_settings_is_a_type_error(func: Any) -> None:
    args: tuple[Any, ...] = {fit_lens: ("toy", "affine"), evaluate_lens: ("toy", "logit")}.get(
        func, ("toy",)
    )
    extra = {"out": "x"} if func is fit_lens else {}
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'seq_lenn'.*seq_len"):
        func(*args, seq_lenn=16, **extra)
    with pytest.raises(TypeError, match="settings"):  # (a type checker may say it first)
        func(*args, settings={"seq_len": 16}, **extra)


def test_a_settings_object_and_keywords_make_the_same_run(native_model: Any) -> None:
    settings = RunSettings(seq_len=16, max_tokens=96, batch_size=3, seed=5, bos="none")
    keywords = {"seq_len": 16, "max_tokens": 96, "batch_size": 3, "seed": 5, "bos": "none"}
    common = {"plugins": "lens", "progress": False}
    by_object = lensdiv.analyze(native_model, **common, settings=settings)
    by_keywords = lensdiv.analyze(native_model, **common, **keywords)
    # keywords change a settings object's fields
    mixed = lensdiv.analyze(
        native_model, **common, settings=dataclasses.replace(settings, seed=1), seed=5
    )
    for run in (by_keywords, mixed):
        for key in ("data", "seed", "lens"):
            assert run.manifest[key] == by_object.manifest[key]
        assert run["lens"].table()["kl"] == pytest.approx(by_object["lens"].table()["kl"])
    assert by_object.manifest["data"]["seq_len"] == 16
    assert by_object.manifest["seed"] == 5


def test_a_lens_setting_where_it_does_not_apply_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="does not apply"):
        fit_lens("toy", "affine", out=tmp_path, lens="tuned:somewhere")
    with pytest.raises(OptionError, match="does not apply"):
        evaluate_lens("toy", "logit", settings=RunSettings(lens="tuned:somewhere"))
