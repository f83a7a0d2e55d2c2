"""Reading ahead (``lensdiv.data.prefetch``): the batches of ``token_batches`` made on a thread,
in order and unchanged; bad data raised where it was; no thread left behind, however a pass ends.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import lensdiv
from lensdiv.cli import app
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo
from lensdiv.core.errors import DataError
from lensdiv.core.results import Result, Table
from lensdiv.core.stats import Stats
from lensdiv.data.prefetch import THREAD_NAME, read_ahead, ready_batches
from lensdiv.data.sources import DataSpec, token_batches
from lensdiv.data.tokenizer import byte_tokenizer

SMALL: dict[str, Any] = {"seq_len": 32, "batch_size": 2, "progress": False}
# A bad line past what the cheap check reads (the file's first 64 KiB): met mid-way.
ROWS, BAD_AFTER = 420, 400


@pytest.fixture(autouse=True)
def read_ahead_always(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' data is small: read it ahead anyway (a run reads ahead only more than
    ``READ_AHEAD_TOKENS`` tokens; see the test of that below)."""
    monkeypatch.setattr("lensdiv.data.prefetch.READ_AHEAD_TOKENS", 0)


def test_small_data_is_read_in_the_callers_thread_without_a_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("lensdiv.data.prefetch.READ_AHEAD_TOKENS", 1000)

    class Counted(Wrapped):
        threads: list[str] = []

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return self.inner(*args, **kwargs)

        def __deepcopy__(self, memo: Any) -> Any:
            raise AssertionError("copied")

    small = DataSpec(max_tokens=1000, seq_len=32, batch_size=2)
    assert _plain(ready_batches(small, Counted(byte_tokenizer()))) == _plain(
        token_batches(small, byte_tokenizer())
    )
    assert Counted.threads and set(Counted.threads) == {threading.current_thread().name}


def _readers(timeout: float = 5.0) -> list[threading.Thread]:
    """The reader threads still alive after ``timeout`` seconds (each ends after its item)."""
    deadline = time.monotonic() + timeout
    alive = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    for thread in alive:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in alive if t.is_alive()]


def _plain(batches: Iterator[Batch]) -> list[Any]:
    """Every batch as plain data, then the message of what stopped the stream, if anything."""
    out: list[Any] = []
    try:
        for b in batches:
            out.append((b.index, b.bos, b.tokens.tolist(), b.mask.tolist(), b.doc.tolist()))
    except DataError as err:
        out.append(str(err))
    return out


class Wrapped:
    """A tokenizer that behaves as ``inner`` does (and deep-copies as a plain object)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet: a copy being made
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def __len__(self) -> int:
        return len(self.inner)


def _jsonl(path: Path, rows: int, bad_after: int | None = None) -> Path:
    lines = [json.dumps({"text": f"Document {i}: the cat that sees the dogs sleeps. " * 4})
             for i in range(rows)]
    if bad_after is not None:
        lines.insert(bad_after, "{not json")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_the_same_batches_in_the_same_order(tmp_path: Path, depth: int) -> None:
    tokenizer = byte_tokenizer()
    for spec in (
        DataSpec(max_tokens=5000, seq_len=32, batch_size=3),
        DataSpec(source=str(_jsonl(tmp_path / "d.jsonl", 40)), seq_len=16, batch_size=2,
                 max_tokens=10**6, bos="none"),
    ):
        expected = _plain(token_batches(spec, tokenizer))
        assert _plain(ready_batches(spec, tokenizer, depth)) == expected
    assert not _readers()


def test_bad_data_is_raised_after_the_batches_before_it(tmp_path: Path) -> None:
    tokenizer = byte_tokenizer()
    spec = DataSpec(source=str(_jsonl(tmp_path / "d.jsonl", ROWS, BAD_AFTER)), seq_len=128,
                    batch_size=8, max_tokens=10**6)
    expected = _plain(token_batches(spec, tokenizer))
    assert expected[-1] == f"d.jsonl line {BAD_AFTER + 1} is not JSON: Expecting property name " \
        "enclosed in double quotes" and len(expected) > 50
    assert _plain(ready_batches(spec, tokenizer)) == expected
    # A bad line beyond the token budget is never met, with or without the thread.
    short = DataSpec(source=spec.source, seq_len=128, batch_size=8, max_tokens=20000)
    assert _plain(ready_batches(short, tokenizer)) == _plain(token_batches(short, tokenizer))
    assert not any(isinstance(x, str) for x in _plain(ready_batches(short, tokenizer)))


def test_closing_stops_the_reader_and_closes_the_data() -> None:
    closed = threading.Event()

    def endless() -> Iterator[int]:
        try:
            n = 0
            while True:
                n += 1
                yield n
        finally:
            closed.set()

    items = read_ahead(endless(), 4)
    assert [next(items) for _ in range(3)] == [1, 2, 3]
    items.close()  # the reader waits for room in a full queue: it must notice and stop
    assert not _readers() and closed.wait(5)


def test_an_exception_through_the_consumer_stops_the_reader() -> None:
    def slow() -> Iterator[int]:
        for n in range(1000):
            time.sleep(0.01)
            yield n

    with pytest.raises(KeyboardInterrupt):
        for n in read_ahead(slow(), 2):
            if n == 2:
                raise KeyboardInterrupt  # what a second Ctrl-C does
    assert not _readers()


def test_the_reader_never_calls_the_models_tokenizer() -> None:
    """It tokenises with a private copy: whatever the caller does meanwhile with the model's
    tokenizer (truncation, padding: settings a fast tokenizer keeps) cannot reach the data."""

    class Watched(Wrapped):
        threads: list[str] = []

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.threads.append(threading.current_thread().name)
            return self.inner(*args, **kwargs)

    watched = Watched(byte_tokenizer())
    spec = DataSpec(max_tokens=3000, seq_len=32, batch_size=2)
    batches = ready_batches(spec, watched)
    first = next(batches)
    watched.inner("x" * 50, truncation=True, max_length=3)  # the caller's own use, meanwhile
    rest = list(batches)
    assert Watched.threads and set(Watched.threads) == {THREAD_NAME}  # the copy's calls
    assert "threads" not in vars(watched)  # ... on the class: the model's own was never called
    assert _plain(iter([first, *rest])) == _plain(token_batches(spec, byte_tokenizer()))


def test_a_tokenizer_that_cannot_be_copied_is_read_without_a_thread() -> None:
    class Uncopyable(Wrapped):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            assert threading.current_thread() is threading.main_thread()
            return self.inner(*args, **kwargs)

        def __deepcopy__(self, memo: Any) -> Any:
            raise TypeError("cannot copy")

    spec = DataSpec(max_tokens=1000, seq_len=32, batch_size=2)
    assert _plain(ready_batches(spec, Uncopyable(byte_tokenizer()))) == _plain(token_batches(spec, byte_tokenizer()))


# -- through a run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Count(Analyzer):
    """Counts tokens and batches; fails at batch ``fail_at`` (``-1``: never)."""

    name = "count"
    fail_at: int = -1

    def hooks(self, info: ModelInfo) -> list[str]:
        return [info.resid(0)]

    def update(self, state: Stats, step: Any) -> None:
        if step.batch.index == self.fail_at:
            raise RuntimeError("stop here")
        state.add("n", step.batch.n_tokens)
        state.add("batches", 1)

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        table = Table("t", {"n": [int(state["n"])], "batches": [int(state["batches"])]})
        return Result(self.name, "counted", tables={"t": table})


def test_bad_data_mid_way_through_the_api_and_the_cli(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", ROWS, BAD_AFTER)
    sizes = {"seq_len": 128, "batch_size": 8, "max_tokens": 10**6}
    before: list[Batch] = []
    try:
        for batch in token_batches(DataSpec(source=str(data), **sizes), byte_tokenizer()):
            before.append(batch)
    except DataError:
        pass
    tokens = sum(b.n_tokens for b in before)
    with pytest.raises(DataError, match=f"d.jsonl line {BAD_AFTER + 1} is not JSON"):
        lensdiv.analyze("toy", data=str(data), plugins=[Count()], out=tmp_path / "api",
                        progress=False, **sizes)
    saved = lensdiv.load_run(tmp_path / "api")
    assert saved.manifest["status"] == "partial"
    assert saved["count"].table()["batches"] == [len(before)]
    assert saved["count"].table()["n"] == [tokens]
    result = CliRunner().invoke(app, ["analyze", "toy", "--data", str(data), "-p", "contrib",
                                      "--out", str(tmp_path / "cli"), "--max-tokens", "1000000",
                                      "--seq-len", "128", "--batch-size", "8", "--no-progress"])
    assert "Traceback" not in result.output and result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert errors and f"d.jsonl line {BAD_AFTER + 1} is not JSON" in errors[0], result.output
    assert lensdiv.load_run(tmp_path / "cli").manifest["timings"]["tokens"] == tokens
    assert not _readers()


def test_a_pass_that_ends_early_leaves_no_reader() -> None:
    """Every analyzer failed at batch 0: the pass stops, and so does the reader."""
    run = lensdiv.analyze("toy", plugins=[Count(fail_at=0)], max_tokens=10**7, **SMALL)
    assert "stop here" in run.errors["count"]
    assert not _readers()


def test_ctrl_c_while_the_data_is_slow_stops_after_the_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT while the model waits for a slow tokenizer: the run stops after the next batch,
    keeps what it counted, and leaves no reader behind."""
    from lensdiv.data import packing

    encode = packing._encode

    def slow(tokenizer: Any, texts: list[str]) -> list[list[int]]:
        time.sleep(0.3)
        return encode(tokenizer, texts)

    @dataclass(frozen=True)
    class Interrupting(Count):
        def update(self, state: Stats, step: Any) -> None:
            if step.batch.index == 0:  # Ctrl-C soon, while the model waits for the data
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
            super().update(state, step)

    monkeypatch.setattr(packing, "_encode", slow)
    run = lensdiv.analyze("toy", plugins=[Interrupting()], max_tokens=10**7,
                          out=tmp_path / "run", **SMALL)
    assert run.manifest["status"] == "interrupted" and run.manifest["signal"] == "SIGINT"
    assert run["count"].table()["n"] == [run.manifest["timings"]["tokens"]] != [0]
    assert not _readers()


def test_the_private_copy_is_kept_while_the_tokenizer_is_the_same() -> None:
    """A run's reader copies the tokenizer once (a 50k-token copy costs a few hundred ms a run):
    the next run on the same, unchanged tokenizer reuses the copy, padding or truncation the
    caller's calls left set change nothing, and a changed tokenizer is copied again."""
    import copy

    from lensdiv.data import prefetch

    tokenizer = copy.deepcopy(byte_tokenizer())  # this test's own
    spec = DataSpec(max_tokens=500, seq_len=32, batch_size=2)
    first = prefetch._private_copy(tokenizer)
    assert first is not tokenizer and prefetch._private_copy(tokenizer) is first
    tokenizer(["a", "bcd"], padding=True, truncation=True, max_length=2)  # the caller's own use
    assert prefetch._private_copy(tokenizer) is first
    assert _plain(ready_batches(spec, tokenizer)) == _plain(token_batches(spec, byte_tokenizer()))
    tokenizer.add_tokens(["the cat"])  # other ids: a new copy, tokenising as the tokenizer does
    second = prefetch._private_copy(tokenizer)
    assert second is not first and len(second) == len(tokenizer)
    docs = ["the cat sleeps"] * 40
    spec = DataSpec.from_data(docs, max_tokens=500, seq_len=32, batch_size=2)
    changed = _plain(ready_batches(spec, tokenizer))
    assert changed == _plain(token_batches(spec, tokenizer)) != _plain(token_batches(spec, byte_tokenizer()))
