"""What the exercises work on: the default toy model, its prompts, residual states and readout.

Everything here is given to the student (not an exercise): loading the toy model once per
process, packing prompts into a right-padded batch with BOS, caching the residual states
``h_0 .. h_L`` of a (hooked) run, the final norm's and unembedding's parameters, and a
clean/corrupt pair of the toy's knowledge base.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any
from urllib.parse import quote

import torch
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.data.pairs import answer_token, builtin_pairs
from lensdiv.models.load import load_model
from lensdiv.ops.capture import capture
from lensdiv.ops.members import member_hooks, member_logits
from lensdiv.ops.readout import final_readout

Hook = tuple[str, Callable[..., Any]]

MODEL = "toy"
PROMPTS = (
    "The happy dog runs to the park",
    "boss(ka)=",
    "A cat sat on the mat and the cat",
)
EXPLORE_PORT = 8765


def fast() -> bool:
    """Whether the notebook runs in the tests' fast mode (``LENSDIV_TUTORIAL_FAST=1``)."""
    return os.environ.get("LENSDIV_TUTORIAL_FAST") == "1"


@cache
def toy(name: str = MODEL) -> Any:
    """The toy model (a ``TransformerBridge``), loaded once per process; trained on first use."""
    model = load_model(name)
    model.eval()
    return model


def tokens(model: Bridge, texts: str | Sequence[str]) -> tuple[Tensor, Tensor]:
    """``(tokens, mask)`` of one or more prompts: BOS first, rows right-padded with the pad id.

    ``mask`` is True at real tokens (BOS included) and False at padding.
    """
    texts = [texts] if isinstance(texts, str) else list(texts)
    rows = [model.to_tokens(text)[0] for text in texts]
    width = max(len(r) for r in rows)
    pad = model.tokenizer.pad_token_id
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
        mask[i, : len(row)] = True
    return out, mask


def residual_states(
    model: Bridge, tokens: Tensor, fwd_hooks: Sequence[Hook] = ()
) -> tuple[Tensor, Tensor]:
    """``(logits, states)`` of a run with ``fwd_hooks`` attached: ``states[l] = h_l``,
    ``[L + 1, batch, pos, d_model]`` (``h_0`` the embedding, ``h_L`` the last block's output
    before the final norm)."""
    L = model.cfg.n_layers
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(L)]
    names.append(f"blocks.{L - 1}.hook_resid_post")
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks)):
        logits, cache = capture(model, tokens, names, need_logits=True)
    assert logits is not None
    return logits.float(), torch.stack([cache[n].float() for n in names])


def readout_params(model: Bridge) -> dict[str, Any]:
    """The final LayerNorm's ``w``, ``b``, ``eps`` and the unembedding ``W_U``, ``b_U``."""
    r = final_readout(model)
    return {"ln_w": r.weight, "ln_b": r.bias, "eps": r.eps, "W_U": r.W_U, "b_U": r.b_U}


def pair(model: Bridge, index: int = 0) -> dict[str, Any]:
    """One clean/corrupt pair of the toy's knowledge base, tokenised (BOS first).

    ``clean``/``corrupt``: ``[1, pos]`` tokens of equal length; ``target``/``foil``: the answer
    token ids of the clean and the corrupt prompt, predicted at the last position.
    """
    p = builtin_pairs(model.tokenizer)[index]
    V = model.cfg.d_vocab
    return {
        "text": (p.clean, p.corrupt),
        "clean": model.to_tokens(p.clean),
        "corrupt": model.to_tokens(p.corrupt),
        "target": answer_token(model.tokenizer, p.clean, p.target, V, "target"),
        "foil": answer_token(model.tokenizer, p.corrupt, str(p.foil), V, "foil"),
    }


def explore_query(text: str, *, skip: int | None = None, corrupt: str | None = None) -> str:
    """The query that opens the explore page on this prompt (``?text=…``; with ``skip`` the block
    skipped; with ``corrupt`` the patch tab on the pair)."""
    query = f"?text={quote(text)}"
    if skip is not None:
        query += f"&skip={skip}"
    if corrupt is not None:
        query += f"&clean={quote(text)}&corrupt={quote(corrupt)}&tab=patch"
    return query


def explore(text: str, *, skip: int | None = None, corrupt: str | None = None) -> str:
    """The command and the address that open ``lensdiv explore`` on this prompt."""
    query = explore_query(text, skip=skip, corrupt=corrupt)
    return (
        f"In a terminal: lensdiv explore {MODEL}   then open "
        f"http://127.0.0.1:{EXPLORE_PORT}/{query}"
    )


def member_predictions(model: Bridge, text: str) -> tuple[Tensor, Tensor]:
    """``(f, y)`` on one prompt: ``f[i]`` the logits member ``i`` predicts at every position that
    has a next token, ``[M, n, d_vocab]`` (``M = 2L + 1``: the embedding, then each block's
    attention and MLP writes, read on the final residual's scale, so that ``f.mean(0)`` is the
    model's logits); ``y`` the next tokens ``[n]`` (docs/science.md#bias)."""
    info = ModelInfo.from_model(model)
    ids, _ = tokens(model, text)
    with torch.no_grad():
        _, cache = capture(model, ids, member_hooks(info), need_logits=False)
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, :-1] = True
    z = member_logits(model, cache, info, keep)  # Σ_i z_i = the logits
    return z * z.shape[0], ids[0, 1:]
