"""The explore page in headless Chromium (tests/browser.py): type a prompt and read the grid,
switch the lens, toggle a skip, patch a cell, open a run — what the page shows checked against
the Python API, no console error, no request leaving 127.0.0.1, a screenshot of each state
(kept in ``$LENSDIV_SCREENSHOTS`` when set)."""

from __future__ import annotations

import json
import os
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
    return token.replace(" ", "\u2423").replace("\n", "\u21b5").replace("\t", "\u21e5")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
    pytest.importorskip("uvicorn", reason="the explore extra is a dev dependency")
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    import lensdiv
    from lensdiv.models.load import load_model
    from lensdiv.run.runner import analyze

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


def grid_of(page: Browser, lens: str) -> list[list[str]]:
    """The top-1 tokens of one panel's grid, rows from h0 up (the page draws the output on top)."""
    rows = page.evaluate(
        f"[...document.querySelectorAll('.panel[data-lens={json.dumps(lens)}] tbody tr')]"
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
        page.hover(".panel[data-lens=logit] tbody tr:nth-child(2) td:nth-of-type(5)")
        detail = page.evaluate("document.querySelector('#detail').innerText")
        assert "KL to the output" in detail and "entropy" in detail and detail.count("%") == 5
        cell = ".panel[data-lens=logit] tbody tr:nth-child(1) td:nth-of-type(3)"
        page.evaluate(f"document.querySelector({json.dumps(cell)}).click()")  # pin it
        assert page.evaluate("document.querySelectorAll('td.pinned').length") == 1
        assert page.evaluate("document.querySelector('#detail h3').textContent").startswith(
            f"{want.rows[-1]} · position 2")
        not_blank(page.screenshot(shots / "explore_1_prompt.png"))
        page.evaluate(f"document.querySelector({json.dumps(cell)}).click()")  # unpin

        # 2. the last-block lens beside the logit lens
        page.evaluate("document.querySelector('#lenses input[value=\"last-block\"]').click()")
        wait(page, "document.querySelectorAll('.panel').length === 2")
        titles = page.evaluate("[...document.querySelectorAll('.panel h2')].map(h => h.textContent)")
        assert titles == ["Logit lens", "Last-block lens"]
        last = prompt_view(model, TEXT, top_k=5, lens="last-block")
        assert grid_of(page, "last-block") == [[shown(c[0]) for c in r] for r in last.top_tokens]
        not_blank(page.screenshot(shots / "explore_2_lenses.png"))

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
        page.evaluate("document.querySelector('#patch-table td[data-layer=\"2\"][data-pos=\"6\"]')"
                      ".click()")
        result = wait(page, "(t => t.startsWith('patch h2') && t)"
                            "(document.querySelector('#patch-result').textContent)")
        from lensdiv.web.session import Session

        clean = page.evaluate("document.querySelector('#clean').value")
        corrupt = page.evaluate("document.querySelector('#corrupt').value")
        direct = Session(model).patch({"clean": clean, "corrupt": corrupt, "layer": 2,
                                       "position": 6})
        p = direct["patched_prob"]
        assert f"→ {100 * p:.{1 if p < 0.1 else 0}f}%" in result
        page.evaluate("document.querySelector('#patch-map').click()")
        n_cells = (int(model.cfg.n_layers) + 1) * len(direct["corrupt_tokens"])
        wait(page, "[...document.querySelectorAll('#patch-table td')].filter(td => "
                   f"td.textContent.endsWith('%')).length === {n_cells}")
        not_blank(page.screenshot(shots / "explore_4_patch.png"))

        # 5. the runs tab opens a saved run's report
        page.evaluate("document.querySelector('#tab-runs').click()")
        wait(page, "!!document.querySelector('a.open-run')")
        page.evaluate("document.querySelector('a.open-run').click()")
        status = wait(page, "(() => { const d = document.querySelector('#run-frame')"
                            ".contentDocument; const s = d && d.getElementById('run-status');"
                            " return s && s.textContent; })()")
        assert status == "complete"
        not_blank(page.screenshot(shots / "explore_5_runs.png"))

        assert page.errors == []
        assert [u for u in page.requests if not (u.startswith(base.rstrip("/"))
                                                 or u.startswith("data:"))] == []

        # 6. a prompt longer than the context: one line on the page, the server still answers
        page.evaluate("document.querySelector('#tab-lens').click()")
        page.evaluate("(p => { p.focus(); p.select(); })(document.querySelector('#prompt'))")
        page.call("Input.insertText", text="x" * (int(model.cfg.n_ctx) + 10))
        message = wait(page, "(e => !e.hidden && e.textContent)(document.querySelector('#error'))")
        assert f"at most {int(model.cfg.n_ctx)}" in message
        not_blank(page.screenshot(shots / "explore_6_error.png"))
        # Chromium logs the 400 response itself; nothing else went wrong.
        assert all("status of 400" in e for e in page.errors), page.errors
        assert all(u.startswith(base.rstrip("/")) or u.startswith("data:") for u in page.requests)
