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
(:func:`lensdiv.ops.rowstats.lens_statistics`): no log-probability tensor over the vocabulary is
ever formed. States
are read in blocks of rows; within a block every state is read in turn against the reference
state's logits, which stay in a preallocated buffer, and every full-vocabulary pass writes into
preallocated buffers (:class:`Workspace`), because a fresh 100 MB tensor per pass costs more in
page faults than the arithmetic it holds. On a CPU a vocabulary wider than :data:`TILE_COLUMNS` is
read a tile of columns at a time (every state within the tile, the reference's tile made once),
so that a block's logits are read back from the cache rather than from memory; the tiles'
statistics merge exactly (:func:`lensdiv.ops.rowstats.merge_stats`). The top-k comes from one pass of chunk maxima
(:func:`lensdiv.ops.rowstats.top_k`), and an unembedding without a bias is one product
(:func:`_unembed`).

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
from lensdiv.core.bridge import Bridge
from lensdiv.core.errors import HookError
from lensdiv.core.numerics import exp_
from lensdiv.ops.norms import FinalNorm, ModuleNorm, NoNorm, declared_norm
from lensdiv.ops.translators import LOGIT, Lens

# Full-vocabulary elements of one readout buffer ([rows, d_vocab]); a lens holds three of them
# (128 MiB each in float32). Large enough for an efficient unembedding matmul on any vocabulary:
# on the gpt2-medium shape with 2 threads, 1/2 and 1/4 of this cost 1.2× and 1.4× more.
BLOCK_ELEMENTS = 1 << 25

# The fewest rows a lens reads per block (:func:`lensdiv.ops.rowstats.lens_statistics`), whatever
# the vocabulary: on Gemma 3's 262k tokens a block of BLOCK_ELEMENTS would be 128 rows, whose
# unembedding product costs about 1.25x per row what 512 rows cost (2 threads; the [d_model,
# vocab] matrix is streamed once per block). A lens then holds three 512 x 262144 float32
# buffers on a GPU (1.5 GiB, whatever the data); on a CPU three tiles of them (TILE_ELEMENTS:
# 32 MiB each) and the block's normalised states (at most HELD_ELEMENTS).
LENS_MIN_ROWS = 512

# Logits of one vocabulary tile on a CPU (:meth:`FinalReadout.tile_columns`): a lens reads a block
# of rows a tile of the vocabulary at a time, every state within the tile, so that the logits it
# writes are read back from the cache rather than from memory. On Gemma 3's 262k vocabulary
# (512 rows, 2 threads) the product in tiles of 4k-16k columns took 0.55-0.68 s a state where
# one [512, 262144] block (537 MB, written to memory and read back) took 0.78 s.
TILE_ELEMENTS = 1 << 23
# The widest tile on a CPU: the fused statistics (:mod:`lensdiv.ops.fused`) add a tile's terms in
# float32, about a thousand to a vectorised lane at this width (measured: ~1.5e-6 of the sum;
# merged in float64 across tiles, see lensdiv/ops/fused.py).
TILE_COLUMNS = 1 << 14

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
        return self.unembed(self.normalize(h), out=out)

    def unembed(
        self,
        x: Float[Tensor, "n d_model"],
        columns: slice | None = None,
        out: Tensor | None = None,
    ) -> Float[Tensor, "n columns"]:
        """Readout-dtype logits of normalised rows ``x`` (:meth:`normalize`'s output) at the
        vocabulary's ``columns`` (a step-1 slice; all by default), into ``out`` when given. A
        transform (a softcap) is applied to whole rows only (:meth:`tile_columns` never cuts
        them)."""
        W_U, b_U = self.W_U, self.b_U if self.biased else None
        if columns is not None:
            if self.transform is not None:
                raise ValueError("the readout's transform reads whole rows of logits")
            W_U, b_U = W_U[:, columns], None if b_U is None else b_U[columns]
        z = _unembed(x, W_U, b_U, out)
        if self.transform is not None:
            z = self.transform(z) if out is None else out.copy_(self.transform(z))
        return z

    def target_columns(
        self, targets: Int[Tensor, " n"]
    ) -> tuple[Float[Tensor, "n d_model"], Float[Tensor, " n"] | None]:
        """The unembedding's column of each row's target token and its bias, gathered once
        for every state read against the same targets (:meth:`target_logits`)."""
        if self.transform is not None:
            raise ValueError("the readout's transform reads whole rows of logits")
        idx = targets.to(self.device)
        return self.W_U[:, idx].T, (self.b_U[idx] if self.biased else None)

    def target_logits(
        self,
        x: Float[Tensor, "rows d_model"],
        columns: tuple[Float[Tensor, "n d_model"], Float[Tensor, " n"] | None],
    ) -> Float[Tensor, " rows"]:
        """Each normalised row's logit of its own target token (:meth:`target_columns`),
        without the other columns: a dot product per row, whose rounding may differ from the
        full product's by an ulp. ``x``: the rows of one or more states, one after another,
        each state's against the same ``n`` targets."""
        W, b = columns
        z = (x.view(-1, *W.shape) * W).sum(-1)
        return (z if b is None else z + b).reshape(-1)

    def tile_columns(self, rows: int, tile_elements: int = TILE_ELEMENTS) -> int:
        """Vocabulary columns a lens reads per tile for ``rows`` rows: the whole vocabulary
        off a CPU (where memory is fast and every call is a launch), under a transform of
        whole rows, or when it is at most :data:`TILE_COLUMNS` wide; else a multiple of 64
        columns (whole :func:`~lensdiv.ops.rowstats.top_k` chunks), ``rows`` rows of them in
        ``tile_elements`` logits."""
        V = self.d_vocab
        if self.device.type != "cpu" or self.transform is not None or V <= TILE_COLUMNS:
            return V
        return min(TILE_COLUMNS, max(64, tile_elements // max(rows, 1) // 64 * 64))

    def probabilities(
        self, h: Float[Tensor, "n d_model"], out: Tensor | None = None
    ) -> Float[Tensor, "n d_vocab"]:
        """Next-token probabilities of residual vectors, in the readout dtype."""
        z = self.logits(h, out=out)
        exp_(z.sub_(z.amax(-1, keepdim=True)))
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


def final_readout(model: Bridge) -> FinalReadout:
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


def _readout_key(model: Bridge) -> tuple[Any, ...]:
    weight = _unembed_weight(model)
    ptr = weight.data_ptr() if weight.device.type != "meta" else id(weight)
    return (
        bool(getattr(model, "compatibility_mode", False)),
        weight.dtype,
        str(weight.device),
        ptr,
    )


def _unembed_module(model: Bridge) -> torch.nn.Module:
    unembed = getattr(model, "unembed", None)
    if not isinstance(unembed, torch.nn.Module):
        raise HookError(
            f"{_name(model)} has no unembedding component, so its states cannot be read out",
            hint="this analyzer needs a decoder language model",
        )
    inner = getattr(unembed, "original_component", None)
    return inner if isinstance(inner, torch.nn.Module) else unembed


def _unembed_weight(model: Bridge) -> Tensor:
    unembed = getattr(model, "unembed", None)
    processed = getattr(unembed, "_parameters", {}).get("_processed_W_U")
    if isinstance(processed, Tensor):
        return processed
    weight = getattr(_unembed_module(model), "weight", None)
    if not isinstance(weight, Tensor):
        weight = model.W_U
    assert isinstance(weight, Tensor)  # a bridge's W_U property
    return weight


def _name(model: Bridge) -> str:
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


def _build(model: Bridge) -> FinalReadout:
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
    model: Bridge, d_vocab: int, device: torch.device, model_dtype: torch.dtype
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
