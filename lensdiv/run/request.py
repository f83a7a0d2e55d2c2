"""What :func:`~lensdiv.run.runner.analyze` was asked, every part checked before the model
loads (arguments, analyzers and their options, lens, split, data, output folder): the
:class:`Request` the runner runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lensdiv.core.analyzer import Analyzer
from lensdiv.core.errors import LensdivError, OptionError
from lensdiv.core.registry import make_analyzers
from lensdiv.core.settings import RunSettings
from lensdiv.data.sources import DataSpec, check_source
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.translators import LOGIT, Lens
from lensdiv.run.defaults import default_data
from lensdiv.run.distributed import World, current_world, gather_objects
from lensdiv.run.feed import Feed
from lensdiv.run.shards import parse_shard
from lensdiv.run.validate import check_arguments, check_output, warn_unread_lens


@dataclass(frozen=True)
class Request:
    """What ``analyze`` was asked, every part checked before the model loads: what the runner
    runs (``progress``: whether this process shows bars; ``part``: the shard to run, if any)."""

    model: Any
    spec: DataSpec
    analyzers: list[Analyzer]
    out_dir: Path | None
    device: Any
    dtype: Any
    threads: int | None
    seed: int
    trust_remote_code: bool
    progress: bool
    overwrite: bool
    placement: dict[str, Any]
    world: World
    part: tuple[int, int] | None
    feed: Feed | None
    translator: Lens = LOGIT


def check_request(
    model: Any,
    data: Any,
    plugins: Any,
    settings: RunSettings,
    *,
    out: str | Path | None,
    options: Mapping[str, Mapping[str, Any]] | None,
    threads: int | None,
    trust_remote_code: bool,
    progress: bool,
    overwrite: bool,
    placement: dict[str, Any],
    shard: str | tuple[int, int] | None,
    feed: Feed | None,
) -> Request:
    """Every check of ``analyze``'s arguments that needs no model, in the order the API
    promises (arguments, analyzers and their options, lens, split, data, output folder)."""
    device, dtype, seed = settings.device, settings.dtype, settings.seed
    flags = {"progress": progress, "trust_remote_code": trust_remote_code, "overwrite": overwrite}
    out_dir = check_arguments(out=out, device=device, seed=seed, flags=flags)
    if threads is not None and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise OptionError(f"threads must be a whole number of at least 1, not {threads!r}")
    analyzers = make_analyzers(plugins, options)
    translator = parse_lens(settings.lens)
    warn_unread_lens(translator, analyzers)
    world, part = split_of(shard)
    if feed is not None and (part is not None or world.parallel):
        raise LensdivError(
            "a feed and --shard or a process group (torchrun) are two ways to split one run",
            hint="use one",
        )
    if device is None and world.parallel:
        device = world.default_device()
    spec = DataSpec.from_data(data, default=default_data(model), **settings.data())
    check_source(spec)
    check_output_once(world, out_dir, analyzers, overwrite=overwrite)
    return Request(
        model,
        spec,
        analyzers,
        out_dir,
        device=device,
        dtype=dtype,
        threads=threads,
        seed=seed,
        trust_remote_code=trust_remote_code,
        progress=progress and world.main,
        overwrite=overwrite,
        placement=placement,
        world=world,
        part=part,
        feed=feed,
        translator=translator,
    )


def check_output_once(
    world: World, out_dir: Path | None, analyzers: list[Analyzer], *, overwrite: bool
) -> None:
    """``check_output`` on the rank that writes, its verdict shared with every rank.

    Only rank 0 writes ``--out``, so only it may judge it: a rank that started late would
    otherwise find rank 0's fresh manifest and refuse the folder as "already holds a run".
    The exchange is also the barrier that keeps rank 0 from writing before every rank is here.
    """
    if not world.parallel:
        check_output(out_dir, analyzers, overwrite=overwrite)
        return
    problem: LensdivError | None = None
    if world.main:
        try:
            check_output(out_dir, analyzers, overwrite=overwrite)
        except LensdivError as err:
            problem = err
    verdict = gather_objects(world, problem, "the check of --out")[0]
    if verdict is not None:
        raise verdict


def split_of(shard: str | tuple[int, int] | None) -> tuple[World, tuple[int, int] | None]:
    """The process group this run is part of (if any), and the shard to run (if any)."""
    world, split = current_world(), parse_shard(shard)
    if world.parallel and split is not None:
        raise LensdivError(
            "--shard and a process group (torchrun) are two ways to split one run",
            hint="use one: torchrun for a coordinated run, --shard I/N for independent jobs",
        )
    return world, split
