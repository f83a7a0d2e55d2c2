"""What ``lensdiv explore`` computes, without the web: one loaded model and its lenses.

A :class:`Session` answers the page's three questions from plain values (no HTTP here, so the
benchmarks and tests call it directly):

- :meth:`Session.grid`: the prompt view (:func:`lensdiv.ops.prompt.prompt_view`) with one lens,
  or with a block (or its attention / MLP write) skipped, plus the output's KL to the unskipped
  run;
- :meth:`Session.patch`: a corrupt prompt run with the clean prompt's residual ``h_l`` copied in
  at one position (or at every (layer, position), the full map), read as the target token's
  probability at the last position (resumed from block ``l`` by
  :class:`~lensdiv.ops.resume.Resumer`, only the last position unembedded:
  :func:`lensdiv.ops.patching.last_position`);
- :meth:`Session.runs`: the saved runs and studies under the ``--runs`` folder, and the path of
  one's page, never a path outside it.

Bad input raises a :class:`~lensdiv.core.errors.LensdivError` (the server answers 400 with its
line). Calls hold a lock: the model serves one request at a time.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import DataError, LensdivError, OptionError
from lensdiv.ops.capture import capture
from lensdiv.ops.cells import products_of
from lensdiv.ops.patching import last_position, rows_per_pass
from lensdiv.ops.prompt import PARTS, float32_readout, prompt_view
from lensdiv.ops.readout import Workspace, final_readout
from lensdiv.ops.resume import Resumer
from lensdiv.ops.translators import LENS_KINDS, Lens, parse_lens
from lensdiv.run.outcome import MANIFEST
from lensdiv.run.report import REPORT
from lensdiv.studies.crossmodel.folder import HTML, STUDY

TOP_K = 5
MAX_TOP_K = 20
MAX_CHARS = 20_000  # a prompt's characters, checked before tokenising
RUN_PAGE = REPORT  # the saved layouts: a run folder, a study folder
STUDY_PAGE = HTML
_DEPTH = 3  # folders below --runs searched for runs and studies


class RequestError(OptionError):
    """A request the session cannot serve (a field missing or of the wrong type)."""


@dataclass(frozen=True)
class SavedPage:
    """A run or study under ``--runs`` with its page."""

    kind: str  # "run" or "study"
    path: str  # relative to the runs folder, "/"-separated
    model: str
    status: str
    what: str  # analyzers (a run) or models (a study)

    def to_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "path": self.path,
            "model": self.model,
            "status": self.status,
            "what": self.what,
            "page": f"{self.path}/{RUN_PAGE if self.kind == 'run' else STUDY_PAGE}".lstrip("/"),
        }


class Session:
    """One model, its lenses and a runs folder, served one request at a time.

    Args:
        model: A loaded ``TransformerBridge``.
        lenses: Fitted lenses (``tuned:PATH`` ...; whatever :func:`parse_lens` reads), each
            checked against the model now; the kinds made without files (``logit``,
            ``last-block``, ``patchscope``: the registry's) are always there.
        runs: The folder whose runs and studies the page lists (``None``: none).
        products: The grid's unembedding products (:data:`lensdiv.ops.cells.PRODUCTS`):
            ``"auto"`` (bfloat16 for the vocabulary-wide sums where the hardware has it and the
            unembedding is large, every number shown in float32), ``"float32"`` or ``"bf16"``.
    """

    def __init__(
        self,
        model: Any,
        lenses: Sequence[str] = (),
        runs: Path | None = None,
        products: str = "auto",
    ) -> None:
        self.model = model
        self.info = ModelInfo.from_model(model)
        self.lenses: dict[str, Lens] = {
            name: kind.build() for name, kind in LENS_KINDS.items() if kind.make is not None
        }
        for spec in lenses:
            if spec in self.lenses:
                continue
            found = parse_lens(spec)
            found.check(self.info)
            self.lenses[spec] = found
        self.runs_root = runs.resolve() if runs is not None else None
        self.products = products_of(products, final_readout(model))
        self.workspace = Workspace()  # the grid's buffers, kept between requests
        self.lock = threading.Lock()
        self._resumer: Resumer | None = None

    # -- facts ---------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What the page needs to know before the first request."""
        spec = getattr(getattr(self.model, "lensdiv_spec", None), "spec", None)
        return {
            "model": str(spec or self.info.name),
            "n_layers": self.info.n_layers,
            "n_ctx": int(getattr(self.model.cfg, "n_ctx", 0) or 0),
            "d_model": int(self.model.cfg.d_model),
            "lenses": list(self.lenses),
            "parts": list(PARTS),
            "runs": self.runs_root is not None,
        }

    # -- the grid ------------------------------------------------------------------------------
    def grid(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The prompt view of ``text`` with ``lens`` (default ``logit``), or with block ``skip``
        (its ``part``: ``block``, ``attn`` or ``mlp``) skipped, as JSON-able data."""
        text = _text(request, "text")
        lens = _field(request, "lens", str, "logit")
        skip = _field(request, "skip", int, None)
        part = _field(request, "part", str, "block")
        top_k = _field(request, "top_k", int, TOP_K)
        if not 1 <= top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be 1-{MAX_TOP_K}, got {top_k}")
        if lens not in self.lenses:
            raise RequestError(
                f"unknown lens {lens!r}", hint=f"this server has: {', '.join(self.lenses)}"
            )
        if part not in PARTS:
            raise RequestError(f"unknown part {part!r}", hint=f"use one of {', '.join(PARTS)}")
        L = self.info.n_layers
        if skip is not None:
            if not 0 <= skip < L:
                raise RequestError(f"cannot skip block {skip}: the model has blocks 0-{L - 1}")
            if not self.lenses[lens].identity:
                raise RequestError(
                    "a skipped block is shown with the logit lens", hint="lens=logit"
                )
        start = time.perf_counter()
        with self.lock:
            self._tokens(text)  # the context, checked without truncation
            view = prompt_view(
                self.model,
                text,
                top_k=top_k,
                lens=self.lenses[lens],
                skip=skip,
                part=part,
                products=self.products,
                workspace=self.workspace,
            )
        out = view.to_dict()
        out["lens"] = lens
        if skip is not None:  # the top row's KL: the skipped output against the unskipped one
            output_kl = list(view.kl[-1])
            later = output_kl[1:] or output_kl
            out["skip"] = {
                "block": skip,
                "part": part,
                "output_kl": output_kl,
                "mean_output_kl": sum(later) / len(later),
            }
        out["ms"] = round(1000 * (time.perf_counter() - start), 1)
        return finite(out)

    # -- patching ------------------------------------------------------------------------------
    def patch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``corrupt`` with the clean prompt's ``h_layer`` at ``position`` (or, with
        ``map: true``, at every (layer, position)); the probability of ``target`` (one token;
        default the clean run's top prediction) at the last position."""
        clean_text, corrupt_text = _text(request, "clean"), _text(request, "corrupt")
        target_text = _field(request, "target", str, "")
        full_map = _field(request, "map", bool, False)
        layer = _field(request, "layer", int, None)
        position = _field(request, "position", int, None)
        start = time.perf_counter()
        with self.lock:
            clean, corrupt = self._tokens(clean_text), self._tokens(corrupt_text)
            if clean.shape[1] != corrupt.shape[1]:
                raise RequestError(
                    f"the clean prompt is {clean.shape[1]} tokens and the corrupt one "
                    f"{corrupt.shape[1]}: patching needs prompts of the same length",
                    hint="edit the corrupt prompt to the clean one's length",
                )
            L, n_pos = self.info.n_layers, clean.shape[1]
            if not full_map:
                if layer is None or position is None:
                    raise RequestError("give layer and position (or map: true)")
                if not 0 <= layer <= L:
                    raise RequestError(f"layer {layer} is outside 0-{L} (h0 … h{L})")
                if not 0 <= position < n_pos:
                    raise RequestError(f"position {position} is outside 0-{n_pos - 1}")
            out = self._patch(clean, corrupt, target_text, layer, position, full_map)
        out["ms"] = round(1000 * (time.perf_counter() - start), 1)
        return finite(out)

    def _patch(
        self,
        clean: torch.Tensor,
        corrupt: torch.Tensor,
        target_text: str,
        layer: int | None,
        position: int | None,
        full_map: bool,
    ) -> dict[str, Any]:
        L, n_pos = self.info.n_layers, clean.shape[1]
        names = [self.info.resid(i) for i in range(L + 1)]
        read, _ = float32_readout(self.model)
        with torch.no_grad():
            _, clean_h = capture(self.model, clean, names, need_logits=False)
            _, corrupt_h = capture(self.model, corrupt, names, need_logits=False)
            clean_p = read(clean_h[names[-1]][0, -1:]).softmax(-1)[0]
            corrupt_p = read(corrupt_h[names[-1]][0, -1:]).softmax(-1)[0]
            target = self._target(target_text, clean_p)
            layers = range(L + 1) if full_map else [int(layer or 0)]
            positions = list(range(n_pos)) if full_map else [int(position or 0)]
            rows = [
                self._patched(corrupt, corrupt_h[names[i]], clean_h[names[i]], i, positions, target)
                for i in layers
            ]
        p_clean, p_corrupt = float(clean_p[target]), float(corrupt_p[target])
        decode = self.model.tokenizer.decode
        out: dict[str, Any] = {
            "target": decode([target]),
            "target_id": target,
            "clean_prob": p_clean,
            "corrupt_prob": p_corrupt,
            "clean_tokens": [decode([int(t)]) for t in clean[0]],
            "corrupt_tokens": [decode([int(t)]) for t in corrupt[0]],
        }
        if full_map:
            out["rows"] = [f"h{i}" for i in range(L + 1)]
            out["map"] = rows
        else:
            patched = rows[0][0]
            gap = p_clean - p_corrupt
            out.update(
                layer=layer,
                position=position,
                patched_prob=patched,
                recovered=(patched - p_corrupt) / gap if abs(gap) > 1e-9 else None,
            )
        return out

    def _patched(
        self,
        tokens: torch.Tensor,
        corrupt: torch.Tensor,
        clean: torch.Tensor,
        layer: int,
        positions: Sequence[int],
        target: int,
    ) -> list[float]:
        """The target's probability at the last position with ``h_layer`` of ``corrupt`` replaced
        by ``clean``'s at each of ``positions`` (one row each; resumed from block ``layer``, only
        the last position read out), batched within the patching memory budget."""
        if self._resumer is None:
            self._resumer = Resumer(self.model)
        n_pos = tokens.shape[1]
        per = rows_per_pass(self.model, n_pos, grad=False)
        out: list[float] = []
        for lo in range(0, len(positions), per):
            chunk = torch.tensor(positions[lo : lo + per], device=corrupt.device)
            mixed = corrupt.repeat(len(chunk), 1, 1)
            mixed[torch.arange(len(chunk), device=corrupt.device), chunk] = clean[0, chunk]
            logits = self._resumer.run(
                tokens.repeat(len(chunk), 1), layer, mixed, last_position(self.model)
            )
            assert logits is not None  # asked for logits
            out += logits[:, -1].float().softmax(-1)[:, target].tolist()
        return out

    def _target(self, text: str, clean_probs: torch.Tensor) -> int:
        if not text:
            return int(clean_probs.argmax())
        ids = self.model.to_tokens(text, prepend_bos=False)[0]
        if ids.numel() != 1:
            raise RequestError(
                f"the target {text!r} is {ids.numel()} tokens, not one",
                hint="give one token (leave it empty for the clean prompt's prediction)",
            )
        return int(ids[0])

    def _tokens(self, text: str) -> torch.Tensor:
        # truncate=False: TransformerBridge.to_tokens cuts a long prompt to the context silently.
        tokens = self.model.to_tokens(text, prepend_bos=True, truncate=False)
        n_ctx = int(getattr(self.model.cfg, "n_ctx", 0) or 0)
        if n_ctx and tokens.shape[1] > n_ctx:
            raise DataError(
                f"the prompt is {tokens.shape[1]} tokens long but the model reads at most {n_ctx}",
                hint="shorten it",
            )
        return tokens

    # -- saved runs and studies ----------------------------------------------------------------
    def runs(self) -> list[dict[str, str]]:
        """The runs (``manifest.json`` + ``report.html``) and studies (``study.json`` +
        ``study.html``) in the runs folder and up to three folders below it."""
        root = self.runs_root
        if root is None or not root.is_dir():
            return []
        found: list[SavedPage] = []
        _walk(root, root, 0, found)
        return [page.to_dict() for page in sorted(found, key=lambda p: p.path)]

    def page(self, relative: str) -> Path:
        """The report.html or study.html at ``relative`` under the runs folder.

        Raises:
            RequestError: No runs folder, another file name, or a path that leaves the folder.
        """
        root = self.runs_root
        if root is None:
            raise RequestError("no runs folder", hint="start lensdiv explore with --runs DIR")
        parts = relative.split("/")
        if parts[-1] not in (RUN_PAGE, STUDY_PAGE) or any(p in ("", ".", "..") for p in parts):
            raise RequestError(f"not a run's or a study's page: {relative!r}")
        path = root.joinpath(*parts).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise RequestError(f"no page {relative!r} under the runs folder")
        return path


def _walk(root: Path, folder: Path, depth: int, found: list[SavedPage]) -> None:
    rel = folder.relative_to(root).as_posix()
    rel = "" if rel == "." else rel
    manifest, study = _json(folder / MANIFEST), _json(folder / STUDY)
    if study is not None and (folder / STUDY_PAGE).is_file():
        models = [m for m in _of(study, "models", list) if isinstance(m, dict)]
        names = [str(m.get("model")) for m in models]
        done = sum(1 for m in models if m.get("status") == "complete")
        plugins = _of(study, "settings", dict).get("plugins", "")
        shown = ", ".join(names[:4]) + (" …" if len(names) > 4 else "")
        what = plugins if isinstance(plugins, str) else ", ".join(map(str, plugins))
        found.append(SavedPage("study", rel, shown, f"{done}/{len(models)} complete", what))
    elif manifest is not None and (folder / RUN_PAGE).is_file():
        model = _of(manifest, "model", dict)
        name = str(model.get("spec") or model.get("name") or "?")
        status = str(manifest.get("status", "?"))
        found.append(
            SavedPage("run", rel, name, status, ", ".join(_of(manifest, "analyzers", dict)))
        )
    if depth >= _DEPTH:
        return
    try:
        children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    except OSError:
        return
    for child in children:
        _walk(root, child, depth + 1, found)


def _of(data: Mapping[str, Any], key: str, kind: type) -> Any:
    """``data[key]`` when it is a ``kind`` (a damaged file lists as empty, never fails)."""
    value = data.get(key)
    return value if isinstance(value, kind) else kind()


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


_TYPES = {str: "a string", int: "an integer", bool: "true or false"}


def _field(request: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    value = request.get(name, default)
    if value is None or value is default:
        return value
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{name} must be {_TYPES[kind]}, got {json.dumps(value)[:40]}")
    return value


def _text(request: Mapping[str, Any], name: str) -> str:
    text = _field(request, name, str, None)
    if text is None:
        raise RequestError(f"the request has no {name!r}")
    if len(text) > MAX_CHARS:
        raise DataError(
            f"the {name} prompt has {len(text)} characters (at most {MAX_CHARS})", hint="shorten it"
        )
    if not text.strip():
        raise DataError(f"the {name} prompt is empty", hint="type some text")
    return text


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


__all__ = ["LensdivError", "RequestError", "Session", "finite"]
