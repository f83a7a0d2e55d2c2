"""The explore page in headless Chromium (tests/browser.py): type a prompt and read the grid,
switch the lens, toggle a skip, patch a cell, open a run — what the page shows checked against
the Python API, no console error, no request leaving 127.0.0.1, a screenshot of each state
(kept in ``$LENSDIV_SCREENSHOTS`` when set). The page explains itself: its legend and each
view's note are on screen, lenses stand side by side with their columns scrolled together, a
long prompt opens on its last positions, a failed request marks the old grids stale, and an
error stays on its own tab."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from lensdiv.ops.prompt import prompt_view
from tests.browser import Browser, find_chromium
from tests.test_browser import not_blank

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (Debian: apt-get install chromium) — the explore page "
    "was not checked in a browser",
)
TEXT = "The happy dog knows the"


def shown(token: str) -> str:
    """A token as the page writes it (explore.js' ``shown``)."""
    token = token.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: f"<0x{ord(m.group()):02X}>", token)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
    pytest.importorskip("uvicorn", reason="the explore extra is a dev dependency")
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    import lensdiv
    from lensdiv.models.load import load_model
    from lensdiv.run.runner import analyze

    # the default toy as users get it (shipped, read from an empty cache): the tests' 30-step toy
    # gives the patch example's target no gap, and the page refuses that map
    with pytest.MonkeyPatch.context() as env:
        env.delenv("LENSDIV_TOY_STEPS", raising=False)
        env.setenv("LENSDIV_CACHE", str(tmp_path_factory.mktemp("empty_cache")))
        model = load_model("toy")
    runs = tmp_path_factory.mktemp("runs")
    analyze(model, plugins="lens", out=runs / "toy-lens", max_tokens=512, seq_len=64,
            batch_size=4, progress=False)
    app = lensdiv.explore(model, runs=runs)
    yield app, model
    app.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("LENSDIV_SCREENSHOTS")
    folder = Path(given) if given else tmp_path_factory.mktemp("explore_shots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait(page: Browser, expression: str, timeout: float = 60) -> Any:
    """The value of ``expression`` once it is truthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = page.evaluate(expression)
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{expression} stayed falsy for {timeout} s")


def visible(page: Browser, selector: str) -> bool:
    """Whether the first element matching ``selector`` is rendered (not hidden, on a shown tab)."""
    return bool(page.evaluate(
        f"(e => !!e && e.getClientRects().length > 0)(document.querySelector({json.dumps(selector)}))"))


def alerts(page: Browser) -> list[str]:
    """The texts of the error boxes on screen."""
    return list(page.evaluate("[...document.querySelectorAll('[role=alert]')]"
                              ".filter(e => e.getClientRects().length > 0).map(e => e.textContent)"))


def columns_in_view(page: Browser, panel: int) -> list[int]:
    """The positions whose column is inside panel ``panel``'s scrolled window."""
    return list(page.evaluate(f"""(() => {{
        const s = document.querySelectorAll('#grids .scroller')[{panel}];
        const heads = [...s.querySelectorAll('thead th')];
        const label = heads.shift().getBoundingClientRect();
        const box = s.getBoundingClientRect();
        return heads.map((th, i) => [i, th.getBoundingClientRect()])
            .filter(([, r]) => r.left >= label.right - 1 && r.right <= box.left + s.clientWidth + 1)
            .map(([i]) => i); }})()"""))


def type_prompt(page: Browser, text: str) -> None:
    page.evaluate("(p => { p.focus(); p.select(); })(document.querySelector('#prompt'))")
    page.call("Input.insertText", text=text)


def grid_of(page: Browser, lens: str) -> list[list[str]]:
    """The top-1 tokens of one panel's grid, rows from h0 up (the page draws the output on top)."""
    rows = page.evaluate(
        f"[...document.querySelectorAll('.panel[data-lens={json.dumps(lens)}] tbody tr:not(.missing)')]"
        ".map(tr => [...tr.querySelectorAll('td')].map(td => td.firstChild.textContent))")
    return list(reversed(rows))


def test_explore_in_a_browser(served: Any, shots: Path) -> None:
    app, model = served
    base = app.url.split("?")[0]  # the URL carries the token
    assert CHROMIUM is not None
    with Browser(CHROMIUM, width=1500, height=950) as page:
        page.open(app.url)
        wait(page, "document.querySelectorAll('#grids td').length > 0")
        # 1. type a prompt (several quick edits: the superseded requests are aborted)
        page.evaluate("(p => { p.focus(); p.select(); })(document.querySelector('#prompt'))")
        for piece in ("The ", "happy ", "dog ", "knows ", "the"):
            page.call("Input.insertText", text=piece)
        want = prompt_view(model, TEXT, top_k=5)
        tokens = [shown(t) for t in want.tokens]
        header = ("[...document.querySelectorAll('.panel[data-lens=logit] thead th')].slice(1)"
                  ".map(th => th.textContent)")
        deadline = time.time() + 60
        while page.evaluate(header) != tokens and time.time() < deadline:
            time.sleep(0.05)
        assert page.evaluate(header) == tokens
        assert grid_of(page, "logit") == [[shown(c[0]) for c in row] for row in want.top_tokens]
        # the legend says what a row, a cell and a colour are; the view's note is under its title
        assert visible(page, "#legend")
        legend = page.evaluate("document.querySelector('#legend').textContent")
        legend = " ".join(legend.split())
        for words in ("residual stream before block", f"h{int(model.cfg.n_layers)} (top)",
                      "the model's output", "predicts next", "colour: that probability"):
            assert words in legend, words
        assert page.evaluate("document.querySelector('.panel[data-lens=logit] .note')"
                             ".textContent") == want.note
        assert visible(page, ".panel[data-lens=logit] .note")
        page.hover(".panel[data-lens=logit] tbody tr:nth-child(2) td:nth-of-type(5)")
        detail = page.evaluate("document.querySelector('#detail').innerText")
        assert "KL to the output" in detail and "entropy" in detail and detail.count("%") == 6
        assert "the next token" in detail  # its probability and rank: the 6th %
        cell = ".panel[data-lens=logit] tbody tr:nth-child(1) td:nth-of-type(3)"
        page.evaluate(f"document.querySelector({json.dumps(cell)}).click()")  # pin it
        assert page.evaluate("document.querySelectorAll('td.pinned').length") == 1
        assert page.evaluate("document.querySelector('#detail h3').textContent").startswith(
            f"{want.rows[-1]} · position 2")
        # the pinned state read by the model itself: the patchscope's greedy continuation
        wait(page, "(document.querySelector('#says h3') || {}).textContent !== undefined")
        says = " ".join(page.evaluate("document.querySelector('#says').innerText").split())
        assert f"what the model says about {want.rows[-1]} here" in says, says
        assert page.evaluate("document.querySelectorAll('#says mark').length") == 1
        assert page.evaluate("document.querySelectorAll('#says .said').length") == 8
        not_blank(page.screenshot(shots / "explore_1_prompt.png"))
        page.evaluate(f"document.querySelector({json.dumps(cell)}).click()")  # unpin

        # 2. the last-block lens beside the logit lens
        page.evaluate("document.querySelector('#lenses input[value=\"last-block\"]').click()")
        wait(page, "document.querySelectorAll('.panel').length === 2")
        titles = page.evaluate("[...document.querySelectorAll('.panel h2')].map(h => h.textContent)")
        assert titles == ["Logit lens", "Last-block lens"]
        last = prompt_view(model, TEXT, top_k=5, lens="last-block")
        assert grid_of(page, "last-block") == [[shown(c[0]) for c in r] for r in last.top_tokens]
        boxes = page.evaluate("[...document.querySelectorAll('.panel')].map(p => {"
                              " const r = p.getBoundingClientRect(); return [r.left, r.right, r.top]; })")
        assert boxes[0][2] == boxes[1][2] and boxes[0][1] <= boxes[1][0], boxes  # side by side
        not_blank(page.screenshot(shots / "explore_2_lenses.png"))

        # a long prompt opens on its last positions, in both lenses; they scroll together
        long = " ".join([TEXT] * 6)
        n_long = len(prompt_view(model, long, top_k=1).tokens)
        type_prompt(page, long)
        wait(page, f"document.querySelectorAll('.panel[data-lens=logit] thead th').length === "
                   f"{n_long + 1} && document.querySelectorAll('.panel').length === 2")
        for panel in (0, 1):
            seen = columns_in_view(page, panel)
            assert seen and seen[-1] == n_long - 1 and seen[0] > 0, seen
        assert columns_in_view(page, 0) == columns_in_view(page, 1)
        window = page.evaluate("document.querySelector('#grid-window').textContent")
        assert visible(page, "#grid-window") and f"of {n_long} in view" in window
        not_blank(page.screenshot(shots / "explore_2_long.png"))
        page.evaluate("document.querySelector('#grid-first').click()")
        wait(page, "(s => s[0].scrollLeft === 0 && s[1].scrollLeft === 0)"
                   "(document.querySelectorAll('#grids .scroller'))")
        assert columns_in_view(page, 0)[0] == 0 == columns_in_view(page, 1)[0]
        page.evaluate("(s => { s[1].scrollLeft = s[1].scrollWidth; })"
                      "(document.querySelectorAll('#grids .scroller'))")  # the reader scrolls one
        wait(page, "(s => s[0].scrollLeft > 0 && s[0].scrollLeft === s[1].scrollLeft)"
                   "(document.querySelectorAll('#grids .scroller'))")
        type_prompt(page, TEXT)
        wait(page, "document.querySelectorAll('.panel[data-lens=logit] thead th').length === "
                   f"{len(want.tokens) + 1}")
        wait(page, "document.querySelectorAll('.panel').length === 2")

        # 3. skip block 1: a third panel and the output's KL to the unskipped run
        page.evaluate("document.querySelector('#lenses input[value=\"last-block\"]').click()")
        page.evaluate("(() => { const s = document.querySelector('#skip-block'); s.value = '1';"
                      " s.dispatchEvent(new Event('change')); })()")
        wait(page, "!!document.querySelector('.panel.skip')")
        skipped = prompt_view(model, TEXT, top_k=5, skip=1)
        later = list(skipped.kl[-1][1:])
        kl_text = page.evaluate("document.querySelector('.panel.skip .skip-kl').textContent")
        assert f"{sum(later) / len(later):.3f} nats" in kl_text
        assert grid_of(page, "skip") == [[shown(c[0]) for c in r] for r in skipped.top_tokens]
        not_blank(page.screenshot(shots / "explore_3_skip.png"))

        # 4. patching: one cell, then the full map
        page.evaluate("document.querySelector('#tab-patch').click()")
        wait(page, "!!document.querySelector('#patch-table')")
        from lensdiv.web.session import Session

        example = Session(model).describe()["patch_example"]
        for field in ("clean", "corrupt", "target"):
            assert page.evaluate(f"document.querySelector('#{field}').value") == example[field]
        assert example["about"] in page.evaluate("document.querySelector('#patch-legend')"
                                                 ".textContent")
        assert visible(page, "#patch-legend")
        page.evaluate("document.querySelector('#patch-table td[data-layer=\"2\"][data-pos=\"6\"]')"
                      ".click()")
        result = wait(page, "(t => t.startsWith('patch h2') && t)"
                            "(document.querySelector('#patch-result').textContent)")
        direct = Session(model).patch({**example, "layer": 2, "position": 6})
        p = direct["patched_prob"]
        assert f"→ {100 * p:.{1 if p < 0.1 else 0}f}%" in result
        page.evaluate("document.querySelector('#patch-map').click()")
        n_cells = (int(model.cfg.n_layers) + 1) * len(direct["corrupt_tokens"])
        wait(page, "[...document.querySelectorAll('#patch-table td')].filter(td => "
                   f"td.textContent.endsWith('%')).length === {n_cells}")
        not_blank(page.screenshot(shots / "explore_4_patch.png"))

        # a failed patch: its error on the Patch tab, the map kept but marked stale
        assert not visible(page, "#stale-patch")
        page.evaluate("(c => { c.value = c.value + ' and more'; c.dispatchEvent(new Event('change'));"
                      " })(document.querySelector('#corrupt'))")
        wait(page, "!document.querySelector('#error-patch').hidden")
        assert "same length" in alerts(page)[0] and len(alerts(page)) == 1
        assert visible(page, "#stale-patch")
        assert page.evaluate("document.querySelector('#patch-grid').classList.contains('stale')")
        not_blank(page.screenshot(shots / "explore_4_patch_error.png"))

        # 5. the runs tab opens a saved run's report
        page.evaluate("document.querySelector('#tab-runs').click()")
        wait(page, "!!document.querySelector('a.open-run')")
        assert alerts(page) == []  # the Patch tab's error stays there
        page.evaluate("document.querySelector('a.open-run').click()")
        status = wait(page, "(() => { const d = document.querySelector('#run-frame')"
                            ".contentDocument; const s = d && d.getElementById('run-status');"
                            " return s && s.textContent; })()")
        assert status == "complete"
        not_blank(page.screenshot(shots / "explore_5_runs.png"))

        page.evaluate("document.querySelector('#tab-patch').click()")
        assert len(alerts(page)) == 1 and visible(page, "#stale-patch")
        assert all("status of 400" in e for e in page.errors), page.errors  # the patch's 400
        assert [u for u in page.requests if not (u.startswith(base.rstrip("/"))
                                                 or u.startswith("data:"))] == []

        # 6. a prompt longer than the context: one line on the page, the server still answers
        page.evaluate("document.querySelector('#tab-lens').click()")
        page.evaluate("(p => { p.focus(); p.select(); })(document.querySelector('#prompt'))")
        page.call("Input.insertText", text="x" * (int(model.cfg.n_ctx) + 10))
        message = wait(page, "(e => !e.hidden && e.textContent)(document.querySelector('#error-lens'))")
        assert f"at most {int(model.cfg.n_ctx)}" in message
        assert visible(page, "#stale-lens") and alerts(page) == [message]
        assert page.evaluate("document.querySelector('#grids').classList.contains('stale')")
        assert page.evaluate("document.querySelectorAll('#grids .panel').length") > 0  # kept
        not_blank(page.screenshot(shots / "explore_6_error.png"))
        type_prompt(page, TEXT)  # a request that succeeds: current again
        wait(page, "document.querySelector('#error-lens').hidden")
        assert not visible(page, "#stale-lens")
        assert not page.evaluate("document.querySelector('#grids').classList.contains('stale')")
        # Chromium logs the 400 response itself; nothing else went wrong.
        assert all("status of 400" in e for e in page.errors), page.errors
        assert all(u.startswith(base.rstrip("/")) or u.startswith("data:") for u in page.requests)
