"""What ``lensdiv explore`` computes, without the web: one loaded model and its lenses.

A :class:`Session` answers the page's questions from plain values (no HTTP here, so the
benchmarks and tests call it directly):

- :meth:`Session.grid`: the prompt view (:func:`lensdiv.ops.prompt.prompt_view`) with one lens,
  or with a block (or its attention / MLP write) skipped, plus the output's KL to the unskipped
  run;
- :meth:`Session.patch`: a corrupt prompt run with the clean prompt's residual ``h_l`` copied in
  at one position (or at a piece of a row of the full map: the page asks for the pieces one by
  one, so other requests get through between them; :meth:`Session.patch_map` puts them
  together), read as the target token's probability at the last position (resumed from block
  ``l`` by
  :class:`~lensdiv.ops.resume.Resumer`, only the last position unembedded:
  :func:`lensdiv.ops.patching.last_position`);
- :meth:`Session.attention`: one position's attention in one block, per head and averaged, the
  sink (the first position) and the heads that attend to it marked;
- :meth:`Session.runs`: the saved runs and studies under the ``--runs`` folder, and the path of
  one's page, never a path outside it.

:meth:`Session.describe` also names the patch tab's example pair (:func:`patch_example`): on the
toy models a subject–verb agreement case from their corpus whose answer patching visibly moves.

Bad input raises a :class:`~lensdiv.core.errors.LensdivError` (the server answers 400 with its
line). A session serves one call at a time: its caller serialises them (the server holds its one
lock around every call; the model and the grid's buffers are shared).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.errors import DataError, LensdivError, OptionError
from lensdiv.data.pairs import builtin_pairs, is_byte_tokenizer
from lensdiv.ops.attention import pattern_hook
from lensdiv.ops.blocklens import PatchscopeLens, inspection
from lensdiv.ops.capture import capture
from lensdiv.ops.cells import products_of
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.patching import last_position, rows_per_pass
from lensdiv.ops.prompt import PARTS, float32_readout, prompt_view
from lensdiv.ops.readout import Workspace, final_readout
from lensdiv.ops.resume import Resumer
from lensdiv.ops.translators import LENS_KINDS, Lens
from lensdiv.run.outcome import MANIFEST
from lensdiv.run.report import REPORT
from lensdiv.studies.crossmodel.folder import HTML, STUDY

TOP_K = 5
SINK_EPS = 0.3  # a head whose weight on the sink exceeds this is marked (the ``sinks`` eps)
MAX_TOP_K = 20
SAYS_TOKENS = 8  # what the model says about a state: tokens of the greedy continuation
MAX_SAYS_TOKENS = 32
MAX_CHARS = 20_000  # a prompt's characters, checked before tokenising
RUN_PAGE = REPORT  # the saved layouts: a run folder, a study folder
STUDY_PAGE = HTML
_DEPTH = 3  # folders below --runs searched for runs and studies
MAP_SECONDS = 0.25  # a piece of the patching map holds the model about this long


class _States(NamedTuple):
    """The captured states of one clean/corrupt pair (rows ``h0`` … ``h_L``)."""

    key: tuple[tuple[int, ...], tuple[int, ...]]
    clean_h: list[torch.Tensor]
    corrupt_h: list[torch.Tensor]
    clean_p: torch.Tensor  # the output distributions at the last position
    corrupt_p: torch.Tensor


#: The patch tab's example on the toy models (byte tokenizer): subject–verb agreement as the toy
#: corpus' grammar writes it. A singular subject makes the verb take ``s`` ("The city laughs"), a
#: plural one does not ("The dogs laugh."); the prompts are the same length in bytes. On the
#: default toy the clean run gives ``s`` 78 %, the corrupt one 9 %, and the clean ``h3`` at the
#: last position brings the corrupt run back to 79 % (the number moves from the subject's last
#: letter to the last position between blocks 1 and 2); tests/test_explore.py checks it.
TOY_EXAMPLE = {
    "clean": "The city laugh",
    "corrupt": "The dogs laugh",
    "target": "s",
    "about": "subject–verb agreement, as in the toy's corpus: after a singular subject the verb "
    "takes an s (The city laughs.), after a plural one it does not (The dogs laugh.)",
}


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
        self._resumer: Resumer | None = None
        self.example = patch_example(model)
        self._captured: _States | None = None  # the last clean/corrupt pair's states
        self._map_step = 4  # positions per batch of a map piece (follows the time taken)

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
            "patch_example": self.example,
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

    # -- attention -----------------------------------------------------------------------------
    def attention(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Where the query at ``position`` of ``text`` attends in block ``block``: each head's
        weights over the keys ``0..position`` and their mean over heads, with the sink (the
        first ``first`` keys, default 1) and the heads whose weight on it exceeds 0.3 (the
        ``sinks`` analyzer's ``eps``) marked."""
        text = _text(request, "text")
        block = _field(request, "block", int, None)
        position = _field(request, "position", int, None)
        first = _field(request, "first", int, 1)
        L = self.info.n_layers
        if block is None or position is None:
            raise RequestError("give block and position")
        if not 0 <= block < L:
            raise RequestError(f"block {block} is outside 0-{L - 1}")
        tokens = self._tokens(text)
        if not 0 <= position < tokens.shape[1]:
            raise RequestError(f"position {position} is outside 0-{tokens.shape[1] - 1}")
        if first < 1:
            raise RequestError(f"first must be at least 1, got {first}")
        start = time.perf_counter()
        with torch.no_grad():
            _, cache = capture(self.model, tokens, [pattern_hook(block)], need_logits=False)
        row = cache[pattern_hook(block)][0, :, position, : position + 1].double().cpu()
        sink = row[:, :first].sum(-1)
        decode = self.model.tokenizer.decode
        return finite(
            {
                "block": block,
                "position": position,
                "tokens": [decode([int(t)]) for t in tokens[0, : position + 1]],
                "heads": row.tolist(),
                "mean": row.mean(0).tolist(),
                "first": first,
                "sink_mass": sink.tolist(),
                "sink_heads": [h for h, m in enumerate(sink.tolist()) if m > SINK_EPS],
                "ms": round(1000 * (time.perf_counter() - start), 1),
            }
        )

    # -- what the model says about a state ------------------------------------------------------
    def says(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The greedy continuation of a patchscope's inspection prompt with ``h_row`` of
        ``text`` at ``position`` patched in (docs/science.md P1): ``tokens`` tokens (default
        :data:`SAYS_TOKENS`) and their probabilities; ``lens`` names the patchscope (its
        prompt, patch position and target rule; default ``patchscope``)."""
        text = _text(request, "text")
        row = _field(request, "row", int, None)
        position = _field(request, "position", int, None)
        n_tokens = _field(request, "tokens", int, SAYS_TOKENS)
        name = _field(request, "lens", str, "patchscope")
        L = self.info.n_layers
        if row is None or position is None:
            raise RequestError("give row and position")
        if not 0 <= row <= L:
            raise RequestError(f"row {row} is outside h0-h{L}")
        if not 1 <= n_tokens <= MAX_SAYS_TOKENS:
            raise RequestError(f"tokens must be 1-{MAX_SAYS_TOKENS}, got {n_tokens}")
        lens = self.lenses.get(name)
        if not isinstance(lens, PatchscopeLens):
            scopes = [k for k, v in self.lenses.items() if isinstance(v, PatchscopeLens)]
            raise RequestError(f"{name!r} is not a patchscope", hint=f"use {', '.join(scopes)}")
        tokens = self._tokens(text)
        if not 0 <= position < tokens.shape[1]:
            raise RequestError(f"position {position} is outside 0-{tokens.shape[1] - 1}")
        start = time.perf_counter()
        with torch.no_grad():
            _, cache = capture(self.model, tokens, [self.info.resid(row)], need_logits=False)
        h = cache[self.info.resid(row)][0, position]
        found = inspection(self.model, lens.prompt, lens.position)
        target = lens.target_layer(row, L)
        said, probs = found.generate(target, h, n_tokens)
        decode = self.model.tokenizer.decode
        return finite(
            {
                "lens": name,
                "row": row,
                "position": position,
                "target": target,
                "prompt": [decode([t]) for t in found.tokens_list],
                "patched": found.position,
                "tokens": [decode([t]) for t in said],
                "probs": probs,
                "text": decode(said),
                "ms": round(1000 * (time.perf_counter() - start), 1),
            }
        )

    # -- patching ------------------------------------------------------------------------------
    def patch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Run ``corrupt`` with the clean prompt's ``h_layer`` at ``position``; the probability
        of ``target`` (one token; default the clean run's top prediction) at the last position.

        With ``map: true``, one *piece* of the full map instead: ``h_layer`` patched at the
        positions ``start, start + 1, …`` for about :data:`MAP_SECONDS` (at least one position,
        never past the row's end), as ``probs``, with ``next`` — the ``{layer, start}`` to ask
        for the next piece, ``None`` after the last — so that the model is never held for a
        whole map (:meth:`patch_map` puts the pieces together).
        """
        clean_text, corrupt_text = _text(request, "clean"), _text(request, "corrupt")
        target_text = _field(request, "target", str, "")
        full_map = _field(request, "map", bool, False)
        layer = _field(request, "layer", int, 0 if full_map else None)
        position = _field(request, "position", int, None)
        first = _field(request, "start", int, 0)
        begun = time.perf_counter()
        clean, corrupt = self._tokens(clean_text), self._tokens(corrupt_text)
        if clean.shape[1] != corrupt.shape[1]:
            raise RequestError(
                f"the clean prompt is {clean.shape[1]} tokens and the corrupt one "
                f"{corrupt.shape[1]}: patching needs prompts of the same length",
                hint="edit the corrupt prompt to the clean one's length",
            )
        L, n_pos = self.info.n_layers, clean.shape[1]
        if full_map:
            position = first
        elif layer is None or position is None:
            raise RequestError("give layer and position (or map: true)")
        if not 0 <= layer <= L:
            raise RequestError(f"layer {layer} is outside 0-{L} (h0 … h{L})")
        if not 0 <= position < n_pos:
            raise RequestError(f"position {position} is outside 0-{n_pos - 1}")
        with torch.no_grad():
            states = self._states(clean, corrupt)
            target = self._target(target_text, states.clean_p)
            out = self._header(clean, corrupt, target, states)
            if full_map:
                probs = self._piece(corrupt, states, layer, position, target)
                end = position + len(probs)
                after = {"layer": layer, "start": end} if end < n_pos else None
                if after is None and layer < L:
                    after = {"layer": layer + 1, "start": 0}
                out.update(layer=layer, start=position, probs=probs, next=after)
            else:
                patched = self._patched(corrupt, states, layer, [position], target)[0]
                gap = out["clean_prob"] - out["corrupt_prob"]
                out.update(
                    layer=layer,
                    position=position,
                    patched_prob=patched,
                    recovered=(patched - out["corrupt_prob"]) / gap if abs(gap) > 1e-9 else None,
                )
        out["ms"] = round(1000 * (time.perf_counter() - begun), 1)
        return finite(out)

    def patch_map(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The full patching map of ``clean`` → ``corrupt``: every piece :meth:`patch` gives for
        ``map: true``, in order, as ``map[layer][position]`` (rows ``h0`` … ``h_L``)."""
        ask: dict[str, Any] = {**request, "map": True, "layer": 0, "start": 0}
        rows: list[list[float]] = [[] for _ in range(self.info.n_layers + 1)]
        while True:
            piece = self.patch(ask)
            rows[piece["layer"]] += piece["probs"]
            if piece["next"] is None:
                break
            ask.update(piece["next"])
        keep = ("target", "target_id", "clean_prob", "corrupt_prob")
        out = {k: piece[k] for k in (*keep, "clean_tokens", "corrupt_tokens")}
        out.update(rows=[f"h{i}" for i in range(len(rows))], map=rows)
        return out

    def _states(self, clean: torch.Tensor, corrupt: torch.Tensor) -> _States:
        """Both prompts' residual streams and output distributions (the last pair's kept: the
        pieces of one map and the cells clicked after it share them)."""
        key = (tuple(clean[0].tolist()), tuple(corrupt[0].tolist()))
        if self._captured is not None and self._captured.key == key:
            return self._captured
        names = [self.info.resid(i) for i in range(self.info.n_layers + 1)]
        read, _ = float32_readout(self.model)
        _, clean_h = capture(self.model, clean, names, need_logits=False)
        _, corrupt_h = capture(self.model, corrupt, names, need_logits=False)
        self._captured = _States(
            key,
            [clean_h[name] for name in names],
            [corrupt_h[name] for name in names],
            read(clean_h[names[-1]][0, -1:]).softmax(-1)[0],
            read(corrupt_h[names[-1]][0, -1:]).softmax(-1)[0],
        )
        return self._captured

    def _header(
        self, clean: torch.Tensor, corrupt: torch.Tensor, target: int, states: _States
    ) -> dict[str, Any]:
        decode = self.model.tokenizer.decode
        return {
            "target": decode([target]),
            "target_id": target,
            "clean_prob": float(states.clean_p[target]),
            "corrupt_prob": float(states.corrupt_p[target]),
            "clean_tokens": [decode([int(t)]) for t in clean[0]],
            "corrupt_tokens": [decode([int(t)]) for t in corrupt[0]],
        }

    def _piece(
        self, tokens: torch.Tensor, states: _States, layer: int, start: int, target: int
    ) -> list[float]:
        """Row ``layer`` of the map from position ``start`` for about :data:`MAP_SECONDS`: in
        batches whose size follows the time the last one took (kept for the next piece)."""
        n_pos = tokens.shape[1]
        most = rows_per_pass(self.model, n_pos, grad=False)
        begun, position = time.perf_counter(), start
        out: list[float] = []
        while position < n_pos and (not out or time.perf_counter() - begun < MAP_SECONDS):
            step = min(self._map_step, most, n_pos - position)
            tick = time.perf_counter()
            out += self._patched(
                tokens, states, layer, list(range(position, position + step)), target
            )
            position += step
            took = time.perf_counter() - tick
            if took < MAP_SECONDS / 8:
                self._map_step = min(2 * self._map_step, most)
            elif took > MAP_SECONDS / 2:
                self._map_step = max(1, self._map_step // 2)
        return out

    def _patched(
        self,
        tokens: torch.Tensor,
        states: _States,
        layer: int,
        positions: Sequence[int],
        target: int,
    ) -> list[float]:
        """The target's probability at the last position with the corrupt prompt's ``h_layer``
        replaced by the clean one's at each of ``positions`` (one row each; resumed from block
        ``layer``, only the last position read out), batched within the patching memory
        budget."""
        if self._resumer is None:
            self._resumer = Resumer(self.model)
        corrupt, clean = states.corrupt_h[layer], states.clean_h[layer]
        per = rows_per_pass(self.model, tokens.shape[1], grad=False)
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


def patch_example(model: Any) -> dict[str, str]:
    """The patch tab's example pair ``{clean, corrupt, target, about}`` for ``model``: the
    agreement case :data:`TOY_EXAMPLE` for the toy models' byte tokenizer, else the first
    built-in pair (:func:`lensdiv.data.pairs.builtin_pairs`: a capital city) with its answer as
    the target where that is one token (else no target: the clean prompt's prediction)."""
    tokenizer = getattr(model, "tokenizer", None)
    pairs = [] if tokenizer is None or is_byte_tokenizer(tokenizer) else builtin_pairs(tokenizer)
    if not pairs:
        example = dict(TOY_EXAMPLE)
    else:
        pair = pairs[0]
        example = {
            "clean": pair.clean,
            "corrupt": pair.corrupt,
            "target": pair.target if isinstance(pair.target, str) else "",
            "about": f"a fact: {pair.clean}{pair.target} (clean), against {pair.corrupt} … "
            "(corrupt)",
        }
    if example["target"] and model.to_tokens(example["target"], prepend_bos=False).shape[1] != 1:
        example["target"] = ""  # not one token here: the clean prompt's prediction
    return example


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
    """``request[name]`` when it is a ``kind`` (a string: text that encodes as UTF-8), else one
    :class:`RequestError` line; every field of every request is read here."""
    value = request.get(name, default)
    if value is None or value is default:
        return value
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise RequestError(f"{name} must be {_TYPES[kind]}, got {json.dumps(value)[:40]}")
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # JSON's "\ud800" escapes decode to lone surrogates
        except UnicodeEncodeError as err:
            raise RequestError(
                f"{name} is not valid text: {err.reason} at character {err.start}"
            ) from None
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
