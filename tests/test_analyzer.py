"""The analyzer contract's plumbing: options parsed from strings, option docs, and ``Batch``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest
import torch

from lensdiv.analyzers.lens import LogitLens
from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import OptionError
from lensdiv.data.tokenizer import PAD_ID
from tests.helpers import Alpha

# -- Analyzer options ----------------------------------------------------------------------------


def test_from_options_parses_strings_to_field_types() -> None:
    got = Alpha.from_options({"flag": "yes", "count": "3", "scale": "0.25", "mode": "slow",
                              "layers": "1,2,5", "limit": "none", "label": "hello"})
    assert got == Alpha(flag=True, count=3, scale=0.25, mode="slow", layers=(1, 2, 5),
                        limit=None, label="hello")
    assert type(got.count) is int and type(got.scale) is float and type(got.flag) is bool
    assert all(type(v) is int for v in got.layers)
    assert Alpha.from_options({"flag": "False", "limit": "7"}) == Alpha(flag=False, limit=7)
    assert Alpha.from_options({"count": 4, "layers": (0,)}) == Alpha(count=4, layers=(0,))
    assert Alpha.from_options() == Alpha()
    assert Alpha().options() == {"flag": False, "count": 1, "scale": 1.0, "mode": "fast",
                                 "layers": (), "limit": 3, "label": "x"}


def test_from_options_unknown_option_suggests() -> None:
    with pytest.raises(OptionError, match="(?i)did you mean 'count'"):
        Alpha.from_options({"cuont": "2"})
    with pytest.raises(OptionError) as err:
        LogitLens.from_options({"topk": "3"})
    assert "did you mean 'top_k'" in str(err.value).lower() and "exclude_bos" in str(err.value)


@pytest.mark.parametrize(
    "key, value",
    [("count", "three"), ("scale", "wide"), ("flag", "maybe"), ("mode", "medium"),
     ("layers", "1,x"), ("limit", "lots")],
)
def test_from_options_bad_value(key: str, value: str) -> None:
    with pytest.raises(OptionError, match=key):
        Alpha.from_options({key: value})


@dataclass(frozen=True)
class Optionals(Alpha):
    """Options whose type is wrapped in ``| None``."""

    name = "optionals"
    aliases = ()

    ids: tuple[int, ...] | None = None
    kind: Literal["x", "y"] | None = None


def test_from_options_parses_optional_tuple() -> None:
    assert Optionals.from_options({"ids": "1,2"}).ids == (1, 2)


def test_from_options_parses_optional_scalars() -> None:
    assert Optionals.from_options({"ids": "none"}).ids is None
    assert Optionals.from_options({"limit": "null"}).limit is None


def test_from_options_validation_error_becomes_option_error() -> None:
    with pytest.raises(OptionError, match="top_k"):
        LogitLens.from_options({"top_k": "0"})


@pytest.mark.parametrize(
    "key,value,needle",
    [
        ("count", True, "expects int, got True (bool)"),
        ("count", 2.5, "expects int, got 2.5"),
        ("count", "1.5", "expects int, got '1.5'"),
        ("scale", True, "expects float, got True"),
        ("scale", float("nan"), "finite"),
        ("scale", "inf", "finite"),
        ("scale", "-inf", "finite"),
        ("flag", 1, "expects bool, got 1"),
        ("mode", 3, "must be one of fast, slow"),
        ("layers", 5, "expects comma-separated int"),
        ("layers", [1, True], "expects int, got True"),
        ("limit", "x", "expects int"),
        ("label", 5, "expects str, got 5"),
    ],
)
def test_from_options_checks_values_that_are_not_text(key: str, value: object, needle: str) -> None:
    """A value given as a Python object is checked like one given as text (never passed on)."""
    with pytest.raises(OptionError) as err:
        Alpha.from_options({key: value})
    assert needle in str(err.value) and f"alpha.{key}" in str(err.value)


def test_from_options_converts_values_that_are_not_text() -> None:
    from pathlib import Path

    got = Alpha.from_options({"count": 2.0, "scale": 3, "layers": [1, 2], "limit": None,
                              "label": Path("/tmp/x")})
    assert got == Alpha(count=2, scale=3.0, layers=(1, 2), limit=None, label="/tmp/x")
    assert type(got.count) is int and type(got.scale) is float and type(got.layers) is tuple


def test_checked_options_converts_or_refuses_an_instance() -> None:
    from lensdiv.core.analyzer import checked_options

    same = Alpha(count=3)
    assert checked_options(same) is same  # nothing to convert: the very instance
    assert checked_options(Alpha(count=2.0)).count == 2  # type: ignore[arg-type]  # converted
    with pytest.raises(OptionError, match="alpha.count expects int, got True"):
        checked_options(Alpha(count=True))


def test_option_docs_come_from_fields_types_and_docstring() -> None:
    from lensdiv.analyzers.skip import LayerSkip

    docs = {row["name"]: row for row in LayerSkip.option_docs()}
    assert list(docs) == [f.name for f in LayerSkip.option_fields()]
    assert docs["part"]["type"] == "block|attn|mlp" and docs["part"]["default"] == "block"
    assert docs["mode"]["help"].startswith("``future``") and "no recompute" in docs["mode"]["help"]
    assert docs["splits"]["type"] == "int" and docs["splits"]["default"] == "4"


# -- Batch -----------------------------------------------------------------------------------------


def test_next_tokens_excludes_last_real_token_and_pads() -> None:
    tokens = torch.tensor([[0, 10, 11, 12, 13], [0, 20, 21, PAD_ID, PAD_ID], [0, 30, PAD_ID,
                                                                              PAD_ID, PAD_ID]])
    mask = tokens != PAD_ID
    batch = Batch(tokens=tokens, mask=mask)
    targets, valid = batch.next_tokens()
    lengths = mask.sum(1)
    for i in range(tokens.shape[0]):
        for j in range(tokens.shape[1]):
            assert bool(valid[i, j]) == (j + 1 < int(lengths[i])), (i, j)
            if valid[i, j]:
                assert targets[i, j] == tokens[i, j + 1]
    assert batch.n_tokens == int(mask.sum())
    assert torch.equal(batch.positions(), mask)
    no_bos = batch.positions(exclude_bos=True)
    assert torch.equal(no_bos[:, 1:], mask[:, 1:]) and not no_bos[:, 0].any()
    assert torch.equal(Batch(tokens, mask, bos=False).positions(exclude_bos=True), mask)


def test_model_info_round_trips_through_json(native_model) -> None:
    import json

    from lensdiv.core.analyzer import ModelInfo

    info = ModelInfo.from_model(native_model, name="tiny")
    data = json.loads(json.dumps(info.to_dict()))
    assert data["hook_names"] == sorted(info.hook_names)
    assert ModelInfo.from_dict(data) == info
