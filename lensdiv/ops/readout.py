"""Reading residual states out as next-token distributions: at full precision, at the floor's cost.

**Precision policy.** Whatever the model's dtype, a residual state that lensdiv reads out is
converted once to the *readout dtype* (:func:`readout_dtype`: float32, or float64 for a float64
model) and everything after that stays in it: the final norm (decomposed into ``γ``, ``β`` and
``eps`` and verified against the model's own module on probe vectors), the unembedding (a
readout-dtype copy of ``W_U``, so the logits come out in the readout dtype), the log-partition,
KL, entropy, cross-entropy, ranks and top-k. Statistics then accumulate in float64
(:class:`~lensdiv.core.stats.Stats`). Interventions still run in the model's dtype (that is the
model being studied); only their measurements are read out this way.

**Cost.** Everything a logit lens reports comes from the logits and one log-partition per row
(:func:`lens_statistics`): no log-probability tensor over the vocabulary is ever formed. States
are read in blocks of rows; within a block every state is read in turn against the reference
state's logits, which stay in a preallocated buffer, and every full-vocabulary pass writes into
preallocated buffers (:class:`Workspace`), because a fresh 100 MB tensor per pass costs more in
page faults than the arithmetic it holds. The top-k comes from one pass of chunk maxima
(:func:`top_k`), and an unembedding without a bias is one product (:func:`_unembed`).

**Devices.** The readout lives where the unembedding executes: inputs are moved there and
results come back to the caller's device. Weights offloaded by accelerate (``meta`` tensors with
an ``AlignDevicesHook``) are read under ``accelerate.utils.align_module_device``, and the final
norm is verified by running the model's own module.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lensdiv.core.analyzer import Step
from lensdiv.core.errors import HookError
from lensdiv.ops.norms import FinalNorm, ModuleNorm, NoNorm, declared_norm
from lensdiv.ops.translators import LOGIT, Lens

# Full-vocabulary elements of one readout buffer ([rows, d_vocab]); a lens holds three of them
# (128 MiB each in float32). Large enough for an efficient unembedding matmul on any vocabulary:
# on the gpt2-medium shape with 2 threads, 1/2 and 1/4 of this cost 1.2× and 1.4× more.
BLOCK_ELEMENTS = 1 << 25

# Relative error allowed when checking the decomposed final norm against the model's own module,
# by the module's parameter dtype. A float64 model's norm may itself compute in float32 (Hugging
# Face's RMSNorm upcasts to float32 whatever the model's dtype), so float64 gets float32's
# tolerance; a wrong form, weight or eps is off by far more. Half precision rounds every output.
_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}
_PROBE_RTOL_LOW = 2e-2

# Components some bridges mount between the last block and the unembedding (BERT heads, OPT-350m's
# project_out, ...): ln_final -> unembed would not be the model's prediction there (the same
# list as TransformerLens' logit_readout refuses).
_READOUT_TRANSFORMS = (
    "mlm_head",
    "prediction_head",
    "project_out",
    "hc_head",
    "sigma_map",
    "classifier_ln",
)


def readout_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype residual states are read out in: float64 for a float64 model, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- the final norm and unembedding ----------------------------------------------------------------


@dataclass(eq=False)
class FinalReadout:
    """The model's final norm and unembedding in the readout dtype, where the unembedding runs.

    Args:
        norm: The final norm (:mod:`lensdiv.ops.norms`): a LayerNorm, an RMSNorm, none, or a
            norm of neither form run as the model's own module in the model's dtype (the one
            place the policy cannot hold; recorded as :attr:`precision`).
        W_U: Unembedding ``[d_model, d_vocab]`` in the readout dtype, times :attr:`logit_scale`.
        b_U: Unembedding bias ``[d_vocab]`` (zeros when there is none), times the scale.
        model_dtype: The dtype of the model's unembedding.
        logit_scale: The adapter's post-unembedding transform when it is a scalar (1.0 for
            almost every model), folded into ``W_U`` and ``b_U``.
        transform: The adapter's transform when it is not a scalar (e.g. a softcap), applied
            to readout-dtype logits.
    """

    norm: FinalNorm = field(repr=False)
    W_U: Float[Tensor, "d_model d_vocab"]
    b_U: Float[Tensor, " d_vocab"]
    model_dtype: torch.dtype
    logit_scale: float = 1.0
    transform: Callable[[Tensor], Tensor] | None = None

    # (b_U's storage and version, whether any of it is non-zero): see :attr:`biased`.
    _bias_seen: tuple[Any, ...] = field(default=(), init=False, repr=False)

    @property
    def biased(self) -> bool:
        """Whether the unembedding has a non-zero bias (checked again when ``b_U`` changes)."""
        key = (self.b_U.data_ptr(), self.b_U._version)
        if self._bias_seen[:2] != key:
            self._bias_seen = (*key, bool(self.b_U.any()))
        return bool(self._bias_seen[2])

    @property
    def kind(self) -> str:
        """The final norm's kind: ``"LN"``, ``"RMS"``, ``"none"`` or ``"module"``."""
        return self.norm.kind

    @property
    def weight(self) -> Float[Tensor, " d_model"]:
        """``γ`` (ones for a non-learnable norm), readout dtype."""
        return self.norm.weight

    @property
    def bias(self) -> Float[Tensor, " d_model"]:
        """``β`` (zeros when the norm has none)."""
        return self.norm.bias

    @property
    def eps(self) -> float:
        """The norm's own epsilon."""
        return self.norm.eps

    @property
    def dtype(self) -> torch.dtype:
        """The readout dtype."""
        return self.W_U.dtype

    @property
    def device(self) -> torch.device:
        """Where the readout runs (the unembedding's execution device)."""
        return self.W_U.device

    @property
    def d_vocab(self) -> int:
        """Vocabulary size."""
        return int(self.W_U.shape[1])

    @property
    def precision(self) -> str:
        """What the readout computes in, for results: e.g. ``"float32"``."""
        name = str(self.dtype).replace("torch.", "")
        if not self.norm.decomposed:
            model = str(self.model_dtype).replace("torch.", "")
            return f"{name} (final norm in the model's {model}: it is neither a LN nor an RMSNorm)"
        return name

    def scale(self, h: Float[Tensor, "n d_model"]) -> Float[Tensor, " n"]:
        """``σ(h)`` per row in the readout dtype, with the norm's epsilon (1 without a norm)."""
        return self.norm.scale(h.to(device=self.device, dtype=self.dtype))

    def normalize(self, h: Float[Tensor, "n d_model"]) -> Float[Tensor, "n d_model"]:
        """The final norm's output ``γ ⊙ (h − mean h)/σ(h) + β`` in the readout dtype, on
        :attr:`device` (a new tensor: ``h`` is never modified)."""
        return self.norm.apply(h, dtype=self.dtype, device=self.device)

    def logits(
        self, h: Float[Tensor, "n d_model"], out: Tensor | None = None
    ) -> Float[Tensor, "n d_vocab"]:
        """Readout-dtype logits of residual vectors (into ``out`` when given), on :attr:`device`."""
        x = self.normalize(h)
        z = _unembed(x, self.W_U, self.b_U if self.biased else None, out)
        if self.transform is not None:
            z = self.transform(z) if out is None else out.copy_(self.transform(z))
        return z

    def probabilities(
        self, h: Float[Tensor, "n d_model"], out: Tensor | None = None
    ) -> Float[Tensor, "n d_vocab"]:
        """Next-token probabilities of residual vectors, in the readout dtype."""
        z = self.logits(h, out=out)
        z.sub_(z.amax(-1, keepdim=True)).exp_()
        return z.div_(z.sum(-1, keepdim=True))


def _unembed(
    x: Float[Tensor, "n d_model"],
    W_U: Float[Tensor, "d_model d_vocab"],
    b_U: Float[Tensor, " d_vocab"] | None,
    out: Tensor | None,
) -> Float[Tensor, "n d_vocab"]:
    """``x @ W_U (+ b_U)`` (into ``out`` when given). Without a bias, one product: ``addmm``
    first copies the bias into every row of its output, a full pass over the logits for
    nothing where the bias is zero (GPT-2 and most models); the product is the same."""
    if b_U is None:
        return torch.mm(x, W_U) if out is None else torch.mm(x, W_U, out=out)
    return torch.addmm(b_U, x, W_U) if out is None else torch.addmm(b_U, x, W_U, out=out)


_READOUTS: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], FinalReadout]] = (
    weakref.WeakKeyDictionary()
)


def final_readout(model: Any) -> FinalReadout:
    """The model's :class:`FinalReadout`, built and verified once per model (and again if its
    weights change: folding, a move to another dtype or device).

    Raises:
        HookError: The bridge mounts a component between the last block and the unembedding,
            or the unembedding's weights cannot be read.
    """
    key = _readout_key(model)
    cached = _READOUTS.get(model)
    if cached is None or cached[0] != key:
        cached = _READOUTS[model] = (key, _build(model))
    return cached[1]


def _readout_key(model: Any) -> tuple[Any, ...]:
    weight = _unembed_weight(model)
    ptr = weight.data_ptr() if weight.device.type != "meta" else id(weight)
    return (
        bool(getattr(model, "compatibility_mode", False)),
        weight.dtype,
        str(weight.device),
        ptr,
    )


def _unembed_module(model: Any) -> torch.nn.Module:
    unembed = getattr(model, "unembed", None)
    if not isinstance(unembed, torch.nn.Module):
        raise HookError(
            f"{_name(model)} has no unembedding component, so its states cannot be read out",
            hint="this analyzer needs a decoder language model",
        )
    inner = getattr(unembed, "original_component", None)
    return inner if isinstance(inner, torch.nn.Module) else unembed


def _unembed_weight(model: Any) -> Tensor:
    unembed = getattr(model, "unembed", None)
    processed = getattr(unembed, "_parameters", {}).get("_processed_W_U")
    if isinstance(processed, Tensor):
        return processed
    weight = getattr(_unembed_module(model), "weight", None)
    if not isinstance(weight, Tensor):
        weight = model.W_U
    assert isinstance(weight, Tensor)  # a bridge's W_U property
    return weight


def _name(model: Any) -> str:
    return str(getattr(getattr(model, "cfg", None), "model_name", "this model"))


@contextmanager
def onloaded(module: torch.nn.Module) -> Iterator[None]:
    """Within this context the parameters of ``module`` are real tensors on its execution device,
    also when accelerate offloaded them (``meta`` tensors with an ``AlignDevicesHook``)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not getattr(hook, "offload", False):
        yield
        return
    from accelerate.utils import align_module_device  # only offloaded models need accelerate

    with align_module_device(module):
        yield


def _build(model: Any) -> FinalReadout:
    name = _name(model)
    mounted = [c for c in _READOUT_TRANSFORMS if c in getattr(model, "_modules", {})]
    if mounted:
        raise HookError(
            f"{name} mounts {mounted} between its last block and the unembedding, so a readout "
            "through the final norm and unembedding would not be the model's prediction",
            hint="this analyzer does not support this architecture",
        )
    unembed = _unembed_module(model)
    with onloaded(unembed):
        W = model.W_U.detach()
        b = getattr(model, "b_U", None)
        if W.device.type == "meta":
            raise HookError(
                f"{name}'s unembedding weights are not readable (on the meta device)",
                hint="load the model with its lm_head on a device or offloaded by accelerate",
            )
        model_dtype, device = W.dtype, W.device
        dtype = readout_dtype(model_dtype)
        offloaded = getattr(getattr(unembed, "_hf_hook", None), "offload", False)
        # A copy where the dtype differs (or the weights go back to disk after this context).
        W_U = W.to(dtype, copy=bool(offloaded))
        b_U = (
            torch.zeros(W.shape[1], dtype=dtype, device=device)
            if b is None
            else b.detach().to(device=device, dtype=dtype, copy=True)
        )
    d_model = int(W_U.shape[0])
    norm_type = getattr(model.cfg, "normalization_type", None)
    ln_final = getattr(model, "ln_final", None)
    ones = torch.ones(d_model, dtype=dtype, device=device)
    zeros = torch.zeros(d_model, dtype=dtype, device=device)
    norm: FinalNorm
    if norm_type is None and ln_final is None:
        norm = NoNorm(ones, zeros, 0.0)
    elif isinstance(ln_final, torch.nn.Module):
        inner = getattr(ln_final, "original_component", None) or ln_final
        with onloaded(inner):
            weight = _param(inner, "weight", ones)
            bias = _param(inner, "bias", zeros)
        eps = _eps(inner, model.cfg)
        norm = _verify_norm(ln_final, norm_type, weight, bias, eps, model_dtype)
    else:
        raise HookError(
            f"{name} declares a final norm ({norm_type!r}) but exposes no ln_final component",
            hint="this analyzer does not support this architecture",
        )
    scale, transform = _output_transform(model, W_U.shape[1], device, model_dtype)
    if scale != 1.0:
        W_U, b_U = W_U * scale, b_U * scale
    return FinalReadout(
        norm=norm,
        W_U=W_U,
        b_U=b_U,
        model_dtype=model_dtype,
        logit_scale=scale,
        transform=transform,
    )


def _param(module: torch.nn.Module, attr: str, default: Tensor) -> Tensor:
    value = getattr(module, attr, None)
    if not isinstance(value, Tensor) or value.device.type == "meta":
        return default
    return (
        value.detach()
        .to(device=default.device, dtype=default.dtype, copy=True)
        .reshape(default.shape)
    )


def _eps(module: torch.nn.Module, cfg: Any) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return float(getattr(cfg, "eps", 1e-5))


def norm_error(ln_final: torch.nn.Module, norm: FinalNorm, model_dtype: torch.dtype) -> float:
    """Largest relative error of the decomposed ``norm`` against the module on probe vectors
    (small ones make ``eps`` visible), computed in the readout dtype from the same probe
    inputs."""
    gen = torch.Generator().manual_seed(0)
    weight = norm.weight
    d_model = weight.shape[0]
    scales = torch.tensor([1e-3, 3e-2, 1.0, 30.0]).repeat_interleave(4).unsqueeze(-1)
    probe = torch.randn(scales.shape[0], d_model, generator=gen) * scales + 0.1 * scales
    probe = probe.to(device=weight.device, dtype=model_dtype)
    with torch.no_grad():
        theirs = ln_final(probe.unsqueeze(0)).squeeze(0).to(weight.dtype)
    ours = norm.apply(probe, dtype=weight.dtype, device=weight.device)
    return float(((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1).clamp_min(1e-12)).max())


def _verify_norm(
    ln_final: torch.nn.Module,
    norm_type: Any,
    weight: Tensor,
    bias: Tensor,
    eps: float,
    model_dtype: torch.dtype,
) -> FinalNorm:
    """The decomposed form that reproduces the module (``γ`` or Gemma's ``1 + γ``), else a
    :class:`~lensdiv.ops.norms.ModuleNorm` (run the module itself)."""
    form = declared_norm(norm_type)
    if form is not None:
        rtol = _PROBE_RTOL.get(model_dtype, _PROBE_RTOL_LOW)
        for gamma in (weight, weight + 1.0):
            norm = form(gamma, bias, eps)
            if norm_error(ln_final, norm, model_dtype) <= rtol:
                return norm
    return ModuleNorm(weight, bias, eps, module=ln_final, model_dtype=model_dtype)


def _output_transform(
    model: Any, d_vocab: int, device: torch.device, model_dtype: torch.dtype
) -> tuple[float, Callable[[Tensor], Tensor] | None]:
    """The adapter's post-unembedding transform: ``(scale, None)`` when it is a scalar multiple
    (1.0 when there is none), else ``(1.0, transform)``."""
    transform = getattr(getattr(model, "adapter", None), "apply_output_logits_transform", None)
    if not callable(transform):
        return 1.0, None
    gen = torch.Generator().manual_seed(1)
    probe = (torch.randn(2, d_vocab, generator=gen) * 3.0).to(device=device, dtype=model_dtype)
    with torch.no_grad():
        out = transform(probe)
    out, probe = out.double(), probe.double()
    scale = float((out * probe).sum() / (probe * probe).sum())
    err = float((out - scale * probe).norm() / out.norm().clamp_min(1e-12))
    if err <= _PROBE_RTOL.get(model_dtype, _PROBE_RTOL_LOW):
        return scale, None
    return 1.0, transform


# -- scratch buffers ---------------------------------------------------------------------------------


class Workspace:
    """Named scratch buffers, kept between calls (one per run: ``step.cached``).

    A fresh tensor of a hundred megabytes costs page faults on first touch, more than the
    arithmetic of an elementwise pass over it; the readout reuses a few buffers instead.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(
        self, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        """A contiguous tensor of ``shape`` backed by the buffer ``name`` (grown as needed).

        Two live tensors must use different names; the contents are arbitrary.
        """
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != dtype
            or buffer.device != device
        ):
            buffer = self._buffers[name] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(*shape)

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()


def workspace(step: Step) -> Workspace:
    """The run's :class:`Workspace` (shared by every analyzer and batch of the run)."""
    ws: Workspace = step.cached(("lensdiv.ops.readout", "workspace"), Workspace)
    return ws


def lens_of(step: Step) -> Lens:
    """The run's lens (``--lens``; the logit lens unless one was given)."""
    lens = step.context.lens
    return LOGIT if lens is None else lens


def block_rows(d_vocab: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Rows of ``d_vocab`` logits per readout block."""
    return max(1, block_elements // max(d_vocab, 1))


# -- statistics from logits --------------------------------------------------------------------------


@dataclass
class RowStats:
    """What one block of logits ``z`` says per row (float64, on the logits' device).

    Args:
        lse: ``log Σ exp z`` (the log-partition).
        expect: ``E_p[z]`` with ``p = softmax z`` (entropy = ``lse − expect``), if asked.
        shift: ``E_p[z − z_ref]`` against a reference block, if given.
        target: ``z[target]``, if targets were given.
        rank: Tokens with a strictly larger logit than the target, if targets were given.
        top: Indices of the ``k`` largest logits ``[n, k]``, if ``k > 0``.
    """

    lse: Tensor
    expect: Tensor | None = None
    shift: Tensor | None = None
    target: Tensor | None = None
    rank: Tensor | None = None
    top: Tensor | None = None


def row_stats(
    z: Float[Tensor, "n d_vocab"],
    scratch: Float[Tensor, "n d_vocab"],
    *,
    targets: Int[Tensor, " n"] | None = None,
    k: int = 0,
    expect: bool = False,
    rank: bool = True,
    reference: Float[Tensor, "n d_vocab"] | None = None,
    product: Float[Tensor, "n d_vocab"] | None = None,
) -> RowStats:
    """Statistics of ``p = softmax(z)`` from the logits alone, one log-partition per row.

    Every full-vocabulary pass writes into ``scratch`` (or ``z`` itself, or ``product``), never
    into a new tensor: top-k, the target's logit and rank, ``e = exp(z − max z)`` and its sum,
    then the expectations ``E_p[x] = Σ e·x / Σ e``. ``E_p[z − z_ref]`` is summed from the
    elementwise differences, so a small KL is not the difference of two large expectations.

    Args:
        z: Logits (readout dtype). Overwritten when ``reference`` is given, or when ``expect``
            is asked without a ``product`` buffer (after every statistic that needs it).
        scratch: A buffer of ``z``'s shape; overwritten.
        targets: Per-row token ids for :attr:`RowStats.target` and :attr:`RowStats.rank`.
        rank: With ``targets``, also count the target's rank (a full-vocabulary pass).
        k: Report the top-``k`` indices.
        expect: Report ``E_p[z]`` (for the entropy).
        reference: Logits of the distribution to compare with: report ``E_p[z − z_ref]``, so
            ``KL(p ‖ p_ref) = E_p[z − z_ref] − lse + lse_ref``.
        product: A buffer for ``e·z`` that keeps ``z`` intact (without ``reference``).
    """
    top = None
    if k > 0:
        values, top = top_k(z, k)
        peak = values[:, :1]
    else:
        peak = z.amax(-1, keepdim=True)
    target = ranks = None
    if targets is not None:
        target_logit = z.gather(-1, targets.view(-1, 1).to(z.device))
        if rank:
            torch.gt(z, target_logit, out=scratch)  # 0/1 in the logits' dtype: exact, and fast
            ranks = scratch.sum(-1).double()
        target = target_logit[:, 0].double()
    torch.sub(z, peak, out=scratch).exp_()
    norm = scratch.sum(-1).double()
    lse = peak[:, 0].double() + norm.log()
    shift = expected = None
    if reference is not None:
        z.sub_(reference).mul_(scratch)
        shift = z.sum(-1).double() / norm
        if expect:
            torch.mul(scratch, reference, out=z)
            expected = shift + z.sum(-1).double() / norm
    elif expect:
        if product is None:
            product = z.mul_(scratch)
        else:
            torch.mul(scratch, z, out=product)
        expected = product.sum(-1).double() / norm
    return RowStats(lse=lse, expect=expected, shift=shift, target=target, rank=ranks, top=top)


# Logits per chunk when :func:`top_k` looks for the largest among the chunks' maxima.
TOPK_CHUNK = 64


def top_k(
    z: Float[Tensor, "n d_vocab"], k: int, chunk: int = TOPK_CHUNK
) -> tuple[Float[Tensor, "n k"], Int[Tensor, "n k"]]:
    """``z.topk(k, dim=-1)`` (values sorted, largest first, and their indices), from one
    vectorised pass over the logits.

    ``torch.topk`` over a row of 50k logits costs a CPU several times an elementwise pass (it
    was an eighth of a lens's statistics). The ``k`` largest logits of a row lie in the ``k``
    chunks (of ``chunk`` consecutive logits) with the largest maxima, so the row's chunk maxima
    are taken in one pass, and ``topk`` looks only at those ``k`` chunks and the row's last,
    incomplete chunk. The values are ``torch.topk``'s; among equal logits the indices may be
    others (``torch.topk`` leaves the order of ties unspecified too).
    """
    n, V = z.shape
    whole = V - V % chunk
    if z.stride(-1) != 1 or whole < 4 * k * chunk:  # a narrow vocabulary: topk is cheap
        values, indices = z.topk(k, dim=-1)
        return values, indices
    chunks = z.as_strided((n, whole // chunk, chunk), (z.stride(0), chunk, 1))
    best = chunks.amax(-1).topk(k, dim=-1).indices
    within = torch.arange(chunk, device=z.device)
    cols = (best.unsqueeze(-1) * chunk + within).reshape(n, k * chunk)
    if whole < V:
        cols = torch.cat([cols, torch.arange(whole, V, device=z.device).expand(n, -1)], dim=1)
    values, picked = z.gather(1, cols).topk(k, dim=-1)
    return values, cols.gather(1, picked)


@dataclass
class LensRows:
    """Logit-lens statistics of every state and row (float64, ``[state, row]``).

    Args:
        kl: ``KL(p_l ‖ p_ref)``.
        entropy: ``H(p_l)``.
        overlap: ``|top_k(p_l) ∩ top_k(p_ref)| / k``.
        target_logp: ``log p_l(target)``.
        rank: Tokens more probable than the target under ``p_l``.
    """

    kl: Tensor
    entropy: Tensor
    overlap: Tensor
    target_logp: Tensor
    rank: Tensor


def lens_statistics(
    readout: FinalReadout,
    states: Sequence[Float[Tensor, "... d_model"]],
    rows: Int[Tensor, " n"],
    targets: Int[Tensor, " n"],
    *,
    k: int,
    reference: int = -1,
    workspace: Workspace | None = None,
    block_elements: int = BLOCK_ELEMENTS,
    translator: Lens | None = None,
    model: Any = None,
    tokens: Int[Tensor, "batch pos"] | None = None,
) -> LensRows:
    """The lens of every state at the given rows, against the reference state's output.

    Blocks of rows; in each block the reference state is read first and its logits stay in a
    buffer while every other state is read against them: one large unembedding matmul per state
    and block, then the statistics of :func:`row_stats` in the block's buffers.

    Args:
        readout: The model's :func:`final_readout`.
        states: Residual states of the same batch (any leading shape, flattened to rows; each
            may live on its own device).
        rows: Flat row indices to read (into ``state.reshape(-1, d_model)``).
        targets: Next-token id per row (any valid id where a row has none; mask it later).
        k: Size of the top-k sets.
        reference: Index into ``states`` of the output state (default the last).
        workspace: Scratch buffers (a fresh one when omitted).
        block_elements: Logits per buffer (rows per block = this / d_vocab).
        translator: The lens (:class:`~lensdiv.ops.translators.Lens`; ``None``: the logit
            lens), indexed like ``states``: its reader gives the state the final norm reads
            (an affine translator applied in the readout dtype; a lens that runs blocks, in
            the model's).
        model, tokens: The model and the batch's tokens, for a lens that runs model blocks.

    Returns:
        :class:`LensRows` on the device of ``rows``.
    """
    ws = workspace or Workspace()
    n_states, n = len(states), int(rows.numel())
    V, dtype, device = readout.d_vocab, readout.dtype, readout.device
    k = max(1, min(k, V))
    reference = reference % n_states
    out = {
        key: torch.zeros(n_states, n, dtype=torch.float64, device=device)
        for key in ("kl", "entropy", "overlap", "target_logp", "rank")
    }
    flat = [s.reshape(-1, s.shape[-1]) for s in states]
    targets = targets.to(device)
    step = block_rows(V, block_elements)
    order = [reference] + [i for i in range(n_states) if i != reference]
    read = (translator or LOGIT).reader(model, tokens, dtype=dtype, device=device)
    for lo in range(0, n, step):
        idx = rows[lo : lo + step]
        r, t, block = int(idx.numel()), targets[lo : lo + step], slice(lo, lo + step)
        z_ref = ws.get("lens.reference", (r, V), dtype, device)
        z = ws.get("lens.logits", (r, V), dtype, device)
        scratch = ws.get("lens.scratch", (r, V), dtype, device)
        ref: RowStats | None = None
        for i in order:
            h = read(flat, i, idx)
            if i == reference:
                logits = readout.logits(h, out=z_ref)
                s = ref = row_stats(logits, scratch, targets=t, k=k, expect=True, product=z)
                kl = torch.zeros_like(s.lse)
            else:
                assert ref is not None  # read first
                logits = readout.logits(h, out=z)
                s = row_stats(logits, scratch, targets=t, k=k, expect=True, reference=z_ref)
                assert s.shift is not None
                kl = (s.shift - s.lse + ref.lse).clamp_min(0.0)
            assert s.expect is not None and s.target is not None and s.rank is not None
            assert s.top is not None and ref.top is not None
            out["kl"][i, block] = kl
            out["entropy"][i, block] = s.lse - s.expect
            same = (s.top.unsqueeze(-1) == ref.top.unsqueeze(-2)).any(-1)
            out["overlap"][i, block] = same.sum(-1).double() / k
            out["target_logp"][i, block] = s.target - s.lse
            out["rank"][i, block] = s.rank
    return LensRows(**{key: value.to(rows.device) for key, value in out.items()})


def cross_entropy(
    readout: FinalReadout,
    h: Float[Tensor, "n d_model"],
    targets: Int[Tensor, " n"],
    *,
    workspace: Workspace | None = None,
    block_elements: int = BLOCK_ELEMENTS,
) -> Float[Tensor, " n"]:
    """Next-token cross-entropy ``lse(z) − z[target]`` of residual vectors (float64, per row,
    on ``h``'s device)."""
    ws = workspace or Workspace()
    V, dtype, device = readout.d_vocab, readout.dtype, readout.device
    n = h.shape[0]
    out = torch.zeros(n, dtype=torch.float64, device=device)
    t_all = targets.to(device)
    step = block_rows(V, block_elements)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        z = readout.logits(h[lo:hi], out=ws.get("ce.logits", (hi - lo, V), dtype, device))
        scratch = ws.get("ce.scratch", (hi - lo, V), dtype, device)
        s = row_stats(z, scratch, targets=t_all[lo:hi], rank=False)
        assert s.target is not None
        out[lo:hi] = s.lse - s.target
    return out.to(h.device)


def log_partition(z: Float[Tensor, "*batch d_vocab"]) -> Float[Tensor, "*batch"]:
    """``log Σ exp z`` along the last axis in float64 (from readout-dtype logits, one exp pass)."""
    peak = z.amax(-1, keepdim=True)
    total = (z - peak).exp_().sum(-1)
    return peak[..., 0].double() + total.double().log()
