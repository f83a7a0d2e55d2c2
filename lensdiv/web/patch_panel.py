"""The patch tab of ``lensdiv explore``: clean → corrupt activation patching, one cell or the map.

:class:`PatchPanel` runs the corrupt prompt with the clean prompt's residual ``h_l`` copied in at
one position (or at a piece of a row of the full map: the page asks for the pieces one by one,
so other requests get through between them; :meth:`PatchPanel.patch_map` puts them together),
read as the target token's probability at the last position (resumed from block ``l`` by
:class:`~lensdiv.ops.resume.Resumer`, only the last position unembedded:
:func:`lensdiv.ops.patching.last_position`).

Every answer says where the two prompts differ (``differ``: the positions whose tokens do) and
how far apart they put the target (``gap``: clean − corrupt probability). Under ``min_gap``
(:data:`~lensdiv.web.asks.MIN_GAP` unless the request lowers it) the share of that gap a patch
recovers is mostly noise (37 % against 37 %), so the answer carries ``gap_note`` (why), a cell
has no ``recovered`` share and a map is refused with that line.

:func:`patch_example` is the tab's example pair: on the toy models a subject–verb agreement case
from their corpus whose answer patching visibly moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.data.pairs import builtin_pairs, is_byte_tokenizer
from lensdiv.ops.capture import capture
from lensdiv.ops.patching import last_position, rows_per_pass
from lensdiv.ops.prompt import float32_readout
from lensdiv.ops.resume import Resumer
from lensdiv.ops.token_text import token_text
from lensdiv.web.asks import PatchAsk, RequestError, finite

MAP_SECONDS = 0.25  # a piece of the patching map holds the model about this long

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


class _States(NamedTuple):
    """The captured states of one clean/corrupt pair (rows ``h0`` … ``h_L``)."""

    key: tuple[tuple[int, ...], tuple[int, ...]]
    clean_h: list[torch.Tensor]
    corrupt_h: list[torch.Tensor]
    clean_p: torch.Tensor  # the output distributions at the last position
    corrupt_p: torch.Tensor


def gap_note(clean: float, corrupt: float, min_gap: float) -> str | None:
    """Why the share of the clean − corrupt gap would be noise, or ``None`` when it is not."""
    if abs(clean - corrupt) >= min_gap:
        return None
    return (
        f"the clean and corrupt prompts give the target about the same probability "
        f"({100 * clean:.1f} % and {100 * corrupt:.1f} %): a gap of "
        f"{100 * abs(clean - corrupt):.1f} points, under the {100 * min_gap:g}-point threshold, "
        "so the share of it a patch recovers would colour noise"
    )


class PatchPanel:
    """Patching on one model; the last clean/corrupt pair's states kept between requests.

    Args:
        model: A loaded ``TransformerBridge``.
        info: Its :class:`ModelInfo`.
        tokens: A prompt's tokens, its length checked against the context (the session's).
    """

    def __init__(
        self, model: Bridge, info: ModelInfo, tokens: Callable[[str], torch.Tensor]
    ) -> None:
        self.model, self.info, self.tokens = model, info, tokens
        self._resumer: Resumer | None = None
        self._captured: _States | None = None  # the last clean/corrupt pair's states
        self._map_step = 4  # positions per batch of a map piece (follows the time taken)

    def patch(self, ask: PatchAsk) -> dict[str, Any]:
        """Run ``ask.corrupt`` with the clean prompt's ``h_layer`` at ``ask.position``; the
        probability of ``ask.target`` (one token; default the clean run's top prediction) at the
        last position.

        With ``ask.map``, one *piece* of the full map instead: ``h_layer`` patched at the
        positions ``start, start + 1, …`` for about :data:`MAP_SECONDS` (at least one position,
        never past the row's end), as ``probs``, with ``next`` — the ``{layer, start}`` to ask
        for the next piece, ``None`` after the last — so that the model is never held for a
        whole map. A map whose gap is under ``ask.min_gap`` is refused (the module's
        description).
        """
        begun = time.perf_counter()
        clean, corrupt = self.tokens(ask.clean), self.tokens(ask.corrupt)
        if clean.shape[1] != corrupt.shape[1]:
            raise RequestError(
                f"the clean prompt is {clean.shape[1]} tokens and the corrupt one "
                f"{corrupt.shape[1]}: patching needs prompts of the same length",
                hint="edit the corrupt prompt to the clean one's length",
            )
        L, n_pos = self.info.n_layers, clean.shape[1]
        layer = (0 if ask.layer is None else ask.layer) if ask.map else ask.layer
        position = ask.start if ask.map else ask.position
        if layer is None or position is None:
            raise RequestError("give layer and position (or map: true)")
        if not 0 <= layer <= L:
            raise RequestError(f"layer {layer} is outside 0-{L} (h0 … h{L})")
        if not 0 <= position < n_pos:
            raise RequestError(f"position {position} is outside 0-{n_pos - 1}")
        with torch.no_grad():
            states = self._states(clean, corrupt)
            target = self._target(ask.target, states.clean_p)
            out = self._header(clean, corrupt, target, states, ask.min_gap)
            if ask.map:
                if out["gap_note"] is not None:
                    raise RequestError(
                        f"no patching map: {out['gap_note']}",
                        hint="choose a target the two prompts disagree on, or another pair",
                    )
                probs = self._piece(corrupt, states, layer, position, target)
                end = position + len(probs)
                after = {"layer": layer, "start": end} if end < n_pos else None
                if after is None and layer < L:
                    after = {"layer": layer + 1, "start": 0}
                out.update(layer=layer, start=position, probs=probs, next=after)
            else:
                patched = self._patched(corrupt, states, layer, [position], target)[0]
                gap = out["gap"]
                share = (patched - out["corrupt_prob"]) / gap if out["gap_note"] is None else None
                out.update(layer=layer, position=position, patched_prob=patched, recovered=share)
        out["ms"] = round(1000 * (time.perf_counter() - begun), 1)
        return finite(out)

    def patch_map(self, ask: PatchAsk) -> dict[str, Any]:
        """The full patching map of ``clean`` → ``corrupt``: every piece :meth:`patch` gives for
        ``map: true``, in order, as ``map[layer][position]`` (rows ``h0`` … ``h_L``)."""
        rows: list[list[float]] = [[] for _ in range(self.info.n_layers + 1)]
        layer, start = 0, 0
        while True:
            piece = self.patch(replace(ask, map=True, layer=layer, start=start))
            rows[piece["layer"]] += piece["probs"]
            if piece["next"] is None:
                break
            layer, start = piece["next"]["layer"], piece["next"]["start"]
        keep = ("target", "target_id", "clean_prob", "corrupt_prob", "gap", "differ")
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
        self,
        clean: torch.Tensor,
        corrupt: torch.Tensor,
        target: int,
        states: _States,
        min_gap: float,
    ) -> dict[str, Any]:
        label = self.model.tokenizer
        clean_p, corrupt_p = float(states.clean_p[target]), float(states.corrupt_p[target])
        return {
            "target": token_text(label, target),
            "target_id": target,
            "clean_prob": clean_p,
            "corrupt_prob": corrupt_p,
            "gap": clean_p - corrupt_p,
            "min_gap": min_gap,
            "gap_note": gap_note(clean_p, corrupt_p, min_gap),
            "clean_tokens": [token_text(label, int(t)) for t in clean[0]],
            "corrupt_tokens": [token_text(label, int(t)) for t in corrupt[0]],
            "differ": [
                i
                for i, (a, b) in enumerate(zip(clean[0].tolist(), corrupt[0].tolist(), strict=True))
                if a != b
            ],
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


def patch_example(model: Bridge) -> dict[str, str]:
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
