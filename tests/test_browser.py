"""The report and the prompt view in a real browser (headless Chromium, `.ci/run` installs it):
no console error, no request beyond the file itself, every analyzer's section there, a
screenshot that is not blank, and the prompt view's hover box opening over a cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lensdiv.ops.prompt import prompt_view
from lensdiv.run.report import REPORT
from tests.browser import Browser, find_chromium
from tests.conftest import ALL_ANALYZERS

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it "
    "when it can) — the report and the prompt view were not checked in a browser",
)


@pytest.fixture(scope="module")
def browser() -> Any:
    pytest.importorskip("websocket", reason="websocket-client is a dev dependency")
    assert CHROMIUM is not None
    with Browser(CHROMIUM, width=1400, height=1000) as page:
        yield page


def not_blank(path: Path) -> None:
    from matplotlib.image import imread

    pixels = imread(path)[..., :3]
    assert pixels.shape[0] > 500 and pixels.shape[1] > 1000
    dark = (pixels.mean(-1) < 0.5).mean()  # text, badges, plot lines
    painted = (pixels.min(-1) < 0.95).mean()  # anything not white: cells, plots, boxes
    colours = len(np.unique((pixels * 15).round().reshape(-1, 3), axis=0))
    assert dark > 0.003 and painted > 0.02 and colours > 20, (dark, painted, colours)


def test_report_in_a_browser(full_run: Any, browser: Browser, tmp_path: Path) -> None:
    browser.open(full_run.out / REPORT)
    assert browser.errors == []
    assert [url for url in browser.requests if not url.startswith("data:")] == [
        (full_run.out / REPORT).resolve().as_uri()
    ]
    shown = browser.evaluate(
        "[...document.querySelectorAll('section.analyzer')].filter(s => s.offsetHeight > 0)"
        ".map(s => s.dataset.analyzer)"
    )
    assert shown == list(ALL_ANALYZERS)
    images = browser.evaluate(
        "[...document.images].map(i => i.complete && i.naturalWidth > 0)"
    )
    assert images and all(images)  # every inline plot decoded
    assert browser.evaluate("document.getElementById('run-status').textContent") == "complete"
    not_blank(browser.screenshot(tmp_path / "report.png"))


def test_prompt_view_in_a_browser(native_model: Any, browser: Browser, tmp_path: Path) -> None:
    view = prompt_view(native_model, "The capital of France is", top_k=3)
    page = view.save(tmp_path / "view.html")
    browser.open(page)
    assert browser.errors == []
    assert [url for url in browser.requests if not url.startswith("data:")] == [page.as_uri()]
    cells = browser.evaluate("document.querySelectorAll('td.pv-cell').length")
    assert cells == len(view.rows) * len(view.tokens)
    tip = "document.querySelector('tbody tr:nth-child(2) td.pv-cell:nth-of-type(4) .pv-tip')"
    assert browser.evaluate(f"getComputedStyle({tip}).display") == "none"
    browser.hover("tbody tr:nth-child(2) td.pv-cell:nth-of-type(4)")
    assert browser.evaluate(f"getComputedStyle({tip}).display") == "block"
    text = browser.evaluate(f"{tip}.innerText")
    assert "KL to the output" in text and "entropy" in text and text.count("%") >= 3
    not_blank(browser.screenshot(tmp_path / "view.png"))
