"""The prompt view of one prompt: what every residual state predicts at every position.

Readings of the same grid (:class:`~lensdiv.view.prompt.PromptView`; several side by side in a
:class:`~lensdiv.view.prompt.PromptViews`):

- ``lens="logit"`` (docs/science.md A2): each block input ``h_l`` (and the final residual ``h_L``)
  through the final norm and the unembedding; the top row is the model's output.
- ``lens="last-block"`` (docs/science.md C1): each ``h_l`` through the final block first, then the
  final norm and the unembedding; at ``l = L − 1`` this is the model's output.
- ``lens="patchscope"`` (docs/science.md P1): each ``h_l`` patched into an inspection prompt
  (:mod:`lensdiv.ops.blocklens`), the model run on, the prompt's last position read out.
- a fitted lens (``lens="tuned:PATH"``, ``"jacobian:PATH"``, ``"affine:PATH"``; docs/science.md
  D1–D3): each ``h_l`` through the lens' translator ``T_l``, then the final norm and unembedding.
- ``skip=s``: the logit lens of the model with block ``s`` skipped (``h_{s+1} := h_s``, or only
  its ``attn`` / ``mlp`` write zeroed) at every position but the first (docs/science.md A3's
  current mode); the KL compares each cell with the *unskipped* model's output, so the top row
  shows what skipping the block changed.

Readouts are float32 whatever the model's dtype (:mod:`lensdiv.ops.readout`, the readout every
analyzer shares): the final norm and unembedding are applied to float32 copies of the residual
states with float32 weights; the cells come from the logits and one log-partition per row, in
blocks of rows (:mod:`lensdiv.ops.cells`; ``products="bf16"`` or ``"auto"``, what ``lensdiv
explore`` uses, takes the vocabulary-wide sums from bfloat16 products and re-reads every shown
number in float32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import DataError, OptionError
from lensdiv.core.provenance import versions
from lensdiv.models.load import load_model
from lensdiv.ops.capture import capture
from lensdiv.ops.cells import Cells, cells, describe
from lensdiv.ops.lens_specs import is_path, parse_lens
from lensdiv.ops.readout import Workspace, final_readout, readout_dtype
from lensdiv.ops.token_text import token_text
from lensdiv.ops.translators import LENS_KINDS, Lens, split_unquoted
from lensdiv.view.prompt import PromptView, PromptViews

PARTS = ("block", "attn", "mlp")


def prompt_view(
    model: Bridge,
    text: str,
    *,
    top_k: int = 3,
    lens: Any = "logit",
    skip: int | None = None,
    part: str = "block",
    prepend_bos: bool = True,
    device: Any = None,
    dtype: Any = None,
    products: str = "float32",
    workspace: Workspace | None = None,
) -> Any:
    """What every residual state of ``model`` predicts at every position of ``text``.

    Args:
        model: A ``TransformerBridge`` or a model spec (``"toy"``, ``"gpt2"``, a folder).
        text: The prompt.
        top_k: Tokens kept per cell (shown on hover).
        lens: Any lens ``--lens`` takes (:func:`~lensdiv.ops.lens_specs.parse_lens`:
            ``"logit"``, ``"last-block"``, ``"patchscope[:OPTIONS]"``, a fitted lens
            ``"tuned:PATH"``, ``"jacobian:PATH"``, ``"affine:PATH"``, or a
            :class:`~lensdiv.ops.translators.Lens`), or several of them (a comma-separated
            string or a list): then a :class:`~lensdiv.view.prompt.PromptViews`, the lenses
            side by side.
        skip: Skip this block (0-based) at every position but the first; logit lens only.
        part: What the skip removes: the whole ``block``, or only its ``attn`` or ``mlp`` write.
        prepend_bos: Put the tokenizer's BOS token first (as the model was trained).
        device, dtype: Where and in which precision to load ``model`` when it is a spec.
        products: How the unembedding products are computed (:data:`lensdiv.ops.cells.PRODUCTS`):
            ``"float32"`` (exact, the default), ``"bf16"`` (the vocabulary-wide sums from
            bfloat16 products, every number shown re-read in float32) or ``"auto"`` (``"bf16"``
            where the hardware has fast bfloat16 and the unembedding is large).
        workspace: Scratch buffers to reuse between calls (the explore server keeps one).

    Returns:
        A :class:`~lensdiv.view.prompt.PromptView` (or, for several lenses, a
        :class:`~lensdiv.view.prompt.PromptViews`): ``print`` it, display it in a notebook,
        ``save("view.html")`` / ``save("view.png")``.

    Raises:
        OptionError: A bad ``top_k``, ``lens``, ``skip`` or ``part``.
        LensError: A fitted lens that cannot be read or does not fit the model.
        DataError: An empty prompt, or one longer than the model's context.
    """
    if isinstance(model, str):
        model = load_model(model, device=device, dtype=dtype)
    lenses = _lenses(lens)
    if len(lenses) > 1:
        if skip is not None:
            raise OptionError("--skip shows one lens", hint="give --lens one lens with --skip")
        return PromptViews(
            tuple(
                prompt_view(
                    model,
                    text,
                    top_k=top_k,
                    lens=one,
                    prepend_bos=prepend_bos,
                    products=products,
                    workspace=workspace,
                )
                for one in lenses
            )
        )
    lens = lenses[0]
    info = ModelInfo.from_model(model)
    L = info.n_layers
    lens.check(info, model)
    if skip is not None and not lens.identity:
        raise OptionError("--skip works with the logit lens only", hint="drop --lens")
    _check_options(top_k, skip, part, L)
    tokens = _tokens(model, text, prepend_bos)
    grid, labels, how = _grid(
        model, info, lens, tokens, skip, part, top_k=top_k, products=products, workspace=workspace
    )
    title, note = _describe(lens, skip, part, L)
    fields = _view(model, info, tokens[0], grid, labels, title, note, lens.kind, skip)
    meta = _meta(model, lens, grid, how, top_k, prepend_bos, skip, part)
    return PromptView(**fields, meta=meta)


def _grid(
    model: Bridge,
    info: ModelInfo,
    lens: Lens,
    tokens: Int[Tensor, "1 pos"],
    skip: int | None,
    part: str,
    *,
    top_k: int,
    products: str,
    workspace: Workspace | None,
) -> tuple[Cells, list[str], str]:
    """The cells of every row shown (each ``h_l`` through ``lens``, or the logit lens of the
    model with block ``skip`` skipped; the KL always to the unskipped output), the rows'
    labels, and how they were read out."""
    L = info.n_layers
    names = [info.resid(layer) for layer in range(L + 1)]
    with torch.no_grad():
        _, clean = capture(model, tokens, names, need_logits=False)
        _, how = float32_readout(model)
        full = final_readout(model)
        if skip is not None:
            with model.hooks(fwd_hooks=skip_hooks(skip, part)):
                _, states = capture(model, tokens, names, need_logits=False)
            rows = [states[name][0] for name in names]
            labels = [f"h{layer}" for layer in range(L + 1)]
        else:
            flat = [clean[name][0] for name in names]
            every = torch.arange(tokens.shape[1], device=tokens.device)
            read = lens.reader(model, tokens, dtype=full.dtype, device=full.device)
            shown = lens.shown(L)
            rows = [read(flat, layer, every) for layer in shown]
            labels = [f"h{layer}" for layer in shown]
        following = torch.cat([tokens[0, 1:], tokens[0, :1]])  # the last one unused
        grid = cells(
            full,
            rows,
            clean[names[-1]][0],
            following,
            k=top_k,
            products=products,
            workspace=workspace,
        )
    return grid, labels, how


def _meta(
    model: Bridge,
    lens: Lens,
    grid: Cells,
    how: str,
    top_k: int,
    prepend_bos: bool,
    skip: int | None,
    part: str,
) -> dict[str, Any]:
    """What a view records of how it was made (lens, options, the readout's precision)."""
    dtype = next(model.parameters()).dtype
    return {
        "lensdiv": versions()["lensdiv"],
        "lens": "skip" if skip is not None else lens.kind,
        **({"translator": lens.describe()} if not lens.identity else {}),
        "top_k": top_k,
        "prepend_bos": prepend_bos,
        "readout_dtype": str(readout_dtype(dtype)).replace("torch.", ""),
        "readout": how if grid.products == "float32" else f"{how}; {describe(grid.products)}",
        "model_dtype": str(dtype).replace("torch.", ""),
        **({"skip": skip, "part": part} if skip is not None else {}),
    }


def float32_readout(model: Bridge) -> tuple[Callable[[Tensor], Tensor], str]:
    """A function from residual vectors ``[n, d_model]`` to readout-dtype logits ``[n, d_vocab]``
    (float32; float64 for a float64 model), and a description of the readout.

    The shared readout of :func:`lensdiv.ops.readout.final_readout`: the model's final norm
    decomposed and verified against its own module, and the unembedding, in the readout dtype.
    """
    readout = final_readout(model)

    def read(h: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_vocab"]:
        return readout.logits(h).to(h.device)

    return read, f"final norm and unembedding in {readout.precision}"


def skip_hooks(skip: int, part: str) -> list[tuple[str, Callable[..., Tensor]]]:
    """Hooks that skip block ``skip`` (or zero its ``attn`` / ``mlp`` write) at positions ≥ 1."""
    if part != "block":

        def zero(tensor: Tensor, *, hook: Any) -> Tensor:
            tensor = tensor.clone()
            tensor[:, 1:] = 0
            return tensor

        return [(f"blocks.{skip}.hook_{part}_out", zero)]
    kept: dict[str, Tensor] = {}

    def keep(tensor: Tensor, *, hook: Any) -> Tensor:
        kept["h"] = tensor.detach().clone()
        return tensor

    def replace(tensor: Tensor, *, hook: Any) -> Tensor:
        tensor = tensor.clone()
        tensor[:, 1:] = kept["h"][:, 1:].to(tensor.dtype)
        return tensor

    return [(f"blocks.{skip}.hook_resid_pre", keep), (f"blocks.{skip}.hook_resid_post", replace)]


def _view(
    model: Bridge,
    info: ModelInfo,
    tokens: Int[Tensor, " pos"],
    grid: Cells,
    labels: list[str],
    title: str,
    note: str,
    lens: str,
    skip: int | None,
) -> dict[str, Any]:
    """The view's fields from the grid's cells (:func:`lensdiv.ops.cells.cells`)."""
    n_pos = tokens.shape[0]
    last = torch.arange(n_pos, device=grid.kl.device) == n_pos - 1
    decode = _decoder(model)
    name = str(getattr(getattr(model, "lensdiv_spec", None), "spec", "") or info.name)
    return {
        "model": name,
        "lens": "skip" if skip is not None else lens,
        "title": title,
        "note": note,
        "tokens": [decode(int(t)) for t in tokens],
        "rows": labels,
        "top_tokens": [[[decode(i) for i in cell] for cell in row] for row in grid.top.tolist()],
        "top_probs": grid.top_logp.exp().tolist(),
        "kl": grid.kl.tolist(),
        "entropy": grid.entropy.tolist(),
        "next_prob": grid.next_logp.exp().masked_fill(last, float("nan")).tolist(),
        "next_rank": grid.next_rank.masked_fill(last, -1).tolist(),
    }


def _describe(lens: Lens, skip: int | None, part: str, n_layers: int) -> tuple[str, str]:
    if skip is not None:
        what = f"block {skip}" if part == "block" else f"the {part} write of block {skip}"
        return (
            f"Logit lens with {what} skipped",
            f"Row h_l: the residual stream before block l with {what} skipped at every position "
            f"but the first, through the final norm and unembedding; KL is to the unskipped "
            f"model's output.",
        )
    return lens.label, lens.lens_kind.explain(n_layers)


def _lenses(lens: Any) -> list[Lens]:
    """``lens`` as a list of lenses (a comma-separated string, a list, or one)."""
    given = (
        split_unquoted(lens, ",")
        if isinstance(lens, str)
        else list(lens)
        if isinstance(lens, (list, tuple))
        else [lens]
    )
    out: list[Lens] = []
    for one in given:
        name = one.strip() if isinstance(one, str) else one
        if isinstance(name, str) and ":" not in name and not is_path(name):
            kind = LENS_KINDS.get(name.lower())
            if kind is None or kind.make is None:
                made = [k for k, found in LENS_KINDS.items() if found.make is not None]
                raise OptionError(
                    f"unknown lens {name!r}",
                    hint=f"use {', '.join(made)}, or a fitted lens: tuned:PATH, jacobian:PATH, "
                    "affine:PATH, or a lens folder (lenses are separated by commas: quote a "
                    'patchscope prompt that has one, prompt="a, b", or use prompt_file=PATH)',
                )
        out.append(parse_lens(name))
    if not out:
        raise OptionError("no lens given", hint="e.g. --lens logit,tuned:DIR")
    return out


def _check_options(top_k: int, skip: int | None, part: str, n_layers: int) -> None:
    if top_k < 1:
        raise OptionError(f"--top-k must be at least 1, got {top_k}")
    if part not in PARTS:
        raise OptionError(f"unknown part {part!r}", hint=f"use one of {', '.join(PARTS)}")
    if skip is not None and not 0 <= skip < n_layers:
        raise OptionError(
            f"cannot skip block {skip}: the model has {n_layers} blocks (0-{n_layers - 1})"
        )


def _tokens(model: Bridge, text: str, prepend_bos: bool) -> Int[Tensor, "1 pos"]:
    if not text.strip():
        raise DataError(
            "the prompt is empty", hint='pass some text, e.g. "The capital of France is"'
        )
    # truncate=False: TransformerBridge.to_tokens would cut a long prompt to the context silently
    tokens = model.to_tokens(text, prepend_bos=prepend_bos, truncate=False)
    n_ctx = int(getattr(model.cfg, "n_ctx", 0) or 0)
    if n_ctx and tokens.shape[1] > n_ctx:
        raise DataError(
            f"the prompt is {tokens.shape[1]} tokens long but the model reads at most {n_ctx}",
            hint="shorten it",
        )
    return tokens


def _decoder(model: Bridge) -> Callable[[int], str]:
    """Token id → its text (a byte without one as ``<0xC3>``: :func:`token_text`), cached (one
    decode per distinct id)."""
    tokenizer = model.tokenizer
    seen: dict[int, str] = {}

    def decode(token: int) -> str:
        if token not in seen:
            seen[token] = token_text(tokenizer, token)
        return seen[token]

    return decode
