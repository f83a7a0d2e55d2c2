"""`lensdiv explore`: the JSON API through Starlette's test client (values against the prompt view
and hand-made hooked passes, every 4xx case, the token), the notebook server, and the command in a
subprocess under a bounded loopback load test (every request answered, no error logged, memory
flat, Ctrl-C stops it cleanly)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from lensdiv.ops.capture import capture

pytest.importorskip("starlette", reason="the explore extra is a dev dependency")
pytest.importorskip("uvicorn", reason="the explore extra is a dev dependency")
from starlette.testclient import TestClient  # noqa: E402

from lensdiv.core.analyzer import ModelInfo  # noqa: E402
from lensdiv.core.errors import LensdivError  # noqa: E402
from lensdiv.ops.lens_files import save_tuned  # noqa: E402
from lensdiv.ops.prompt import prompt_view  # noqa: E402
from lensdiv.ops.token_text import token_text  # noqa: E402
from lensdiv.web.patch_panel import TOY_EXAMPLE, patch_example  # noqa: E402
from lensdiv.web.server import make_app  # noqa: E402
from lensdiv.web.session import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The happy dog runs"
CLEAN, CORRUPT = "The happy dog", "The angry cat"
LOCAL = "http://127.0.0.1:8765"  # a loopback Host: a server without a token answers only that


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, native_model: Any) -> Path:
    """A runs folder: one real run (with its report.html) and a study's minimal layout."""
    from lensdiv.run.runner import analyze

    root = tmp_path_factory.mktemp("runs")
    analyze(native_model, plugins="lens", out=root / "lens-run", max_tokens=256, seq_len=32,
            batch_size=4, progress=False)
    study = root / "studies" / "family"
    study.mkdir(parents=True)
    (study / "study.json").write_text(json.dumps(
        {"settings": {"plugins": "lens,skip"}, "models": [{"model": "toy", "status": "complete"},
                                    {"model": "toy:d8", "status": "failed"}]}))
    (study / "study.html").write_text("<html><title>study</title></html>")
    (root / "secret.txt").write_text("not served")
    return root


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory, native_model: Any) -> str:
    info = ModelInfo.from_model(native_model)
    gen = torch.Generator().manual_seed(0)
    d = info.d_model
    folder = tmp_path_factory.mktemp("tuned")
    save_tuned(folder, {i: 0.1 * torch.randn(d, d, generator=gen) for i in range(info.n_layers)},
               {i: 0.1 * torch.randn(d, generator=gen) for i in range(info.n_layers)},
               d_model=d, n_layers=info.n_layers, model_name="tiny")
    return f"tuned:{folder}"


@pytest.fixture(scope="module")
def session(native_model: Any, tuned: str, runs: Path) -> Session:
    return Session(native_model, [tuned], runs)


@pytest.fixture(scope="module")
def client(session: Session) -> TestClient:
    return TestClient(make_app(session), base_url=LOCAL)


def same_view(got: dict[str, Any], view: Any) -> None:
    want = view.to_dict()
    assert got["tokens"] == want["tokens"] and got["rows"] == want["rows"]
    assert got["top_tokens"] == want["top_tokens"]
    for key in ("top_probs", "kl", "entropy"):
        assert torch.allclose(torch.tensor(got[key]), torch.tensor(want[key]), atol=1e-6), key


def test_info(client: TestClient, session: Session, tuned: str) -> None:
    info = client.get("/api/info").json()
    # the kinds made without files come from the registry of lens kinds, then the fitted ones
    assert info["lenses"] == ["logit", "last-block", "patchscope", tuned]
    assert info["n_layers"] == session.info.n_layers and info["runs"] is True


@pytest.mark.parametrize("lens", ["logit", "last-block", "patchscope", "tuned"])
def test_grid_is_the_prompt_view(client: TestClient, native_model: Any, tuned: str,
                                 lens: str) -> None:
    name = tuned if lens == "tuned" else lens
    got = client.post("/api/grid", json={"text": TEXT, "lens": name, "top_k": 4})
    assert got.status_code == 200
    same_view(got.json(), prompt_view(native_model, TEXT, top_k=4, lens=name))
    assert got.json()["lens"] == name and got.json()["ms"] > 0


@pytest.mark.parametrize("part", ["block", "attn", "mlp"])
def test_skip_shows_the_output_kl(client: TestClient, native_model: Any, part: str) -> None:
    got = client.post("/api/grid", json={"text": TEXT, "skip": 1, "part": part}).json()
    view = prompt_view(native_model, TEXT, top_k=5, skip=1, part=part)
    same_view(got, view)
    kl = got["skip"]["output_kl"]
    assert got["skip"]["block"] == 1 and got["skip"]["part"] == part
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # position 0 is never skipped
    assert min(kl[1:]) > 0  # skipping changes every later position's output
    assert got["skip"]["mean_output_kl"] == pytest.approx(sum(kl[1:]) / len(kl[1:]))


def hooked_patch(model: Any, layer: int, position: int, target: int) -> float:
    """The target's probability at the last position of the corrupt prompt with the clean
    ``h_layer`` at ``position``: TransformerLens hooks on a full pass (not the resumer)."""
    info = ModelInfo.from_model(model)
    name = info.resid(layer)
    _, cache = model.run_with_cache(model.to_tokens(CLEAN), names_filter=[name])

    def put(tensor: torch.Tensor, *, hook: Any) -> torch.Tensor:
        tensor = tensor.clone()
        tensor[:, position] = cache[name][:, position]
        return tensor

    with torch.no_grad():
        logits = model.run_with_hooks(model.to_tokens(CORRUPT), fwd_hooks=[(name, put)])
    return float(logits[0, -1].float().softmax(-1)[target])


def test_patch_matches_a_hooked_pass(client: TestClient, native_model: Any) -> None:
    # min_gap 0: the tiny random model gives the target about the same probability in both
    base = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "layer": 0,
                                           "position": 0, "min_gap": 0}).json()
    target = base["target_id"]
    with torch.no_grad():
        clean_out = native_model(native_model.to_tokens(CLEAN))[0, -1].float().softmax(-1)
    assert target == int(clean_out.argmax())  # the default target: the clean top-1
    assert base["clean_prob"] == pytest.approx(float(clean_out[target]), rel=1e-4)
    L = ModelInfo.from_model(native_model).n_layers
    for layer, position in ((0, 5), (1, 6), (L, 13)):
        got = client.post("/api/patch", json={"clean": CLEAN, "corrupt": CORRUPT, "layer": layer,
                                              "position": position, "min_gap": 0}).json()
        want = hooked_patch(native_model, layer, position, target)
        assert got["patched_prob"] == pytest.approx(want, rel=1e-4, abs=1e-7)
        assert got["recovered"] == pytest.approx(
            (want - base["corrupt_prob"]) / (base["clean_prob"] - base["corrupt_prob"]), rel=1e-3)


def test_patching_map(client: TestClient, session: Session, native_model: Any) -> None:
    got = session.patch_map({"clean": CLEAN, "corrupt": CORRUPT, "target": "g", "min_gap": 0})
    target = got["target_id"]
    assert got["target"] == "g"
    rows = got["map"]
    L, n_pos = ModelInfo.from_model(native_model).n_layers, len(got["corrupt_tokens"])
    assert len(rows) == L + 1 and all(len(r) == n_pos for r in rows)
    same = [t for t in range(n_pos) if got["clean_tokens"][t] == got["corrupt_tokens"][t]]
    for t in same:  # h0 is the embedding: the same token patches nothing
        assert rows[0][t] == pytest.approx(got["corrupt_prob"], rel=1e-4)
    assert rows[L][-1] == pytest.approx(got["clean_prob"], rel=1e-4)  # the clean output itself
    assert rows[2][6] == pytest.approx(hooked_patch(native_model, 2, 6, target), rel=1e-4)


def check_example(model: Any, example: dict[str, str], min_gap: float = 0) -> dict[str, Any]:
    """The example pair is one the patch tab can run: prompts of one length, a one-token target."""
    assert set(example) == {"clean", "corrupt", "target", "about"} and example["about"]
    clean, corrupt = (model.to_tokens(example[k], prepend_bos=True) for k in ("clean", "corrupt"))
    assert clean.shape == corrupt.shape
    session = Session(model)
    assert session.describe()["patch_example"] == example
    out = session.patch_map({**example, "min_gap": min_gap})
    if example["target"]:
        assert out["target"] == example["target"]
    return out


def test_patch_example_runs(native_model: Any) -> None:
    check_example(native_model, patch_example(native_model))


def test_toy_patch_example_is_agreement() -> None:
    from lensdiv.models.toy import build, parse_toy

    toy = build(parse_toy("toy"))  # untrained: the pair runs, whatever it shows
    assert patch_example(toy) == TOY_EXAMPLE
    check_example(toy, TOY_EXAMPLE)


def test_patch_example_for_another_tokenizer() -> None:
    """A tokenizer other than the toys': the first built-in pair (a capital city), its answer the
    target when it is one token, else no target (the clean prompt's prediction)."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from lensdiv.data.pairs import builtin_pairs

    words = ["<unk>", "The", "capital", "of", "is", "France", "Paris", "Italy", "Rome"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    pair = builtin_pairs(tokenizer)[0]
    for per_token, target in ((1, pair.target), (2, "")):  # as if the answer were two tokens

        def to_tokens(text: str, prepend_bos: bool, n: int = per_token) -> torch.Tensor:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            return torch.tensor([ids * n])

        example = patch_example(SimpleNamespace(tokenizer=tokenizer, to_tokens=to_tokens))
        assert example["clean"] == pair.clean == "The capital of France is"
        assert example["corrupt"] == pair.corrupt and example["target"] == target
        assert pair.clean in example["about"] and pair.corrupt in example["about"]


def test_toy_patch_example_moves_the_answer(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    """On the default toy as users get it — the one shipped with the package, read from a fresh
    (empty) cache as on a fresh clone — patching the example's best (layer, position) moves the
    target's probability from the corrupt run's most of the way to the clean run's: the pair
    shows something, and its map is drawn at the default threshold (MIN_GAP)."""
    from lensdiv.models.load import load_model
    from lensdiv.models.toy import TrainRecipe, parse_toy, trained_log
    from lensdiv.web.asks import MIN_GAP

    monkeypatch.delenv("LENSDIV_TOY_STEPS", raising=False)  # the tests' recipe is 30 steps
    monkeypatch.setenv("LENSDIV_CACHE", str(tmp_path))  # nothing cached: where users start
    spec = parse_toy("toy")
    found = trained_log(spec, TrainRecipe.default(spec))
    assert found is not None and found[0] == "shipped"  # loads without training
    out = check_example(load_model("toy"), TOY_EXAMPLE, min_gap=MIN_GAP)
    best = max(p for row in out["map"] for p in row)
    assert out["clean_prob"] - out["corrupt_prob"] > 0.5
    assert best - out["corrupt_prob"] > 0.5
    # the answer is read at the last position: its column carries it from a middle layer up
    assert out["map"][-1][-1] == pytest.approx(out["clean_prob"], rel=1e-4)
    assert out["map"][0][-1] == pytest.approx(out["corrupt_prob"], rel=1e-4)


def test_map_pieces_are_the_whole_map(client: TestClient, session: Session,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces the page asks for one by one (each short: here one batch, MAP_SECONDS = 0)
    cover every (layer, position) once, in order, and equal the map computed in one go."""
    import lensdiv.web.patch_panel as module

    monkeypatch.setattr(module, "MAP_SECONDS", 0.0)
    session.patcher._map_step = 3
    ask: dict[str, Any] = {"clean": CLEAN, "corrupt": CORRUPT, "map": True, "min_gap": 0}
    rows: dict[int, list[float]] = {}
    pieces = 0
    while True:
        piece = client.post("/api/patch", json=ask).json()
        assert piece["start"] == len(rows.setdefault(piece["layer"], []))  # in order, no gap
        rows[piece["layer"]] += piece["probs"]
        pieces += 1
        if piece["next"] is None:
            break
        ask.update(piece["next"])
    L, n_pos = session.info.n_layers, len(piece["corrupt_tokens"])
    assert sorted(rows) == list(range(L + 1)) and all(len(r) == n_pos for r in rows.values())
    assert pieces > L + 1  # rows in several pieces
    clean, corrupt = session.tokens(CLEAN), session.tokens(CORRUPT)
    patcher = session.patcher
    with torch.no_grad():  # the whole map at once: every position of a row in one batch
        states = patcher._states(clean, corrupt)
        whole = [patcher._patched(corrupt, states, layer, range(n_pos), piece["target_id"])
                 for layer in range(L + 1)]
    for layer in range(L + 1):
        assert rows[layer] == pytest.approx(whole[layer], rel=1e-5, abs=1e-8), layer
    assembled = session.patch_map({"clean": CLEAN, "corrupt": CORRUPT, "min_gap": 0})
    for layer in range(L + 1):
        assert assembled["map"][layer] == pytest.approx(whole[layer], rel=1e-5, abs=1e-8)


LONG = "x" * 200  # the tiny model reads 128 tokens


@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/api/grid", {"text": LONG}, 400, "at most 128"),
        ("/api/grid", {"text": TEXT, "lens": "tuned:/etc"}, 400, "unknown lens 'tuned:/etc'"),
        ("/api/grid", {"text": TEXT, "skip": 3}, 400, "cannot skip block 3"),
        ("/api/grid", {"text": TEXT, "skip": -1}, 400, "cannot skip block -1"),
        ("/api/grid", {"text": TEXT, "skip": 1, "part": "ffn"}, 400, "unknown part"),
        ("/api/grid", {"text": TEXT, "skip": 1, "lens": "last-block"}, 400, "logit lens"),
        ("/api/grid", {"text": TEXT, "skip": True}, 400, "skip must be an integer"),
        ("/api/grid", {"text": TEXT, "top_k": 0}, 400, "top_k"),
        ("/api/grid", {"text": 3}, 400, "text must be a string"),
        ("/api/grid", {"text": "   "}, 400, "empty"),
        ("/api/grid", {}, 400, "no 'text'"),
        ("/api/grid", "{not json", 400, "malformed JSON"),
        ("/api/grid", "[1, 2]", 400, "JSON object"),
        ("/api/grid", b"\xff\xfe", 400, "malformed JSON"),
        ("/api/grid", "x" * 300_000, 413, "over 256 KiB"),
        ("/api/grid", '{"text": "ab\\ud800cd"}', 400, "text is not valid text"),
        ("/api/grid", '{"text": "ok", "lens": "\\udfff"}', 400, "lens is not valid text"),
        ("/api/patch", '{"clean": "ab\\ud800cd", "corrupt": "abcd", "map": true}', 400,
         "clean is not valid text"),
        ("/api/patch", '{"clean": "abcd", "corrupt": "ab\\ud800cd", "layer": 0, "position": 0}',
         400, "corrupt is not valid text"),
        ("/api/patch", '{"clean": "abcd", "corrupt": "abce", "target": "\\ud800", "map": true}',
         400, "target is not valid text"),
        ("/api/patch", {"clean": CLEAN, "corrupt": "The cat"}, 400, "same length"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "target": "dog", "map": True}, 400,
         "not one"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "layer": 9, "position": 0}, 400,
         "layer 9 is outside"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "layer": 0, "position": 99}, 400,
         "position 99 is outside"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT}, 400, "give layer and position"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "map": True, "start": 99}, 400,
         "position 99 is outside"),
        ("/api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "map": True, "layer": -1}, 400,
         "layer -1 is outside"),
        ("/api/patch", {"clean": LONG, "corrupt": LONG, "map": True}, 400, "at most 128"),
        ("/api/attention", {"text": TEXT, "block": 9, "position": 0}, 400, "block 9 is outside"),
        ("/api/attention", {"text": TEXT, "block": 0, "position": 99}, 400,
         "position 99 is outside"),
        ("/api/attention", {"text": TEXT}, 400, "give block and position"),
        ("/api/says", {"text": TEXT}, 400, "give row and position"),
        ("/api/says", {"text": TEXT, "row": 9, "position": 0}, 400, "row 9 is outside"),
        ("/api/says", {"text": TEXT, "row": 0, "position": 99}, 400, "position 99 is outside"),
        ("/api/says", {"text": TEXT, "row": 0, "position": 0, "tokens": 0}, 400,
         "tokens must be 1-32"),
        ("/api/says", {"text": TEXT, "row": 0, "position": 0, "lens": "logit"}, 400,
         "'logit' is not a patchscope"),
    ],
)
def test_bad_requests_get_one_clear_line(client: TestClient, path: str, body: Any, status: int,
                                         says: str) -> None:
    if isinstance(body, (str, bytes)):
        got = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        got = client.post(path, json=body)
    assert got.status_code == status, got.text
    assert list(got.json()) == ["error"] and says in got.json()["error"]
    assert "\n" not in got.json()["error"]


def test_other_4xx(client: TestClient) -> None:
    cases = [
        (client.post("/api/grid", content=json.dumps({"text": TEXT})), 400, "Content-Type"),
        (client.get("/api/grid"), 405, "not allowed"),
        (client.get("/nothing"), 404, "no such page"),
        (client.get("/runs/secret.txt"), 404, "not a run's or a study's page"),
        (client.get("/runs/../../etc/passwd"), 404, "no such page"),
        (client.get("/runs/lens-run/..%2F..%2Freport.html"), 404, ""),
        (client.get("/runs/missing/report.html"), 404, "no page"),
    ]
    for got, status, says in cases:
        assert got.status_code == status, got.text
        assert says in got.json()["error"]


def test_runs_are_listed_and_served(client: TestClient, runs: Path) -> None:
    listed = client.get("/api/runs").json()["runs"]
    assert [(r["kind"], r["path"], r["page"]) for r in listed] == [
        ("run", "lens-run", "lens-run/report.html"),
        ("study", "studies/family", "studies/family/study.html"),
    ]
    assert listed[0]["status"] == "complete" and listed[0]["what"] == "lens"
    assert listed[1]["status"] == "1/2 complete" and listed[1]["what"] == "lens,skip"
    page = client.get("/runs/lens-run/report.html")
    assert page.status_code == 200 and page.text == (runs / "lens-run" / "report.html").read_text()


def test_page_and_its_files(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "explore.js" in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy
    # only local pages (a notebook's) may frame it
    framed_by = re.search(r"frame-ancestors ([^;]*)", policy)
    assert framed_by and framed_by.group(1).split() == [
        "'self'", "http://127.0.0.1:*", "http://localhost:*"]
    for name in ("/explore.js", "/explore.css"):
        got = client.get(name)
        assert got.status_code == 200 and got.headers["content-security-policy"] == policy
        assert got.headers["cache-control"] == "no-store"
    assert client.post("/explore.js").status_code == 405
    assert not re.search(r"(src|href)=\"(https?:)?//", page.text)  # nothing from elsewhere


def test_token_and_host(session: Session) -> None:
    guarded = TestClient(make_app(session, token="s3cret"))
    assert guarded.get("/api/info").status_code == 403
    assert guarded.get("/api/info?token=wrong").status_code == 403
    assert guarded.get("/api/info", headers={"X-Lensdiv-Token": "s3cret"}).status_code == 200
    first = guarded.get("/?token=s3cret")
    assert first.status_code == 200 and "lensdiv_token" in first.headers["set-cookie"]
    assert guarded.get("/api/runs").status_code == 200  # the cookie from now on
    fresh = TestClient(make_app(session, token="s3cret"))  # no cookie: the bare URL
    bare = fresh.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert bare.status_code == 403 and bare.headers["content-type"].startswith("text/html")
    assert "?token=" in bare.text and "open that url" in bare.text.lower()
    for name in ("/explore.js", "/explore.css"):  # the package's files: no token needed
        assert fresh.get(name).status_code == 200  # (a notebook's frame sends no cookie)
    assert fresh.post("/explore.js").status_code == 403
    api = fresh.get("/api/info", headers={"Accept": "text/html"})
    assert api.status_code == 403 and "token" in api.json()["error"]  # the API: JSON
    for host in ("evil.example", "testserver", "127.0.0.1.evil.example"):
        # DNS rebinding: without a token, a loopback server answers loopback names only
        refused = TestClient(make_app(session), base_url=f"http://{host}").get("/api/info")
        assert refused.status_code == 403, host
        assert refused.json()["error"].startswith(f"Host {host!r} refused")
    for host in ("127.0.0.1:8765", "localhost", "[::1]:8765", "[::1]"):
        answered = TestClient(make_app(session), base_url=f"http://{host}").get("/api/info")
        assert answered.status_code == 200, (host, answered.text)


def test_token_by_default(native_model: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """The URL carries a fresh token (on loopback too); --no-token says so on stderr and serves
    loopback only; bound to every interface, the URL names this machine."""
    import socket

    from lensdiv.core.errors import OptionError
    from lensdiv.web.serve import NO_TOKEN_WARNING, machine_name, prepare, url_of

    urls = []
    for _ in range(2):
        server, sock, url = prepare(native_model)
        sock.close()
        urls.append(url)
        assert server.config.app.state.token == url.split("?token=")[1]
    assert urls[0] != urls[1] and all("?token=" in u for u in urls)
    assert capsys.readouterr().err == ""
    server, sock, url = prepare(native_model, token=False)
    sock.close()
    assert "?token=" not in url and server.config.app.state.token is None
    assert capsys.readouterr().err.strip() == NO_TOKEN_WARNING
    with pytest.raises(OptionError, match="--no-token serves a loopback address only"):
        prepare(native_model, host="0.0.0.0", token=False)
    for host in ("0.0.0.0", "::"):
        named = url_of(host, 8765, "abc")
        assert named == f"http://{machine_name()}:8765/?token=abc"
        assert machine_name() in (socket.getfqdn(), socket.gethostname())
        assert "0.0.0.0" not in named and "[::]" not in named
    if socket.gethostname() not in ("localhost", "127.0.0.1"):  # never a loopback name
        assert not machine_name().startswith("localhost")
    assert url_of("::1", 8765, None) == "http://[::1]:8765/"


def test_missing_extra_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from lensdiv.web.serve import require

    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(LensdivError) as err:
        require()
    assert "lensdiv[explore]" in str(err.value) and "uvicorn" in str(err.value)


def test_notebook_server(native_model: Any) -> None:
    import lensdiv

    app = lensdiv.explore(native_model)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[\w-]{20,}", app.url), app.url
        assert app.running
        base, token = app.url.split("?token=")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(base + "api/info", timeout=30)  # the token is required
        assert refused.value.code == 403
        request = urllib.request.Request(base + "api/info", headers={"X-Lensdiv-Token": token})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert json.load(r)["n_layers"] == ModelInfo.from_model(native_model).n_layers
        assert f'<iframe src="{app.url}"' in app._repr_html_()  # the page, with its token
    finally:
        app.stop()
    assert not app.running
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(base + "api/info", timeout=5)


# -- the command, under load ------------------------------------------------------------------


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def ask(base: str, i: int, token: str = "") -> tuple[int, bool]:
    """One request of a mix: (status, whether it was meant to be bad)."""
    kinds = [
        ("api/grid", {"text": f"The dog {i}"}, False),
        ("api/grid", {"text": f"The cat {i}", "skip": i % 2, "part": "mlp"}, False),
        ("api/grid", {"text": TEXT, "lens": "nope"}, True),
        ("api/grid", {"text": TEXT, "skip": 99}, True),
        ("api/grid", "{broken", True),
        ("api/grid", {"text": LONG}, True),
        ("api/patch", {"clean": CLEAN, "corrupt": CORRUPT, "layer": 1, "position": i % 13},
         False),
        ("api/runs", None, False),
    ]
    path, body, bad = kinds[i % len(kinds)]
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    request = urllib.request.Request(base + path, data=None if data is None else data.encode(),
                                     headers={"Content-Type": "application/json",
                                              "X-Lensdiv-Token": token})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            json.load(r)
            return r.status, bad
    except urllib.error.HTTPError as err:
        json.load(err)  # a JSON body with the error
        return err.code, bad


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads memory from /proc")
def test_command_under_load_then_ctrl_c(tiny_dirs: dict[str, Path], runs: Path) -> None:
    model = tiny_dirs[sorted(tiny_dirs)[0]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "lensdiv", "explore", str(model), "--port", "0", "--no-browser",
         "--runs", str(runs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+/)\?token=([\w-]+)", line)
        assert found, line + (proc.stderr.read() if proc.stderr and proc.poll() else "")
        base, token = found.groups()
        clients, per_client = 20, 20

        def round_of_load() -> list[tuple[int, bool]]:
            answers: list[tuple[int, bool]] = []
            lock = threading.Lock()

            def client(c: int) -> None:
                for r in range(per_client):
                    got = ask(base, c * per_client + r, token)
                    with lock:
                        answers.append(got)

            threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            return answers

        for i in range(16):  # warm: every kind of request once, buffers allocated
            ask(base, i, token)
        before = rss_kb(proc.pid)
        answers = round_of_load()
        middle = rss_kb(proc.pid)
        answers += round_of_load()
        after = rss_kb(proc.pid)
        counts = {s: sum(a == s for a, _ in answers) for s in sorted({a for a, _ in answers})}
        print(f"explore load: statuses {counts}, RSS kB {before} → {middle} → {after}")
        assert len(answers) == 2 * clients * per_client  # every request answered
        for status, bad in answers:
            assert (400 <= status < 500) if bad else status in (200, 503), (status, bad)
        assert sum(status == 200 for status, _ in answers) > len(answers) // 3
        # Memory flat: the second round adds nothing beyond noise to the first.
        assert after - middle < 20_000, (before, middle, after)
        assert middle - before < 60_000, (before, middle, after)
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "stopped" in out
    assert "Traceback" not in err and "ERROR" not in err, err


def test_command_help_and_taken_port() -> None:
    from typer.testing import CliRunner

    from lensdiv.cli import app
    from lensdiv.web.serve import bind

    result = CliRunner().invoke(app, ["explore", "--help"], terminal_width=200)
    assert result.exit_code == 0 and "Example: lensdiv explore" in result.output
    assert "pip install 'lensdiv[explore]'" in " ".join(result.output.split())  # not eaten
    assert "--no-token" in result.output
    taken = bind("127.0.0.1", 0)
    try:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["explore", "toy", "--port", str(port), "--no-browser"])
        assert result.exit_code == 2
        assert f"cannot listen on 127.0.0.1:{port}" in result.output
    finally:
        taken.close()
    result = CliRunner().invoke(app, ["explore", "toy", "--runs", "/no/such/dir", "--no-browser"])
    assert result.exit_code == 2 and "is not a folder" in result.output


def test_products_setting(native_model: Any, client: TestClient) -> None:
    """The tiny model's unembedding is small: `auto` stays float32 (every figure above is exact);
    `bf16` asked for shows the same output row and says so; an unknown kind is one line."""
    from typer.testing import CliRunner

    from lensdiv.cli import app

    assert Session(native_model).products == "float32"
    fast = TestClient(make_app(Session(native_model, products="bf16")), base_url=LOCAL)
    got = fast.post("/api/grid", json={"text": TEXT}).json()
    exact = client.post("/api/grid", json={"text": TEXT}).json()
    assert "bf16 products" in got["meta"]["readout"] and "bf16" not in exact["meta"]["readout"]
    assert got["top_tokens"][-1] == exact["top_tokens"][-1]
    assert got["top_probs"][-1] == exact["top_probs"][-1]
    result = CliRunner().invoke(app, ["explore", "toy", "--products", "fast", "--port", "0",
                                      "--no-browser"])
    assert result.exit_code == 2 and "unknown products 'fast'" in result.output
    assert "Traceback" not in result.output


def test_attention_of_a_position_is_the_pattern_it_shows(client: TestClient,
                                                         native_model: Any) -> None:
    """One position's attention in one block: the model's own pattern row, per head and
    averaged, over the tokens the grid shows; the sink (position 0) and its heads marked."""
    grid = client.post("/api/grid", json={"text": TEXT}).json()
    position = len(grid["tokens"]) - 1
    got = client.post("/api/attention", json={"text": TEXT, "block": 1, "position": position})
    assert got.status_code == 200, got.text
    out = got.json()
    assert out["tokens"] == grid["tokens"][: position + 1]
    tokens = native_model.to_tokens(TEXT, prepend_bos=True)
    _, cache = capture(native_model, tokens, ["blocks.1.attn.hook_pattern"], need_logits=False)
    want = cache["blocks.1.attn.hook_pattern"][0, :, position, : position + 1].double()
    assert torch.allclose(torch.tensor(out["heads"], dtype=torch.float64), want, atol=1e-6)
    assert out["mean"] == pytest.approx(want.mean(0).tolist(), abs=1e-6)
    assert out["sink_mass"] == pytest.approx(want[:, 0].tolist(), abs=1e-6)
    assert out["sink_heads"] == [h for h in range(want.shape[0]) if want[h, 0] > 0.3]


def test_what_the_model_says_is_the_patchscope_continuation(client: TestClient,
                                                            native_model: Any) -> None:
    """A pinned cell's state read by the model itself: the inspection prompt's greedy
    continuation with that state patched in, as :meth:`Inspection.generate` gives it."""
    from lensdiv.ops.blocklens import DEFAULT_PROMPT
    from lensdiv.ops.inspection import inspection

    grid = client.post("/api/grid", json={"text": TEXT}).json()
    position = len(grid["tokens"]) - 1
    got = client.post("/api/says", json={"text": TEXT, "row": 1, "position": position,
                                         "tokens": 5})
    assert got.status_code == 200, got.text
    out = got.json()
    tokens = native_model.to_tokens(TEXT, prepend_bos=True)
    info = ModelInfo.from_model(native_model)
    _, cache = capture(native_model, tokens, [info.resid(1)], need_logits=False)
    found = inspection(native_model, DEFAULT_PROMPT, -1)
    said, probs = found.generate(1, cache[info.resid(1)][0, position], 5)
    decode = native_model.tokenizer.decode
    label = [token_text(native_model.tokenizer, t) for t in said]  # bytes as <0xC3>
    assert out["tokens"] == label and out["text"] == decode(said)
    assert out["probs"] == pytest.approx(probs, rel=1e-6)
    assert (out["lens"], out["row"], out["target"], out["patched"]) == (
        "patchscope", 1, 1, len(out["prompt"]) - 1)
    assert out["prompt"] == [token_text(native_model.tokenizer, t) for t in found.tokens_list]
