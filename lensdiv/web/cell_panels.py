"""A pinned cell's panels in ``lensdiv explore``: the attention of its position in the block
that wrote its row, and what the model itself says about its state (a patchscope).

Both take the model, its :class:`~lensdiv.core.analyzer.ModelInfo`, the prompt's tokens (checked
by the session) and the parsed request; tokens are written as :func:`token_text` writes them (a
byte without text as ``<0xC3>``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.ops.attention import pattern_hook
from lensdiv.ops.blocklens import PatchscopeLens
from lensdiv.ops.capture import capture
from lensdiv.ops.inspection import inspection
from lensdiv.ops.token_text import token_text
from lensdiv.ops.translators import Lens
from lensdiv.web.asks import AttentionAsk, RequestError, SaysAsk, finite

SINK_EPS = 0.3  # a head whose weight on the sink exceeds this is marked (the ``sinks`` eps)


def attention(
    model: Bridge, info: ModelInfo, tokens: torch.Tensor, ask: AttentionAsk
) -> dict[str, Any]:
    """Where the query at ``ask.position`` attends in block ``ask.block``: each head's weights
    over the keys ``0..position`` and their mean over heads, with the sink (the first
    ``ask.first`` keys) and the heads whose weight on it exceeds :data:`SINK_EPS` (the ``sinks``
    analyzer's ``eps``) marked."""
    block, position = ask.block, ask.position
    assert block is not None and position is not None  # AttentionAsk checks
    L = info.n_layers
    if not 0 <= block < L:
        raise RequestError(f"block {block} is outside 0-{L - 1}")
    if not 0 <= position < tokens.shape[1]:
        raise RequestError(f"position {position} is outside 0-{tokens.shape[1] - 1}")
    start = time.perf_counter()
    with torch.no_grad():
        _, cache = capture(model, tokens, [pattern_hook(block)], need_logits=False)
    row = cache[pattern_hook(block)][0, :, position, : position + 1].double().cpu()
    sink = row[:, : ask.first].sum(-1)
    return finite(
        {
            "block": block,
            "position": position,
            "tokens": [token_text(model.tokenizer, int(t)) for t in tokens[0, : position + 1]],
            "heads": row.tolist(),
            "mean": row.mean(0).tolist(),
            "first": ask.first,
            "sink_mass": sink.tolist(),
            "sink_heads": [h for h, m in enumerate(sink.tolist()) if m > SINK_EPS],
            "ms": round(1000 * (time.perf_counter() - start), 1),
        }
    )


def says(
    model: Bridge, info: ModelInfo, lenses: dict[str, Lens], tokens: torch.Tensor, ask: SaysAsk
) -> dict[str, Any]:
    """The greedy continuation of a patchscope's inspection prompt with ``h_row`` at
    ``ask.position`` patched in (docs/science.md P1): ``ask.tokens`` tokens and their
    probabilities; ``ask.lens`` names the patchscope (its prompt, patch position and target
    rule)."""
    row, position = ask.row, ask.position
    assert row is not None and position is not None  # SaysAsk checks
    L = info.n_layers
    if not 0 <= row <= L:
        raise RequestError(f"row {row} is outside h0-h{L}")
    lens = lenses.get(ask.lens)
    if not isinstance(lens, PatchscopeLens):
        scopes = [k for k, v in lenses.items() if isinstance(v, PatchscopeLens)]
        raise RequestError(f"{ask.lens!r} is not a patchscope", hint=f"use {', '.join(scopes)}")
    if not 0 <= position < tokens.shape[1]:
        raise RequestError(f"position {position} is outside 0-{tokens.shape[1] - 1}")
    start = time.perf_counter()
    with torch.no_grad():
        _, cache = capture(model, tokens, [info.resid(row)], need_logits=False)
    h = cache[info.resid(row)][0, position]
    found = inspection(model, lens.prompt, lens.position)
    target = lens.target_layer(row, L)
    said, probs = found.generate(target, h, ask.tokens)
    text = [token_text(model.tokenizer, t) for t in said]
    return finite(
        {
            "lens": ask.lens,
            "row": row,
            "position": position,
            "target": target,
            "prompt": [token_text(model.tokenizer, t) for t in found.tokens_list],
            "patched": found.position,
            "tokens": text,
            "probs": probs,
            "text": model.tokenizer.decode(said),
            "ms": round(1000 * (time.perf_counter() - start), 1),
        }
    )
