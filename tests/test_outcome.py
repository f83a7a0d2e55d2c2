"""What a run leaves behind: the manifest's final states, its shape check, and signal shields.

The end-to-end cases (real runs, real signals, full disks) are in ``tests/test_errors.py``; here
the rules themselves, one by one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from lensdiv.core.errors import DataError, ResultError
from lensdiv.run.interrupts import (
    Terminated,
    handle_signals,
    shielded,
    signals_received,
)
from lensdiv.run.outcome import FINAL, check_manifest, finish


def _manifest(*statuses: str) -> dict[str, Any]:
    return {"analyzers": {f"a{i}": {"status": s} for i, s in enumerate(statuses)}}


@pytest.mark.parametrize(
    "statuses,stopped,status",
    [
        (("complete", "complete"), None, "complete"),
        (("complete", "skipped"), None, "complete"),
        (("complete", "failed"), None, "partial"),
        (("failed", "skipped"), None, "failed"),
        (("partial", "running"), DataError("bad line"), "partial"),
        (("running", "pending"), RuntimeError("a bug"), "failed"),
        (("partial", "pending"), KeyboardInterrupt(), "interrupted"),
        (("complete", "pending"), Terminated(), "interrupted"),
    ],
)
def test_every_run_ends_in_a_final_state(
    statuses: tuple[str, ...], stopped: BaseException | None, status: str
) -> None:
    manifest = _manifest(*statuses)
    assert finish(manifest, stopped) == status == manifest["status"]
    assert status in FINAL
    for entry in manifest["analyzers"].values():
        assert entry["status"] in ("complete", "partial", "failed", "skipped", "interrupted")
        if entry["status"] == "failed" and stopped is not None:
            assert entry.get("error")
    if isinstance(stopped, KeyboardInterrupt):
        assert manifest["signal"] == ("SIGTERM" if isinstance(stopped, Terminated) else "SIGINT")
        assert "interrupted" in [e["status"] for e in manifest["analyzers"].values()]


@pytest.mark.parametrize("data", [[1], "x", {"analyzers": []}, {"analyzers": {"a": 1}},
                                  {"model": [], "analyzers": {}}])
def test_manifests_of_the_wrong_shape(data: Any) -> None:
    with pytest.raises(ResultError, match="manifest.json"):
        check_manifest(data, Path("run/manifest.json"))


def test_signals_wait_inside_a_shield_and_raise_outside() -> None:
    with handle_signals():
        with shielded():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # the handler has run: recorded, not raised
            assert signals_received() == [signal.SIGTERM]
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert signals_received() == []  # outside: nothing is recorded any more


def test_a_soft_shield_gives_way_to_the_second_signal() -> None:
    with handle_signals(), shielded(soft=True):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert signals_received() == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        with shielded():  # a strict shield inside: never raised
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
    assert len(signals_received()) == 0


def test_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with handle_signals():
        assert signal.getsignal(signal.SIGTERM) != before[1]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
