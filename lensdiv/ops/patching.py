"""Patched forward passes: copy activations into a run, batched, and integrated gradients.

:func:`run_patches` resumes the forward pass from the patched layer
(:class:`~lensdiv.ops.resume.Resumer`) and batches every variant (e.g. one per position) of every
patch of a layer into one pass, chunked to stay within a fixed memory budget: a patching sweep is
``L`` passes of ``sites x T x pairs`` rows that run ``L/2`` blocks on average, where
TransformerLens' ``get_act_patch_*`` runs ``3·L·T`` full passes. :func:`integrated_gradients`
needs gradients; it batches the integration steps the same way and unembeds only the answer
position. Both read logits at the last position only (the answer position of a prompt), through
the resumer's readout: readout-dtype logits (float32, float64 for a float64 model) whatever the
model's dtype (:mod:`lensdiv.ops.readout`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from lensdiv.core.bridge import Bridge
from lensdiv.ops.readout import readout_dtype
from lensdiv.ops.resume import Resumer

# Activation elements one batched intervention pass may hold (~256 MB in fp32).
_ELEMENTS = 1 << 26

Hook = tuple[str, Callable[..., Any]]
Patch = tuple[str, Tensor, Tensor]  # (site, masks [variant, pos], values [batch, pos, d_model])


def site_hook(site: str, layer: int) -> str:
    """TransformerLens hook name of ``site`` (``resid_pre``, ``attn_out``, ...) in block ``layer``."""
    return f"blocks.{layer}.hook_{site}"


def last_position(model: Bridge) -> list[Hook]:
    """A hook that keeps only the last position (the answer position) for the readout, where
    the model has the hook (a resumed pass applies it to the final residual): the final norm
    and unembedding are per position, so the answer's logits are unchanged, and the largest
    matmul of a small model shrinks ``pos``-fold."""
    if "unembed.hook_in" not in model.hook_dict:
        return []

    def last(tensor: Tensor, *, hook: Any) -> Tensor:
        return tensor[:, -1:]

    return [("unembed.hook_in", last)]


def rows_per_pass(model: Bridge, n_pos: int, *, grad: bool) -> int:
    """Rows of ``n_pos`` tokens one batched pass may hold within a fixed memory budget.

    Without gradients a pass holds a few ``[row, pos, d_mlp]`` activations and the logits;
    with gradients it keeps about a dozen activations per block for the backward.
    """
    cfg = model.cfg
    width = int(getattr(cfg, "d_mlp", None) or 4 * cfg.d_model)
    if grad:  # the answer position alone is unembedded (see last_position)
        per_row = n_pos * width * 12 * int(cfg.n_layers) + int(cfg.d_vocab)
    else:
        per_row = n_pos * (width * 4 + int(cfg.d_vocab))
    return max(1, _ELEMENTS // per_row)


def run_patches(
    resumer: Resumer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    resid: Float[Tensor, "batch pos d_model"],
    patches: Sequence[Patch],
) -> list[Tensor]:
    """Answer-position logits ``[variant, batch, d_vocab]`` of every variant of every patch.

    A patch ``(site, masks, values)`` has one variant per row of ``masks``: it runs every row of
    ``tokens`` from block ``layer`` with input ``resid`` (``h_layer``, ``0 ≤ layer ≤ L``) and
    replaces the activation of ``site`` by ``values`` at the positions where the row is True.
    ``site`` is ``"resid_pre"`` (the residual ``h_layer`` itself; ``layer = L`` is the final
    residual) or ``"attn_out"``/``"mlp_out"`` of block ``layer``. All variants of all patches
    share batched passes, chunked to stay within a fixed memory budget.
    """
    n_batch, n_pos = tokens.shape
    kinds = [site for site, masks, _ in patches for _ in range(masks.shape[0])]
    groups = [g for g, (_, masks, _) in enumerate(patches) for _ in range(masks.shape[0])]
    masks = torch.cat([m.to(tokens.device) for _, m, _ in patches])
    per_chunk = max(1, rows_per_pass(resumer.model, n_pos, grad=False) // n_batch)
    out = []
    for start in range(0, masks.shape[0], per_chunk):
        stop = min(start + per_chunk, masks.shape[0])
        n = stop - start
        rows = tokens.repeat(n, 1)
        where = masks[start:stop, None, :, None].expand(n, n_batch, n_pos, 1)
        where = where.reshape(n * n_batch, n_pos, 1)
        values = torch.cat([patches[g][2] for g in groups[start:stop]])
        of_kind = {
            kind: torch.tensor(
                [k == kind for k in kinds[start:stop]], device=tokens.device
            ).repeat_interleave(n_batch)[:, None, None]
            for kind in set(kinds[start:stop])
        }
        mixed = resid.repeat(n, 1, 1)
        if "resid_pre" in of_kind:  # (a split model's layers: patch where the residual lives)
            sel = (where & of_kind["resid_pre"]).to(mixed.device)
            mixed = torch.where(sel, values.to(mixed), mixed)
        hooks = []
        for kind, rows_of_kind in of_kind.items():
            if kind == "resid_pre":
                continue

            def hook(
                tensor: Tensor,
                *,
                hook: Any,
                sel: Tensor = where & rows_of_kind,
                new: Tensor = values,
            ) -> Tensor:
                # Interventions happen where the hooked module runs.
                return torch.where(sel.to(tensor.device), new.to(tensor), tensor)

            hooks.append((site_hook(kind, layer), hook))
        logits = resumer.run(rows, layer, mixed, hooks)
        assert logits is not None
        out.append(logits[:, -1].reshape(n, n_batch, -1))
    flat = torch.cat(out)
    sizes = [masks.shape[0] for _, masks, _ in patches]
    return list(flat.split(sizes))


def run_variants(
    resumer: Resumer,
    tokens: Int[Tensor, "batch pos"],
    layer: int,
    resid: Float[Tensor, "batch pos d_model"],
    masks: Bool[Tensor, "variant pos"],
    values: Float[Tensor, "batch pos d_model"],
    site: str = "resid_pre",
) -> Float[Tensor, "variant batch d_vocab"]:
    """:func:`run_patches` for one patch: logits of ``len(masks)`` variants."""
    (logits,) = run_patches(resumer, tokens, layer, resid, [(site, masks, values)])
    return logits


def integrated_gradients(
    model: Bridge,
    tokens: Int[Tensor, "batch pos"],
    hook_name: str,
    x: Float[Tensor, "batch pos d_model"],
    baseline: Float[Tensor, "batch pos d_model"],
    fn: Callable[[Tensor], Tensor],
    steps: int,
    start: int | None = None,
    *,
    resumer: Resumer | None = None,
) -> tuple[Float[Tensor, "batch pos"], Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """Integrated gradients of ``fn`` of the answer-position logits w.r.t. activation ``hook_name``.

    ``fn`` maps logits ``[k, batch, d_vocab]`` (``k`` copies of the batch) to ``[k, batch]``.

    The activation is replaced by ``baseline + α (x - baseline)`` for the midpoints
    ``α = (k + ½)/steps`` (error O(1/steps²)), all α of a chunk in one batched pass (the
    first also evaluates ``f(x)`` and ``f(baseline)``).

    Returns:
        ``attr[b, t] = Σ_d (x - baseline)[b, t, d] · mean_α ∂f/∂h[b, t, d]``, ``f(x)`` and
        ``f(baseline)`` per row; completeness says ``attr.sum(-1) ≈ f(x) - f(baseline)``.
        ``attr`` is summed in float64 and returned in the readout dtype of ``x``'s dtype
        (:func:`~lensdiv.ops.readout.readout_dtype`: float64 for a float64 model, else
        float32).

    With ``start`` (``hook_name`` is then the residual ``h_start``) each pass resumes from the
    path value and runs only blocks ``start..L-1``, with ``resumer`` (the run's; a new one for
    ``model`` when omitted, which checks itself on first use).
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if start is not None and resumer is None:
        resumer = Resumer(model)
    n_batch, n_pos = tokens.shape
    diff = (x - baseline).detach()
    per_chunk = max(1, rows_per_pass(model, n_pos, grad=True) // n_batch - 2)
    grad_sum = torch.zeros_like(diff)
    alphas = (torch.arange(steps, dtype=torch.float64, device=x.device) + 0.5) / steps

    def forward(path: Tensor) -> Tensor:
        rows = tokens.repeat(path.shape[0] // n_batch, 1)

        def inject(tensor: Tensor, *, hook: Any) -> Tensor:
            return path.to(tensor)  # the hooked module's device and dtype

        if start is not None:
            assert resumer is not None  # built above
            logits = resumer.run(rows, start, path, last_position(model), grad=True)
            assert logits is not None  # asked for logits
        else:
            with model.hooks(fwd_hooks=[(hook_name, inject), *last_position(model)]):
                logits = model(rows)
        return fn(logits[:, -1].reshape(-1, n_batch, logits.shape[-1]))

    ends = None
    for lo in range(0, steps, per_chunk):
        chunk = alphas[lo : lo + per_chunk].to(x.dtype)
        path = baseline.detach()[None] + chunk[:, None, None, None] * diff[None]
        if ends is None:  # the end points ride along with the first chunk (their grads unused)
            path = torch.cat([x.detach()[None], baseline.detach()[None], path])
        path = path.reshape(-1, n_pos, diff.shape[-1]).requires_grad_(True)
        with torch.enable_grad():
            values = forward(path)
            (grad,) = torch.autograd.grad(values.sum(), path)
        grad = grad.detach().reshape(-1, n_batch, n_pos, diff.shape[-1])
        if ends is None:
            ends, grad = values.detach()[:2], grad[2:]
        grad_sum += grad.sum(0)
    assert ends is not None
    attr = (diff.double() * grad_sum.double()).sum(-1) / steps
    return attr.to(readout_dtype(diff.dtype)), ends[0], ends[1]
