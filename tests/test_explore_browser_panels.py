"""The explore page's fixes of issue 45 in headless Chromium (tests/browser.py): a link's bad
values named, bytes labelled <0xC3>, rows of side-by-side lenses level, no column half under the
sticky row labels, a pinned cell's next token and its attention in a full-width panel (readable
key labels, the sink in view, rows that enlarge, a log colour scale), a grid's CSV, the patch
tab's threshold, reset target and marked positions, the map's answer in view once filled, a
stopped server said in words, and the page at 800 px wide. Screenshots as in
tests/test_explore_browser.py."""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
import torch

from tests.browser import Browser, find_chromium
from tests.test_browser import not_blank
from tests.test_explore_browser import alerts, visible, wait

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (Debian: apt-get install chromium) — the explore page "
    "was not checked in a browser",
)
LONG = "The small cities that know the king sleep. The old dog laughs. The café is big"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default toy as users get it (shipped with the package, read from an empty cache: the
    tests' 30-step toy gives the example's target no gap) behind an explore server."""
    pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
    pytest.importorskip("uvicorn", reason="the explore extra is a dev dependency")
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    import lensdiv
    from lensdiv.models.load import load_model

    with pytest.MonkeyPatch.context() as env:
        env.delenv("LENSDIV_TOY_STEPS", raising=False)
        env.setenv("LENSDIV_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
        model = load_model("toy")
    app = lensdiv.explore(model)
    yield app, model
    app.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("LENSDIV_SCREENSHOTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("explore_shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def link(app: Any, **values: str) -> str:
    return app.url + "".join(f"&{k}={quote(v)}" for k, v in values.items())


def first_column_clear(page: Browser, scroller: str) -> bool:
    """Whether the first column right of the sticky row labels starts at or after them."""
    return bool(page.evaluate(f"""(() => {{
        const s = document.querySelector({json.dumps(scroller)});
        const heads = [...s.querySelectorAll('thead tr:last-child th')];
        const label = heads.shift().getBoundingClientRect();
        const first = heads.map(th => th.getBoundingClientRect()).find(r => r.right > label.right + 1);
        return first.left >= label.right - 1; }})()"""))


def test_lens_tab(served: Any, shots: Path) -> None:
    app, model = served
    assert CHROMIUM is not None
    with Browser(CHROMIUM, width=1500, height=1000) as page:
        page.open(link(app, text=LONG, skip="9"))
        wait(page, "document.querySelectorAll('#grids td').length > 0")
        # a link's value the page cannot use is named, not dropped
        assert visible(page, "#notice")
        notice = page.evaluate("document.querySelector('#notice').textContent")
        assert "skip=9" in notice and "blocks are 0-3" in notice and "ignored" in notice
        assert page.evaluate("document.querySelector('#skip-block').value") == ""
        # é is two bytes, each labelled
        heads = page.evaluate("[...document.querySelectorAll('.panel thead th')].map(t => t.textContent)")
        assert "<0xC3>" in heads and "<0xA9>" in heads and "\ufffd" not in "".join(heads)
        # the last-block lens has no h4: its panel leaves that row blank, the rows stay level
        page.evaluate("document.querySelector('#lenses input[value=\"last-block\"]').click()")
        wait(page, "document.querySelectorAll('.panel').length === 2 && "
                   "!!document.querySelector('.panel[data-lens=\"last-block\"] tr.missing')")
        tops = page.evaluate("[...document.querySelectorAll('#grids .panel')].map(p => "
                             "[...p.querySelectorAll('tbody tr')].map(tr => "
                             "Math.round(tr.getBoundingClientRect().top)))")
        assert len(tops[0]) == len(tops[1]) == int(model.cfg.n_layers) + 1
        assert all(abs(a - b) <= 1 for a, b in zip(*tops, strict=True)), tops
        assert "does not read h4" in page.evaluate(
            "document.querySelector('.panel[data-lens=\"last-block\"] tr.missing').textContent")
        # scrolled anywhere, no column hides half under the sticky row labels
        for left in (137, 333, 50):
            page.evaluate(f"document.querySelectorAll('#grids .scroller')[0].scrollLeft = {left}")
            time.sleep(0.4)
            for n in (1, 2):
                assert first_column_clear(page, f"#grids .panel:nth-child({n}) .scroller"), left
        # the grid's CSV: one line per cell
        href = page.evaluate("document.querySelector('.panel[data-lens=logit] a.csv').href")
        assert href.startswith("data:text/csv")
        lines = list(csv.reader(io.StringIO(unquote(href.split(",", 1)[1]))))
        n_tokens = len(heads) - 1  # one panel: its labels' column, then a column a token
        assert len(lines) == 1 + (int(model.cfg.n_layers) + 1) * n_tokens
        assert lines[0][:5] == ["row", "position", "token", "next_token", "next_prob"]
        assert all(len(line) == len(lines[0]) for line in lines)
        # pin a cell near the end: the next token, then the attention under the grids
        page.evaluate("[...document.querySelectorAll('.panel[data-lens=logit] tbody tr')][1]"
                      ".querySelectorAll('td')[" + str(n_tokens - 3) + "].click()")
        detail = page.evaluate("document.querySelector('#detail').innerText")
        assert "the next token" in detail and "rank" in detail
        wait(page, "!!document.querySelector('#attention-panel table.attn')")
        width = page.evaluate("document.querySelector('#attention-panel').getBoundingClientRect().width")
        assert width > 0.9 * page.evaluate("document.querySelector('.main').getBoundingClientRect().width")
        keys = page.evaluate("[...document.querySelectorAll('#attention-panel th.key')].map(t => t.textContent)")
        assert keys[0] == "<bos>" and "<0xC3>" in keys and len(keys) == n_tokens - 2
        font = page.evaluate("parseFloat(getComputedStyle(document.querySelector("
                             "'#attention-panel th.key span')).fontSize)")
        assert font >= 11
        # the sink (position 0) in view beside the row labels, though the keys are scrolled
        sink = page.evaluate("""(() => { const s = document.querySelector('#attention-panel .scroller');
            const r = document.querySelector('#attention-panel th.sink').getBoundingClientRect();
            const b = s.getBoundingClientRect(); return [s.scrollLeft, r.left >= b.left, r.right <= b.right]; })()""")
        assert sink[0] > 0 and sink[1] and sink[2], sink
        # a row enlarges (its weights written in); small weights stay tinted (a log scale)
        row = "#attention-panel tbody tr:nth-child(2)"
        before = page.evaluate(f"document.querySelector('{row}').getBoundingClientRect().height")
        page.evaluate(f"document.querySelector('{row} button.enlarge').click()")
        after = page.evaluate(f"document.querySelector('{row}').getBoundingClientRect().height")
        assert after > 1.5 * before
        # wider cells: snapped again, the sink's neighbour clear of it, the query's key in view
        time.sleep(0.3)
        clear = page.evaluate("""(() => { const s = document.querySelector('#attention-panel .scroller');
            const sink = document.querySelector('#attention-panel thead th.sink').getBoundingClientRect();
            const keys = [...document.querySelectorAll('#attention-panel thead th.key:not(.sink)')]
                .map(th => th.getBoundingClientRect());
            const first = keys.find(r => r.right > sink.right + 1), last = keys[keys.length - 1];
            const b = s.getBoundingClientRect();
            return [first.left >= sink.right - 1, last.right <= b.right + 1]; })()""")
        assert clear == [True, True], clear
        assert page.evaluate(f"getComputedStyle(document.querySelector('{row} td .w')).display") != "none"
        tints = page.evaluate("""[...document.querySelectorAll('#attention-panel td')]
            .filter(td => /: (1\\.\\d|2\\.\\d)%$/.test(td.title)).map(td => td.style.background)""")
        assert tints and all(t != "rgb(255, 255, 255)" for t in tints)
        assert "log scale" in page.evaluate("document.querySelector('#attention-panel').textContent")
        page.evaluate("document.querySelector('#attention-panel').scrollIntoView()")
        not_blank(page.screenshot(shots / "explore_7_attention.png"))
        assert page.errors == []


def test_patch_tab(served: Any, shots: Path) -> None:
    app, model = served
    assert CHROMIUM is not None
    with Browser(CHROMIUM, width=1500, height=1000) as page:
        # the same prompt twice: no gap, the map refused with the server's reason
        page.open(link(app, tab="patch", clean="The city laugh", corrupt="The city laugh"))
        wait(page, "!!document.querySelector('#patch-table')")
        assert page.evaluate("document.querySelector('#target').value") == ""  # not the example's
        assert "Your own pair" in page.evaluate("document.querySelector('#patch-about').textContent")
        wait(page, "!document.querySelector('#patch-gap').hidden")
        gap = page.evaluate("document.querySelector('#patch-gap').textContent")
        assert "about the same probability" in gap and "5-point threshold" in gap
        assert page.evaluate("document.querySelector('#patch-map').disabled")
        page.evaluate("document.querySelector('#patch-table td[data-layer=\"2\"][data-pos=\"3\"]').click()")
        wait(page, "!!document.querySelector('#patch-table td.no-share')")
        assert "too small" in page.evaluate("document.querySelector('#patch-result').textContent")
        not_blank(page.screenshot(shots / "explore_8_patch_refused.png"))
        # a link's target is read; the differing positions are marked; the answer in view
        page.open(link(app, tab="patch", clean="The city laugh", corrupt="The dogs laugh",
                       target="s"))
        wait(page, "!!document.querySelector('#patch-table')")
        assert page.evaluate("document.querySelector('#target').value") == "s"
        assert page.evaluate("document.querySelector('#patch-gap').hidden")
        marked = page.evaluate("[...document.querySelectorAll('#patch-table thead tr:last-child th.differ')]"
                               ".map(th => th.textContent)")
        assert marked == ["d", "o", "g", "s"]
        page.evaluate("document.querySelector('#patch-map').click()")
        wait(page, "!!document.querySelector('#patch-csv')")
        inside = page.evaluate("""(() => { const s = document.querySelector('#patch-grid .scroller');
            const b = s.getBoundingClientRect();
            const last = [...document.querySelectorAll('#patch-table td[data-layer="4"]')].pop().getBoundingClientRect();
            return last.right <= b.right + 1 && last.left >= b.left; })()""")
        assert inside
        # another pair typed: the example's target and words go
        page.evaluate("(c => { c.value = 'The girl laugh'; c.dispatchEvent(new Event('change')); })"
                      "(document.querySelector('#clean'))")
        assert page.evaluate("document.querySelector('#target').value") == ""
        not_blank(page.screenshot(shots / "explore_9_patch_map.png"))
        assert page.errors == []


def test_narrow_window_and_a_stopped_server(served: Any, shots: Path, tmp_path: Path) -> None:
    import lensdiv
    from lensdiv.core.analyzer import ModelInfo
    from lensdiv.ops.lens_files import save_tuned

    _, model = served
    info = ModelInfo.from_model(model)
    folder = tmp_path / "some" / "deep" / "folder" / "my-tuned-lens"
    save_tuned(folder, {i: torch.eye(info.d_model) for i in range(info.n_layers)},
               {i: torch.zeros(info.d_model) for i in range(info.n_layers)},
               d_model=info.d_model, n_layers=info.n_layers, model_name="toy")
    spec = f"tuned:{folder}"
    own = lensdiv.explore(model, lenses=[spec])  # a server of its own, to stop
    assert CHROMIUM is not None
    try:
        with Browser(CHROMIUM, width=800, height=900) as page:
            page.open(own.url)
            wait(page, "document.querySelectorAll('#grids td').length > 0")
            # a fitted lens by its folder's name, the whole spec on hover
            label = page.evaluate("(l => [l.textContent.trim(), l.title])"
                                  "([...document.querySelectorAll('#lenses label')].pop())")
            assert label == ["tuned: my-tuned-lens", spec]
            header = page.evaluate("document.querySelector('header').getBoundingClientRect().height")
            assert header < 50  # one line
            assert page.evaluate("document.documentElement.scrollWidth") <= 800
            for name in ("patch", "runs"):
                page.evaluate(f"document.querySelector('#tab-{name}').click()")
                time.sleep(0.5)
                assert page.evaluate("document.documentElement.scrollWidth") <= 800, name
            page.evaluate("document.querySelector('#tab-lens').click()")
            page.screenshot(shots / "explore_10_narrow.png")  # (not_blank wants 1000 px)
            own.stop()
            page.evaluate("(p => { p.value = 'The dog'; p.dispatchEvent(new Event('input')); })"
                          "(document.querySelector('#prompt'))")
            message = wait(page, "(e => !e.hidden && e.textContent)(document.querySelector('#error-lens'))")
            assert "server is not answering" in message and "Failed to fetch" not in message
            assert alerts(page) == [message]
    finally:
        own.stop()
