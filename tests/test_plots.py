"""Plots that read at a glance: one test per rule, on the figure objects themselves.

Rules (issue 17): integer ticks on layer axes; every value axis and colour bar labelled with its
quantity and unit; diverging colour maps centred at 0 for signed quantities; token strings on
position axes where positions are few; undefined cells blank (NaN) and said so in the caption.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lensdiv.core.results import DIVERGING_CMAP, Plot, Result, Table
from tests.conftest import ALL_ANALYZERS

# Issue 18 owns depth_score.py; its plots get their units there.
UNITS_ELSEWHERE = {"depth-score"}


def every_plot(run: Any) -> list[tuple[str, Result, Plot]]:
    return [(name, run[name], spec) for name in ALL_ANALYZERS for spec in run[name].plots]


def colour_bar(ax: Any) -> Any:
    return ax.images[0].colorbar


def visible_ticks(axis: Any, low: float, high: float) -> np.ndarray:
    ticks = np.asarray(axis.get_ticklocs(), dtype=float)
    return ticks[(ticks >= low - 1e-9) & (ticks <= high + 1e-9)]


def test_every_analyzer_has_plots(full_run: Any) -> None:
    assert not full_run.errors, full_run.errors
    assert all(full_run[name].plots for name in ALL_ANALYZERS)


def test_layer_axes_have_integer_ticks(full_run: Any) -> None:
    """Line plots over layers, blocks or steps, and the index axes of heatmaps: whole numbers."""
    checked = 0
    for name, result, spec in every_plot(full_run):
        fig, ax = spec.figure(result)
        axes = []
        if spec.kind == "line" and spec.x and not spec.logx:
            x = np.asarray(result.tables[spec.source][spec.x])
            if x.dtype.kind in "iu":
                axes.append((ax.xaxis, *ax.get_xlim()))
        elif spec.kind == "heatmap":
            if not spec.xticklabels:
                axes.append((ax.xaxis, *ax.get_xlim()))
            if not spec.yticklabels:
                axes.append((ax.yaxis, *ax.get_ylim()))
        for axis, low, high in axes:
            ticks = visible_ticks(axis, min(low, high), max(low, high))
            assert len(ticks), (name, spec.name)
            assert np.array_equal(ticks, np.round(ticks)), (name, spec.name, ticks)
            checked += 1
    assert checked >= 20


def test_half_layer_ticks_are_gone() -> None:
    """The case that prompted the rule: 5 states drew ticks at 0, 0.5, 1, ... before."""
    result = Result("x", tables={"t": Table("t", {"layer": [0, 1, 2, 3, 4], "v": [1.0] * 5})},
                    plots=(Plot("line", "p", "t", "t", x="layer", y=("v",), ylabel="v (nats)"),))
    _, ax = result.plots[0].figure(result)
    assert list(visible_ticks(ax.xaxis, 0, 4)) == [0, 1, 2, 3, 4]


def test_every_axis_and_colour_bar_is_labelled_with_a_unit(full_run: Any) -> None:
    for name, result, spec in every_plot(full_run):
        _, ax = spec.figure(result)
        assert ax.get_title(), (name, spec.name)
        assert ax.get_xlabel().strip(), (name, spec.name, "x axis")
        assert ax.get_ylabel().strip(), (name, spec.name, "y axis")
        if spec.kind == "heatmap":
            label = colour_bar(ax).ax.get_ylabel()
            assert label.strip(), (name, spec.name, "colour bar")
            value_label = label
        else:
            value_label = ax.get_ylabel()
        if name not in UNITS_ELSEWHERE:
            # The quantity's unit (nats, rad, ratio, fraction) or range, in parentheses.
            assert "(" in value_label and ")" in value_label, (name, spec.name, value_label)


def test_signed_quantities_use_a_diverging_map_centred_at_zero(full_run: Any) -> None:
    signed = {("patch", f"patch_{site}") for site in ("resid_pre", "attn_out", "mlp_out")}
    signed |= {("patch", "ig"), ("dynamics", "dynamics_pca")}
    seen = set()
    for name, result, spec in every_plot(full_run):
        if spec.kind != "heatmap":
            continue
        _, ax = spec.figure(result)
        image = ax.images[0]
        if (name, spec.name) in signed:
            seen.add((name, spec.name))
            assert spec.signed
            assert image.cmap.name.startswith(DIVERGING_CMAP)
            assert image.norm.vmin == -image.norm.vmax  # symmetric: 0 sits in the middle
            assert image.norm(0.0) == pytest.approx(0.5)
            white = np.asarray(image.cmap(0.5)[:3])
            assert white.min() > 0.9  # the centre colour is (almost) white
        else:
            assert not spec.signed and not image.cmap.name.startswith(DIVERGING_CMAP)
    assert seen == signed


def test_position_axes_carry_tokens(full_run: Any) -> None:
    """Patching maps: offsets from the answer, with the clean token wherever every pair shares
    it (the toy's knowledge-base pairs all end in "=")."""
    result = full_run["patch"]
    spec = next(p for p in result.plots if p.name == "patch_resid_pre")
    _, ax = spec.figure(result)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == list(spec.xticklabels)
    assert labels[-1] == "0\n=" and all(label.split("\n")[0].lstrip("-").isdigit()
                                        for label in labels)
    assert ax.get_xticks()[-1] == 0  # offset 0 is the answer position


def test_undefined_cells_are_blank_and_captioned(full_run: Any) -> None:
    result = full_run["skip"]
    spec = next(p for p in result.plots if p.name == "skip_effect")
    fig, ax = spec.figure(result)
    drawn = ax.images[0].get_array()
    L = drawn.shape[0]
    rows, cols = np.indices((L, L))
    assert np.array_equal(np.ma.getmaskarray(drawn), cols <= rows)  # E[s, l] for l ≤ s: blank
    assert ax.images[0].cmap.get_bad()[3] == 0  # transparent, over a hatched background
    assert ax.patch.get_hatch() == "///"
    assert "undefined" in spec.caption and "l ≤ s" in spec.caption
    assert any("Hatched cells" in t.get_text() for t in fig.texts)  # the PNG says so too
    # The data keeps its zeros (identities hold); only the drawing leaves them out.
    assert np.all(result.arrays["effect_max"][cols <= rows] == 0)


def test_nan_cells_are_explained_even_without_a_caption() -> None:
    result = Result("x", arrays={"m": [[1.0, np.nan], [2.0, 3.0]]},
                    plots=(Plot("heatmap", "m", "t", "m", clabel="v (nats)"),))
    spec = result.plots[0]
    fig, ax = spec.figure(result)
    assert np.ma.getmaskarray(ax.images[0].get_array()).tolist() == [[False, True], [False, False]]
    assert "Hatched cells have no value" in spec.full_caption(result)
    assert any("Hatched" in t.get_text() for t in fig.texts)
    _, bare = spec.figure(result, caption=False)
    assert not bare.figure.texts


def test_plot_spec_round_trips_and_checks_masks() -> None:
    spec = Plot("heatmap", "m", "t", "m", clabel="c", signed=True, xticklabels=("a", "b"),
                extent=(-1.5, 0.5, -0.5, 1.5), mask="col<row", caption="why")
    result = Result("x", arrays={"m": np.ones((2, 2))}, plots=(spec,))
    assert Result.from_json(result.to_json()).plots == (spec,)
    with pytest.raises(ValueError, match="mask"):
        Plot("heatmap", "m", "t", "m", mask="diagonal")
