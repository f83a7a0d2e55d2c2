"""Data-parallel runs under ``torch.distributed``: every process (rank) feeds its share of the
batches, and the analyzers' states are all-reduced at the end of every pass.

Launched by ``torchrun`` (``torchrun --nproc-per-node 8 -m lensdiv analyze ...``), the command
line joins the process group the launcher describes (:func:`launched_world`; gloo on CPU, NCCL
on GPU); from Python, :func:`lensdiv.analyze` called inside an initialised process group does
the same. The run then goes like this:

- **Batches**: every rank reads the same stream (packing is sequential, so each rank tokenises
  all of it) and runs batch ``i`` when ``i mod world == rank``; uneven counts and ranks without
  a batch are fine. Ranks move in *rounds* of ``world`` batches and agree at the end of each
  round, with one all-reduce of a status code, whether every rank is fine: a rank that failed
  (exception, out of memory) stops every rank after that round with one line naming it
  (:class:`~lensdiv.core.errors.RankError`), and Ctrl-C (SIGINT, which ``torchrun`` forwards)
  stops every rank at the same round, so the states can still be combined and the partial
  results written, as in one process.
- **States** (:func:`reduce_states`): at the end of every pass, the ranks first exchange what
  their states hold (:meth:`~lensdiv.core.stats.Stats.summary`: names, kinds, shapes, fixed
  values, sets, rows) and which analyzers failed. An analyzer that failed on any rank fails on
  all; one whose states disagree (names of one kind here and another there, shapes, fixed
  values, a row recorded twice) fails with the difference. The rest follows the merge rules of
  :mod:`lensdiv.core.stats`, the same that merge saved shards: a name that a rank lacks (a rank
  without a batch has an empty state) is created as its rule's identity, every sum, maximum and
  minimum not frozen by earlier passes is all-reduced in float64 with its rule's collective,
  and fixed values, sets and rows are folded with their rule. Every rank ends the pass with the
  state one process would have had, so ``start_pass`` (a fit) and the next pass work as in
  one process.
- **Output**: rank 0 alone shows progress (with the world's tokens/s), finalizes and writes;
  the manifest records the world size, backend, devices and per-rank timings.
- **Faults**: collectives time out (``timeout_s``) instead of waiting for a dead or stuck rank
  for ever; a failed collective is a :class:`~lensdiv.core.errors.RankError` too. Under
  ``torchrun`` a rank that dies outright (killed, segfault) makes the launcher stop the others.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from itertools import islice
from typing import Any, final

import torch

from lensdiv.core.analyzer import Batch
from lensdiv.core.errors import DataError, LensdivError, RankError, StateError
from lensdiv.core.stats import Stats, plan_reduce
from lensdiv.run.engine import Engine, describe
from lensdiv.run.feed import Feed, OnBatch
from lensdiv.run.interrupts import interruption, signals_received

# Collective timeout of a process group the command line creates: long enough for the slowest
# rank to load a large model before the first collective, short of hanging for ever.
DEFAULT_TIMEOUT_S = 1800.0
# Round status codes (all-reduced with MAX: the worst wins).
OK, INTERRUPTED, STOPPED, FAILED = 0, 1, 2, 3


@dataclass(frozen=True)
class World:
    """The processes of one run.

    Args:
        rank: This process's rank (0 finalizes and writes).
        size: Number of processes.
        local_rank: Rank on this node (which GPU it uses).
        backend: ``"gloo"``, ``"nccl"``, or ``"none"`` for a single process.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str = "none"

    @property
    def main(self) -> bool:
        """Whether this process finalizes, writes and shows progress."""
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        """More than one process."""
        return self.size > 1

    def comm_device(self) -> torch.device:
        """Where tensors of collectives live: the rank's GPU for NCCL, else the CPU."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def default_device(self) -> str:
        """The device a rank's model goes on when none is given: its GPU, else the CPU."""
        if torch.cuda.is_available():
            return f"cuda:{self.local_rank % torch.cuda.device_count()}"
        return "cpu"


def current_world() -> World:
    """The initialised process group this process belongs to, or a world of one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return World()
    return World(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        backend=str(dist.get_backend()),
    )


def launched() -> bool:
    """Whether a launcher (``torchrun``, or ``srun`` with the variables set) started this
    process as one of several: ``WORLD_SIZE`` above 1 in the environment."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


@contextmanager
def launched_world(timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[World]:
    """Join the process group a launcher described in the environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) for the duration of the block; without a
    launcher, or inside a group already initialised, a plain :func:`current_world`.

    NCCL when CUDA is available (each rank on GPU ``LOCAL_RANK``), gloo otherwise. On leaving
    normally the ranks meet at a barrier before the group is destroyed.
    """
    import torch.distributed as dist

    if not launched() or dist.is_initialized():
        yield current_world()
        return
    if timeout_s <= 0:
        raise LensdivError(f"the collective timeout must be positive, got {timeout_s:g} s")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    clean = False
    try:
        yield current_world()
        clean = True
    finally:
        if clean:
            try:
                dist.barrier()
            except Exception:  # a rank gone at the very end: nothing left to wait for
                clean = False
        if clean or backend == "gloo":  # NCCL teardown may block on a rank that is gone
            dist.destroy_process_group()


# -- collectives ---------------------------------------------------------------------------------


def _collective(world: World, what: str, call: Callable[[], Any]) -> Any:
    """Run a collective; a failure (a timeout, a rank gone) becomes one :class:`RankError`."""
    try:
        return call()
    except RankError:
        raise
    except Exception as err:  # DistBackendError, gloo's RuntimeError on timeout or a lost peer
        raise RankError(
            f"rank {world.rank} of {world.size} lost the other ranks during {what} "
            f"({describe(err)})",
            hint="another rank died or hangs: see its log; raise --dist-timeout if it was "
            "only slow",
        ) from None


def gather_objects(world: World, value: Any, what: str) -> list[Any]:
    """``value`` of every rank, in rank order (``all_gather_object``: plain Python data)."""
    import torch.distributed as dist

    if not world.parallel:
        return [value]
    out: list[Any] = [None] * world.size
    _collective(world, what, lambda: dist.all_gather_object(out, value))
    return out


def all_reduce(world: World, tensor: torch.Tensor, op: str, what: str) -> None:
    """All-reduce ``tensor`` in place with ``"sum"``, ``"max"`` or ``"min"`` (moved to the
    backend's device and back when it lives elsewhere)."""
    import torch.distributed as dist

    if not world.parallel:
        return
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    buffer = tensor.to(world.comm_device()).contiguous()
    _collective(world, what, lambda: dist.all_reduce(buffer, op=reduce_op))
    if buffer is not tensor:
        tensor.copy_(buffer.view_as(tensor))


def agree(world: World, code: int, message: str = "") -> list[tuple[int, int, str]]:
    """Every rank's status of a round: ``[(rank, code, message)]`` of the ranks that are not
    fine (empty when all are). One all-reduce of the worst code; the messages are gathered
    only when some rank has one."""
    flag = torch.tensor([code], dtype=torch.int64, device=world.comm_device())
    all_reduce(world, flag, "max", "a status exchange")
    if int(flag.item()) == OK:
        return []
    statuses = gather_objects(world, (code, message), "a status exchange")
    return [(rank, c, m) for rank, (c, m) in enumerate(statuses) if c != OK]


# -- states --------------------------------------------------------------------------------------


def reduce_states(world: World, engine: Engine, index: int, states: Mapping[str, Stats]) -> None:
    """Combine the ranks' states of every analyzer of pass ``index`` (see the module
    docstring): one exchange of every analyzer's failure or :meth:`Stats.summary`, then per
    analyzer the :func:`~lensdiv.core.stats.plan_reduce` every rank derives alike and
    :meth:`Stats.reduce` with this group's all-reduce. Analyzers that failed on a rank, or
    whose states disagree, fail on every rank.
    """
    if not world.parallel:
        return
    # Every analyzer of the pass, failed ones too: every rank sends the same keys.
    group = [a for a in engine.analyzers if a.n_passes(engine.info) > index]
    failures = engine.failures
    mine: dict[str, Any] = {}
    for a in group:
        failure = failures.get(a.name)
        state = states.get(a.name)
        summary = state.summary() if failure is None and state is not None else None
        mine[a.name] = (failure, summary)
    everyone = gather_objects(world, mine, f"the exchange of states after pass {index + 1}")
    for a in group:
        failed = [(r, theirs[a.name][0]) for r, theirs in enumerate(everyone)]
        failed = [(r, message) for r, message in failed if message]
        if failed:
            rank, message = failed[0]
            engine.fail(a, f"{message} (on rank {rank})")
            continue
        try:
            plan = plan_reduce([theirs[a.name][1] for theirs in everyone])
        except StateError as err:
            engine.fail(a, err, f"end of pass {index + 1}")
            continue
        states[a.name].reduce(
            plan, _all_reduce_in(world, f"the reduction of {a.name!r}"), world.comm_device()
        )


def _all_reduce_in(world: World, what: str) -> Callable[[torch.Tensor, str], None]:
    """:func:`all_reduce` in ``world`` as :meth:`Stats.reduce` calls it."""

    def call(tensor: torch.Tensor, op: str) -> None:
        all_reduce(world, tensor, op, what)

    return call


# -- feeding ---------------------------------------------------------------------------------------


@dataclass
class RankTimes:
    """Seconds and tokens of one rank, for the manifest.

    Args:
        busy_s: Feeding its batches (forward passes and updates).
        wait_s: Waiting for the other ranks (status exchanges and reductions).
        tokens: Real tokens of the batches it ran (pass 0 of every group).
        batches: Batches it ran (every pass).
    """

    busy_s: float = 0.0
    wait_s: float = 0.0
    tokens: int = 0
    batches: int = 0


@final
class DataParallelFeed(Feed):
    """Batch ``i`` on rank ``i mod world``, in lock-step rounds; states reduced every pass.

    Args:
        world: The process group.
        device: This rank's device (recorded in the manifest).
    """

    def __init__(self, world: World, device: str) -> None:
        self.world = world
        self.device = device
        self.times = RankTimes()
        if world.backend == "nccl" and device.startswith("cuda"):
            # NCCL's collectives of Python objects run on the current device: the rank's own.
            torch.cuda.set_device(torch.device(device))

    @property
    def finalizes(self) -> bool:
        """Rank 0 alone finalizes and writes."""
        return self.world.main

    def start(self) -> None:
        """Wait until every rank has loaded its model (one exchange)."""
        started = time.perf_counter()
        gather_objects(self.world, self.world.rank, "the start of the run")
        self.times.wait_s += time.perf_counter() - started

    def run_pass(
        self,
        engine: Engine,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: OnBatch | None = None,
    ) -> None:
        """Pass ``index``: this rank's share of ``batches``, then the reduction of the states.

        Raises:
            RankError: A rank failed; the pass's analyzers fail on every rank.
            KeyboardInterrupt: Some rank was interrupted; the states are reduced first.
            DataError: Bad data met mid-way; the states are reduced first.
        """
        try:
            stop, local_error = self._rounds(engine, index, batches, states, on_batch)
        except RankError as err:  # a rank failed, or a collective did: nothing more to reduce
            engine.fail_pass(index, f"stopped: {err}")  # earlier passes' results are written
            raise
        if stop is None:
            return
        code, message = stop
        if code == STOPPED:
            raise local_error or DataError(message)
        raise interruption(signals_received()[0]) if signals_received() else KeyboardInterrupt()

    def _rounds(
        self,
        engine: Engine,
        index: int,
        batches: Iterable[Batch],
        states: Mapping[str, Stats],
        on_batch: OnBatch | None,
    ) -> tuple[tuple[int, str] | None, LensdivError | None]:
        """Feed this rank's share round by round, then reduce; return why the ranks stopped
        early (``(code, message)``) and this rank's own data error, if any."""
        world, stream = self.world, iter(batches)
        own_tokens = 0
        stop: tuple[int, str] | None = None
        local_error: LensdivError | None = None
        with _interrupt_flag() as interrupted:
            while stop is None:
                code, message = OK, ""
                try:
                    round_ = list(islice(stream, world.size))
                except LensdivError as err:  # bad data met mid-way (every rank reads it)
                    round_, code, message, local_error = [], STOPPED, str(err), err
                mine = round_[world.rank : world.rank + 1]
                if mine and code == OK:
                    started, before = time.perf_counter(), engine.tokens
                    try:
                        engine.feed(index, mine, states)
                    except LensdivError as err:
                        code, message, local_error = STOPPED, str(err), err
                    except Exception as err:  # out of memory, a broken forward: stop every rank
                        code, message = FAILED, describe(err)
                    self.times.busy_s += time.perf_counter() - started
                    self.times.batches += 1
                    own_tokens += engine.tokens - before
                if interrupted():
                    code = max(code, INTERRUPTED)
                started = time.perf_counter()
                trouble = agree(world, code, message)
                self.times.wait_s += time.perf_counter() - started
                failed = [(r, m) for r, c, m in trouble if c == FAILED]
                if failed:
                    rank, why = failed[0]
                    raise RankError(f"rank {rank} of {world.size} failed: {why}")
                if trouble:
                    worst = max(c for _, c, _ in trouble)
                    stop = (worst, next(m for _, c, m in trouble if c == worst))
                    break
                if on_batch is not None:
                    for batch in round_:
                        on_batch(batch)
                if not round_:
                    break
        self._reduce(engine, index, states, own_tokens)
        return stop, local_error

    def _reduce(
        self,
        engine: Engine,
        index: int,
        states: Mapping[str, Stats],
        own_tokens: int,
    ) -> None:
        started = time.perf_counter()
        if engine.counts(index):  # the world's tokens, as one process would have counted them
            total = torch.tensor([own_tokens], dtype=torch.int64, device=self.world.comm_device())
            all_reduce(self.world, total, "sum", "the count of tokens")
            engine.count_tokens(int(total.item()) - own_tokens)  # the other ranks' tokens
            self.times.tokens += own_tokens
        reduce_states(self.world, engine, index, states)
        self.times.wait_s += time.perf_counter() - started

    def describe(self) -> dict[str, Any]:
        return {
            "distributed": {
                "world_size": self.world.size,
                "backend": self.world.backend,
                "rank_of_batch": "batch i runs on rank i mod world_size",
            }
        }

    def close(self, manifest: dict[str, Any]) -> None:
        mine = {
            "rank": self.world.rank,
            "device": self.device,
            "host": os.uname().nodename if hasattr(os, "uname") else "",
            "busy_s": round(self.times.busy_s, 3),
            "wait_s": round(self.times.wait_s, 3),
            "tokens": self.times.tokens,
            "batches": self.times.batches,
        }
        ranks = gather_objects(self.world, mine, "the exchange of timings")
        entry = manifest.setdefault("distributed", {})
        entry["devices"] = [r["device"] for r in ranks]
        entry["ranks"] = ranks


@contextmanager
def _interrupt_flag() -> Iterator[Callable[[], bool]]:
    """While feeding, Ctrl-C (SIGINT) only raises a flag the next status exchange reads, so
    every rank stops at the same round; a second Ctrl-C stops this rank at once."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    hits: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(hits) or bool(signals_received())  # SIGTERM: lensdiv's own handler
    finally:
        signal.signal(signal.SIGINT, previous)
