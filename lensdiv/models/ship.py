"""Refresh the default toy shipped with the package (for maintainers; ``make ship-toy``).

``python -m lensdiv.models.ship`` trains ``toy`` with its default recipe into a temporary cache,
records the digest of its first :data:`~lensdiv.models.toy.PREFIX_STEPS` steps (``prefix.json``:
what ``tests/test_toy.py`` reproduces in seconds, bit for bit on the platform named there), and
puts the entry into ``lensdiv/models/shipped/`` in place of any other, saying whether the weights
are those it replaces. ``--entry FOLDER`` ships an entry already trained (of the same key)
instead of training again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lensdiv.core.bridge import Bridge
from lensdiv.models.entries import COMPLETE as _COMPLETE
from lensdiv.models.entries import sha256_file as _sha256
from lensdiv.models.entries import verify_entry
from lensdiv.models.toy import (
    _PREFIX,
    PREFIX_STEPS,
    SHIPPED,
    WEIGHTS,
    TrainRecipe,
    build,
    entry_name,
    load_weights,
    parse_toy,
    train_toy,
)

_FILES = ("recipe.json", "train_log.json", "loss.png")


def weights_digest(model: Bridge) -> str:
    """sha256 of a model's weights (every name of its state, sorted, and its bytes): equal
    digests are bit-for-bit equal weights."""
    import hashlib

    digest = hashlib.sha256()
    for name, value in sorted(model.original_model.state_dict().items()):
        digest.update(name.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def platform_tag() -> dict[str, Any]:
    """What decides whether training gives the same bits: torch's version, the processor, the
    vector instructions torch's kernels use on it (``AVX2``, ``AVX512``: the same ``x86_64``
    gives other bits with other ones) and torch's threads."""
    import torch

    return {
        "torch": torch.__version__.split("+")[0],
        "machine": platform.machine(),
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def prefix_digest(progress: bool = False) -> str:
    """The digest of the default toy after :data:`PREFIX_STEPS` steps of its default recipe."""
    spec = parse_toy("toy")
    model, _ = train_toy(
        spec, TrainRecipe(), progress=progress, save=False, stop_after=PREFIX_STEPS
    )
    return weights_digest(model)


def ship(entry: Path | None = None, *, progress: bool = True) -> Path:
    """Train (or take ``entry``) the default toy and make it the shipped entry; returns it."""
    if os.environ.get("LENSDIV_TOY_STEPS"):
        raise SystemExit("unset LENSDIV_TOY_STEPS: the shipped toy has the default recipe")
    spec, recipe = parse_toy("toy"), TrainRecipe()
    name = entry_name(spec, recipe)
    with tempfile.TemporaryDirectory(prefix="lensdiv-ship-") as tmp:
        if entry is None:
            os.environ["LENSDIV_CACHE"] = tmp
            model, _ = train_toy(spec, recipe, progress=progress)
            entry = Path(tmp) / "toy" / name
        if entry.name != name or verify_entry(entry) is not None:
            raise SystemExit(f"{entry} is no verified entry of {name}")
        model = build(spec)
        load_weights(model, entry)
        staged = Path(tmp) / "staged"
        staged.mkdir()
        from safetensors.torch import save_model

        save_model(model.original_model, str(staged / WEIGHTS))
        for kept in _FILES:
            shutil.copy2(entry / kept, staged / kept)
        prefix = {"steps": PREFIX_STEPS, "sha256": prefix_digest(progress), **platform_tag()}
        (staged / _PREFIX).write_text(json.dumps(prefix, indent=1))
        files = [WEIGHTS, "recipe.json", "train_log.json", _PREFIX]
        (staged / _COMPLETE).write_text(
            json.dumps({"sha256": {f: _sha256(staged / f) for f in files}})
        )
        before = _shipped_digests()
        for old in SHIPPED.iterdir() if SHIPPED.is_dir() else ():
            if old.is_dir():
                shutil.rmtree(old)
        SHIPPED.mkdir(exist_ok=True)
        shutil.copytree(staged, SHIPPED / name)
        for shipped in (SHIPPED / name).iterdir():
            shipped.chmod(0o644)  # package data, readable by all (safetensors writes 0600)
    now = weights_digest(model)
    if not before:
        print(f"shipped {SHIPPED / name}")
    else:
        same = "the same weights as" if now in before else "new weights, not those of"
        print(f"shipped {SHIPPED / name}: {same} the entry it replaces")
    return SHIPPED / name


def _shipped_digests() -> set[str]:
    digests = set()
    for folder in SHIPPED.iterdir() if SHIPPED.is_dir() else ():
        if (folder / WEIGHTS).is_file():
            model = build(parse_toy("toy"))
            load_weights(model, folder)
            digests.add(weights_digest(model))
    return digests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entry", type=Path, help="ship this trained cache entry instead")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    ship(args.entry, progress=not args.no_progress)


if __name__ == "__main__":
    main()
