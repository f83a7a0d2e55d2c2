"""Translators: what a lens does to a residual state before the final norm and unembedding.

A lens reads residual state ``h_l`` as ``p_l = softmax(W_U N(T_l(h_l)) + b_U)``; the translator
``T_l`` is what tells lenses apart (docs/science.md, D1–D3):

==============  =================================  ============================================
lens            ``T_l(h)``                         fitted to / file
==============  =================================  ============================================
``logit``       ``h``                              nothing (the logit lens)
``tuned``       ``h + A_l h + b_l``                ``KL(p_L ‖ p_l)`` by SGD; tuned-lens's layout
``jacobian``    ``J_l h``                          the average Jacobian ∂h_L/∂h_l; TL's file
``affine``      ``W_l h + c_l``                    least squares to ``h_L``; tuned-lens's layout
==============  =================================  ============================================

Every translator is affine, so one class holds them all: per residual index ``l`` (``h_0`` the
embedding, ``h_L`` the final residual, as everywhere in lensdiv) a weight and an optional bias,
applied either as ``h Wᵀ + b`` or residually as ``h + h Wᵀ + b`` (the tuned lens' own form, so a
zero-initialised lens is the logit lens to the last bit). Indices without a map read ``h`` as it
is: the last (``h_L``) always, and ``h_0`` for a Jacobian lens.

Index conventions of the files: a tuned lens' translator ``i`` reads Hugging Face's
``hidden_states[i]`` = ``h_i`` (``i = 0..L-1``); a TransformerLens Jacobian lens' layer ``k``
reads the output of block ``k`` = ``h_{k+1}`` (``k = 0..L-2``).

**Precision.** A translator is applied in the readout dtype (float32, or float64 for a float64
model) on the readout's device, to a state already converted to that dtype: the policy of
:mod:`lensdiv.ops.readout` holds, and the cost is one ``d_model × d_model`` matmul per state.

**Files.** ``tuned:PATH`` and ``affine:PATH`` read a folder (or its ``config.json``) in
tuned-lens's layout (``config.json`` + ``params.pt`` with ``"{i}.weight"``, ``"{i}.bias"``), so
published tuned lenses load here and lensdiv's load in tuned-lens; a name that is not a path is
looked up in tuned-lens's published lenses on the Hugging Face hub. ``jacobian:PATH`` reads
TransformerLens' ``JacobianLens`` files (its own loader: artifacts and reference checkpoints),
or a published lens by name (``JacobianLens.from_pretrained``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import LensError

LensKind = Literal["logit", "tuned", "jacobian", "affine"]
LENS_KINDS: tuple[LensKind, ...] = ("logit", "tuned", "jacobian", "affine")
#: How results name each lens ("Tuned lens: KL to the output").
LABELS: dict[str, str] = {
    "logit": "Logit lens",
    "tuned": "Tuned lens",
    "jacobian": "Jacobian lens",
    "affine": "Affine lens",
}
#: The same in the middle of a sentence ("the Jacobian lens' translator").
PHRASES: dict[str, str] = {
    "logit": "logit lens",
    "tuned": "tuned lens",
    "jacobian": "Jacobian lens",
    "affine": "affine lens",
}
TUNED_CONFIG, TUNED_PARAMS = "config.json", "params.pt"
JACOBIAN_FILE = "jacobian_lens.pt"
# tuned-lens's published lenses: a Hugging Face *space*, one folder per model under lens/.
TUNED_HUB_REPO, TUNED_HUB_TYPE = "AlignmentResearch/tuned-lens", "space"


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
class Translator:
    """A lens' per-layer translators (see the module docstring).

    Args:
        kind: ``logit``, ``tuned``, ``jacobian`` or ``affine``.
        maps: ``{residual index l: Map}``; an index without one reads ``h_l`` as it is.
        source: Where it was read from (a path or a hub name; ``None`` for the logit lens).
        d_model: Width the maps were fitted for (0 for the logit lens).
        meta: Provenance recorded with the file (prompts, tokens, fit settings).
    """

    kind: LensKind = "logit"
    maps: Mapping[int, Map] = field(default_factory=dict)
    source: str | None = None
    d_model: int = 0
    meta: Mapping[str, Any] = field(default_factory=dict)
    _placed: dict[tuple[int, torch.dtype, torch.device], tuple[Tensor, Tensor | None]] = field(
        default_factory=dict, repr=False
    )

    @property
    def label(self) -> str:
        """``"Tuned lens"``: how results name it."""
        return LABELS[self.kind]

    @property
    def identity(self) -> bool:
        """The logit lens: every state read as it is."""
        return not self.maps

    @property
    def spec(self) -> str:
        """``kind`` or ``kind:source``, as ``--lens`` takes it."""
        return self.kind if self.source is None else f"{self.kind}:{self.source}"

    def translates(self, index: int) -> bool:
        """Whether residual state ``h_index`` is changed before the readout."""
        return index in self.maps

    def apply(
        self,
        h: Float[Tensor, "n d_model"],
        index: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Float[Tensor, "n d_model"]:
        """``T_index(h)`` in ``dtype`` on ``device`` (``h`` as it is where no map applies)."""
        found = self.maps.get(index)
        if found is None:
            return h
        key = (index, dtype, device)
        if key not in self._placed:
            bias = found.bias.to(device, dtype) if found.bias is not None else None
            self._placed[key] = (found.weight.to(device, dtype).T.contiguous(), bias)
        weight_t, bias = self._placed[key]
        x = h.to(device=device, dtype=dtype)
        out = torch.addmm(x, x, weight_t) if found.residual else x @ weight_t
        return out if bias is None else out.add_(bias)

    def check(self, info: ModelInfo) -> None:
        """Refuse a lens fitted for another shape of model.

        Raises:
            LensError: Another width, or a map for a residual index the model lacks.
        """
        if self.identity:
            return
        if self.d_model != info.d_model:
            raise LensError(
                f"the {PHRASES[self.kind]} {self.source!r} was fitted for d_model {self.d_model}, "
                f"but {info.name} has d_model {info.d_model}",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )
        bad = [i for i in self.maps if not 0 <= i < info.n_layers]
        if bad:
            raise LensError(
                f"the {PHRASES[self.kind]} {self.source!r} has a translator for residual state "
                f"h{max(bad)}, but {info.name} has {info.n_layers} blocks (h0..h{info.n_layers - 1} "
                "can be translated)",
                hint="fit a lens for this model: lensdiv lenses fit MODEL --kind ...",
            )

    def describe(self) -> dict[str, Any]:
        """What the manifest and every result record of the lens."""
        if self.identity:
            return {"kind": self.kind, "label": self.label}
        return {
            "kind": self.kind,
            "label": self.label,
            "source": self.source,
            "states": sorted(self.maps),
            "d_model": self.d_model,
            "sha256": self.fingerprint(),
            **({"meta": dict(self.meta)} if self.meta else {}),
        }

    def fingerprint(self) -> str:
        """A hash of the maps' values (shards and merges check they used the same lens)."""
        digest = hashlib.sha256()
        for index in sorted(self.maps):
            found = self.maps[index]
            digest.update(f"{index}:{found.residual}".encode())
            digest.update(found.weight.detach().float().cpu().numpy().tobytes())
            if found.bias is not None:
                digest.update(found.bias.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()


LOGIT = Translator()


def parse_lens(spec: Any) -> Translator:
    """A translator from what ``--lens`` / ``lens=`` take: ``"logit"``, ``"tuned:PATH"``,
    ``"jacobian:PATH"``, ``"affine:PATH"`` (a path, or a published lens' name), or a
    :class:`Translator`.

    Raises:
        LensError: Not one of these, or a file that cannot be read (one line, with a hint).
    """
    if spec is None:
        return LOGIT
    if isinstance(spec, Translator):
        return spec
    if not isinstance(spec, str):
        raise LensError(
            f"a lens is 'logit', 'tuned:PATH', 'jacobian:PATH' or 'affine:PATH', not {spec!r}"
        )
    kind, _, where = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "logit" and not where:
        return LOGIT
    if kind not in LENS_KINDS or kind == "logit" or not where.strip():
        raise LensError(
            f"unknown lens {spec!r}",
            hint="use logit, tuned:PATH, jacobian:PATH or affine:PATH (a fitted lens' file or "
            "folder: lensdiv lenses fit)",
        )
    if kind == "jacobian":
        return read_jacobian(where)
    return read_tuned(where, kind=kind)


# -- tuned-lens's layout ---------------------------------------------------------------------------


def read_tuned(where: str | Path, *, kind: Literal["tuned", "affine"] = "tuned") -> Translator:
    """A lens saved in tuned-lens's layout: a folder (or its ``config.json``) with
    ``config.json`` and ``params.pt``, or a published lens' name.

    Raises:
        LensError: Missing or unreadable files, or parameters that do not fit the config.
    """
    folder = Path(where).expanduser()
    if folder.name == TUNED_CONFIG and folder.is_file():
        folder = folder.parent
    if not folder.exists():
        folder = _hub_tuned(str(where))
    try:
        config = json.loads((folder / TUNED_CONFIG).read_text())
        params = torch.load(folder / TUNED_PARAMS, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError) as err:
        raise LensError(
            f"cannot read the {PHRASES[kind]} in {str(folder)!r}: {_line(err)}",
            hint=f"a lens folder holds {TUNED_CONFIG} and {TUNED_PARAMS} (tuned-lens's layout)",
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
    return Translator(kind, maps, source=str(where), d_model=d_model, meta=meta)


def save_tuned(
    folder: str | Path,
    weights: Mapping[int, Tensor],
    biases: Mapping[int, Tensor],
    *,
    d_model: int,
    n_layers: int,
    model_name: str,
    extra: Mapping[str, Any] | None = None,
) -> list[Path]:
    """Write translators ``h + W_i h + b_i`` (``i = 0..n_layers-1``) in tuned-lens's layout.

    Every index ``0..n_layers-1`` gets a translator (tuned-lens's loader expects them all):
    missing ones are zero (the identity). ``extra`` keys go into ``config.json`` (tuned-lens
    ignores keys it does not know).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state: dict[str, Tensor] = {}
    for i in range(n_layers):
        weight = weights.get(i)
        bias = biases.get(i)
        state[f"{i}.weight"] = (
            torch.zeros(d_model, d_model) if weight is None else weight.detach().float().cpu()
        ).contiguous()
        state[f"{i}.bias"] = (
            torch.zeros(d_model) if bias is None else bias.detach().float().cpu()
        ).contiguous()
    config = {
        "base_model_name_or_path": model_name,
        "d_model": d_model,
        "num_hidden_layers": n_layers,
        "bias": True,
        "base_model_revision": None,
        "unembed_hash": None,
        "lens_type": "linear_tuned_lens",
        **dict(extra or {}),
    }
    params, conf = folder / TUNED_PARAMS, folder / TUNED_CONFIG
    torch.save(state, params)
    conf.write_text(json.dumps(config, indent=2))
    return [conf, params]


def _hub_tuned(name: str) -> Path:
    """The folder of tuned-lens's published lens ``name``, downloaded from the hub."""
    try:
        from huggingface_hub import hf_hub_download

        files = [
            hf_hub_download(
                TUNED_HUB_REPO,
                filename,
                subfolder=f"lens/{name}",
                repo_type=TUNED_HUB_TYPE,
            )
            for filename in (TUNED_CONFIG, TUNED_PARAMS)
        ]
    except Exception as err:  # offline, unknown name, no huggingface_hub
        raise LensError(
            f"{name!r} is neither a lens folder nor a published tuned lens ({_line(err)})",
            hint="pass the folder of a fitted lens (lensdiv lenses fit), or a model name that "
            "tuned-lens publishes (needs the network)",
        ) from None
    return Path(files[0]).parent


# -- TransformerLens' Jacobian lens ----------------------------------------------------------------


def read_jacobian(where: str | Path) -> Translator:
    """A Jacobian lens: TransformerLens' ``JacobianLens`` file (artifact or reference
    checkpoint) or a published lens' name (``JacobianLens.from_pretrained``).

    Raises:
        LensError: The file cannot be read or is not a Jacobian lens.
    """
    from transformer_lens.tools.analysis import JacobianLens

    path = Path(where).expanduser()
    if path.is_dir() and (path / JACOBIAN_FILE).is_file():
        path = path / JACOBIAN_FILE
    try:
        lens = (
            JacobianLens.load(str(path))
            if path.is_file()
            else JacobianLens.from_pretrained(str(where))
        )
    except Exception as err:  # a damaged file, not a lens, offline, an unknown name
        raise LensError(
            f"cannot read the Jacobian lens {str(where)!r}: {_line(err)}",
            hint="pass a file written by lensdiv lenses fit --kind jacobian or "
            "JacobianLens.save, or a published lens' name (needs the network)",
        ) from None
    maps = {int(k) + 1: Map(j.detach().float()) for k, j in lens.jacobians.items()}
    meta = {"n_prompts": lens.n_prompts, **dict(lens.metadata)}
    return Translator("jacobian", maps, source=str(where), d_model=lens.d_model, meta=meta)


def save_jacobian(
    path: str | Path,
    jacobians: Mapping[int, Tensor],
    *,
    n_prompts: int,
    d_model: int,
    metadata: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a Jacobian lens as TransformerLens does (``JacobianLens.save``: its four keys plus
    its metadata), so ``JacobianLens.load`` reads it; ``jacobians`` keyed by TL's layer
    (``h_{k+1}`` is layer ``k``). float32 unless asked otherwise (TL's default is float16)."""
    from transformer_lens.tools.analysis import JacobianLens

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lens = JacobianLens(
        {int(k): v for k, v in jacobians.items()},
        n_prompts=n_prompts,
        d_model=d_model,
        metadata=dict(metadata or {}),
    )
    lens.save(str(path), dtype=dtype)
    return path


def _line(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())[:200]
