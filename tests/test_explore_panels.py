"""`lensdiv explore`'s panels through Starlette's test client: the patch tab's gap threshold and
the positions where the two prompts differ, bytes labelled ``<0xC3>`` (the grid, the patch tab,
the attention), the request dataclasses' one-line errors, and a 500 that says nothing of the
exception (it is logged)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
from starlette.testclient import TestClient  # noqa: E402

from lensdiv.ops.token_text import token_text  # noqa: E402
from lensdiv.web.asks import MIN_GAP, PatchAsk, RequestError, parse  # noqa: E402
from lensdiv.web.patch_panel import gap_note  # noqa: E402
from lensdiv.web.server import INTERNAL, make_app  # noqa: E402
from lensdiv.web.session import Session  # noqa: E402

LOCAL = "http://127.0.0.1:8765"
CLEAN, CORRUPT = "The happy dog", "The angry cat"


@pytest.fixture(scope="module")
def session(native_model: Any) -> Session:
    return Session(native_model)


@pytest.fixture(scope="module")
def client(session: Session) -> TestClient:
    return TestClient(make_app(session), base_url=LOCAL)


def test_a_small_gap_refuses_the_map(client: TestClient, session: Session) -> None:
    """The tiny random model gives the clean top-1 about the same probability after both
    prompts: the map is refused with the reason, a cell has no share, the page is told the
    threshold; min_gap 0 draws it anyway."""
    assert client.get("/api/info").json()["min_gap"] == MIN_GAP
    cell = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "layer": 1,
                                           "position": 2}).json()
    assert abs(cell["gap"]) < MIN_GAP and cell["min_gap"] == MIN_GAP
    assert cell["gap"] == pytest.approx(cell["clean_prob"] - cell["corrupt_prob"])
    assert "about the same probability" in cell["gap_note"] and "5-point threshold" in cell["gap_note"]
    assert cell["recovered"] is None and cell["patched_prob"] is not None
    refused = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "map": True})
    assert refused.status_code == 400
    message = refused.json()["error"]
    assert message.startswith("no patching map: the clean and corrupt prompts give the target")
    assert "\n" not in message and "choose a target" in message
    drawn = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "map": True,
                                            "min_gap": 0})
    assert drawn.status_code == 200 and drawn.json()["gap_note"] is None
    # a large gap: a share, no note
    assert gap_note(0.78, 0.09, MIN_GAP) is None
    assert gap_note(0.37, 0.37, MIN_GAP) is not None and gap_note(0.003, 0.003, 0.05)


def test_the_differing_positions(client: TestClient, session: Session) -> None:
    out = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "layer": 0,
                                          "position": 0}).json()
    want = [i for i, (a, b) in enumerate(zip(session.tokens(CLEAN)[0].tolist(),
                                             session.tokens(CORRUPT)[0].tolist(), strict=True))
            if a != b]
    assert out["differ"] == want and want and 0 not in want  # the BOS and "The" agree
    whole = session.patch_map({"clean": CLEAN, "corrupt": CORRUPT, "min_gap": 0})
    assert whole["differ"] == want and whole["gap"] == pytest.approx(out["gap"])


def test_bytes_are_labelled(client: TestClient, native_model: Any) -> None:
    """A token that is a byte of a character (é is two bytes here) reads <0xC3>, not "�"."""
    tokenizer = native_model.tokenizer
    ids = tokenizer("é", add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids] == ["\ufffd", "\ufffd"]
    assert [token_text(tokenizer, i) for i in ids] == ["<0xC3>", "<0xA9>"]
    text = "The café"
    grid = client.post("/api/grid", json={"text": text}).json()
    assert grid["tokens"][-2:] == ["<0xC3>", "<0xA9>"]
    assert not any("\ufffd" in t for row in grid["top_tokens"] for cell in row for t in cell)
    attention = client.post("/api/attention", json={"text": text, "block": 0,
                                                    "position": len(grid["tokens"]) - 1}).json()
    assert attention["tokens"][-2:] == ["<0xC3>", "<0xA9>"]
    patch = client.post("/api/patch", json={"clean": "The café", "corrupt": "The cafè",
                                            "layer": 0, "position": 0}).json()
    assert patch["clean_tokens"][-1] == "<0xA9>" and patch["corrupt_tokens"][-1] == "<0xA8>"
    assert patch["differ"] == [len(patch["clean_tokens"]) - 1]


def test_the_grid_gives_the_next_token(client: TestClient) -> None:
    """The pinned cell shows the actual next token's probability and rank (the last position
    has no next token)."""
    grid = client.post("/api/grid", json={"text": CLEAN}).json()
    n = len(grid["tokens"])
    assert len(grid["next_prob"]) == len(grid["rows"]) and len(grid["next_rank"][0]) == n
    assert grid["next_prob"][0][-1] is None and grid["next_rank"][0][-1] == -1
    assert all(0 <= p <= 1 for row in grid["next_prob"] for p in row[:-1])
    assert all(r >= 0 for row in grid["next_rank"] for r in row[:-1])  # 0: the top-1


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"clean": "a", "corrupt": "b", "map": True, "min_gap": 2}, "min_gap must be 0-1"),
        ({"clean": "a", "corrupt": "b", "map": True, "min_gap": "x"}, "min_gap must be a number"),
        ({"clean": "a", "corrupt": "b", "map": True, "min_gap": True}, "min_gap must be a number"),
        ({"clean": "a", "corrupt": "b", "map": "yes"}, "map must be true or false"),
        ({"clean": "a", "corrupt": "b", "layer": 1.5, "position": 0}, "layer must be an integer"),
        ({"corrupt": "b", "map": True}, "no 'clean'"),
    ],
)
def test_request_fields(client: TestClient, body: dict[str, Any], says: str) -> None:
    got = client.post("/api/patch", json=body)
    assert got.status_code == 400 and says in got.json()["error"], got.text


def test_requests_are_frozen_dataclasses() -> None:
    ask = parse(PatchAsk, {"clean": "a", "corrupt": "b", "map": True, "target": None,
                           "min_gap": 0, "ignored": 1})
    assert ask == PatchAsk(clean="a", corrupt="b", map=True, min_gap=0.0)
    assert isinstance(ask.min_gap, float)
    with pytest.raises(AttributeError):
        ask.clean = "c"  # type: ignore[misc]
    with pytest.raises(RequestError, match="min_gap must be 0-1"):
        parse(PatchAsk, {"clean": "a", "corrupt": "b", "min_gap": -0.5})


def test_a_crash_is_logged_not_echoed(session: Session, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: Any) -> Any:
        raise RuntimeError("secret detail /srv/private/data.txt")

    monkeypatch.setattr(session, "grid", broken)
    client = TestClient(make_app(session), base_url=LOCAL, raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="lensdiv.explore"):
        got = client.post("/api/grid", json={"text": CLEAN})
    assert got.status_code == 500 and got.json() == {"error": INTERNAL}
    assert "secret" not in got.text and "RuntimeError" not in got.text
    assert any("secret detail" in (r.exc_text or str(r.exc_info)) for r in caplog.records)
    assert client.post("/api/info").status_code == 405  # still serving
