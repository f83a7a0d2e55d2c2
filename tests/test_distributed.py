"""Data parallel runs: two gloo processes give the one-process results; faults stop every rank.

The multi-process tests start real processes (``multiprocessing`` from a fork server, a real
gloo process group through a file store, one thread each), as ``torchrun`` would, plus one run
of ``torchrun`` itself. The reduction logic (``plan_reduce`` of the state summaries) is also tested on its own.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from lensdiv.core.analyzer import Analyzer, ModelInfo, Step
from lensdiv.core.errors import LensdivError, RankError, StateError
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats, plan_reduce
from lensdiv.data.sources import DataSpec
from lensdiv.lenses.affine import AffineFit
from lensdiv.lenses.jacobian import JacobianFit
from lensdiv.run.distributed import World, current_world
from lensdiv.run.runner import analyze, load_run
from lensdiv.testing.contract import assert_results_close
from lensdiv.testing.models import save_tiny_model

EVERY = "lens,contrib,patch,linmap,skip,depth-score,bias,submod,dynamics"
# Small task sets and few integration steps keep every analyzer to about a second; batch sizes
# give several batches each, so the examples split between the ranks too.
OPTIONS = {
    "patch": {"ig_steps": "8", "batch_size": "2"},
    "depth-score": {"per_grade": "3", "batch_size": "4"},
    "submod": {"samples": "8", "greedy": "3"},
    "skip": {"splits": "2"},
}
# The lens analyzer read through the patchscope lens (its inspection prompt's prefix cached on
# each rank) and the patchscope sweep.
SCOPES = "lens,patchscope"
# The lens fits of lensdiv.lenses: analyzers whose states are summed Jacobians and moments.
LENS_FITS = [JacobianFit(skip_first=4), AffineFit()]
# 3 batches of 2 rows of 24 tokens, the last short and padded: an odd count for 2 ranks.
SPEC = DataSpec(seq_len=24, max_tokens=24 * 5 + 9, batch_size=2)
# Rows of the probe forward pass that validation makes before a run (not a batch of the data).
PROBE_TOKENS = 8
# One batch: rank 1 has nothing to do.
ONE_BATCH = DataSpec(seq_len=24, max_tokens=40, batch_size=2)
# Long enough that a fault or Ctrl-C always arrives mid-run.
LONG = DataSpec(seq_len=24, max_tokens=24 * 20000, batch_size=2)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("dist") / "llama")


@dataclass(frozen=True)
class FailsOnRankOne(Analyzer):
    """Fails on rank 1 only (its batch 1), so it must fail on every rank."""

    name = "fails-on-one"

    def hooks(self, info: ModelInfo) -> list[str]:
        return []

    def update(self, state: Stats, step: Step) -> None:
        import torch.distributed as dist

        state.add("n", step.batch.n_tokens)
        if dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("only rank 1 fails")

    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return Result(self.name, "")


# -- what each rank runs (in a process of its own) -------------------------------------------------


def _rank_main(rank: int, world: int, store: str, scenario: str, model: str, out: str,
               timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    code = 0
    try:
        if scenario == "lenses":
            analyze(model, data=SPEC, plugins=LENS_FITS, out=f"{out}/lenses", progress=False)
        elif scenario == "equal":
            analyze(model, data=SPEC, plugins=EVERY, options=OPTIONS, out=f"{out}/every",
                    progress=False)
            analyze(model, data=ONE_BATCH, plugins="lens,contrib", out=f"{out}/idle",
                    progress=False)
            analyze(model, data=SPEC, plugins=SCOPES, lens="patchscope", out=f"{out}/scope",
                    progress=False)
            analyze(model, data=SPEC, plugins=[FailsOnRankOne(), "contrib"], out=f"{out}/fails",
                    progress=False)
        else:
            from lensdiv.models.load import load_model

            bridge = load_model(model, device="cpu")
            if rank == 1:
                calls = []

                def fault(module: Any, args: Any) -> None:
                    if args[0].shape[1] == PROBE_TOKENS:  # the check that the model runs
                        return
                    calls.append(1)
                    if scenario == "hang" and len(calls) == 3:  # a few batches in: stuck
                        time.sleep(300)
                    if scenario == "raise" and len(calls) == 2:  # its batch of the 2nd pass
                        raise RuntimeError("CUDA out of memory (simulated)")

                bridge.blocks[1].register_forward_pre_hook(fault)
            if scenario == "hang":
                analyze(bridge, data=LONG, plugins="lens,contrib", progress=False)
            else:  # contrib is done after pass 1, linmap needs a second pass
                if rank == 1:  # a rank that starts late must not find rank 0's run in --out
                    time.sleep(3)
                analyze(bridge, data=SPEC, plugins="contrib,linmap", out=f"{out}/run",
                        progress=False)
    except LensdivError as err:
        Path(out, f"rank{rank}.txt").write_text(str(err))
        code = err.exit_code
    finally:
        dist.destroy_process_group()
    sys.exit(code)


def _launch(tmp: Path, scenario: str, model: Path, *, timeout_s: float = 600.0) -> list[Any]:
    # A fork server that has imported torch, TransformerLens and lensdiv once starts every rank
    # of every test in a moment (spawning pays those imports, ~5 s, per process).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_distributed"])
    procs = [
        ctx.Process(target=_rank_main, args=(rank, 2, str(tmp / "store"), scenario, str(model),
                                             str(tmp), timeout_s))
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    return procs


def _join(procs: list[Any], limit: float) -> float:
    """Wait for every process (at most ``limit`` seconds); return the seconds it took."""
    started = time.monotonic()
    for p in procs:
        p.join(max(0.0, limit - (time.monotonic() - started)))
    return time.monotonic() - started


# -- the same results as one process --------------------------------------------------------------


def test_two_ranks_give_the_results_of_one_process(llama_dir: Path, tmp_path: Path) -> None:
    procs = _launch(tmp_path, "equal", llama_dir)
    # Meanwhile, the same runs in this process.
    one = analyze(str(llama_dir), data=SPEC, plugins=EVERY, options=OPTIONS, progress=False)
    idle = analyze(str(llama_dir), data=ONE_BATCH, plugins="lens,contrib", progress=False)
    scope = analyze(str(llama_dir), data=SPEC, plugins=SCOPES, lens="patchscope", progress=False)
    _join(procs, 300)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    for name, single in (("every", one), ("idle", idle), ("scope", scope)):
        two = load_run(tmp_path / name)
        assert not single.errors and not two.errors, (single.errors, two.errors)
        assert sorted(two.results) == sorted(single.results)
        for analyzer, result in single.results.items():
            # Sums over ranks in another order: last bits only; counts and settings exact.
            assert_results_close(two[analyzer], result, rtol=1e-6, what=f"{name}: {analyzer}")
        manifest = two.manifest
        assert manifest["status"] == "complete"
        dist = manifest["distributed"]
        assert (dist["world_size"], dist["backend"], dist["devices"]) == (2, "gloo", ["cpu"] * 2)
        assert manifest["world_size"] == 2
        ranks = dist["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        own = sum(e.get("tokens", 0) for e in manifest["analyzers"].values())  # task examples
        assert sum(r["tokens"] for r in ranks) == manifest["timings"]["tokens"] + own
        assert manifest["model_info"]["n_layers"] == 3
    every = load_run(tmp_path / "every").manifest["distributed"]["ranks"]
    assert all(r["batches"] > 0 and r["busy_s"] > 0 for r in every)
    # Batch i on rank i mod 2: of 3 corpus batches, rank 0 ran 2 and rank 1 one (pass 0).
    idle_ranks = load_run(tmp_path / "idle").manifest["distributed"]["ranks"]
    assert [r["batches"] for r in idle_ranks] == [1, 0]
    assert idle_ranks[1]["tokens"] == 0
    # An analyzer that failed on rank 1 failed everywhere; the others finished.
    fails = load_run(tmp_path / "fails")
    assert fails.errors == {"fails-on-one": "ValueError: only rank 1 fails (batch 1) (on rank 1)"}
    assert_results_close(fails["contrib"], one["contrib"], rtol=1e-6, what="contrib beside")
    # Rank 1 wrote nothing: rank 0 alone writes.
    assert {p.name for p in tmp_path.iterdir()} - {"store"} == {"every", "idle", "scope", "fails"}


def test_two_ranks_fit_the_lenses_of_one_process(llama_dir: Path, tmp_path: Path) -> None:
    """The Jacobian and affine lens files of 2 gloo processes equal one process's."""
    from lensdiv.ops.lens_specs import read_jacobian, read_tuned

    procs = _launch(tmp_path, "lenses", llama_dir)
    one = analyze(str(llama_dir), data=SPEC, plugins=LENS_FITS, out=tmp_path / "one",
                  progress=False)
    _join(procs, 300)
    assert [p.exitcode for p in procs] == [0, 0], [p.exitcode for p in procs]
    two = load_run(tmp_path / "lenses")
    assert one.ok and two.ok, (one.errors, two.errors)
    read = {"fit-jacobian": (read_jacobian, "jacobian_lens.pt"),
            "fit-affine": (read_tuned, "affine_lens")}
    for name, (reader, file) in read.items():
        a, b = reader(tmp_path / "one" / name / file), reader(tmp_path / "lenses" / name / file)
        assert sorted(a.maps) == sorted(b.maps)
        for index in a.maps:
            torch.testing.assert_close(b.maps[index].weight, a.maps[index].weight, rtol=1e-5,
                                       atol=1e-6)
    assert two["fit-jacobian"].meta["prompts"] == one["fit-jacobian"].meta["prompts"]


# -- faults ---------------------------------------------------------------------------------------


def test_a_failing_rank_stops_every_rank_with_one_line(llama_dir: Path, tmp_path: Path) -> None:
    procs = _launch(tmp_path, "raise", llama_dir)
    took = _join(procs, 60)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert took < 60, "a rank did not stop"
    assert [p.exitcode for p in procs] == [RankError.exit_code] * 2
    for rank in range(2):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        assert "\n" not in line
        assert line == "rank 1 of 2 failed: RuntimeError: CUDA out of memory (simulated)"
    # What finished in an earlier pass is on disk; the rest failed with the rank's error.
    run = load_run(tmp_path / "run")
    assert run.manifest["status"] == "failed"
    assert run.manifest["error"] == line
    assert sorted(run.results) == ["contrib"]
    assert run.results["contrib"].meta["tokens"] == 129  # every token of the run
    assert run.errors == {"linmap": f"stopped: {line}"}


def test_a_stuck_rank_times_out_instead_of_hanging(llama_dir: Path, tmp_path: Path) -> None:
    procs = _launch(tmp_path, "hang", llama_dir, timeout_s=6)
    rank0, rank1 = procs
    rank0.join(90)
    alive = rank0.is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(10)
    assert not alive, "rank 0 waited for the stuck rank for ever"
    assert rank0.exitcode == RankError.exit_code
    line = (tmp_path / "rank0.txt").read_text()
    assert line.startswith("rank 0 of 2 lost the other ranks during a status exchange")
    assert "--dist-timeout" in line and "\n" not in line


def test_ctrl_c_under_torchrun_stops_every_rank_and_keeps_partial_results(
    llama_dir: Path, tmp_path: Path
) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    out = tmp_path / "run"
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "lensdiv",
               "analyze", str(llama_dir), "--plugins", "lens,contrib", "--seq-len", "24",
               "--batch-size", "2", "--max-tokens", str(LONG.max_tokens), "--out", str(out),
               "--no-progress"]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "manifest.json").is_file():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(1.0)  # some batches in
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, output
    run = load_run(out)
    manifest = run.manifest
    assert manifest["status"] == "interrupted", output
    assert manifest["distributed"]["world_size"] == 2
    assert sorted(run.results) == ["contrib", "lens"]
    assert all(r.meta["partial"] for r in run.results.values())
    assert 0 < manifest["timings"]["tokens"] < LONG.max_tokens
    # Both ranks stopped at the same round and were reduced: their tokens add up.
    assert sum(r["tokens"] for r in manifest["distributed"]["ranks"]) == manifest["timings"]["tokens"]


# -- the reduction, rule by rule ------------------------------------------------------------------


def _state(**entries: Any) -> Stats:
    state = Stats()
    for name, (kind, value) in entries.items():
        getattr(state, {"sum": "add", "max": "max", "min": "min", "fixed": "fix"}[kind])(name, value)
    return state


def test_plan_reduce_creates_what_an_idle_rank_lacks_and_unites_the_rest() -> None:
    busy = _state(n=("sum", 3.0), top=("max", torch.ones(2)), k=("fixed", {"mode": "a"}))
    busy.include("grades", "1-hop")
    busy.append("pairs", 4, {"x": 1})
    other = _state(n=("sum", 1.0), k=("fixed", {"mode": "a"}))
    other.include("grades", "2-hop")
    other.append("pairs", 7, {"x": 2})
    plan = plan_reduce([s.summary() for s in (busy, Stats(), other)])
    assert plan.tensors == [("max", "top", (2,)), ("sum", "n", ())]
    assert plan.values == {
        "k": ("fixed", {"mode": "a"}),
        "grades": ("set", {"1-hop", "2-hop"}),
        "pairs": ("rows", {4: {"x": 1}, 7: {"x": 2}}),
    }


@pytest.mark.parametrize("a, b, message", [
    (_state(n=("sum", 1.0)), _state(n=("max", 1.0)), "'n' is a sum on rank 0 and a max on rank 1"),
    (_state(v=("sum", torch.ones(2))), _state(v=("sum", torch.ones(3))),
     "'v' has shape (2,) on rank 0 and (3,) on rank 1"),
    (_state(k=("fixed", 1)), _state(k=("fixed", 2)), "ranks 0 and 1 disagree on 'k'"),
])
def test_plan_reduce_refuses_states_that_disagree(a: Stats, b: Stats, message: str) -> None:
    with pytest.raises(StateError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_reduce([a.summary(), b.summary()])


def test_plan_reduce_refuses_a_row_on_two_ranks_and_different_passes() -> None:
    a, b = Stats(), Stats()
    a.append("rows", 1, 0)
    b.append("rows", 1, 0)
    with pytest.raises(StateError, match=r"row 1 of 'rows' is on two ranks \(0\.\.1\)"):
        plan_reduce([a.summary(), b.summary()])
    a.freeze()
    c = _state(other=("sum", 1.0))
    with pytest.raises(StateError, match="finished different passes"):
        plan_reduce([a.summary(), c.summary()])


def test_frozen_entries_are_not_exchanged() -> None:
    state = _state(n=("sum", 2.0), fit=("fixed", torch.ones(3)))
    state.freeze()
    state.add("m", 1.0)
    summary = state.summary()
    assert summary["entries"] == {"m": ("sum", (), None)}


def test_one_process_is_a_world_of_one() -> None:
    world = current_world()
    assert world == World() and world.main and not world.parallel


def test_rank_errors_are_one_line_and_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    import lensdiv.run.runner as runner
    from lensdiv.cli import app

    def fail(*args: Any, **kwargs: Any) -> None:
        raise RankError("rank 1 of 2 failed: RuntimeError: CUDA out of memory")

    monkeypatch.setattr(runner, "analyze", fail)
    result = CliRunner().invoke(app, ["analyze", "toy", "--no-progress"])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["error: rank 1 of 2 failed: RuntimeError: CUDA out of memory"]


def test_manifest_of_one_process_records_the_model_facts(tmp_path: Path) -> None:
    from lensdiv.testing.models import boot_native_tiny

    run = analyze(boot_native_tiny(), data=ONE_BATCH, plugins="contrib", out=tmp_path,
                  progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "distributed" not in manifest and "shard" not in manifest
    assert manifest["world_size"] == 1
    assert manifest["model"]["device_map"] is None
    assert manifest["model_info"]["n_layers"] == run["contrib"].tables["contrib"].columns[
        "layer"][-1] + 1
