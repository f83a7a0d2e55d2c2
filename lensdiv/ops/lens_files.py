"""The file layouts of fitted lenses: what reads and writes them, in the formats of the tools that
define them (the kinds of lens that use them are in :mod:`lensdiv.ops.translators`).

- **tuned-lens's layout** (``tuned`` and ``affine`` lenses): a folder with ``config.json`` and
  ``params.pt`` (``"{i}.weight"``, ``"{i}.bias"`` of translator ``i``, which reads Hugging Face's
  ``hidden_states[i]`` = ``h_i`` as ``h + A_i h + b_i``). Written by one writer,
  :class:`TunedLensFolder` (an artifact a result carries; :func:`save_tuned` writes one at once);
  read by :func:`read_tuned_maps`, which also reads tuned-lens 0.0.x's ``layer_translators.``
  names. tuned-lens's ``TunedLens`` loads what it writes.
- **TransformerLens' Jacobian lens file** (``jacobian``): what ``JacobianLens.save`` writes;
  :class:`JacobianLensFile` / :func:`save_jacobian` write it with TransformerLens' own class,
  :func:`read_jacobian_maps` reads it with ``JacobianLens.load`` (layer ``k`` reads the output of
  block ``k`` = ``h_{k+1}``).

A reader returns the maps ``{residual index: Map}``, the width and the file's metadata; the
published lenses of the Hugging Face hub are fetched here too (never for a path: see
:func:`lensdiv.ops.translators.read_lens`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.errors import LensError
from lensdiv.core.results import Artifact

TUNED_CONFIG, TUNED_PARAMS = "config.json", "params.pt"
JACOBIAN_FILE = "jacobian_lens.pt"
# tuned-lens's published lenses: a Hugging Face *space*, one folder per model under lens/.
TUNED_HUB_REPO, TUNED_HUB_TYPE = "AlignmentResearch/tuned-lens", "space"
# The keys of tuned-lens's config.json that its writer sets (a lens' other metadata is kept).
_TUNED_KEYS = (
    "base_model_name_or_path",
    "d_model",
    "num_hidden_layers",
    "bias",
    "base_model_revision",
    "unembed_hash",
    "lens_type",
)


@dataclass(frozen=True, eq=False)
class Map:
    """One residual index's affine map.

    Args:
        weight: ``W`` ``[d_model, d_model]`` (out, in), float32 on the CPU.
        bias: ``b`` ``[d_model]`` or ``None``.
        residual: ``T(h) = h + h Wᵀ + b`` (tuned-lens form) instead of ``h Wᵀ + b``.
    """

    weight: Float[Tensor, "d_model d_model"]
    bias: Float[Tensor, " d_model"] | None = None
    residual: bool = False


@dataclass(frozen=True, eq=False)
class LensMaps:
    """What a lens file holds: per residual index a map, the width, the file's metadata."""

    maps: dict[int, Map]
    d_model: int
    meta: dict[str, Any] = field(default_factory=dict)


# -- tuned-lens's layout ---------------------------------------------------------------------------


def is_tuned_folder(path: Path) -> bool:
    """A folder (or its ``config.json``) in tuned-lens's layout."""
    folder = path.parent if path.name == TUNED_CONFIG and path.is_file() else path
    return (folder / TUNED_CONFIG).is_file() and (folder / TUNED_PARAMS).is_file()


def tuned_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of a folder in tuned-lens's layout (``{}`` if unreadable)."""
    folder = path.parent if path.name == TUNED_CONFIG and path.is_file() else path
    try:
        config = json.loads((folder / TUNED_CONFIG).read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def read_tuned_maps(where: Path, phrase: str = "tuned lens") -> LensMaps:
    """The translators of a folder (or its ``config.json``) in tuned-lens's layout.

    Raises:
        LensError: Missing or unreadable files, or parameters that do not fit the config.
    """
    folder = where.parent if where.name == TUNED_CONFIG and where.is_file() else where
    try:
        config = json.loads((folder / TUNED_CONFIG).read_text())
        params = torch.load(folder / TUNED_PARAMS, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise LensError(
            f"cannot read the {phrase} in {str(folder)!r}: {line_of(err)}",
            hint=f"a lens folder holds {TUNED_CONFIG} and {TUNED_PARAMS} (tuned-lens's layout), "
            "or is the --out folder of lensdiv lenses fit",
        ) from None
    if not isinstance(config, dict) or not isinstance(params, dict):
        raise LensError(f"{folder} is not a lens in tuned-lens's layout")
    # v0.0.x of tuned-lens saved the whole lens: its translators under "layer_translators."
    params = {
        k.removeprefix("layer_translators."): v
        for k, v in params.items()
        if not k.startswith(("unembed", "input_translator"))
    }
    d_model = int(config.get("d_model", 0))
    maps: dict[int, Map] = {}
    for key, weight in params.items():
        index, _, part = key.partition(".")
        if part != "weight" or not index.isdigit():
            continue
        bias = params.get(f"{index}.bias")
        if tuple(weight.shape) != (d_model, d_model) or (
            bias is not None and tuple(bias.shape) != (d_model,)
        ):
            raise LensError(
                f"{folder / TUNED_PARAMS}: translator {index} has shape {tuple(weight.shape)}, "
                f"not ({d_model}, {d_model}) as {TUNED_CONFIG} says"
            )
        maps[int(index)] = Map(
            weight.detach().float(),
            None if bias is None else bias.detach().float(),
            residual=True,
        )
    if not maps:
        raise LensError(f"{folder / TUNED_PARAMS} holds no translator ('0.weight', ...)")
    meta = {k: v for k, v in config.items() if k not in ("d_model",)}
    return LensMaps(maps, d_model, meta)


class TunedLensFolder(Artifact):
    """Translators ``h + W_i h + b_i`` (``i = 0..n_layers-1``) in tuned-lens's layout: the one
    writer of that layout (a result's artifact, or written at once by :func:`save_tuned`).

    Every index ``0..n_layers-1`` gets a translator (tuned-lens's loader expects them all):
    missing ones are zero (the identity). ``extra`` keys go into ``config.json`` (tuned-lens
    ignores keys it does not know).
    """

    def __init__(
        self,
        name: str,
        weights: Mapping[int, Tensor],
        biases: Mapping[int, Tensor],
        *,
        d_model: int,
        n_layers: int,
        model_name: str,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = name
        self.weights, self.biases = weights, biases
        self.d_model, self.n_layers, self.model_name = d_model, n_layers, model_name
        self.extra = dict(extra or {})

    def write(self, path: Path) -> list[Path]:
        path.mkdir(parents=True, exist_ok=True)
        d = self.d_model
        state: dict[str, Tensor] = {}
        for i in range(self.n_layers):
            weight, bias = self.weights.get(i), self.biases.get(i)
            state[f"{i}.weight"] = (
                torch.zeros(d, d) if weight is None else weight.detach().float().cpu()
            ).contiguous()
            state[f"{i}.bias"] = (
                torch.zeros(d) if bias is None else bias.detach().float().cpu()
            ).contiguous()
        config = {
            "base_model_name_or_path": self.model_name,
            "d_model": d,
            "num_hidden_layers": self.n_layers,
            "bias": True,
            "base_model_revision": None,
            "unembed_hash": None,
            "lens_type": "linear_tuned_lens",
            **self.extra,
        }
        params, conf = path / TUNED_PARAMS, path / TUNED_CONFIG
        torch.save(state, params)
        conf.write_text(json.dumps(config, indent=2))
        return [conf, params]


def save_tuned(
    folder: str | Path,
    weights: Mapping[int, Tensor],
    biases: Mapping[int, Tensor],
    **fields: Any,
) -> list[Path]:
    """Write translators ``h + W_i h + b_i`` in tuned-lens's layout now: a
    :class:`TunedLensFolder` named after ``folder`` (``fields``: its keywords ``d_model``,
    ``n_layers``, ``model_name``, ``extra``), written there."""
    folder = Path(folder)
    return TunedLensFolder(folder.name, weights, biases, **fields).write(folder)


def write_tuned_maps(path: Path, found: LensMaps, n_layers: int, model_name: str) -> list[Path]:
    """Write ``found`` in tuned-lens's layout (a map ``h Wᵀ + c`` as ``h + h (W − I)ᵀ + c``)."""
    eye = torch.eye(found.d_model)
    weights = {i: m.weight if m.residual else m.weight - eye for i, m in found.maps.items()}
    biases = {i: m.bias for i, m in found.maps.items() if m.bias is not None}
    lens = TunedLensFolder(
        path.name,
        weights,
        biases,
        d_model=found.d_model,
        n_layers=n_layers,
        model_name=model_name,
        extra={k: v for k, v in found.meta.items() if k not in _TUNED_KEYS},
    )
    return lens.write(path)


def fetch_tuned(name: str) -> Path:
    """The folder of tuned-lens's published lens ``name``, downloaded from the hub (from its
    cache only under ``HF_HUB_OFFLINE``).

    Raises:
        LensError: Offline and not cached, an unknown name, no network (one line).
    """
    offline = hub_offline()
    if not offline:
        check_hub(f"{name!r} is neither a lens folder nor a published tuned lens")
    try:
        from huggingface_hub import hf_hub_download

        files = [
            hf_hub_download(
                TUNED_HUB_REPO,
                filename,
                subfolder=f"lens/{name}",
                repo_type=TUNED_HUB_TYPE,
                local_files_only=offline,
            )
            for filename in (TUNED_CONFIG, TUNED_PARAMS)
        ]
    except Exception as err:  # offline, unknown name, no huggingface_hub
        raise LensError(
            f"{name!r} is neither a lens folder nor a published tuned lens "
            f"({'not in the hub cache, HF_HUB_OFFLINE is set' if offline else line_of(err)})",
            hint="pass the folder of a fitted lens (lensdiv lenses fit), or a model name that "
            "tuned-lens publishes (needs the network; HF_HUB_OFFLINE=1 fails at once)",
        ) from None
    return Path(files[0]).parent


# -- TransformerLens' Jacobian lens ----------------------------------------------------------------


def is_jacobian_file(path: Path) -> bool:
    """A Jacobian lens file (``*.pt``), or a folder holding ``jacobian_lens.pt``."""
    if path.is_dir():
        return (path / JACOBIAN_FILE).is_file()
    return path.is_file() and path.suffix == ".pt"


def read_jacobian_maps(where: Path | str, *, published: bool = False) -> LensMaps:
    """A Jacobian lens: TransformerLens' ``JacobianLens`` file (artifact or reference
    checkpoint; a folder holding ``jacobian_lens.pt``), or with ``published`` a published
    lens' name (``JacobianLens.from_pretrained``).

    Raises:
        LensError: The file cannot be read or is not a Jacobian lens; a name while
            ``HF_HUB_OFFLINE`` is set.
    """
    from transformer_lens.tools.analysis import JacobianLens

    if published and hub_offline():
        raise LensError(
            f"cannot read the Jacobian lens {str(where)!r}: it is no file, and the published "
            "lenses are not looked up (HF_HUB_OFFLINE is set)",
            hint="pass a file written by lensdiv lenses fit --kind jacobian or JacobianLens.save",
        )
    if published:
        check_hub(f"cannot read the Jacobian lens {str(where)!r}: it is no file")
    path = Path(where).expanduser()
    if path.is_dir() and (path / JACOBIAN_FILE).is_file():
        path = path / JACOBIAN_FILE
    try:
        lens = (
            JacobianLens.from_pretrained(str(where)) if published else JacobianLens.load(str(path))
        )
    except Exception as err:  # a damaged file, not a lens, offline, an unknown name
        raise LensError(
            f"cannot read the Jacobian lens {str(where)!r}: {line_of(err)}",
            hint="pass a file written by lensdiv lenses fit --kind jacobian or "
            "JacobianLens.save, or a published lens' name (needs the network)",
        ) from None
    maps = {int(k) + 1: Map(j.detach().float()) for k, j in lens.jacobians.items()}
    meta = {"n_prompts": lens.n_prompts, **dict(lens.metadata)}
    return LensMaps(maps, int(lens.d_model), meta)


class JacobianLensFile(Artifact):
    """A Jacobian lens written as TransformerLens' ``JacobianLens.save`` writes it (the one
    writer of that layout; :func:`save_jacobian` writes one at once). ``jacobians`` keyed by
    TL's layer (``h_{k+1}`` is layer ``k``); float32 unless asked otherwise (TL's default is
    float16)."""

    def __init__(
        self,
        name: str,
        jacobians: Mapping[int, Tensor],
        n_prompts: int,
        d_model: int,
        metadata: Mapping[str, Any] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.name = name
        self.jacobians, self.n_prompts, self.d_model = jacobians, n_prompts, d_model
        self.metadata, self.dtype = dict(metadata or {}), dtype

    def write(self, path: Path) -> list[Path]:
        from transformer_lens.tools.analysis import JacobianLens

        path.parent.mkdir(parents=True, exist_ok=True)
        lens = JacobianLens(
            {int(k): v for k, v in self.jacobians.items()},
            n_prompts=self.n_prompts,
            d_model=self.d_model,
            metadata=dict(self.metadata),
        )
        tmp = path.with_name(f".{path.name}.tmp")
        lens.save(str(tmp), dtype=self.dtype)
        tmp.replace(path)
        return [path]


def save_jacobian(
    path: str | Path,
    jacobians: Mapping[int, Tensor],
    *,
    n_prompts: int,
    d_model: int,
    metadata: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Jacobian lens now, as TransformerLens does (:class:`JacobianLensFile`), so
    ``JacobianLens.load`` reads it."""
    path = Path(path)
    JacobianLensFile(path.name, jacobians, n_prompts, d_model, metadata, dtype).write(path)
    return path


def write_jacobian_maps(path: Path, found: LensMaps, n_layers: int, model_name: str) -> list[Path]:
    """Write ``found`` as TransformerLens' file (the map of ``h_{k+1}`` is its layer ``k``)."""
    if any(m.bias is not None or m.residual for m in found.maps.values()):
        raise LensError("a Jacobian lens file holds linear maps J h only (no bias)")
    jacobians = {i - 1: m.weight for i, m in found.maps.items()}
    n_prompts = int(found.meta.get("n_prompts", 0))
    metadata = {"model_name": model_name, **found.meta}
    return JacobianLensFile(path.name, jacobians, n_prompts, found.d_model, metadata).write(path)


# -- the hub ---------------------------------------------------------------------------------------


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) keeps lookups off the network."""
    return any(
        os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def check_hub(what: str) -> None:
    """Fail at once, in one line, when the Hugging Face hub cannot be reached (one request
    without retries: the downloads retry with back-off for tens of seconds).

    Raises:
        LensError: No answer from the hub.
    """
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session

        get_session().head(constants.ENDPOINT, timeout=5)
    except Exception as err:  # no network, no DNS, a proxy refusing, no huggingface_hub
        raise LensError(
            f"{what}, and the Hugging Face hub cannot be reached to look it up ({line_of(err)})",
            hint="pass a lens' file or folder (lensdiv lenses fit --out); HF_HUB_OFFLINE=1 reads "
            "the hub's cache only",
        ) from None


def line_of(err: BaseException) -> str:
    """An exception as one short line."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]
