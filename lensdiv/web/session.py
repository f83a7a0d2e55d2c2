"""What ``lensdiv explore`` computes, without the web: one loaded model and its lenses.

A :class:`Session` answers the page's questions from plain values (no HTTP here, so the
benchmarks and tests call it directly); each request is parsed into its frozen dataclass
(:mod:`lensdiv.web.asks`) and served by its panel:

- :meth:`Session.grid` (here): the prompt view (:func:`lensdiv.ops.prompt.prompt_view`) with one
  lens, or with a block (or its attention / MLP write) skipped, plus the output's KL to the
  unskipped run;
- :meth:`Session.patch`, :meth:`Session.patch_map`: clean → corrupt patching, one cell or a
  piece of the map (:mod:`lensdiv.web.patch_panel`), refused where the two prompts give the
  target about the same probability;
- :meth:`Session.attention`, :meth:`Session.says`: a pinned cell's attention and what the model
  says about its state (:mod:`lensdiv.web.cell_panels`);
- :meth:`Session.runs`, :meth:`Session.page`: the saved runs and studies under the ``--runs``
  folder, and the path of one's page, never a path outside it (:mod:`lensdiv.web.saved`).

:meth:`Session.describe` also names the patch tab's example pair
(:func:`~lensdiv.web.patch_panel.patch_example`).

Bad input raises a :class:`~lensdiv.core.errors.LensdivError` (the server answers 400 with its
line). A session serves one call at a time: its caller serialises them (the server holds its one
lock around every call; the model and the grid's buffers are shared).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lensdiv.core.analyzer import ModelInfo
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import DataError, LensdivError
from lensdiv.ops.cells import products_of
from lensdiv.ops.lens_specs import parse_lens
from lensdiv.ops.prompt import PARTS, prompt_view
from lensdiv.ops.readout import Workspace, final_readout
from lensdiv.ops.translators import LENS_KINDS, Lens
from lensdiv.web import cell_panels
from lensdiv.web.asks import (
    MIN_GAP,
    AttentionAsk,
    GridAsk,
    PatchAsk,
    RequestError,
    SaysAsk,
    finite,
    parse,
)
from lensdiv.web.patch_panel import PatchPanel, patch_example
from lensdiv.web.saved import saved_page, saved_pages


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
        model: Bridge,
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
        self.example = patch_example(model)
        self.patcher = PatchPanel(model, self.info, self.tokens)

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
            "min_gap": MIN_GAP,
        }

    # -- the grid ------------------------------------------------------------------------------
    def grid(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The prompt view of ``text`` with ``lens`` (default ``logit``), or with block ``skip``
        (its ``part``: ``block``, ``attn`` or ``mlp``) skipped, as JSON-able data."""
        ask = parse(GridAsk, dict(request))
        if ask.lens not in self.lenses:
            raise RequestError(
                f"unknown lens {ask.lens!r}", hint=f"this server has: {', '.join(self.lenses)}"
            )
        L, skip = self.info.n_layers, ask.skip
        if skip is not None:
            if not 0 <= skip < L:
                raise RequestError(f"cannot skip block {skip}: the model has blocks 0-{L - 1}")
            if not self.lenses[ask.lens].identity:
                raise RequestError(
                    "a skipped block is shown with the logit lens", hint="lens=logit"
                )
        start = time.perf_counter()
        self.tokens(ask.text)  # the context, checked without truncation
        view = prompt_view(
            self.model,
            ask.text,
            top_k=ask.top_k,
            lens=self.lenses[ask.lens],
            skip=skip,
            part=ask.part,
            products=self.products,
            workspace=self.workspace,
        )
        out = view.to_dict()
        out["lens"] = ask.lens
        if skip is not None:  # the top row's KL: the skipped output against the unskipped one
            output_kl = list(view.kl[-1])
            later = output_kl[1:] or output_kl
            out["skip"] = {
                "block": skip,
                "part": ask.part,
                "output_kl": output_kl,
                "mean_output_kl": sum(later) / len(later),
            }
        out["ms"] = round(1000 * (time.perf_counter() - start), 1)
        return finite(out)

    # -- the panels --------------------------------------------------------------------------
    def patch(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One patched cell, or a piece of the map (:meth:`PatchPanel.patch`)."""
        return self.patcher.patch(parse(PatchAsk, dict(request)))

    def patch_map(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The whole patching map (:meth:`PatchPanel.patch_map`)."""
        return self.patcher.patch_map(parse(PatchAsk, {**request, "map": True}))

    def attention(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """One position's attention in one block (:func:`cell_panels.attention`)."""
        ask = parse(AttentionAsk, dict(request))
        return cell_panels.attention(self.model, self.info, self.tokens(ask.text), ask)

    def says(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """What the model says about ``h_row`` at a position (:func:`cell_panels.says`)."""
        ask = parse(SaysAsk, dict(request))
        return cell_panels.says(self.model, self.info, self.lenses, self.tokens(ask.text), ask)

    def tokens(self, text: str) -> torch.Tensor:
        """``text``'s tokens (a BOS first), refused past the model's context."""
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
        """The runs and studies under the runs folder (:func:`saved_pages`)."""
        return saved_pages(self.runs_root)

    def page(self, relative: str) -> Path:
        """The report.html or study.html at ``relative`` under the runs folder
        (:func:`saved_page`: a :class:`RequestError` for any other path)."""
        return saved_page(self.runs_root, relative)


__all__ = ["LensdivError", "RequestError", "Session", "finite"]
