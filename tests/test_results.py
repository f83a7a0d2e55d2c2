"""Results: exact JSON round trip, files on disk, rendering, pandas, plots.

Every check is an identity (JSON round trip = the original, CSV rows = the table's columns); no
expected number is hard-coded.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from lensdiv.core.results import Plot, Result, Table
from tests.helpers import assert_results_equal


@pytest.fixture
def result() -> Result:
    nan, inf = float("nan"), float("inf")
    return Result(
        analyzer="demo",
        summary="Two tables, two arrays, three plots.",
        tables={
            "main": Table("main", {"layer": [0, 1, 2], "value": [0.5, nan, -inf],
                                   "state": ["h0", "h1", "h2"]}, "Per-layer demo values"),
            "extra": Table("extra", {"k": [0, 1], "v": [1.25, nan]}),
        },
        arrays={"map": np.array([[1.0, nan], [inf, -2.5]]), "curve": [0.1, 0.2, nan]},
        plots=(
            Plot("line", "demo_line", "Values", "main", x="layer", y=("value",), logy=True),
            Plot("line", "demo_two", "Extra", "extra", x="k", y=("v",), xlabel="k", ylabel="v"),
            Plot("heatmap", "demo_map", "Map", "map"),
        ),
        meta={"options": {"top_k": 5, "flag": True, "none": None}, "seed": 0, "nan": nan,
              "tensor": torch.tensor([1.0, 2.0]), "path": Path("/tmp/x"), "tuple": (1, "a")},
    )


def test_result_json_round_trip_is_exact(result: Result) -> None:
    text = result.to_json()
    back = Result.from_json(text)
    assert_results_equal(back, result)
    assert back.to_json() == text
    values = back.tables["main"]["value"]
    assert math.isnan(values[1]) and values[2] == -math.inf
    assert np.isnan(back.arrays["map"][0, 1]) and back.arrays["map"][1, 0] == math.inf
    assert math.isnan(back.meta["nan"])
    # Numpy / torch / path values became plain JSON data, so a second trip changes nothing.
    assert back.meta["tensor"] == [1.0, 2.0] and back.meta["path"] == "/tmp/x"
    assert_results_equal(Result.from_dict(json.loads(json.dumps(back.to_dict()))), result)


def test_result_save_and_load(result: Result, tmp_path: Path) -> None:
    written = result.save(tmp_path / "demo")
    folder = tmp_path / "demo"
    expected = {f"{t}.csv" for t in result.tables} | {f"{p.name}.png" for p in result.plots}
    assert {p.name for p in written} == expected | {"result.json"}
    # The numbers first: result.json and every CSV before any plot.
    order = [p.suffix for p in written]
    assert order.index(".json") < min((i for i, s in enumerate(order) if s == ".png"), default=99)
    assert all(s != ".csv" for s in order[order.index(".json") :])
    assert {p.name for p in folder.iterdir()} == expected | {"result.json"}  # no temp files left
    for plot in result.plots:
        assert (folder / f"{plot.name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, table in result.tables.items():
        with open(folder / f"{name}.csv", newline="") as fh:
            rows = list(csv.reader(fh))
        assert rows[0] == list(table.columns)
        body = zip(*table.columns.values(), strict=True)
        assert rows[1:] == [[str(v) for v in row] for row in body]
    assert_results_equal(Result.load(folder), result)
    assert_results_equal(Result.load(folder / "result.json"), result)


def test_result_renders(result: Result) -> None:
    console = Console(file=io.StringIO(), width=100)
    console.print(result)
    text = console.file.getvalue()
    assert "demo" in text and result.summary in text
    assert result.tables["main"].description in text  # the main table with its title
    assert max(len(line) for line in text.splitlines()) <= 100
    # A table without a description is titled by its name.
    console = Console(file=io.StringIO(), width=100)
    console.print(result.tables["extra"])
    assert "extra" in console.file.getvalue()
    assert "demo" in result._repr_mimebundle_(include=(), exclude=())["text/plain"]


def test_result_to_pandas(result: Result) -> None:
    pytest.importorskip("pandas")
    frame = result.to_pandas()
    assert list(frame.columns) == list(result.tables["main"].columns)
    assert len(frame) == len(result.tables["main"])
    assert frame["layer"].tolist() == [0, 1, 2] and frame["state"].tolist() == ["h0", "h1", "h2"]
    np.testing.assert_array_equal(frame["value"].to_numpy(), result.tables["main"]["value"])
    extra = result.to_pandas("extra")
    np.testing.assert_array_equal(extra["v"].to_numpy(), result.tables["extra"]["v"])


def test_table_rejects_ragged_columns() -> None:
    with pytest.raises(ValueError, match="different lengths"):
        Table("bad", {"a": [1, 2], "b": [1]})


def test_saving_plots_leaves_the_matplotlib_backend_alone(tmp_path: Path) -> None:
    """A notebook's inline backend must survive ``save_plots`` (and toy training's loss plot)."""
    import matplotlib

    previous = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        result = Result(
            "x",
            tables={"t": Table("t", {"a": [1, 2], "b": [3.0, 4.0]})},
            plots=(Plot("line", "p", "title", "t", x="a", y=("b",), logx=True, logy=True),),
        )
        assert [p.name for p in result.save_plots(tmp_path)] == ["p.png"]
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)


def test_a_plot_that_cannot_be_drawn_costs_only_its_png(result: Result, tmp_path: Path) -> None:
    from lensdiv.core.errors import SaveError

    broken = Plot("line", "broken", "names a missing table", "nowhere", x="a", y=("b",))
    bad = dataclasses.replace(result, plots=(broken, *result.plots))
    with pytest.raises(SaveError) as err:
        bad.save(tmp_path / "demo")
    assert "broken.png (cannot draw: the result has no table 'nowhere' (it has: main, extra))" \
        in str(err.value)
    assert list(err.value.failed) == [tmp_path / "demo" / "broken.png"]
    names = {p.name for p in err.value.written}
    assert names == {"main.csv", "extra.csv", "result.json"} | {f"{p.name}.png" for p in result.plots}
    assert {p.name for p in (tmp_path / "demo").iterdir()} == names  # no temporary files
    with pytest.raises(SaveError, match="broken.png"):  # `lensdiv report --plots` alike
        bad.redraw(tmp_path / "demo")


def test_files_that_cannot_be_written_are_named(result: Result, tmp_path: Path) -> None:
    from lensdiv.core.errors import SaveError

    folder = tmp_path / "demo"
    (folder / "main.csv").mkdir(parents=True)  # a folder where a file goes: that write fails
    with pytest.raises(SaveError) as err:
        result.save(folder)
    assert str(err.value).startswith("demo: could not write 1 file(s) in")
    assert "main.csv (" in str(err.value)
    assert (folder / "result.json").is_file() and (folder / "extra.csv").is_file()
    assert not list(folder.glob(".*tmp*"))
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SaveError, match="could not write"):
        result.save(afile / "sub")
