"""``patch`` — causal interventions on clean/corrupt prompt pairs (docs/science.md A4).

Three measurements on the same pairs ``{clean, corrupt, target[, foil]}``:

1. **Activation patching** clean → corrupt over (layer × position) for ``resid_pre``,
   ``attn_out`` and ``mlp_out``: run the corrupt prompt with one clean activation copied in and
   score it by ``(m_patched - m_corrupt) / (m_clean - m_corrupt)`` (0: no effect, 1: the clean
   answer is fully restored), where the metric ``m`` is the target-minus-foil logit difference or
   the target probability at the answer position. Mean and standard error over pairs.
2. **Residual erasure**: replace ``h_l(t)`` by the dataset-mean residual of layer ``l`` (mean over
   every clean prompt's positions, BOS excluded by default, summed in pass 0) and measure
   ``||p - p̃||₂`` between the clean and the erased output distributions at the answer position:
   an ``[L+1, T]`` map.
3. **Integrated gradients** of the metric with respect to each layer output ``h_l`` (``l = 0..L``)
   of the clean prompt, from the baseline ``h̄_l`` (the prompt's mean over positions, BOS excluded
   by default) along the straight path, midpoint rule with ``ig_steps`` steps:
   ``attr(l, t) = Σ_d (h - h̄)·mean grad``.
   Completeness ``Σ_t attr(l, t) ≈ f(h_l) - f(h̄_l)`` is checked and its worst error reported.

Conventions:

- **Pairs** come from a JSONL file (``-O patch.pairs=FILE``, one object per line; BOS is
  prepended) or, by default, from the built-in set; the answer position is the prompt's last
  token and the answer token is the target's first token as a continuation of the prompt (see
  :mod:`lensdiv.data.pairs`).
- **Alignment**: clean and corrupt of one pair must tokenise to the same length (positions are
  compared one to one); pairs of different lengths are aligned **at the end**: column ``j`` of a
  ``[.., T]`` map is the position ``j - (T - 1)`` tokens before the answer position, and a column
  averages only the pairs long enough to have it.
- Pairs whose clean and corrupt metrics coincide (``|Δ| < 1e-6``) cannot be normalised: they are
  left out of the patching scores (counted in ``meta["degenerate_pairs"]``) but still enter the
  erasure and IG maps.

Interventions resume the forward pass from the patched layer and batch every site and position
of a layer into one pass (:mod:`lensdiv.ops.patching`; the tests check it agrees with
TransformerLens' ``get_act_patch_*``).

State (``T`` is a prompt length in tokens; sums unless said otherwise):

- pass 0: ``lengths`` (set of the ``T`` seen), ``pairs`` (rows keyed by the pair's line: tokens,
  answer ids, clean and corrupt metric), ``all/T`` and ``n/T`` (pairs, and pairs that can be
  normalised), ``SITE/T/raw|sum|sq`` (raw metric; normalised score and its square, over pairs),
  ``ig/T/sum|sq|n`` and ``ig/abs_error|rel_error`` (maxima), ``resid_sum``/``resid_n`` (for the
  erasure mean, with ``erasure``), ``intervention`` (set of the resumer's modes).
- start of pass 1: ``erase/mean`` (fixed: ``resid_sum / resid_n``; the sums are dropped).
- pass 1: ``erase/T/sum|sq|n`` and ``erase/intervention`` (set).

The package: this module is the analyzer (options, pairs, the measurements of both passes);
:mod:`~lensdiv.analyzers.patch.maps` turns the sums into :class:`PatchingMaps` (the numbers, from
the state alone); :mod:`~lensdiv.analyzers.patch.present` turns those into the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.analyzers.patch.maps import EPS, Aligned, PairMetrics, PatchingMaps
from lensdiv.analyzers.patch.present import present
from lensdiv.core.analyzer import Analyzer, Batch, ModelInfo, Step
from lensdiv.core.bridge import Bridge
from lensdiv.core.devices import stack_on
from lensdiv.core.errors import DataError
from lensdiv.core.results import Result
from lensdiv.core.stats import Stats
from lensdiv.data.pairs import builtin_pairs, pair_batches, read_pairs
from lensdiv.ops.capture import capture
from lensdiv.ops.patching import integrated_gradients, run_patches, run_variants, site_hook
from lensdiv.ops.readout import final_readout
from lensdiv.ops.resume import Resumer, resumer_for

__all__ = ["SITES", "Aligned", "PairMetrics", "Patching", "PatchingMaps", "metric_values"]

SITES = ("resid_pre", "attn_out", "mlp_out")


# -- measurements -------------------------------------------------------------------------------
def metric_values(
    logits: Float[Tensor, "row d_vocab"],
    target: Int[Tensor, " row"],
    foil: Int[Tensor, " row"],
    metric: str,
) -> Float[Tensor, " row"]:
    """``logit[target] - logit[foil]`` (``logit_diff``) or ``p(target)`` (``prob``), in float32
    (float64 logits stay float64)."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    if metric == "logit_diff":
        return logits.gather(-1, target[:, None])[:, 0] - logits.gather(-1, foil[:, None])[:, 0]
    return logits.log_softmax(-1).gather(-1, target[:, None])[:, 0].exp()


# -- the analyzer -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Patching(Analyzer):
    """Activation patching, residual erasure and integrated gradients on clean/corrupt pairs.

    Args:
        pairs: ``"builtin"`` or a JSONL file of ``{clean, corrupt, target[, foil]}`` per line.
        metric: ``logit_diff`` (target minus foil logit; needs a foil) or ``prob`` (target
            probability), at the answer position.
        sites: Activations to patch: any of ``resid_pre``, ``attn_out``, ``mlp_out``.
        ig_steps: Integration steps of integrated gradients (the source's 256); ``0`` skips IG.
            The midpoint rule's error falls as ``1/steps²``: on the trained default toy 256 steps
            leave a completeness error of at most 1e-4 (0.1 % relative for the worst pair and
            layer), 64 steps 2e-3 (2 %) at a quarter of the cost. The error reached is in the
            result.
        erasure: Run the residual-erasure map (a second pass over the pairs).
        exclude_bos: Leave BOS out of the dataset-mean residual and of the IG baseline mean.
        prepend_bos: Put the tokenizer's BOS token before every prompt.
        batch_size: Pairs per batch (pairs are batched by token length).
    """

    name = "patch"
    aliases = ("patching", "causal")
    description = (
        "Activation patching (resid/attn/mlp x position), residual erasure and integrated "
        "gradients on clean/corrupt pairs"
    )
    depth_profiles = ("depth.resid_pre_max",)
    extra_forwards = True
    needs_grad = True
    passes: ClassVar[int] = 2

    pairs: str = "builtin"
    metric: Literal["logit_diff", "prob"] = "logit_diff"
    sites: tuple[str, ...] = SITES
    ig_steps: int = 256
    erasure: bool = True
    exclude_bos: bool = True
    prepend_bos: bool = True
    batch_size: int = 8

    def __post_init__(self) -> None:
        unknown = [s for s in self.sites if s not in SITES]
        if unknown or not self.sites:
            raise ValueError(f"sites must be some of {', '.join(SITES)}, not {self.sites!r}")
        if self.metric not in ("logit_diff", "prob"):
            raise ValueError(f"metric must be logit_diff or prob, not {self.metric!r}")
        if self.ig_steps < 0:
            raise ValueError(f"ig_steps must be >= 0, got {self.ig_steps}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def hooks(self, info: ModelInfo) -> list[str]:
        names = [info.resid(layer) for layer in range(info.n_layers + 1)]
        for site in self.sites:
            if site != "resid_pre":
                names += [site_hook(site, layer) for layer in range(info.n_layers)]
        return names

    # -- examples --------------------------------------------------------------------------------
    def examples(self, model: Bridge, info: ModelInfo) -> list[Batch]:
        tokenizer = model.tokenizer
        if self.pairs == "builtin":
            pairs, source = builtin_pairs(tokenizer), "built-in pair"
            if not pairs:
                raise DataError(
                    "no built-in pair tokenises to equal lengths with this model's tokenizer",
                    hint="pass your own pairs with -O patch.pairs=FILE.jsonl",
                )
        else:
            pairs, source = read_pairs(self.pairs), f"{Path(self.pairs).name} line"
        return pair_batches(
            tokenizer,
            pairs,
            source=source,
            d_vocab=info.d_vocab,
            n_ctx=int(getattr(model.cfg, "n_ctx", 0) or 0),
            prepend_bos=self.prepend_bos,
            logit_diff=self.metric == "logit_diff",
            batch_size=self.batch_size,
        )

    # -- streaming ---------------------------------------------------------------------------------
    def update(self, state: Stats, step: Step) -> None:
        resumer = resumer_for(step)
        with torch.no_grad():
            if step.pass_index == 0:
                self._measure(state, step, resumer)
                modes = "intervention"
            elif self.erasure and "erase/mean" in state:
                self._erase(state, step, resumer)
                modes = "erase/intervention"
            else:
                return
        if resumer.mode is not None:
            state.include(modes, resumer.mode)

    def start_pass(self, state: Stats, info: ModelInfo, index: int) -> None:
        if index == 1 and self.erasure and "resid_n" in state:
            state.fix("erase/mean", state["resid_sum"] / state["resid_n"])
            state.drop("resid_sum")
            state.drop("resid_n")

    def _measure(self, state: Stats, step: Step, resumer: Resumer) -> None:
        """Pass 0: the pairs' metrics, patching, the sums of the erasure mean, then IG."""
        batch, info, model = step.batch, step.info, step.model
        L = info.n_layers
        n_batch, n_pos = batch.tokens.shape
        device = batch.tokens.device
        target = batch.extra["target"].to(device)
        foil = batch.extra["foil"].to(device)
        clean = {k: v.detach() for k, v in step.cache.items()}
        readout = final_readout(model)
        clean_last = readout.logits(clean[info.resid(L)][:, -1]).to(device)
        keep = torch.ones(n_pos, dtype=torch.bool, device=device)
        if self.exclude_bos and batch.bos:
            keep[0] = False
        corrupt_tokens = batch.extra["corrupt"].to(device)
        _, corrupt = capture(model, corrupt_tokens, self.hooks(info), need_logits=False)
        corrupt_last = readout.logits(corrupt[info.resid(L)][:, -1]).to(device)
        m_clean = metric_values(clean_last, target, foil, self.metric).double()
        m_corrupt = metric_values(corrupt_last, target, foil, self.metric).double()
        gap = m_clean - m_corrupt
        ok = gap.abs() >= EPS
        state.include("lengths", str(n_pos))
        decode = getattr(getattr(model, "tokenizer", None), "decode", None)
        for i, line in enumerate(batch.extra["line"]):  # a pair's line is unique in the set
            row = {
                "line": int(line),
                "tokens": n_pos,
                "target": int(target[i]),
                "foil": int(foil[i]),
                "clean": float(m_clean[i]),
                "corrupt": float(m_corrupt[i]),
                # The clean prompt's tokens, for the position axis of the plots.
                "text": [decode([int(t)]) for t in batch.tokens[i]] if decode else [],
            }
            state.append("pairs", int(line), row)

        # Dataset-mean residual for the erasure pass.
        if self.erasure:
            h_all = stack_on([clean[info.resid(layer)] for layer in range(L + 1)], device).double()
            state.add("resid_sum", h_all[:, :, keep].sum((1, 2)))
            state.add("resid_n", n_batch * int(keep.sum()))

        # Activation patching: one batched pass per layer for every site and position.
        eye = torch.eye(n_pos, dtype=torch.bool, device=batch.tokens.device)
        state.add(f"n/{n_pos}", int(ok.sum()))
        state.add(f"all/{n_pos}", n_batch)
        raw = torch.zeros(len(self.sites), L, n_pos, n_batch, dtype=torch.float64)
        for layer in range(L):
            patches = [(site, eye, clean[site_hook(site, layer)]) for site in self.sites]
            outs = run_patches(resumer, corrupt_tokens, layer, corrupt[info.resid(layer)], patches)
            for i, logits in enumerate(outs):
                flat = logits.reshape(n_pos * n_batch, -1).to(device)
                values = metric_values(flat, target.repeat(n_pos), foil.repeat(n_pos), self.metric)
                raw[i, layer] = values.reshape(n_pos, n_batch).double().cpu()
        for i, site in enumerate(self.sites):
            score = (raw[i] - m_corrupt.cpu()) / torch.where(ok, gap, torch.ones_like(gap)).cpu()
            score = score[..., ok.cpu()]
            state.add(f"{site}/{n_pos}/raw", raw[i].sum(-1))
            state.add(f"{site}/{n_pos}/sum", score.sum(-1))
            state.add(f"{site}/{n_pos}/sq", (score**2).sum(-1))

        if self.ig_steps:
            self._integrate(state, step, resumer, keep, target, foil)

    def _integrate(
        self,
        state: Stats,
        step: Step,
        resumer: Resumer,
        keep: Bool[Tensor, " pos"],
        target: Int[Tensor, " batch"],
        foil: Int[Tensor, " batch"],
    ) -> None:
        """Pass 0: integrated gradients of the metric w.r.t. every layer output ``h_l`` of the
        clean prompts, from the prompt's mean over the ``keep`` positions."""
        batch, info, model = step.batch, step.info, step.model
        L = info.n_layers
        n_batch, n_pos = batch.tokens.shape
        device = batch.tokens.device

        def fn(logits: Tensor) -> Tensor:
            k = logits.shape[0]
            flat = metric_values(
                logits.reshape(-1, logits.shape[-1]).to(device),
                target.repeat(k),
                foil.repeat(k),
                self.metric,
            )
            return flat.reshape(k, -1)

        attr_all = torch.zeros(L + 1, n_batch, n_pos, dtype=torch.float64, device=device)
        abs_error = torch.zeros(L + 1, dtype=torch.float64)
        rel_error = torch.zeros(L + 1, dtype=torch.float64)
        for layer in range(L + 1):
            x = step.cache[info.resid(layer)].detach()
            base = x[:, keep.to(x.device)].mean(1, keepdim=True).expand_as(x)
            attr, f_x, f_base = integrated_gradients(
                model,
                batch.tokens,
                info.resid(layer),
                x,
                base,
                fn,
                self.ig_steps,
                layer,
                resumer=resumer,
            )
            attr = attr.to(device)
            attr_all[layer] = attr.double()
            delta = (f_x - f_base).double().to(device)
            error = (attr.double().sum(-1) - delta).abs()
            abs_error[layer] = float(error.max())
            rel_error[layer] = float((error / delta.abs().clamp_min(EPS)).max())
        state.max("ig/abs_error", abs_error)
        state.max("ig/rel_error", rel_error)
        state.add(f"ig/{n_pos}/sum", attr_all.sum(1))
        state.add(f"ig/{n_pos}/sq", (attr_all**2).sum(1))
        state.add(f"ig/{n_pos}/n", n_batch)

    def _erase(self, state: Stats, step: Step, resumer: Resumer) -> None:
        """Pass 1: ``||p - p~||`` at the answer after erasing each ``h_l(t)`` to the mean."""
        tokens, info = step.batch.tokens, step.info
        n_batch, n_pos = tokens.shape
        L = info.n_layers
        final = step.cache[info.resid(L)].detach()[:, -1]
        p_clean = final_readout(step.model).probabilities(final).to(tokens.device)
        mean = state["erase/mean"]
        eye = torch.eye(n_pos, dtype=torch.bool, device=tokens.device)
        dist = torch.zeros(L + 1, n_pos, n_batch, dtype=torch.float64, device=tokens.device)
        for layer in range(L + 1):
            h = step.cache[info.resid(layer)].detach()
            values = mean[layer].to(h).expand_as(h)
            logits = run_variants(resumer, tokens, layer, h, eye, values).to(tokens.device)
            dist[layer] = (logits.softmax(-1) - p_clean).norm(dim=-1)
        state.add(f"erase/{n_pos}/sum", dist.sum(-1))
        state.add(f"erase/{n_pos}/sq", (dist**2).sum(-1))
        state.add(f"erase/{n_pos}/n", n_batch)

    # -- results -----------------------------------------------------------------------------------
    def finalize(self, state: Stats, info: ModelInfo) -> Result:
        return present(PatchingMaps.from_state(state, info, self.sites), self)
